"""Writes served requests to MLflow as traces, in a process of its own beside the ingress replica.

`python -m serving.trace_recorder FD`: the replica's TraceWriter (serving.trace_writer) sends the settings, then
batches of ServedRequests over the connection FD, and hears back each batch's outcome counts. Here a request
becomes a trace (serving.traces), scored with the configured task where the task can read the request, its
images stored once by digest in the experiment's artifacts, written linked to the served version's
LoggedModel: one `start_trace` per trace (its assessments inside) and one `log_spans` per batch. While MLflow
is down or frozen the batch is retried from where it stopped with a capped backoff, so recording resumes when
it is back. A process apart: MLflow's client work (JSON, HTTP, PNG, scoring) never holds the GIL
the replica's event loop answers requests with. It ends when the connection closes (the replica stopped or died).
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
from mlflow.artifacts import get_artifact_repository
from mlflow.entities import (AssessmentSource, AssessmentSourceType, Feedback, Span, SpanType, TraceInfo, TraceLocation,
                             TraceState)
from mlflow.exceptions import MlflowException
from mlflow.tracing.client import TracingClient
from mlflow.tracing.constant import SpanAttributeKey, SpansLocation, TraceTagKey
from mlflow.tracing.utils import (build_otel_context, generate_assessment_id,
                                  generate_mlflow_trace_id_from_otel_trace_id)
from mlflow.tracking import MlflowClient
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Status, StatusCode
from PIL import Image
from requests.exceptions import RequestException

from rlops.layout import (TRACE_IMAGES_DIR, TRACE_MODEL_ID, TRACE_PASSED, TRACE_SCORE, TRACE_TAG_PASSED,
                          version_model_id)
from rlops.task import Outcome, Task, TaskError, load_task
from serving.trace_writer import TraceWriterSettings
from serving.traces import ServedRequest, TracePayload, trace_payload

log = logging.getLogger("ray.serve.rlops")
# below the replica it serves beside: traces are background work, answers come first (a recorder that
# falls behind fills the writer's queue, and what does not fit is dropped and counted)
RECORDER_NICE = 10
# MLflow unreachable, frozen, overloaded (5xx, 429): the same trace is retried (capped backoff) for this
# long, then counted as failed; anything else (a 4xx such as an unknown version, a bug) fails it at once
RETRY_FOR_S = 30.0
_RETRY_MAX_S = 2.0


def retried(exc: Exception) -> bool:
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return status >= 500 or status == 429
    return isinstance(exc, (RequestException, OSError))


class TaskScorer:
    """The task's verdict on a served answer, where the task can read the request (one image, the text)."""

    def __init__(self, task: Task):
        self.task = task
        self.source = f"{type(task).__module__}:{type(task).__name__}"

    def score(self, payload: TracePayload) -> Outcome | None:
        if len(payload.images) != 1 or payload.answer_text is None:
            return None
        (_, data), = payload.images.values()
        try:
            image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        except (OSError, ValueError):
            return None
        item = self.task.request_item(image, " ".join(payload.texts))
        return None if item is None else self.task.score(item, payload.answer_text)


def task_scorer(settings: TraceWriterSettings) -> TaskScorer | None:
    if not settings.task_path:
        return None
    try:
        return TaskScorer(load_task(settings.task_path, settings.task_options))
    except TaskError as exc:  # the endpoint serves on; its traces go unscored
        log.error("traces are not scored: %s", exc)
        return None


@dataclass
class PendingTrace:
    """A served request on its way to MLflow, with what was done for it, so that a retry does nothing twice."""

    served: ServedRequest
    info: TraceInfo | None = None  # prepared: located, scored, images stored, its span built
    span: Span | None = None
    started: bool = False


