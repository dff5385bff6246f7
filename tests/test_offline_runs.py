"""Offline runs (issue 32): a run with no server keeps everything in its run dir; `rlops runs sync` replays it
into the real MLflow server as exactly the run online logging makes, once, however often or however
interrupted; bundles carry a run across networks and a bad one is refused before anything is logged."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from rlops.cli import main as rlops_cli
from test_tracker_faults import write_config
from test_tracker_support import logged_table, make_peft_adapter, metric_history
from tracker import BundleError, RunSession, run_dir_status, sync_runs
from tracker.bundle import unpack_bundle
from tracker.inputs import DatasetRef
from tracker.offline import TAG_OFFLINE_ID
from tracker.state import END_FILE, STATE_DIR, stored_run

SOURCE = "maze_2d/local7"
EVAL_SET = DatasetRef(SOURCE, "e" * 64, source="maze seeds 0-7", source_type="generated", rows=8)
ITEMS = 8
NO_SERVER = "http://127.0.0.1:9"  # the discard port: nothing answers there
VOLATILE_TAGS = {"rlops.heartbeat", TAG_OFFLINE_ID, "rlops.registration"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [make_peft_adapter(root / f"a{i}", seed=i) for i in range(3)]


def offline(config, **tracking):
    cfg = config.model_copy(deep=True)
    cfg.tracking.mode, cfg.tracking.uri = "offline", NO_SERVER
    for key, value in tracking.items():
        setattr(cfg.tracking, key, value)
    return cfg


def eval_rows(solved: int) -> list[dict]:
    return [{"id": i, "passed": i < solved, "score": float(i < solved), "extras": {"steps": 3 + i}}
            for i in range(ITEMS)]


def scripted_run(cfg, run_dir: Path, adapters, *, steps: int = 12, keys: int = 20, end: str = "finish") -> RunSession:
    """The same run whichever way it is tracked: metrics, a base eval, three checkpoints with evals, eval and
    GRPO samples with images, the registration of the best checkpoint (it beats the base: 8/8 vs 0/8)."""
    cfg.tracking.sample_items, cfg.tracking.sample_groups, cfg.tracking.sample_train_every = 3, 1, 3
    image = np.zeros((12, 12, 3), dtype=np.uint8)
    session = RunSession.start(cfg, run_dir, params={"lr": 1e-5, "group_size": 4, "api_token": "s3cr3t"},
                               tags={"rlops.trainer": "script"}, run_name="scripted", datasets=[EVAL_SET])
    with session:
        session.log_eval(SOURCE, 0.0, eval_rows(0), step=0)
        for step in range(1, steps + 1):
            session.log_metrics({f"m/k{k}": step * (k + 1) / 7 for k in range(keys)}, step=step)
            if step % 3 == 0:
                groups = [{"group": g, "image": image + g, "completion": f"up {g}", "advantage": g - 0.5}
                          for g in (0, 0, 1, 1)]
                session.log_samples(groups, step=step, kind="train")
            if step % (steps // 3) == 0:
                k = step // (steps // 3)
                session.log_checkpoint(adapters[k - 1], step=step)
                solved = {1: 3, 2: 8, 3: 5}[k]
                session.log_eval(SOURCE, solved / ITEMS, eval_rows(solved), step=step, metrics={"steps": 4.0 + k})
                session.log_samples([{"image": image + i, "id": i, "completion": "up", "passed": i < solved}
                                     for i in range(ITEMS)], step=step)
        session.register_best()
        if end == "fail":
            raise RuntimeError("the trainer broke")
    return session


def snapshot(client, run_id: str, model_name: str, tmp: Path) -> dict:
    """What a user compares in MLflow: params, tags, every point, tables, LoggedModels, the registration."""
    run = client.get_run(run_id)
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("rlops.") and k not in VOLATILE_TAGS}
    metrics = {key: metric_history(client, run_id, key) for key in sorted(run.data.metrics)
               if not key.startswith("system/")}
    tables = {}
    for folder in (f"eval_tables/{SOURCE}", "eval/samples", "train/samples"):
        for f in client.list_artifacts(run_id, folder):
            if f.path.endswith(".json"):
                rows = logged_table(client, run_id, f.path, tmp)
                tables[f.path] = [{k: (v["type"] if isinstance(v, dict) and "filepath" in v else v)
                                   for k, v in row.items()} for row in rows]
            else:
                tables[f.path] = "image"
    models = sorted(client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                filter_string=f"source_run_id = '{run_id}'"),
                    key=lambda m: int(m.tags["rlops.step"]))
    ids = {m.model_id: f"step-{m.tags['rlops.step']}" for m in models}
    logged = [(m.name, m.model_type, str(m.status), {k: v.replace(model_name, "<model>") for k, v in m.tags.items()},
               m.params,
               sorted((x.key, x.step, x.value, x.dataset_digest) for x in m.metrics),
               sorted(f.path for f in client.list_logged_model_artifacts(m.model_id))) for m in models]
    outputs = sorted((ids[o.model_id], o.step) for o in run.outputs.model_outputs)
    versions = [(ids[v.source.split("/")[-1]], {k: v for k, v in v.tags.items() if k != "rlops.run_id"}, v.aliases)
                for v in client.search_model_versions(f"name = '{model_name}'")]
    inputs = sorted((i.dataset.name, i.dataset.digest) for i in run.inputs.dataset_inputs)
    return {"status": run.info.status, "name": run.info.run_name, "params": run.data.params, "tags": tags,
            "metrics": metrics, "tables": tables, "models": logged, "outputs": outputs, "versions": versions,
            "inputs": inputs, "system": any(k.startswith("system/") for k in run.data.metrics)}


def synced_run_id(client, experiment: str, offline_id: str) -> list[str]:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return [r.info.run_id for r in client.search_runs([exp.experiment_id],
                                                       filter_string=f"tags.`{TAG_OFFLINE_ID}` = '{offline_id}'")]


def test_offline_run_with_no_server_then_sync_equals_the_same_run_logged_online(
        test_config, tmp_path, mlflow_client, adapters):
    test_config.tracking.system_metrics_interval_s = 0.2
    online = scripted_run(test_config.model_copy(deep=True), tmp_path / "online", adapters)

    run_dir = tmp_path / "offline"
    offline_config = offline(test_config, system_metrics_interval_s=0.2)
    offline_config.registry.models = [test_config.registry.models[0] + "-synced"]  # its own versions to compare
    t0 = time.time()
    gone = scripted_run(offline_config, run_dir, adapters)
    assert gone.offline and gone.run_id.startswith("offline-") and time.time() - t0 < 30  # never waited on a network
    assert gone.registered is None
    status = run_dir_status(run_dir)
    assert status.unsynced and status.run_id is None and status.intended_end == "FINISHED"
    assert (status.pending_checkpoints, status.pending_registrations) == (3, 1) and status.spooled_points > 240
    shown = CliRunner().invoke(rlops_cli, ["runs", "status", str(run_dir)])
    assert "synced:               no" in shown.output and f"rlops runs sync {run_dir}" in shown.output
    record, end = stored_run(run_dir), json.loads((run_dir / STATE_DIR / END_FILE).read_text())

    sync_config = test_config.model_copy(deep=True)
    sync_config.tracking.beat_base_max_p = None  # the run's own registration rule decides, not the syncing config's
    config_path = write_config(sync_config, tmp_path / "mlflow.yaml")
    synced = CliRunner().invoke(rlops_cli, ["--config", str(config_path), "runs", "sync", str(run_dir), "--json"])
    assert synced.exit_code == 0, synced.output
    report, = json.loads(synced.stdout)
    assert report["offline_id"] == record["offline_id"] and report["ended"] == "FINISHED" and report["left"] == ""
    assert report["registered"] == f"{offline_config.registered_model} v1"
    run_id = report["run_id"]

    want = snapshot(mlflow_client, online.run_id, test_config.registered_model, tmp_path / "a")
    got = snapshot(mlflow_client, run_id, offline_config.registered_model, tmp_path / "b")
    for key in want:
        assert got[key] == want[key], key
    assert got == want
    assert want["params"]["api_token"] == "****" and want["system"] and len(want["metrics"]) == 22
    info = mlflow_client.get_run(run_id).info
    assert (info.start_time, info.end_time) == (record["start_time_ms"], end["end_time_ms"])  # its own times
    assert run_dir_status(run_dir).drained

    again = CliRunner().invoke(rlops_cli, ["--config", str(config_path), "runs", "sync", str(run_dir)])
    # (the eval points are re-sent linked, as on any resume: MLflow drops what it has)
    assert again.exit_code == 0 and "0 checkpoint(s) landed" in again.output and "synced" in again.output
    assert synced_run_id(mlflow_client, test_config.tracking.experiment, record["offline_id"]) == [run_id]
    assert snapshot(mlflow_client, run_id, offline_config.registered_model, tmp_path / "c") == want


def test_sync_killed_at_any_point_then_run_again_gives_one_exact_run(stack, test_config, tmp_path, mlflow_client,
                                                                      adapters):
    """SIGKILL of `rlops runs sync` while points go out, then while checkpoints go out; a third sync lands the
    rest: every point once, three LoggedModels, one registered version."""
    steps, keys = 240, 40
    run_dir = tmp_path / "offline"
    with pytest.raises(RuntimeError, match="the trainer broke"):
        scripted_run(offline(test_config, system_metrics=False), run_dir, adapters, steps=steps, keys=keys, end="fail")
    offline_id = stored_run(run_dir)["offline_id"]
    cfg = test_config.model_copy(deep=True)
    cfg.tracking.batch_size = 50  # many requests, so a kill lands between them
    config_path = write_config(cfg, tmp_path / "mlflow.yaml")
    sync = [sys.executable, "-m", "rlops.cli", "--config", str(config_path), "runs", "sync", str(run_dir)]
    env = stack.env

    def started(check) -> None:
        proc = subprocess.Popen(sync, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                ids = synced_run_id(mlflow_client, cfg.tracking.experiment, offline_id)
                if ids and check(ids[0]):
                    break
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    started(lambda run_id: len(mlflow_client.get_metric_history(run_id, "m/k0")) > 0)
    run_id, = synced_run_id(mlflow_client, cfg.tracking.experiment, offline_id)
    partial = len(mlflow_client.get_metric_history(run_id, f"m/k{keys - 1}"))
    assert partial < steps  # killed mid-way
    started(lambda run_id: bool(mlflow_client.search_logged_models(
        experiment_ids=[mlflow_client.get_run(run_id).info.experiment_id], filter_string=f"source_run_id = '{run_id}'")))
    done = subprocess.run(sync, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    assert synced_run_id(mlflow_client, cfg.tracking.experiment, offline_id) == [run_id]
    for k in (0, keys // 2, keys - 1):
        assert metric_history(mlflow_client, run_id, f"m/k{k}") == [(s, s * (k + 1) / 7) for s in range(1, steps + 1)]
    evals = metric_history(mlflow_client, run_id, f"eval/{SOURCE}/avg_score")
    assert evals == [(0, 0.0), (80, 3 / 8), (160, 1.0), (240, 5 / 8)]
    run = mlflow_client.get_run(run_id)
    models = mlflow_client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                filter_string=f"source_run_id = '{run_id}'")
    assert sorted(int(m.tags["rlops.step"]) for m in models) == [80, 160, 240]
    assert all(str(m.status) == "READY" for m in models) and len(run.outputs.model_outputs) == 3
    versions = mlflow_client.search_model_versions(f"name = '{cfg.registered_model}'")
    assert [v.tags["rlops.step"] for v in versions] == ["160"]
    assert run.info.status == "FAILED" and run.data.tags["rlops.exception_type"] == "RuntimeError"  # never FINISHED


def test_bundles_carry_a_run_and_a_bad_one_is_refused_before_anything_is_logged(
        test_config, tmp_path, mlflow_client, adapters):
    run_dir = tmp_path / "offline"
    scripted_run(offline(test_config, system_metrics=False), run_dir, adapters, steps=6, keys=3)
    offline_id = stored_run(run_dir)["offline_id"]
    bundle = tmp_path / "run.tgz"
    exported = CliRunner().invoke(rlops_cli, ["runs", "export", str(run_dir), "-o", str(bundle)])
    assert exported.exit_code == 0 and f"run offline-{offline_id}" in exported.output, exported.output

    def rebuilt(name: str, change) -> Path:
        """The bundle's members re-packed, `change(members)` applied to (name, bytes) pairs."""
        with tarfile.open(bundle) as tar:
            members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
        out = tmp_path / name
        with tarfile.open(out, "w:gz") as tar:
            for member_name, data in change(members):
                info = tarfile.TarInfo(member_name)
                info.size = len(data)
                tar.addfile(info, __import__("io").BytesIO(data))
        return out

    spool = f"{STATE_DIR}/spool.jsonl"
    truncated = tmp_path / "truncated.tgz"
    truncated.write_bytes(bundle.read_bytes()[: bundle.stat().st_size // 2])
    altered = rebuilt("altered.tgz", lambda ms: [(n, d.replace(b'"value":', b'"value":1', 1) if n == spool else d)
                                                 for n, d in ms])
    added = rebuilt("added.tgz", lambda ms: ms + [(f"{STATE_DIR}/jobs/999999-register.json", b"{}")])
    missing = rebuilt("missing.tgz", lambda ms: [(n, d) for n, d in ms if n != spool])
    escaping = rebuilt("escaping.tgz", lambda ms: ms + [("../../evil.txt", b"x")])
    config_path = write_config(test_config, tmp_path / "mlflow.yaml")
    for bad, reason in ((truncated, "not a whole run bundle"), (altered, "spool.jsonl was altered"),
                        (added, "not in its manifest"), (missing, "lacks 1 file"), (escaping, "outside")):
        refused = CliRunner().invoke(rlops_cli, ["--config", str(config_path), "runs", "sync", str(bad)])
        assert refused.exit_code == 1 and reason in refused.output, (bad.name, refused.output)
        # a good bundle beside a bad one: the whole call is refused before anything is logged
        refused = CliRunner().invoke(rlops_cli, ["--config", str(config_path), "runs", "sync", str(bundle), str(bad)])
        assert refused.exit_code == 1
    assert synced_run_id(mlflow_client, test_config.tracking.experiment, offline_id) == []
    assert not (tmp_path / "escaping.txt").exists() and not (test_config.data_path.parent / "evil.txt").exists()

    first, = sync_runs(test_config, [bundle])
    second, = sync_runs(test_config, [bundle])
    assert first.run_id == second.run_id and not first.left and not second.left
    assert first.run_dir == unpack_bundle(bundle, test_config.data_path)  # unpacked once, found again
    assert metric_history(mlflow_client, first.run_id, "m/k2") == [(s, s * 3 / 7) for s in range(1, 7)]
    assert [v.tags["rlops.step"] for v in mlflow_client.search_model_versions(
        f"name = '{test_config.registered_model}'")] == ["4"]
    with pytest.raises(BundleError, match="first member"):
        unpack_bundle(rebuilt("no-manifest.tgz", lambda ms: ms[1:]), test_config.data_path)


def test_a_run_goes_offline_then_online_then_offline_on_one_run_dir(test_config, tmp_path, mlflow_client, adapters):
    """Offline first, continued online (the run is bound and everything lands), then offline again (its
    points wait for the next sync); the fallback takes a run offline when the server does not answer."""
    run_dir = tmp_path / "run"
    off = offline(test_config, system_metrics=False)
    first = RunSession.start(off, run_dir, params={"lr": 0.1})
    first.log_metrics({"loss": 1.0}, step=1)
    first.log_checkpoint(adapters[0], step=1)
    first.kill("preempted")

    test_config.tracking.system_metrics = False
    with RunSession.start(test_config, run_dir, params={"lr": 0.1}) as second:
        assert not second.offline and second.resumed_after_step == 1
        second.log_metrics({"loss": 0.5}, step=2)
    run_id = second.run_id
    assert synced_run_id(mlflow_client, test_config.tracking.experiment, stored_run(run_dir)["offline_id"]) == [run_id]
    assert metric_history(mlflow_client, run_id, "loss") == [(1, 1.0), (2, 0.5)]
    assert mlflow_client.get_run(run_id).data.params["lr"] == "0.1"

    fallback = offline(test_config, mode="online", offline_fallback=True, system_metrics=False)
    with RunSession.start(fallback, run_dir, resume=True) as third:
        assert third.offline and third.run_id == run_id
        third.log_metrics({"loss": 0.25}, step=3)
    assert metric_history(mlflow_client, run_id, "loss") == [(1, 1.0), (2, 0.5)]
    report, = sync_runs(test_config, [run_dir])
    assert report.run_id == run_id and report.points_landed == 1
    assert metric_history(mlflow_client, run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 0.25)]
    assert mlflow_client.get_run(run_id).data.tags["rlops.resumes"] == "2"
    models = mlflow_client.search_logged_models(experiment_ids=[mlflow_client.get_run(run_id).info.experiment_id],
                                                filter_string=f"source_run_id = '{run_id}'")
    assert [m.tags["rlops.step"] for m in models] == ["1"]
