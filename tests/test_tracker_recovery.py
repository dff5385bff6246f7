"""What a resumed, interrupted or overloaded run leaves in MLflow: registration waits for the truth,
poison points don't block the rest, a full disk doesn't end the sender, one writer per run dir, and
`rlops runs status|flush` show and drain what a stopped run left. Real MLflow server throughout."""
from __future__ import annotations

import errno
import json
import os
import socket
import time

import pytest
from click.testing import CliRunner

from rlops.cli import main as rlops_cli
from test_tracker_faults import proxied, write_config
from test_tracker_support import make_peft_adapter, metric_history
from tracker import RunSession, run_dir_status
from tracker import spool as spool_module
from tracker.lock import LOCK_FILE, RunDirBusy, RunDirLock
from tracker.sender import DEAD_LETTER_FILE
from tracker.state import STATE_DIR
from tracker.spool import MetricSpool, encode

SOURCE = "maze_2d/local7"


def test_registration_waits_for_the_best_checkpoint_through_an_outage(test_config, tmp_path, mlflow_proxy,
                                                                      mlflow_client, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the uploader's client fails fast while cut
    cfg = proxied(test_config, mlflow_proxy, flush_timeout_s=1.0)
    run_dir = tmp_path / "run"
    adapters = [make_peft_adapter(tmp_path / f"a{i}", seed=i) for i in range(3)]
    with RunSession.start(cfg, run_dir) as session:
        for step, score in ((1, 0.3), (2, 0.5)):
            session.log_checkpoint(adapters[step - 1], step=step)
            session.log_eval(SOURCE, score, [], step=step)
        assert session.flush(60)
        mlflow_proxy.cut()  # the server freezes before the last (and best) checkpoint
        session.log_checkpoint(adapters[2], step=3)
        session.log_eval(SOURCE, 0.9, [], step=3)
        assert session.register_best() is None  # not among a partial set
    name = cfg.registered_model
    assert mlflow_client.search_model_versions(f"name = '{name}'") == []  # nothing worse was registered
    assert mlflow_client.get_run(session.run_id).info.status == "RUNNING"  # the end is not recorded yet

    status = run_dir_status(run_dir)
    assert (status.pending_checkpoints, status.pending_registrations, status.intended_end) == (1, 1, "FINISHED")
    assert status.spooled_points >= 1 and status.holder is None and not status.drained
    shown = CliRunner().invoke(rlops_cli, ["runs", "status", str(run_dir)])
    assert shown.exit_code == 0 and "pending registration: 1" in shown.output and "not drained" in shown.output

    config_path = write_config(cfg, tmp_path / "mlflow.yaml")
    still_cut = CliRunner().invoke(rlops_cli, ["--config", str(config_path), "runs", "flush", str(run_dir),
                                               "--timeout", "1"])
    assert still_cut.exit_code == 1 and "cannot reach the MLflow run" in still_cut.output
    assert not run_dir_status(run_dir).drained and run_dir_status(run_dir).holder is None  # nothing lost

    mlflow_proxy.restore()
    flushed = CliRunner().invoke(rlops_cli, ["--config", str(config_path), "runs", "flush", str(run_dir),
                                             "--timeout", "60"])
    assert flushed.exit_code == 0, flushed.output
    assert "1 checkpoint(s) landed" in flushed.output and f"registered: {name} v1" in flushed.output
    assert "run marked FINISHED" in flushed.output and flushed.output.strip().endswith("drained")
    candidate = mlflow_client.get_model_version_by_alias(name, "candidate")
    assert candidate.tags["rlops.step"] == "3" and candidate.tags["rlops.metric_value"] == "0.9"
    run = mlflow_client.get_run(session.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rlops.registration"] == f"{name} v1 (step 3)"
    assert metric_history(mlflow_client, session.run_id, f"eval/{SOURCE}/avg_score") == [(1, 0.3), (2, 0.5), (3, 0.9)]
    assert run_dir_status(run_dir).drained


def test_a_rejected_point_goes_to_dead_letters_and_the_rest_land(test_config, tmp_path, mlflow_client):
    run_dir = tmp_path / "run"
    with RunSession.start(test_config, run_dir) as session:
        with pytest.raises(ValueError, match=r"is 300 characters long; MLflow accepts keys of at most 250"):
            session.log_metrics({"x" * 300: 1.0}, step=1)
        session.log_metrics({"m": 1.0}, step=1)
        assert session.flush(30)
        session.kill("test")  # an interrupted run: resumed below
    # a batch MLflow will never accept (as an older writer without the key check could have spooled it)
    spool, now = MetricSpool(run_dir / STATE_DIR), int(time.time() * 1000)
    spool.append([encode("m", float(s), now, s) for s in (2, 3)] + [encode("y" * 300, 1.0, now, 3)]
                 + [encode("m", float(s), now, s) for s in (4, 5)])
    spool.close()
    with RunSession.start(test_config, run_dir) as resumed:
        assert resumed.flush(60)  # not retried forever: the rejected point is set aside
        assert resumed.dead_letters == 1
    assert metric_history(mlflow_client, session.run_id, "m") == [(s, float(s)) for s in range(1, 6)]
    [letter] = [json.loads(line) for line in (run_dir / STATE_DIR / DEAD_LETTER_FILE).read_text().splitlines()]
    assert letter["point"]["key"] == "y" * 300 and "250" in letter["error"]
    assert mlflow_client.get_run(session.run_id).data.tags["rlops.dead_letters"] == "1"
    assert run_dir_status(run_dir).dead_letters == 1
    shown = CliRunner().invoke(rlops_cli, ["runs", "status", str(run_dir)])
    assert "dead letters:         1" in shown.output


def test_a_full_disk_on_the_ack_file_does_not_end_the_sender(test_config, tmp_path, mlflow_client, monkeypatch):
    real_write, failures = spool_module.write_atomically, []

    def full_disk(path, text):
        if path.name == spool_module.ACK_FILE and len(failures) < 3:
            failures.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, text)

    monkeypatch.setattr(spool_module, "write_atomically", full_disk)
    with RunSession.start(test_config, tmp_path / "run") as session:
        session.log_metrics({"m": 1.0}, step=1)
        assert session.flush(30)  # the ack failed 3 times, then the disk had room again
        session.log_metrics({"m": 2.0}, step=2)
        assert session.flush(30)
        assert session._outbox.sender.disk_errors == 3 and session._outbox.sender.last_error is None
    assert len(failures) == 3
    assert metric_history(mlflow_client, session.run_id, "m") == [(1, 1.0), (2, 2.0)]


def test_a_second_writer_on_a_run_dir_is_refused_by_name(test_config, tmp_path):
    run_dir = tmp_path / "run"
    with RunSession.start(test_config, run_dir):
        with pytest.raises(RunDirBusy, match=rf"in use by pid {os.getpid()} on host {socket.gethostname()} since "):
            RunSession.start(test_config, run_dir)
    with RunSession.start(test_config, run_dir) as again:  # released at the end
        assert again.run_id


def test_the_lock_is_a_lease(tmp_path):
    def holder(**fields):
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time() - 60,
                  "lease_until": time.time() + 60, "token": "other"} | fields
        (tmp_path / LOCK_FILE).write_text(json.dumps(record))

    holder(host="old-pod-7f9c")  # another host, lease running: refused however old
    with pytest.raises(RunDirBusy, match="pid .* on host old-pod-7f9c since .*lease until"):
        RunDirLock(tmp_path, 30).acquire()
    holder(host="old-pod-7f9c", lease_until=time.time() - 1)  # its lease ran out: taken over
    lock = RunDirLock(tmp_path, 30)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    holder(pid=2 ** 22 + 12345)  # this host, a pid that no longer exists (kill -9): taken over at once
    lock = RunDirLock(tmp_path, 30)
    lock.acquire()
    assert lock.renew()
    holder(host="new-owner")  # someone took it over meanwhile: renewing says so
    assert not lock.renew()


