"""Fault tests: an MLflow outage through the loopback proxy, kill -9 during the outage, SIGTERM, and the
heartbeat sweep. Every point must land exactly once and the training thread must never wait on MLflow."""
from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlops.cli import main as rlops_cli
from test_tracker_support import make_peft_adapter, metric_history
from tracker import RunSession
from tracker.checkpoints import TAG_STEP
from tracker.state import stored_run_id

HOOK_BOUND_S = 0.005  # median of one log_metrics call of 100 metrics (2-core box shared with other tests)
HOOK_WORST_S = 0.100  # the slowest single call, with ample room for scheduler noise
KEYS = [f"m/{i:03d}" for i in range(100)]


def proxied(config, proxy, **tracking):
    cfg = config.model_copy(deep=True)
    cfg.tracking.uri = proxy.url
    cfg.tracking.retry_max_backoff_s = 0.5
    for key, value in tracking.items():
        setattr(cfg.tracking, key, value)
    return cfg


def write_config(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def assert_exactly_once(client, run_id: str, steps: range) -> None:
    for key in (KEYS[0], KEYS[57], KEYS[-1]):
        assert metric_history(client, run_id, key) == [(s, float(s)) for s in steps], key
    assert len(client.get_metric_history(run_id, KEYS[13])) == len(steps)


def test_outage_mid_run_loses_nothing_and_never_blocks(test_config, tmp_path, mlflow_proxy, mlflow_client):
    cfg = proxied(test_config, mlflow_proxy)
    adapter = make_peft_adapter(tmp_path / "adapter")
    hook_times = []
    with RunSession.start(cfg, tmp_path / "run") as session:
        for step in range(40):
            if step == 10:
                mlflow_proxy.cut()
            if step == 30:  # the server (read directly, not through the proxy) saw nothing of the outage
                assert all(s < 10 for s, _ in metric_history(mlflow_client, session.run_id, KEYS[0]))
                mlflow_proxy.restore()
            started = time.perf_counter()
            session.log_metrics({k: float(step) for k in KEYS}, step=step)
            if step == 20:
                session.log_checkpoint(adapter, step=step)  # snapshot is local; upload waits for the server
            hook_times.append(time.perf_counter() - started)
            time.sleep(0.05)  # the outage lasts ~1 s of "training"
    assert session.failed_requests > 0  # the outage was real: the sender saw failures and retried
    assert statistics.median(hook_times) < HOOK_BOUND_S, statistics.median(hook_times)
    assert max(hook_times) < HOOK_WORST_S, max(hook_times)
    assert mlflow_client.get_run(session.run_id).info.status == "FINISHED"
    assert_exactly_once(mlflow_client, session.run_id, range(40))
    models = mlflow_client.search_logged_models(experiment_ids=[session.experiment_id],
                                                filter_string=f"source_run_id = '{session.run_id}'")
    assert [m.tags[TAG_STEP] for m in models] == ["20"]


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from rlops.config import load_config
    from tracker import RunSession
    cfg = load_config(sys.argv[1], environ={})
    session = RunSession.start(cfg, Path(sys.argv[2]))
    keys = [f"m/{i:03d}" for i in range(100)]
    for step in range(5):
        session.log_metrics({k: float(step) for k in keys}, step=step)
    assert session.flush(30)
    print("FLUSHED", flush=True)
    sys.stdin.readline()  # the parent cuts the connection, then says go
    for step in range(5, 10):
        session.log_metrics({k: float(step) for k in keys}, step=step)
    session.log_checkpoint(Path(sys.argv[3]), step=9)
    print("LOGGED", flush=True)
    time.sleep(600)
""")


def test_kill_9_during_outage_then_restart_lands_every_point_once(stack, test_config, tmp_path, mlflow_proxy,
                                                                  mlflow_client):
    cfg = proxied(test_config, mlflow_proxy, heartbeat_interval_s=0.2)
    config_path = write_config(cfg, tmp_path / "mlflow.yaml")
    run_dir, adapter = tmp_path / "run", make_peft_adapter(tmp_path / "adapter")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(config_path), str(run_dir), str(adapter)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=stack.env)
    try:
        assert child.stdout.readline().strip() == "FLUSHED"
        mlflow_proxy.cut()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "LOGGED"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    mlflow_proxy.restore()
    [run] = mlflow_client.search_runs([mlflow_client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert run.info.run_id == stored_run_id(run_dir) and run.info.status == "RUNNING"
    assert_exactly_once(mlflow_client, run.info.run_id, range(5))  # nothing of the outage got through

    # the dead process never ended its run: the sweep (as `rlops runs sweep`) settles it from the heartbeat
    time.sleep(1.5)
    result = CliRunner().invoke(rlops_cli, ["--config", str(config_path), "runs", "sweep", "--timeout", "1"])
    assert result.exit_code == 0, result.output
    assert f"marked FAILED: {run.info.run_id}" in result.output
    swept = mlflow_client.get_run(run.info.run_id)
    assert swept.info.status == "FAILED" and "no heartbeat" in swept.data.tags["rlops.failure_reason"]

    # as if the server had stored steps 0-4 but the acknowledgement never reached the spool: replay them too
    (run_dir / ".rlops-tracker" / "spool.ack").write_text("0")
    with RunSession.start(cfg, run_dir) as resumed:
        assert resumed.run_id == run.info.run_id
    assert mlflow_client.get_run(run.info.run_id).info.status == "FINISHED"
    assert_exactly_once(mlflow_client, run.info.run_id, range(10))
    models = mlflow_client.search_logged_models(experiment_ids=[resumed.experiment_id],
                                                filter_string=f"source_run_id = '{run.info.run_id}'")
    assert [m.tags[TAG_STEP] for m in models] == ["9"]  # the snapshot taken before kill -9 was uploaded


def test_sigterm_ends_the_run_killed(stack, test_config, tmp_path, mlflow_client):
    config_path = write_config(test_config, tmp_path / "mlflow.yaml")
    script = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from rlops.config import load_config
        from tracker import RunSession
        with RunSession.start(load_config(sys.argv[1], environ={}), Path(sys.argv[2])) as session:
            session.log_metrics({"loss": 1.0}, step=1)
            print(session.run_id, flush=True)
            while True:
                time.sleep(0.1)
    """)
    child = subprocess.Popen([sys.executable, "-c", script, str(config_path), str(tmp_path / "run")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=stack.env)
    run_id = child.stdout.readline().strip()
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) != 0
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["rlops.end_reason"] == "SIGTERM"
    assert metric_history(mlflow_client, run_id, "loss") == [(1, 1.0)]