class TraceRecorder:
    """Writes a batch of requests at a time; `record` answers its outcome counts (recorded, scored, failed)."""

    def __init__(self, settings: TraceWriterSettings, scorer: TaskScorer | None = None):
        self.settings = settings
        self._scorer = scorer
        self._locations: dict[tuple[str | None, int | None], tuple[str | None, str, str]] = {}
        self._stored_images: set[tuple[str, str]] = set()
        self._client = None

    def record(self, batch: list[ServedRequest]) -> dict[str, int]:
        counts: Counter[str] = Counter()
        pending = [PendingTrace(served) for served in batch]
        backoff, deadline = 0.1, time.monotonic() + RETRY_FOR_S
        while pending:
            try:
                self._advance(pending, counts)
            except Exception as exc:  # noqa: BLE001 - one bad batch must not end the recorder
                if retried(exc) and time.monotonic() < deadline:
                    time.sleep(backoff)
                    backoff = min(_RETRY_MAX_S, backoff * 2)
                    continue
                log.error("%d trace(s) not recorded: %s: %s", len(pending), type(exc).__name__, exc)
                counts["failed"] += len(pending)
                break
        return dict(counts)

    def _advance(self, pending: list[PendingTrace], counts: Counter[str]) -> None:
        """Takes each pending trace as far as it goes, removing those that end. Each trace is started before
        its span is logged: `log_spans` then only adds to the trace, where the other order has `start_trace`
        merge into the trace `log_spans` made, twice the server's work (bench/README.md)."""
        self._each(pending, counts, self._prepare)
        self._each(pending, counts, self._start)
        _, tracing = self._mlflow()
        for experiment_id in {trace.info.experiment_id for trace in pending}:
            logged = [trace for trace in pending if trace.info.experiment_id == experiment_id]
            tracing.log_spans(experiment_id, [trace.span for trace in logged])
            for trace in logged:
                pending.remove(trace)
                counts["recorded"] += 1
                if trace.info.assessments:
                    counts["scored"] += 1

    @staticmethod
    def _each(pending: list[PendingTrace], counts: Counter[str], step) -> None:
        """`step` on each trace: what MLflow refuses for good fails that trace alone; a retried error stops."""
        for trace in list(pending):
            try:
                step(trace)
            except Exception as exc:  # noqa: BLE001
                if retried(exc):
                    raise
                log.error("trace not recorded: %s: %s", type(exc).__name__, exc)
                counts["failed"] += 1
                pending.remove(trace)

    def _mlflow(self):
        if self._client is None:
            uri = self.settings.tracking_uri
            self._client = (MlflowClient(tracking_uri=uri, registry_uri=uri), TracingClient(uri))
        return self._client

    def _location(self, served: ServedRequest) -> tuple[str | None, str, str]:
        """(LoggedModel id or None, experiment id, artifact root) of the served version (cached)."""
        key = (served.registered_model, served.version)
        if key not in self._locations:
            client, _ = self._mlflow()
            model_id = None
            if served.registered_model is not None and served.version is not None:
                version = client.get_model_version(served.registered_model, str(served.version))
                model_id = version_model_id(version.model_id, version.source)
            if model_id:
                experiment = client.get_experiment(client.get_logged_model(model_id).experiment_id)
            else:
                experiment = self._experiment(client)
            self._locations[key] = (model_id, experiment.experiment_id, experiment.artifact_location)
        return self._locations[key]

    def _experiment(self, client):
        name = self.settings.experiment
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                client.create_experiment(name)
            except MlflowException:
                pass  # another replica created it first
            experiment = client.get_experiment_by_name(name)
        return experiment

    def _store_images(self, payload: TracePayload, artifact_root: str) -> None:
        for digest, (media_type, data) in payload.images.items():
            if (artifact_root, digest) in self._stored_images:
                continue
            repo = get_artifact_repository(f"{artifact_root}/{TRACE_IMAGES_DIR}", tracking_uri=self.settings.tracking_uri)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{digest}.{media_type.split('/', 1)[1].split('+')[0]}"
                path.write_bytes(data)
                repo.log_artifact(str(path))
            self._stored_images.add((artifact_root, digest))

    def _prepare(self, trace: PendingTrace) -> None:
        if trace.info is not None:
            return
        served = trace.served
        payload = trace_payload(served, self.settings.content)
        model_id, experiment_id, artifact_root = self._location(served)
        outcome = self._scorer.score(payload) if self._scorer is not None and payload.ok else None
        assessments = []
        if outcome is not None:
            payload.tags[TRACE_TAG_PASSED] = "true" if outcome.passed else "false"
            source = AssessmentSource(source_type=AssessmentSourceType.CODE, source_id=self._scorer.source)
            extras = {k: json.dumps(v) for k, v in outcome.extras.items()}
            # ids of their own: a retried start_trace stores each once
            assessments = [Feedback(name=TRACE_SCORE, value=outcome.score, source=source, metadata=extras),
                           Feedback(name=TRACE_PASSED, value=outcome.passed, source=source)]
            for assessment in assessments:
                assessment.assessment_id = generate_assessment_id()
        if self.settings.content:
            self._store_images(payload, artifact_root)
        span, trace_id = root_span(served, payload, experiment_id)
        metadata = {TRACE_MODEL_ID: model_id} if model_id else {}
        # its span follows in the batch's log_spans: till then a reader finds the trace without spans (rather
        # than looking for them in the artifacts, which fails)
        tags = {**payload.tags, TraceTagKey.SPANS_LOCATION: SpansLocation.TRACKING_STORE.value}
        trace.span = span
        trace.info = TraceInfo(trace_id=trace_id, trace_location=TraceLocation.from_experiment_id(experiment_id),
                               request_time=served.started_ns // 1_000_000,
                               state=TraceState.OK if payload.ok else TraceState.ERROR,
                               request_preview=payload.request_preview, response_preview=payload.response_preview,
                               client_request_id=payload.response_id, execution_duration=int(served.latency_ms),
                               trace_metadata=metadata, tags=tags, assessments=assessments)

    def _start(self, trace: PendingTrace) -> None:
        if not trace.started:
            _, tracing = self._mlflow()
            tracing.start_trace(trace.info)
            trace.started = True