def test_a_torn_last_line_in_evals_jsonl_is_tolerated(tmp_path):
    from tracker.evals import EvalLinks

    path = tmp_path / "evals.jsonl"
    path.write_text(json.dumps({"step": 2, "points": [[f"eval/{SOURCE}/avg_score", 0.5, 1000]]}) + "\n"
                    + json.dumps({"step": 2, "model_id": "m-2"}) + "\n" + '{"step": 4, "points": [["eval/ma')
    links = EvalLinks(path)
    [relinked] = links.restore()  # a crash mid-write: the whole records before it still count
    assert (relinked.key, relinked.step, relinked.model_id) == (f"eval/{SOURCE}/avg_score", 2, "m-2")
    assert links.history == {f"eval/{SOURCE}/avg_score": {2: 0.5}}
    links.close()


def test_a_full_disk_holds_spool_points_back_in_order_until_they_are_written(tmp_path, monkeypatch):
    spool, real_write = MetricSpool(tmp_path), os.write
    spool.append([encode("m", 1.0, 1, 1)])
    full = {"on": True}

    def write(fd, data):
        if full["on"] and fd == spool._fd:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(spool_module.os, "write", write)
    chunks = [spool.append([encode("m", float(s), s, s)]) for s in (2, 3)]  # the training thread goes on
    assert [c.first_seq for c in chunks] == [2, 3]
    with pytest.raises(OSError, match="still unwritten"):
        spool.sync()  # the sender waits here: nothing is sent before it is in the spool file
    full["on"] = False
    spool.sync()
    spool.close()
    assert [c.first_seq for c in MetricSpool(tmp_path).unacknowledged()] == [1]
    assert [json.loads(line.split("\t")[1])["step"] for line in (tmp_path / "spool.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_line_appended_after_a_torn_one_is_not_lost(tmp_path):
    spool = MetricSpool(tmp_path)
    spool.append([encode("m", 1.0, 1, 1)])
    spool.close()
    with open(tmp_path / "spool.jsonl", "a") as fh:
        fh.write('2\t{"key":"m","val')  # a short write on a full disk, then the process died
    reopened = MetricSpool(tmp_path)
    reopened.append([encode("m", 3.0, 3, 3)])  # must start on a line of its own
    reopened.close()
    [pending] = MetricSpool(tmp_path).unacknowledged()
    assert [json.loads(b)["step"] for b in pending.bodies] == [1, 3]


def test_a_checkpoint_job_whose_output_landed_before_a_crash_completes(test_config, tmp_path, mlflow_client):
    from tracker.checkpoints import JOBS_DIR, snapshot_adapter

    run_dir, adapter = tmp_path / "run", make_peft_adapter(tmp_path / "adapter")
    with RunSession.start(test_config, run_dir) as session:
        session.log_checkpoint(adapter, step=2)
        assert session.flush(60)
        session.kill("test")
    [model] = mlflow_client.search_logged_models(experiment_ids=[session.experiment_id])
    # as if the process died after log_outputs landed but before the job file was removed
    job = run_dir / STATE_DIR / JOBS_DIR / "000009-ckpt-2.json"
    snapshot_adapter(adapter, job.with_suffix(""))
    job.write_text(json.dumps({"kind": "checkpoint", "step": 2, "model_id": model.model_id, "output_sent": True}))
    with RunSession.start(test_config, run_dir) as resumed:
        assert resumed.flush(60)  # log_outputs a second time would be a 400 forever
    assert not job.exists()
    assert [o.model_id for o in mlflow_client.get_run(session.run_id).outputs.model_outputs] == [model.model_id]


def test_a_short_write_on_a_full_disk_leaves_no_half_step_in_the_spool(tmp_path, monkeypatch):
    spool, real_write = MetricSpool(tmp_path), os.write
    short = {"on": True}

    def write(fd, data):  # the disk fills after 10 bytes of this append
        return real_write(fd, bytes(data[:10])) if short["on"] and fd == spool._fd else real_write(fd, data)

    monkeypatch.setattr(spool_module.os, "write", write)
    spool.append([encode("m", float(i), 1, 7) for i in range(3)])  # one step's points: all or none
    assert (tmp_path / "spool.jsonl").read_bytes() == b""  # cut back: a restart sees no part of step 7
    short["on"] = False
    spool.sync()
    spool.close()
    assert len(MetricSpool(tmp_path).unacknowledged()[0].bodies) == 3


def test_a_caught_up_spool_is_emptied_during_the_run_and_a_resume_still_knows_its_last_step(tmp_path, monkeypatch):
    """The soak's finding (issue 34): acknowledged lines stayed until a session opened the file with nothing
    pending, so a long run with restarts filled its disk. Past COMPACT_BYTES a caught-up file is emptied."""
    monkeypatch.setattr(spool_module, "COMPACT_BYTES", 200)
    spool = MetricSpool(tmp_path)
    first = spool.append([encode("m", float(s), s, s) for s in range(1, 11)])
    spool.acknowledge(5)  # not caught up: nothing goes
    assert len((tmp_path / "spool.jsonl").read_text().splitlines()) == 10
    spool.acknowledge(first.last_seq)
    assert (tmp_path / "spool.jsonl").read_text() == "" and (tmp_path / "spool.last_step").read_text() == "10"
    later = spool.append([encode("m", 11.0, 11, 11)])  # numbering goes on; the line is appended at 0
    assert later.first_seq == 11
    spool.close()
    reopened = MetricSpool(tmp_path)
    assert reopened.previous_last_step == 11 and [c.first_seq for c in reopened.unacknowledged()] == [11]
    assert reopened.append([encode("m", 12.0, 12, 12)]).first_seq == 12
    reopened.close()


def test_a_spool_line_appended_while_the_sender_compacts_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(spool_module, "COMPACT_BYTES", 100)
    spool = MetricSpool(tmp_path)
    chunk = spool.append([encode("m", float(s), s, s) for s in range(1, 6)])
    real_write_atomically = spool_module.write_atomically

    def append_meanwhile(path, text):  # the training thread appends between the two locked sections
        real_write_atomically(path, text)
        if path.name == "spool.last_step":
            spool.append([encode("m", 6.0, 6, 6)])

    monkeypatch.setattr(spool_module, "write_atomically", append_meanwhile)
    spool.acknowledge(chunk.last_seq)
    monkeypatch.setattr(spool_module, "write_atomically", real_write_atomically)
    spool.close()
    assert [json.loads(b)["step"] for c in MetricSpool(tmp_path).unacknowledged() for b in c.bodies] == [6]
