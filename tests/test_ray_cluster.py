"""The cluster path on one machine: `rlops up` with `ray.nodes: 2` (a head and a worker raylet, supervised
like the rest of the stack), `rlops status` showing it, and the local trainer and SkyRL's dry run of the
production recipe submitted to it by training/train_job.sh exactly as the production job is: tracked from
inside the Ray job on the shared data dir, logs streamed back, `ray job stop` ending the run KILLED, a
resubmission on the same run dir resuming it, and no secret of the nodes' environment anywhere in Ray's
job API or session dir."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import REPO, llm_replica_logs, niceness, ray_records, wait_preloaded, write_config
from rlops.config import RAY_TOKEN_FILE
from rlops import stack as rlops_stack
from rlops.processes import autogroup_nice, read_record
from rlops.stack import MLFLOW, RAY_HEAD, ray_temp_dir
from tracker.checkpoints import TAG_SHA256
from tracker.naming import eval_key
from tasks.maze.datasets import skyrl_eval_set

pytestmark = pytest.mark.slow

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
STALENESS_S = 1.0


def test_status_shows_every_node_of_the_cluster(ray_cluster):
    out = subprocess.run([str(Path(sys.executable).parent / "rlops"), "status"], env=ray_cluster.env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    head = next(line for line in out.stdout.splitlines() if line.strip().startswith(RAY_HEAD))
    assert "healthy" in head and "2/2 nodes alive" in head and ray_cluster.config.ray_dashboard_url in head
    assert any(line.strip().startswith("ray-worker-1") and "healthy" in line for line in out.stdout.splitlines())
    # Each node and what it starts yields the cores to the control plane (MLflow, S3, promote): ray.nice.
    for name in rlops_stack.ray_node_names(ray_cluster.config):
        node = read_record(ray_cluster.config.data_path, name).process()
        assert min(niceness(node)) >= ray_cluster.config.ray.nice > 0, name
        assert autogroup_nice(node.pid) in (None, *range(ray_cluster.config.ray.nice, 20)), name  # its session too
    assert niceness(read_record(ray_cluster.config.data_path, MLFLOW).process()) == {os.getpriority(os.PRIO_PROCESS, 0)}


def test_the_dashboard_answers_only_with_the_clusters_token(ray_cluster):
    """Token auth on the local cluster (`rlops up`): the dashboard's job API refuses a client without the
    data dir's token, or with another one (issue 33's attack suite)."""
    url = f"{ray_cluster.config.ray_dashboard_url}/api/jobs/"
    token = (ray_cluster.config.data_path / RAY_TOKEN_FILE).read_text().strip()
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer " + "0" * len(token)}, timeout=30).status_code in (401, 403)
    assert httpx.get(url, headers={"authorization": f"Bearer {token}"}, timeout=30).status_code == 200


def _tiny_local_env(name: str) -> dict[str, str]:
    """The local trainer shrunk to seconds a step (as in test_training_local), its own experiment and model."""
    return {"RLOPS_TRACKING__EXPERIMENT": f"exp-{name}", "RLOPS_REGISTRY__MODELS": f"[model-{name}]",
            "RLOPS_TRAINING__LOCAL__NUM_GENERATIONS": "4", "RLOPS_TRAINING__LOCAL__PROMPTS_PER_STEP": "2",
            "RLOPS_TRAINING__LOCAL__CKPT_INTERVAL": "2", "RLOPS_TRAINING__LOCAL__EVAL_INTERVAL": "2",
            "RLOPS_TASK__OPTIONS": "{answer_length: 8}", "RLOPS_TRAINING__LOCAL__EVAL_SAMPLES": "0",
            "RLOPS_TRACKING__SAMPLE_ITEMS": "0", "RLOPS_TRACKING__SAMPLE_GROUPS": "0",
            "RLOPS_TRACKING__SYSTEM_METRICS": "false"}


def _submit(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(REPO / "training" / "train_job.sh"), *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stopped(client, submission_id: str) -> str:
    return _wait_for("the stop", lambda: str(client.get_job_status(submission_id)) in TERMINAL and
                     str(client.get_job_status(submission_id)))


def _no_secret_in_ray(ray_cluster, client, submit_output: str) -> None:
    """The nodes' secrets reached the jobs (they talked to S3 and MLflow) but nothing Ray shows or keeps."""
    shown = {"submit output": submit_output, **ray_records(client, ray_temp_dir(ray_cluster.config))}
    hits = [(where, name) for where, text in shown.items() for name, value in ray_cluster.secrets.items()
            if value in text]
    assert hits == [], f"secret values found in Ray's records: {hits}"


