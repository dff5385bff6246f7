"""tracker/ core against the real MLflow server: lifecycle, resume, metrics, checkpoints, evals, registry."""
from __future__ import annotations

import json
import math
import threading
import time

import numpy as np
import pytest
from mlflow.entities import Metric

from test_tracker_support import logged_table, make_peft_adapter, metric_history
from tracker import RunSession
from rlops.layout import TAG_SHA256, TAG_STEP
from tracker import outbox as outbox_module
from tracker.checkpoints import sha256_of
from tracker.lifecycle import TAG_EXCEPTION_MESSAGE, TAG_EXCEPTION_TYPE
from tracker.naming import eval_key, metric_key, redacted_params, split_param_changes
from tracker.outbox import MetricOutbox
from tracker.registry import rank_checkpoints, retention_victims
from tracker.run_start import TAG_PARAM_CHANGED
from tracker.sender import MetricSender
from tracker.spool import MetricSpool, decode, encode
from tracker.state import STATE_DIR


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [make_peft_adapter(root / f"a{i}", seed=i) for i in range(2)]


# ------------------------------------------------------------------------------------------ pure parts


def test_metric_keys_follow_skyrl_mapping():
    assert metric_key("reward/avg_pass_at_8") == "reward/avg_pass_at_8"
    assert metric_key("reward/avg_pass@8") == "reward/avg_pass_at_8"
    assert metric_key("timing/step#1") == "timing/step_1"
    assert eval_key("maze_2d/easy") == "eval/maze_2d/easy/avg_score"
    with pytest.raises(ValueError, match="data_source"):
        eval_key("")