def test_exit_without_finish_still_lands_points_and_leaves_the_run_to_the_sweep(stack, test_config, tmp_path,
                                                                                mlflow_client):
    config_path = write_config(test_config, tmp_path / "mlflow.yaml")
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        from rlops.config import load_config
        from tracker import RunSession
        session = RunSession.start(load_config(sys.argv[1], environ={}), Path(sys.argv[2]))
        for step in range(50):
            session.log_metrics({f"m/{i:03d}": float(step) for i in range(100)}, step=step)
        print(session.run_id, flush=True)  # and exit: no finish(), no context manager
    """)
    out = subprocess.run([sys.executable, "-c", script, str(config_path), str(tmp_path / "run")],
                         capture_output=True, text=True, env=stack.env, timeout=120, check=True)
    run_id = out.stdout.strip()
    assert_exactly_once(mlflow_client, run_id, range(50))
    assert mlflow_client.get_run(run_id).info.status == "RUNNING"  # not FINISHED: the sweep settles it


def test_sweep_measures_silence_on_its_own_clock():
    from types import SimpleNamespace

    from tracker.sweep import Observations, stale_runs

    def run(run_id, beat):
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id, run_name=run_id, status="RUNNING"),
                               data=SimpleNamespace(tags={"rlops.heartbeat": beat}))

    seen = Observations({})
    # never observed: judged by its own stamp, so a run dead for hours fails at first sight
    assert [s.run_id for s in stale_runs([run("dead", "0"), run("live", "995")], 1000, 60, seen)] == ["dead"]
    # once observed only the sweeper's clock counts: an unchanged beat for 70 s of it is silence
    assert stale_runs([run("live", "995")], 1050, 60, seen) == []
    assert [s.silent_s for s in stale_runs([run("live", "995")], 1070, 60, seen)] == [70]
    assert stale_runs([run("skewed", "99999")], 1000, 60, Observations({"skewed": ("99998", 900.0)})) == []
    # a look that failed (an outage) makes the next one start afresh: nothing is judged on it
    blind = Observations({"live": ("995", 1000.0)}, blind=True)
    assert stale_runs([run("live", "995"), run("new", "0")], 5000, 60, blind) == []
    assert blind.seen == {"live": ("995", 5000), "new": ("0", 5000)} and not blind.blind


def test_an_outage_longer_than_the_heartbeat_timeout_does_not_fail_a_live_run(stack, test_config, tmp_path,
                                                                              mlflow_proxy, mlflow_client,
                                                                              monkeypatch):
    from tracker import sweep_stale_runs

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = proxied(test_config, mlflow_proxy, heartbeat_interval_s=0.2)
    cfg.data_dir = str(tmp_path / "sweeper")  # this sweeper's own observations
    with RunSession.start(cfg, tmp_path / "run") as session:
        assert sweep_stale_runs(cfg, timeout_s=2) == []
        mlflow_proxy.cut()  # the tracking server is out for everyone, the sweeper too
        time.sleep(2.0)
        with pytest.raises(Exception):
            sweep_stale_runs(cfg, timeout_s=2)
        time.sleep(1.5)  # the heartbeat has now been paused for 3.5 s against a 2 s timeout
        mlflow_proxy.restore()
        assert sweep_stale_runs(cfg, timeout_s=2) == []  # just back: nothing is judged on this look
        time.sleep(1.0)  # the trainer beats again
        assert sweep_stale_runs(cfg, timeout_s=2) == []
        assert mlflow_client.get_run(session.run_id).info.status == "RUNNING"
    assert mlflow_client.get_run(session.run_id).info.status == "FINISHED"