def _wait_for(what: str, check, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(2)
    return found


def test_local_trainer_as_a_ray_job_stops_killed_and_resumes(ray_cluster, mlflow_client, unique_name):
    client = ray_cluster.job_client()
    env = {**ray_cluster.env, **_tiny_local_env(unique_name)}
    run_dir = ray_cluster.config.data_path / "runs" / f"job-{unique_name}"
    first_id, second_id = f"grpo-{uuid.uuid4().hex[:8]}", f"grpo-{uuid.uuid4().hex[:8]}"

    # 1. submitted like production; stopped with `ray job stop` once it has a checkpoint
    first = _submit({**env, "SUBMISSION_ID": first_id, "RUN_DIR": str(run_dir)}, "--local", "--fast", "--steps", "200")
    started = time.monotonic()
    _wait_for("the first checkpoint", lambda: list(run_dir.glob("checkpoint-*")))
    print(f"job running with a checkpoint after {time.monotonic() - started:.0f} s")
    assert client.stop_job(first_id)
    streamed, _ = first.communicate(timeout=300)
    assert _stopped(client, first_id) == "STOPPED"
    info = client.get_job_info(first_id)
    assert info.entrypoint == f"python -m rlops train --local --run-dir {run_dir} --fast --steps 200"
    experiment = mlflow_client.get_experiment_by_name(f"exp-{unique_name}")
    [run] = mlflow_client.search_runs([experiment.experiment_id])
    assert run.info.status == "KILLED" and run.data.tags["rlops.end_reason"] == "SIGTERM"
    assert "GRPO" in streamed or "step" in streamed  # the job's own output came back through `ray job submit`
    assert (run_dir / "checkpoint-2").is_dir()

    # 2. resubmitted on the same run dir: the same MLflow run continues from the latest checkpoint
    resume_at = max(int(p.name.rsplit("-", 1)[1]) for p in run_dir.glob("checkpoint-*"))
    second = subprocess.run(["bash", str(REPO / "training" / "train_job.sh"), "--local", "--fast", "--steps",
                             str(resume_at + 2)], cwd=REPO, env={**env, "SUBMISSION_ID": second_id,
                                                                  "RUN_DIR": str(run_dir)},
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert str(client.get_job_status(second_id)) == "SUCCEEDED"
    # from the latest checkpoint the tracker logged: one saved just before the stop, whose hook never ran, is redone
    resumed_from = re.search(rf"resuming run {run.info.run_id} from {re.escape(str(run_dir))}/checkpoint-(\d+)", second.stdout)
    assert resumed_from and 2 <= int(resumed_from.group(1)) <= resume_at, second.stdout[-3000:]
    resumed = mlflow_client.get_run(run.info.run_id)
    assert resumed.info.status == "FINISHED" and resumed.data.tags["rlops.resumes"] == "1"
    rewards = mlflow_client.get_metric_history(run.info.run_id, "reward/avg_raw_reward")
    assert max(m.step for m in rewards) == resume_at + 2
    assert len({m.step for m in rewards}) == len(rewards)  # replayed steps are logged once

    # 3. the nodes' secrets reached the job (it talked to S3 and MLflow) but nothing Ray shows or keeps
    shown = ray_records(client, ray_temp_dir(ray_cluster.config))
    assert any(name.endswith("job-driver-" + first_id + ".log") for name in shown)
    assert "RLOPS_CONFIG" in shown[f"job info {first_id}"]  # the runtime env is there, without secrets
    _no_secret_in_ray(ray_cluster, client, streamed + second.stdout + second.stderr)


def test_skyrl_dry_run_as_a_ray_job_stops_killed_and_resumes(ray_cluster, mlflow_client, unique_name):
    """The production recipe's CPU dry run (`train_job.sh --skyrl-dry-run`): SkyRL's {GPU: 1, CPU: 1} bundles
    on the nodes' logical GPUs (`ray.gpus_per_node`), `ray job stop` once a checkpoint is on disk ends the
    run KILLED (the driver cancels the training task), and the resubmission on the same run dir continues the
    same MLflow run after that checkpoint: every step's metrics once, the eval, every checkpoint and the HF
    export as LoggedModels, no registered version."""
    client = ray_cluster.job_client()
    model = f"model-{unique_name}"
    env = {**ray_cluster.env, "RLOPS_TRACKING__EXPERIMENT": f"exp-{unique_name}", "RLOPS_REGISTRY__MODELS": f"[{model}]",
           "RLOPS_TRACKING__SYSTEM_METRICS": "false"}
    run_dir = ray_cluster.config.data_path / "runs" / f"skyrl-{unique_name}"
    first_id, second_id = f"dry-{uuid.uuid4().hex[:8]}", f"dry-{uuid.uuid4().hex[:8]}"
    steps = 3

    first = _submit({**env, "SUBMISSION_ID": first_id, "RUN_DIR": str(run_dir)}, "--skyrl-dry-run", "--steps", str(steps))
    latest = run_dir / "ckpt" / "latest_ckpt_global_step.txt"
    started = time.monotonic()
    _wait_for("the first checkpoint", latest.exists)
    print(f"dry-run job with a checkpoint after {time.monotonic() - started:.0f} s")
    assert client.stop_job(first_id)
    streamed, _ = first.communicate(timeout=300)
    assert _stopped(client, first_id) == "STOPPED"
    assert client.get_job_info(first_id).entrypoint == (
        f"python -m rlops train --skyrl-dry-run --run-dir {run_dir} --steps {steps}")
    [run] = mlflow_client.search_runs([mlflow_client.get_experiment_by_name(f"exp-{unique_name}").experiment_id])
    assert run.info.status == "KILLED" and run.data.tags["rlops.end_reason"] == "KeyboardInterrupt", streamed[-3000:]
    assert int(latest.read_text()) < steps

    second = subprocess.run(["bash", str(REPO / "training" / "train_job.sh"), "--skyrl-dry-run", "--steps", str(steps)],
                            cwd=REPO, env={**env, "SUBMISSION_ID": second_id, "RUN_DIR": str(run_dir)},
                            capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert str(client.get_job_status(second_id)) == "SUCCEEDED"
    assert f"/runs/{run.info.run_id}" in second.stdout and "registered version: none (a dry run" in second.stdout
    assert "colocate_all=true" in second.stdout.split("checked on GPU only: ", 1)[1].splitlines()[0]
    resumed = mlflow_client.get_run(run.info.run_id)
    assert resumed.info.status == "FINISHED" and resumed.data.tags["rlops.resumes"] == "1"
    assert resumed.data.tags["rlops.trainer"] == "skyrl" and resumed.data.tags["rlops.task"] == "tasks.maze:MazeTask"
    assert resumed.data.params["generator/max_turns"] == "3" and resumed.data.params["trainer/strategy"] == "fsdp"
    assert len(mlflow_client.search_runs([run.info.experiment_id])) == 1  # the resubmission continued, no new run
    for key in ("policy/policy_loss", "reward/avg_raw_reward"):  # every step once, across the stop
        assert sorted(m.step for m in mlflow_client.get_metric_history(run.info.run_id, key)) == [1, 2, 3], key
    # a step's own total time is measured after its checkpoint: the stopped step's may be missing, never twice
    total = sorted(m.step for m in mlflow_client.get_metric_history(run.info.run_id, "timing/step"))
    assert total[-1] == steps and len(set(total)) == len(total)
    score = eval_key(skyrl_eval_set().data_source)
    assert [m.step for m in mlflow_client.get_metric_history(run.info.run_id, score)] == [steps]
    models = {int(m.tags["rlops.step"]): m for m in mlflow_client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'")}
    assert sorted(models) == [1, 2, 3]  # the checkpoint the stop cut off from its on_save is logged too
    for step, logged in models.items():
        assert {k for k in logged.tags if k.startswith(TAG_SHA256)} == {
            f"{TAG_SHA256}adapter_config.json", f"{TAG_SHA256}adapter_model.safetensors"}, step
    assert score in {m.key for m in models[steps].metrics}
    export = run_dir / "export" / f"global_step_{steps}" / "policy"
    assert json.loads((export / "adapter_config.json").read_text())["r"] == 8
    assert mlflow_client.search_model_versions(f"name = '{model}'") == []
    _no_secret_in_ray(ray_cluster, client, streamed + second.stdout + second.stderr)


# ------------------------------------------------------------------------------------ serving on the cluster


def test_two_ingress_and_two_llm_replicas_flip_production_together(ray_cluster, tmp_path_factory, unique_name):
    """`rlops serve` on the 2-node cluster with 2 ingress and 2 LLM replicas (the real vLLM engine, one per
    node): v2 is published as `promote --verify` does it (a preview, then the move) while 4 clients keep
    asking for production. Both LLM replicas load v2 before anything asks for it; no answer is a 5xx; from
    the promote's return + the staleness bound on, every answer, on both ingress replicas, is v2."""
    import httpx

    from conftest import register_adapter, train_adapter
    from registry_hooks import operations
    from registry_hooks.sync import Promoter
    from rlops import processes
    from rlops.config import load_config
    from rlops.layout import version_folder
    from training.tiny_vlm import build_tiny_vlm

    started = time.monotonic()
    root = tmp_path_factory.mktemp("cluster-serving")
    base_dir = build_tiny_vlm(root / "base")
    adapter = train_adapter(base_dir, root / "adapter", "right right right right", seed=1)
    data = yaml.safe_load(ray_cluster.config_path.read_text())
    data["tracking"] = {"experiment": f"exp-{unique_name}"}
    data["registry"] = {"models": [f"model-{unique_name}"], "guarded_aliases": []}
    data["serving"] = {
        "model_source": str(base_dir), "dynamic_lora_loading_path": f"s3://{data['storage']['bucket']}/lora-{unique_name}",
        "port": processes.free_port(), "routes_staleness_s": STALENESS_S,
        # 4 CPUs in all: an LLM replica takes 1 (its actor) + 0.5 (its engine), so one lands on each node
        "replica_cpus": 0.5, "min_replicas": 2, "max_replicas": 2, "ingress_replicas": 2,
    }
    path = write_config(root / "mlflow.yaml", data)
    config = load_config(path, environ={})
    model = config.registry.models[0]
    v1, v2 = (register_adapter(config, adapter, step) for step in (1, 2))  # one adapter, two folders
    operations.promote(config, model, to_alias="production", version=v1, trigger="test")
    url = f"http://{config.serving.host}:{config.serving.port}"
    env = {**ray_cluster.env, "RLOPS_CONFIG": str(path), "HF_HUB_OFFLINE": "1"}
    record = processes.start(config.data_path, "serve-cluster", [str(Path(sys.executable).parent / "rlops"), "serve"], env)
    answers: list[tuple[float, int, str | None, str | None]] = []  # (sent at, status, version, ingress replica)
    stop = threading.Event()

    def client(http: httpx.Client) -> None:
        body = {"model": f"{config.serving.base_model_id}:{model}", "max_tokens": 1,
                "messages": [{"role": "user", "content": "move"}]}
        while not stop.is_set():
            sent = time.time()
            r = http.post(f"{url}/v1/chat/completions", json=body)
            answers.append((sent, r.status_code, r.headers.get("x-rlops-model-version"), r.headers.get("x-rlops-replica")))

    try:
        log = Path(record.log)
        waited = processes.wait_healthy(record, lambda: f"ready: {url}/v1" in log.read_text(errors="replace"), timeout_s=900)
        print(f"\n2 ingress + 2 vLLM replicas ready in {waited:.0f} s")
        v2_id = f"{config.serving.base_model_id}:{version_folder(model, v2)}"

        with httpx.Client(timeout=120) as http, ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(client, http) for _ in range(4)]
            time.sleep(5)  # steady load on v1
            Promoter(config).publish_preview(model, v2, alias="production", trigger="test")  # --verify's first step
            wait_preloaded(ray_temp_dir(config), v2_id, replicas=2, timeout_s=120)
            assert not [a for a in answers if a[2] == str(v2)]  # nobody has asked for v2 yet
            operations.promote(config, model, to_alias="production", version=v2, trigger="test")
            acked = time.time()
            time.sleep(STALENESS_S + 5)
            stop.set()
            for future in clients:
                future.result()
    finally:
        stop.set()
        processes.stop(config.data_path, "serve-cluster", timeout_s=90)

    assert len(llm_replica_logs(ray_temp_dir(config))) == 2  # serving.min/max_replicas: 2 engines
    # vLLM logs its binding from the engine process: a worker's .out or .err, or the replica's Serve log
    cores = {ids for path in ray_temp_dir(config).glob("session_*/logs/**/*")
             if path.is_file() and path.suffix in (".out", ".err", ".log")
             for ids in re.findall(r"core ids=\[([0-9, ]*)\]", path.read_text(errors="replace"))}
    assert len(cores) == 2, cores  # each node's engine on its own core (rlops.stack.vllm_cpu_binding)
    statuses = collections.Counter(status for _, status, _, _ in answers)
    assert statuses and all(status < 500 for status in statuses), statuses
    after = [a for a in answers if a[0] > acked + STALENESS_S]
    assert after and {version for _, _, version, _ in after} == {str(v2)}
    assert len({replica for _, _, _, replica in after}) == 2  # both ingress replicas, each only v2
    assert {version for _, _, version, _ in answers} == {str(v1), str(v2)}
    print(f"{len(answers)} answers ({dict(statuses)}), {len(after)} after ack + {STALENESS_S:g} s, "
          f"whole test {time.monotonic() - started:.0f} s")