def test_params_are_flattened_and_redacted():
    params = redacted_params({"trainer": {"lr": 1e-5, "api_key": "abc", "hf_token": "hf_" + "x" * 30},
                              "storage": {"uri": "postgresql://u:pw@db/x", "note": "sk-" + "a" * 20},
                              "targets": ["q_proj", "v_proj"]})
    assert params == {"trainer.lr": "1e-05", "trainer.api_key": "****", "trainer.hf_token": "****",
                      "storage.uri": "postgresql://u:****@db/x", "storage.note": "****",
                      "targets": "['q_proj', 'v_proj']"}
    assert split_param_changes({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ({"c": "4"}, {"b": "3"})


def test_spool_replays_only_unacknowledged_points(tmp_path):
    spool = MetricSpool(tmp_path)
    first = spool.append([encode("m", float(i), 1000 + i, i) for i in range(5)])
    second = spool.append([encode("n", math.nan, 1, 9)])
    assert (first.first_seq, first.last_seq, second.first_seq) == (1, 5, 6)
    assert json.loads(first.bodies[0]) == {"key": "m", "value": 0.0, "timestamp": 1000, "step": 0}
    spool.acknowledge(3)
    spool.close()
    with (tmp_path / "spool.jsonl").open("a") as fh:
        fh.write('7\t{"key":"torn')  # a crash mid-line
    reopened = MetricSpool(tmp_path)
    [pending] = reopened.unacknowledged()
    points = [decode(body) for body in pending.bodies]
    assert pending.first_seq == 4 and [(p.key, p.step) for p in points] == [("m", 3), ("m", 4), ("n", 9)]
    assert math.isnan(points[-1].value) and json.loads(pending.bodies[-1])["value"] == "NaN"
    assert reopened.append([encode("m", 1.0, 1, 1, "m-123")]).first_seq == 7
    reopened.acknowledge(7)
    reopened.close()
    assert MetricSpool(tmp_path).unacknowledged() == []


class Recorder:  # stands in for the REST client: records the steps of each batch it would post
    timeout_s = 1.0

    def __init__(self):
        self.batches = []

    def log_metrics(self, run_id, bodies, timeout_s=None):
        self.batches.append([decode(b).step for b in bodies])


def test_sender_splits_chunks_into_batches_in_order(tmp_path):
    spool, rest = MetricSpool(tmp_path), Recorder()
    sender = MetricSender(spool, rest, "run", batch_size=3, max_backoff_s=1)
    for chunk in ([0, 1], [2, 3, 4, 5, 6], [7]):
        sender.submit(spool.append([encode("m", 1.0, 1, step) for step in chunk]))
    assert sender.flush(10) and spool.acked == 8
    sender.stop()
    assert [s for batch in rest.batches for s in batch] == list(range(8))
    assert all(len(batch) <= 3 for batch in rest.batches)


def test_sender_gathers_points_for_its_interval_and_a_flush_sends_at_once(tmp_path):
    spool, rest = MetricSpool(tmp_path), Recorder()
    sender = MetricSender(spool, rest, "run", batch_size=100, max_backoff_s=1, linger_s=0.5)
    for step in range(5):  # five training steps inside one interval: one request
        sender.submit(spool.append([encode("m", 1.0, 1, step)]))
        time.sleep(0.02)
    deadline = time.monotonic() + 10
    while spool.acked < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rest.batches == [[0, 1, 2, 3, 4]]
    sender.stop()

    slow = MetricSender(spool, rest, "run", batch_size=100, max_backoff_s=1, linger_s=3600)
    slow.submit(spool.append([encode("m", 1.0, 1, 5)]))
    started = time.monotonic()
    assert slow.flush(10) and spool.acked == 6  # a flush does not wait for the interval
    assert time.monotonic() - started < 5 and rest.batches[-1] == [5]
    slow.stop()

def test_the_training_thread_only_queues_until_the_writer_or_a_barrier_spools(tmp_path, monkeypatch):
    class Down:  # stands in for the REST client of an unreachable server: nothing is acknowledged
        timeout_s = 1.0

        def log_metrics(self, run_id, bodies, timeout_s=None):
            raise ConnectionError("down")

    def spooled() -> list[tuple[str, float, int]]:
        lines = (tmp_path / "spool.jsonl").read_text().splitlines()
        return [(p.key, p.value, p.step) for p in (decode(line.split("\t", 1)[1]) for line in lines)]

    def outbox() -> MetricOutbox:
        return MetricOutbox(tmp_path, Down(), "run", batch_size=100, max_backoff_s=0.1, on_dead_letters=print)

    monkeypatch.setattr(outbox_module, "WRITE_INTERVAL_S", 3600.0)  # the spool writer thread stays asleep
    first = outbox()
    first.put_metrics({"loss": 1.0, "ok": True, "n": 3}, step=1)
    with pytest.raises(TypeError, match="metric 'bad': value must be a number"):
        first.put_metrics({"bad": "high"}, step=2)
    with pytest.raises(ValueError, match="MLflow accepts keys of at most 250"):
        first.put_metrics({"k" * 300: 1.0}, step=2)
    assert spooled() == []  # handed over, not written: the caller did no I/O
    first.barrier()
    assert spooled() == [("loss", 1.0, 1), ("ok", 1.0, 1), ("n", 3.0, 1)]
    first.put_metrics({"loss": 0.5}, step=2)
    first.stop()  # spools what is still queued
    first.close()

    monkeypatch.undo()
    second = outbox()  # a restart: continues after the last spooled step, replays what was not acknowledged
    assert second.resumed_after_step == 2 and second.pending == 4
    second.put_metrics({"loss": 0.1}, step=2)
    assert second.replayed_points == 1
    second.put_metrics({"loss": 0.2}, step=3)
    deadline = time.monotonic() + 10
    while ("loss", 0.2, 3) not in spooled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spooled()[-1] == ("loss", 0.2, 3)  # the writer thread spooled it, no barrier needed
    second.stop()
    second.close()


def test_ranking_and_retention_are_pure():
    class M:  # the LoggedModel fields ranking reads
        def __init__(self, model_id, step, value):
            self.model_id, self.tags = model_id, {TAG_STEP: str(step)}
            self.metrics = [] if value is None else [Metric("eval/x/avg_score", value, 0, step)]

    models = [M("a", 10, 0.5), M("b", 20, 0.9), M("c", 30, 0.9), M("d", 40, None), M("e", 5, 0.1)]
    ranked = rank_checkpoints(models, "eval/x/avg_score")
    assert [s.model_id for s in ranked] == ["c", "b", "a", "e"]  # tie -> later step
    assert retention_victims(models, ranked, keep_best=1, protected={"a"}) == ["b", "e"]  # keeps best, latest, registered
    # scores measured on another eval set (another digest) never compete
    models[1].metrics = [Metric("eval/x/avg_score", 0.99, 0, 20, dataset_name="x", dataset_digest="other")]
    models[2].metrics = [Metric("eval/x/avg_score", 0.9, 0, 30, dataset_name="x", dataset_digest="ours")]
    assert [s.model_id for s in rank_checkpoints(models, "eval/x/avg_score", "ours")] == ["c"]


# ---------------------------------------------------------------------------------- against MLflow


def test_run_logs_everything_and_registers_best(test_config, tmp_path, mlflow_client, adapters):
    run_dir = tmp_path / "ckpts"
    params = {"trainer": {"lr": 1e-5, "secret_token": "s3cr3t"}, "generator": {"n_samples_per_prompt": 8}}
    with RunSession.start(test_config, run_dir, params=params, tags={"rlops.trainer": "test"},
                          run_name="core") as session:
        for step in range(1, 4):
            session.log_metrics({"policy/loss": 1.0 / step, "reward/avg_pass@8": step / 10}, step=step)
        session.log_checkpoint(adapters[0], step=2)
        session.log_eval("maze_2d/local7", 0.25, [{"id": 0, "passed": False, "score": 0.0,
                                                   "extras": {"steps": 15, "final_distance": 3}}], step=2)
        session.log_eval("maze_2d/local7", 0.75, [{"id": np.int64(0), "passed": np.bool_(True), "score": np.float32(1),
                                                   "extras": {"steps": 7, "final_distance": np.float32(0)}}],
                         step=3)  # eval before its checkpoint: linked when the upload lands
        session.log_checkpoint(adapters[1], step=3)
        version = session.register_best()
    run = mlflow_client.get_run(session.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.secret_token"] == "****" and run.data.params["trainer.lr"] == "1e-05"
    assert run.data.tags["rlops.trainer"] == "test" and run.data.tags["rlops.host"]
    assert metric_history(mlflow_client, session.run_id, "policy/loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert metric_history(mlflow_client, session.run_id, "reward/avg_pass_at_8") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    key = "eval/maze_2d/local7/avg_score"
    assert metric_history(mlflow_client, session.run_id, key) == [(2, 0.25), (3, 0.75)]

    models = {int(m.tags[TAG_STEP]): m for m in mlflow_client.search_logged_models(
        experiment_ids=[session.experiment_id], filter_string=f"source_run_id = '{session.run_id}'")}
    assert sorted(models) == [2, 3]
    for step, adapter in zip((2, 3), adapters):
        model = models[step]
        assert model.model_type == "lora-adapter" and str(model.status) == "READY"
        assert model.tags["rlops.base_model"] == test_config.training.base_model
        assert model.tags[TAG_SHA256 + "adapter_model.safetensors"] == sha256_of(adapter / "adapter_model.safetensors")
        assert [(m.key, m.step) for m in model.metrics] == [(key, step)]
        files = {f.path for f in mlflow_client.list_logged_model_artifacts(model.model_id)}
        assert files == {"adapter_config.json", "adapter_model.safetensors"}
    outputs = {o.model_id: o.step for o in run.outputs.model_outputs}
    assert outputs == {models[2].model_id: 2, models[3].model_id: 3}

    table_files = [f.path for f in mlflow_client.list_artifacts(session.run_id, "eval_tables/maze_2d/local7")]
    assert table_files == ["eval_tables/maze_2d/local7/step_000002.json", "eval_tables/maze_2d/local7/step_000003.json"]
    table = json.loads(open(mlflow_client.download_artifacts(session.run_id, table_files[1], str(tmp_path))).read())
    assert table["columns"] == ["id", "passed", "score", "extras", "step"]
    assert table["data"] == [["0", True, 1.0, {"steps": 7, "final_distance": 0.0}, 3]]

    assert version.name == test_config.registered_model and version.source == f"models:/{models[3].model_id}"
    assert version.tags == {"rlops.run_id": session.run_id, "rlops.step": "3", "rlops.metric_key": key,
                            "rlops.metric_value": "0.75"}
    assert version.aliases == ["candidate"]
    assert list((run_dir / STATE_DIR / "jobs").iterdir()) == []  # every upload landed and was cleaned up


def test_samples_land_as_a_table_with_images_and_evals_name_their_dataset(test_config, tmp_path, mlflow_client):
    from tracker.inputs import DatasetRef

    eval_set = DatasetRef("maze_2d/local7", "e" * 64, source="s3://rlops/datasets/local/eval.parquet", rows=64)
    train_set = DatasetRef("maze_2d/local7", "t" * 64, source="/data/train.parquet", context="training")
    test_config.tracking.sample_items, test_config.tracking.sample_groups = 2, 1
    test_config.tracking.sample_train_every = 3
    test_config.tracking.system_metrics_interval_s = 0.5
    image = np.zeros((20, 20, 3), dtype=np.uint8)
    rendered = []

    def render():  # called on the sample thread, not here
        rendered.append(threading.current_thread().name)
        return image

    with RunSession.start(test_config, tmp_path / "run", datasets=[eval_set, train_set]) as session:
        rows = [{"image": render, "seed": seed, "completion": "up stop", "solved": seed == 1} for seed in range(3)]
        assert session.log_samples(rows, step=4) == 2 and rendered == []
        groups = [{"group": g, "image": image, "completion": "left", "advantage": 0.0} for g in (0, 0, 1, 1)]
        assert session.log_samples(groups, step=3, kind="train") == 2
        assert session.log_samples(groups, step=4, kind="train") == 0  # between sample_train_every steps
        session.log_eval("maze_2d/local7", 0.5, [{"id": 0, "passed": True, "score": 1.0}], step=4)
        with pytest.raises(ValueError, match="sample kind"):
            session.log_samples(rows, step=4, kind="other")
        time.sleep(2)  # a few system-metric samples
    assert set(rendered) == {"rlops-tracker-samples"}
    run = mlflow_client.get_run(session.run_id)
    table = logged_table(mlflow_client, session.run_id, "eval/samples/step_4.json", tmp_path)
    assert [(r["seed"], r["solved"]) for r in table] == [(0, False), (1, True)]
    images = {f.path for f in mlflow_client.list_artifacts(session.run_id, "table_images/eval/samples/step_4")}
    assert all(r["image"]["type"] == "image" and r["image"]["filepath"] in images for r in table)
    files = {f.path for f in mlflow_client.list_artifacts(session.run_id, "eval/samples")}
    assert files == {"eval/samples/step_4.json", "eval/samples/step_4.png"}
    groups = logged_table(mlflow_client, session.run_id, "train/samples/step_3.json", tmp_path)
    assert [r["group"] for r in groups] == [0, 0]
    inputs = {(i.dataset.digest, i.dataset.source) for i in run.inputs.dataset_inputs}
    assert inputs == {("e" * 36, '{"uri": "s3://rlops/datasets/local/eval.parquet"}'),
                      ("t" * 36, '{"uri": "/data/train.parquet"}')}
    assert any(key.startswith("system/") for key in run.data.metrics)


def test_resume_continues_the_same_run(test_config, tmp_path, mlflow_client):
    run_dir = tmp_path / "ckpts"
    first = RunSession.start(test_config, run_dir, params={"lr": 0.1, "epochs": 2})
    first.log_metrics({"loss": 1.0}, step=1)
    first.fail(RuntimeError("preempted"))
    assert mlflow_client.get_run(first.run_id).info.status == "FAILED"

    with RunSession.start(test_config, run_dir, params={"lr": 0.2, "epochs": 2}) as second:
        assert second.run_id == first.run_id
        assert mlflow_client.get_run(second.run_id).info.status == "RUNNING"
        second.log_metrics({"loss": 0.5}, step=2)
    run = mlflow_client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.1" and run.data.tags[TAG_PARAM_CHANGED + "lr"] == "0.2"
    assert run.data.tags["rlops.resumes"] == "1"
    assert metric_history(mlflow_client, run.info.run_id, "loss") == [(1, 1.0), (2, 0.5)]


def test_exception_ends_failed_and_interrupt_ends_killed(test_config, tmp_path, mlflow_client):
    with pytest.raises(ZeroDivisionError):
        with RunSession.start(test_config, tmp_path / "a") as failing:
            failing.log_metrics({"loss": 1.0}, step=0)
            1 / 0
    run = mlflow_client.get_run(failing.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags[TAG_EXCEPTION_TYPE] == "ZeroDivisionError"
    assert run.data.tags[TAG_EXCEPTION_MESSAGE] == "division by zero"
    assert metric_history(mlflow_client, failing.run_id, "loss") == [(0, 1.0)]

    with pytest.raises(KeyboardInterrupt):
        with RunSession.start(test_config, tmp_path / "b") as killed:
            raise KeyboardInterrupt
    assert mlflow_client.get_run(killed.run_id).info.status == "KILLED"
    with pytest.raises(RuntimeError, match="already ended"):
        killed.log_metrics({"loss": 1.0}, step=1)


def test_inputs_are_validated_with_specific_messages(test_config, tmp_path):
    with pytest.raises(TypeError, match="rlops.config.Config"):
        RunSession.start({"tracking": {}}, tmp_path)
    orphan = tmp_path / "orphan" / ".rlops-tracker"
    orphan.mkdir(parents=True)
    (orphan / "run.json").write_text(json.dumps({"run_id": "0" * 32}))
    with pytest.raises(ValueError, match="which the tracking server does not have; remove that file"):
        RunSession.start(test_config, tmp_path / "orphan")
    with RunSession.start(test_config, tmp_path) as session:
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            session.log_metrics({"loss": 1.0}, step=-1)
        with pytest.raises(TypeError, match="metric 'loss': value must be a number"):
            session.log_metrics({"loss": "high"}, step=1)
        for log in (session.log_metrics, session.log_eval_metrics):
            with pytest.raises(TypeError, match="metrics must be a mapping of name -> number, got list"):
                log([("loss", 1.0)], step=1)
        with pytest.raises(TypeError, match="metrics must be a mapping of name -> number, got list"):
            session.log_eval("maze_2d/easy", 0.5, [], step=1, metrics=[("sampled_avg_score", 0.5)])
        with pytest.raises(ValueError, match="score must be within"):
            session.log_eval("maze_2d/easy", 1.5, [], step=1)
        with pytest.raises(ValueError, match="eval row 0 lacks score"):
            session.log_eval("maze_2d/easy", 0.5, [{"id": 1, "passed": True, "extras": {}}], step=1)
        with pytest.raises(TypeError, match="extras must be a dict"):
            session.log_eval("maze_2d/easy", 0.5, [{"id": 1, "passed": True, "score": 1, "extras": [3]}], step=1)
        with pytest.raises(ValueError, match="lacks adapter_model.safetensors"):
            (tmp_path / "bad").mkdir()
            (tmp_path / "bad" / "adapter_config.json").write_text("{}")
            session.log_checkpoint(tmp_path / "bad", step=1)
        assert session.register_best("maze_2d/easy") is None  # nothing evaluated: nothing registered


def test_register_on_eval_and_retention_keep_best_latest_and_registered(test_config, tmp_path, mlflow_client,
                                                                        adapters):
    test_config.tracking.register_on_eval = True
    test_config.tracking.keep_best_checkpoints = 1
    scores = {1: 0.9, 2: 0.5, 3: 0.2, 4: 0.3}
    with RunSession.start(test_config, tmp_path / "run") as session:
        for step, score in scores.items():
            session.log_checkpoint(adapters[step % 2], step=step)
            session.log_eval("maze_2d/local7", score, [], step=step)
        assert session.flush(60)
        # registered in the background after the first linked eval; later evals were worse: no new version
        early = mlflow_client.get_model_version_by_alias(test_config.registered_model, "candidate")
        assert early.tags["rlops.step"] == "1"
        version = session.register_best()
    assert version.version == early.version
    assert len(mlflow_client.search_model_versions(f"name = '{test_config.registered_model}'")) == 1
    left = mlflow_client.search_logged_models(experiment_ids=[session.experiment_id],
                                              filter_string=f"source_run_id = '{session.run_id}'")
    assert sorted(int(m.tags[TAG_STEP]) for m in left) == [1, 4]  # best (and registered) + latest
