"""The trace recorder's batches against the session's real MLflow: each trace of a batch is written once with its
assessments, a trace MLflow refuses fails alone, and a batch cut off mid-way by an outage resumes where it
stopped when MLflow is back (no trace or assessment twice)."""
from __future__ import annotations

import threading
import time
from collections import Counter

from test_prompt_sets import registered_version, served_request

from rlops.layout import TRACE_PASSED, TRACE_SCORE
from serving.app import trace_settings
from serving.trace_recorder import TraceRecorder, task_scorer
from serving.trace_writer import TraceWriterSettings
from tasks.maze.env import answer_text, solve
from tasks.maze.task import item_maze


def recorder_and_items(config, client, tracking_uri: str | None = None):
    config.task.options = {"answer_length": 8}
    _, version = registered_version(client, config)
    settings = TraceWriterSettings.model_validate({**trace_settings(config), "sample_rate": 1.0,
                                                   "tracking_uri": tracking_uri or config.tracking_uri})
    task = config.load_task()
    return TraceRecorder(settings, task_scorer(settings)), task.eval_items(task.eval_sets()[0]), int(version)


def assessments_by_trace(client, config) -> dict[str, Counter]:
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    traces = client.search_traces(locations=[experiment.experiment_id], max_results=100)
    return {t.info.trace_id: Counter(a.name for a in t.info.assessments) for t in traces}


def test_a_batch_writes_each_trace_once_scored_and_a_refused_trace_fails_alone(test_config, mlflow_client):
    recorder, items, version = recorder_and_items(test_config, mlflow_client)
    batch = [served_request(test_config, items[0], answer_text(solve(item_maze(items[0]))), version),
             served_request(test_config, items[1], "stop", version + 41),  # no such version: MLflow says 404
             served_request(test_config, items[2], "stop", version)]
    assert recorder.record(batch) == {"recorded": 2, "scored": 2, "failed": 1}
    found = assessments_by_trace(mlflow_client, test_config)
    assert list(found.values()) == [Counter({TRACE_SCORE: 1, TRACE_PASSED: 1})] * 2


def test_a_batch_cut_off_by_an_outage_resumes_where_it_stopped(test_config, mlflow_client, mlflow_proxy, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as in the recorder's process: it retries itself
    recorder, items, version = recorder_and_items(test_config, mlflow_client, mlflow_proxy.url)
    batch = [served_request(test_config, items[0], "stop", version) for _ in range(100)]  # one picture: the traces' starts
    recorder.record(batch[:1])  # the version's location and the picture are stored before the outage
    experiment_id = mlflow_client.get_experiment_by_name(test_config.tracking.experiment).experiment_id
    seen_at_cut = []

    def cut_once_the_batch_is_being_started():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            started = len(mlflow_client.search_traces(locations=[experiment_id], max_results=100, include_spans=False))
            if started > 1:
                mlflow_proxy.cut()
                seen_at_cut.append(started)
                time.sleep(1.5)
                mlflow_proxy.restore()
                return
            time.sleep(0.02)

    outage = threading.Thread(target=cut_once_the_batch_is_being_started)
    outage.start()
    counts = recorder.record(batch[1:])
    outage.join()
    assert seen_at_cut and seen_at_cut[0] < len(batch), seen_at_cut  # the outage came mid-batch
    assert counts == {"recorded": 99, "scored": 99}
    found = assessments_by_trace(mlflow_client, test_config)
    assert len(found) == 100 and all(c == Counter({TRACE_SCORE: 1, TRACE_PASSED: 1}) for c in found.values())
