"""Secrets never reach Ray: a real local Ray head whose node environment holds the credentials (as the
cluster's Secret refs do), a job submitted by training/train_job.sh from a shell that holds them too, then
Ray's whole session dir (logs, runtime_env records, job tables) and the job API's info and logs are
searched for every secret value. The local `rlops serve` is checked the same way in test_serving_app."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import ray_records
from rlops.processes import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
SECRETS = {name: f"{name.lower().replace('_', '-')}-{uuid.uuid4().hex}" for name in
           ("AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "RLOPS_HOOKS__SECRET", "SERVING_API_KEYS", "DB_PASSWORD")}


def secret_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLOPS_", "MLFLOW_", "AWS_", "RAY_"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as rlops.stack.ray_node_env: else the agents start too slowly
    env["RAY_AUTH_MODE"] = "disabled"  # `ray start` turns token auth on by default; this session's clients have it off
    env.update({name: value for name, value in SECRETS.items() if name != "DB_PASSWORD"})
    env.update({"AWS_ACCESS_KEY_ID": "rlops-test-key-id", "MLFLOW_TRACKING_USERNAME": "admin",
                "RLOPS_CONFIG": str(REPO / "mlflow.yaml"), "RLOPS_SERVING__API_KEYS_ENV": "SERVING_API_KEYS",
                "RLOPS_TRACKING__URI": f"http://127.0.0.1:{free_port()}",  # nobody's MLflow
                "RLOPS_SERVER__BACKEND_STORE_URI": f"postgresql://mlflow:{SECRETS['DB_PASSWORD']}@db:5432/mlflow",
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)})
    return env


@pytest.fixture
def ray_head():
    """`ray start --head` on loopback with its own temp dir; stopped by pid (never `ray stop`: that would end
    every Ray on the machine), whatever the test did."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rlray-", dir="/tmp"))  # short: Ray's socket paths have a length cap
    dashboard, agent = free_port(), free_port()
    env = secret_environment()
    log = open(temp_dir.with_name(temp_dir.name + ".log"), "w+")  # beside the temp dir: read back if the head fails
    starter = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={agent}", "--num-cpus=1", "--num-gpus=0",
         f"--temp-dir={temp_dir}", "--disable-usage-stats", "--include-dashboard=true"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        from ray.job_submission import JobSubmissionClient

        address = f"http://127.0.0.1:{dashboard}"
        deadline = time.monotonic() + 180
        while True:
            try:
                JobSubmissionClient(address).list_jobs()
                # submissions need the head's agent: without it the dashboard answers 500 after 10 s
                httpx.get(f"http://127.0.0.1:{agent}/api/healthz", timeout=5).raise_for_status()
                break
            except Exception:  # noqa: BLE001 - the dashboard or its agent is not up yet
                if time.monotonic() > deadline or starter.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"ray start --head did not come up: {log.read()[-2000:]}")
                time.sleep(2)
        yield address, temp_dir, env
    finally:
        ours = [p for p in psutil.process_iter(["cmdline"]) if str(temp_dir) in " ".join(p.info["cmdline"] or [])]
        try:
            os.killpg(starter.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        for process in ours:
            try:
                process.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(ours, timeout=5)  # a Ray process ignores SIGTERM: the rest have ended by then
        for process in alive:
            process.kill()
        starter.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
        log.close()
        os.unlink(log.name)


def test_no_secret_reaches_ray_session_dir_or_job_info(ray_head):
    from ray.job_submission import JobStatus, JobSubmissionClient

    address, temp_dir, env = ray_head
    submission_id = f"grpo-secrets-{uuid.uuid4().hex[:6]}"
    # The job runs our entrypoint on the node (its env holds the secrets), loads the rlops config and stops at
    # SkyRL's config check (an unknown key: the job ends in seconds, no GPU needed); submission, runtime env,
    # driver logs and job tables all exist by then.
    proc = subprocess.run(["bash", str(REPO / "training" / "train_job.sh"), "trainer.no_such_key=1"], cwd=REPO,
                          env={**env, "RAY_ADDRESS": address, "SUBMISSION_ID": submission_id,
                               "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert f"Job '{submission_id}' submitted" in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    client = JobSubmissionClient(address)
    deadline = time.monotonic() + 120
    while client.get_job_status(submission_id) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(1)
    info = client.get_job_info(submission_id)
    logs = client.get_job_logs(submission_id)
    assert info.entrypoint.startswith("python -m training.skyrl_main") and info.runtime_env["env_vars"]
    assert info.status == JobStatus.FAILED and "Invalid fields" in logs  # our entrypoint ran, stopped there
    shown = {"submit output": proc.stdout + proc.stderr, **ray_records(client, temp_dir)}
    assert len(shown) > 20  # logs of gcs, raylet, dashboard, the job driver, ...
    hits = [(where, name) for where, text in shown.items() for name, value in SECRETS.items() if value in text]
    assert hits == [], f"secret values found in Ray's records: {hits}"