def root_span(served: ServedRequest, payload: TracePayload, experiment_id: str):
    """The trace's one span (the request through the endpoint), as MLflow's own exporter builds it."""
    otel_trace_id, span_id = random.getrandbits(128), random.getrandbits(64)
    trace_id = generate_mlflow_trace_id_from_otel_trace_id(otel_trace_id)
    attributes = {SpanAttributeKey.REQUEST_ID: json.dumps(trace_id),
                  SpanAttributeKey.SPAN_TYPE: json.dumps(SpanType.CHAT_MODEL if served.endpoint == "chat" else SpanType.LLM),
                  SpanAttributeKey.INPUTS: json.dumps(payload.inputs, ensure_ascii=False),
                  SpanAttributeKey.OUTPUTS: json.dumps(payload.outputs, ensure_ascii=False),
                  SpanAttributeKey.EXPERIMENT_ID: json.dumps(experiment_id)}
    end_ns = served.started_ns + int(served.latency_ms * 1e6)
    otel = ReadableSpan(name=f"/v1/{'chat/completions' if served.endpoint == 'chat' else 'completions'}",
                        context=build_otel_context(otel_trace_id, span_id), parent=None, start_time=served.started_ns,
                        end_time=end_ns, attributes=attributes,
                        status=Status(StatusCode.OK if payload.ok else StatusCode.ERROR), resource=Resource.get_empty())
    return Span(otel), trace_id


def main(argv: list[str]) -> None:
    os.nice(RECORDER_NICE)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One slow call must not hold the queue for minutes (MLflow's default is 7 retries with a 2x backoff):
    # `record` retries by itself, capped.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    with Connection(int(argv[0])) as conn:
        settings = TraceWriterSettings.model_validate(conn.recv())
        recorder = TraceRecorder(settings, task_scorer(settings))
        while True:
            try:
                batch = conn.recv()
            except EOFError:
                return
            conn.send(recorder.record(batch))


if __name__ == "__main__":
    main(sys.argv[1:])
