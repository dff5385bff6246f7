"""RunSession: one MLflow run owned by one training job, resumable from the trainer's output dir.

The training thread only validates, stamps and appends (spool write + in-memory queue); everything that
talks to MLflow runs on background threads: the metric sender, the artifact uploader, the heartbeat.
State lives in `<run_dir>/.rlops-tracker/` (run id, spool, pending jobs, eval links), so it moves
with the checkpoints and a restarted job continues the same run without losing or doubling a point.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from mlflow import MlflowClient
from mlflow.entities import Param, RunStatus, RunTag
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from rlops.config import Config, mask_uri, mask_value
from tracker import registry
from tracker.checkpoints import TABLE_DIR, TAG_BASE_MODEL, TAG_LORA_RANK, ArtifactUploader
from tracker.naming import as_float, eval_key, metric_key, redacted_params, split_param_changes
from tracker.rest import MAX_TAGS_PER_BATCH, MlflowRest
from tracker.sender import MetricSender
from tracker.spool import MetricSpool, Point, encode

log = logging.getLogger(__name__)

STATE_DIR = ".rlops-tracker"
RUN_FILE = "run.json"
EVALS_FILE = "evals.jsonl"
TAG_HEARTBEAT = "rlops.heartbeat"
TAG_END_REASON = "rlops.end_reason"
TAG_EXCEPTION_TYPE = "rlops.exception_type"
TAG_EXCEPTION_MESSAGE = "rlops.exception_message"
TAG_PARAM_CHANGED = "rlops.param_changed."
TAG_RESUMES = "rlops.resumes"
TAG_HOST = "rlops.host"
TAG_GIT_COMMIT = "rlops.git_commit"
EVAL_ROW_KEYS = ("seed", "solved", "steps", "final_distance")
MAX_TAG_VALUE = 5000


class RunTerminated(BaseException):
    """Raised on the main thread by SIGTERM while a session is open; ends the run KILLED."""


def state_dir(run_dir: Path) -> Path:
    return Path(run_dir) / STATE_DIR


def stored_run_id(run_dir: Path) -> str | None:
    path = state_dir(run_dir) / RUN_FILE
    return json.loads(path.read_text())["run_id"] if path.exists() else None


class RunSession:
    """Use `RunSession.start(...)`, ideally as a context manager (exception -> FAILED,
    SIGTERM/KeyboardInterrupt -> KILLED, clean exit -> FINISHED)."""

    def __init__(self, config: Config, run_dir: Path, client: MlflowClient, run_id: str, experiment_id: str,
                 model_tags: dict[str, str]):
        self.config = config
        self.run_dir = Path(run_dir)
        self._state = state_dir(run_dir)
        self._client = client
        self._run_id = run_id
        self._experiment_id = experiment_id
        self._rest = MlflowRest(config.tracking_uri, config.tracking.request_timeout_s)
        self._lock = threading.Lock()
        self._ended: str | None = None
        self._linked: dict[int, str] = {}  # step -> model_id of that step's checkpoint
        self._unlinked: dict[int, list[Point]] = {}  # eval points waiting for their step's checkpoint
        self._eval_sources: set[str] = set()
        self._spool = MetricSpool(self._state)
        self._sender = MetricSender(self._spool, self._rest, run_id, batch_size=config.tracking.batch_size,
                                    max_backoff_s=config.tracking.retry_max_backoff_s)
        for chunk in self._spool.unacknowledged():
            self._sender.submit(chunk)
        self._evals_fd = os.open(self._state / EVALS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._restore_eval_links()
        self._uploader = ArtifactUploader(
            client, run_id, experiment_id, self._state,
            model_tags=model_tags,
            on_checkpoint=self._checkpoint_landed, on_register=self._register_in_background,
            max_backoff_s=config.tracking.retry_max_backoff_s)
        self._checkpoint_steps = set(self._linked) | self._uploader.queued_checkpoint_steps()
        self._heartbeat_stop = threading.Event()
        threading.Thread(target=self._heartbeat, name="rlops-tracker-heartbeat", daemon=True).start()
        # An interpreter exit without finish(): still land what is spooled (bounded); the run stays RUNNING
        # until `rlops runs sweep` fails it, since an unclean end is not FINISHED.
        atexit.register(self._flush_at_exit)
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # ------------------------------------------------------------------------------------- starting

    @classmethod
    def start(cls, config: Config, run_dir: Path, *, params: Mapping[str, Any] = {}, tags: Mapping[str, str] = {},
              run_name: str | None = None) -> "RunSession":
        """Start a run, or resume the one whose id is stored in `run_dir` (the trainer's output dir)."""
        if not isinstance(config, Config):
            raise TypeError(f"config must be rlops.config.Config, got {type(config).__name__}")
        if not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"run_dir must be a path, got {type(run_dir).__name__}")
        if not isinstance(params, Mapping) or not isinstance(tags, Mapping):
            raise TypeError("params and tags must be mappings")
        run_dir = Path(run_dir)
        state = state_dir(run_dir)
        state.mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
        run_id = stored_run_id(run_dir)
        run_tags = _default_tags(config) | {str(k): str(mask_value(str(k), v)) for k, v in tags.items()}
        try:
            if run_id:
                run = _resume(client, run_id, state)
                run_tags[TAG_RESUMES] = str(int(run.data.tags.get(TAG_RESUMES, "0")) + 1)
            else:
                experiment_id = _experiment_id(client, config.tracking.experiment)
                run = client.create_run(experiment_id, run_name=run_name)
                (state / RUN_FILE).write_text(json.dumps({"run_id": run.info.run_id, "experiment_id": experiment_id,
                                                          "tracking_uri": mask_uri(config.tracking_uri)}))
            _log_params_and_tags(client, run, redacted_params(params), run_tags)
        except MlflowException as exc:
            raise ConnectionError(f"cannot {'resume' if run_id else 'start'} the MLflow run at "
                                  f"{mask_uri(config.tracking_uri)}: {exc.message}") from exc
        log.info("tracking run %s (%s) in %s", run.info.run_id, "resumed" if run_id else "new", config.tracking_uri)
        # each checkpoint carries the run's base model and rank (the trainer's tags win over config defaults)
        model_tags = {key: run_tags[key] for key in (TAG_BASE_MODEL, TAG_LORA_RANK)}
        return cls(config, run_dir, client, run.info.run_id, run.info.experiment_id, model_tags)

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def experiment_id(self) -> str:
        return self._experiment_id

    @property
    def failed_requests(self) -> int:
        """How many metric requests to MLflow failed and were retried (an outage shows up here)."""
        return self._sender.failed_requests

    @property
    def ended(self) -> str | None:
        """The final status once the session ended, else None."""
        return self._ended

    # ------------------------------------------------------------------------- training-thread hooks

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Enqueue one step's metrics (timestamp fixed now); returns after the local spool append."""
        self._check_open()
        step = _check_step(step)
        _check_metrics(metrics)
        now = int(time.time() * 1000)
        # strings only, no per-point objects: the hot path should not wake the garbage collector
        bodies = [encode(metric_key(k), as_float(k, v), now, step) for k, v in metrics.items()]
        self._sender.submit(self._spool.append(bodies))

    def log_checkpoint(self, adapter_dir: Path, step: int) -> bool:
        """Snapshot the adapter folder now (the trainer may delete it next); upload in the background.
        One checkpoint per step: returns False when this step's checkpoint was already logged."""
        self._check_open()
        step = _check_step(step)
        with self._lock:
            if step in self._checkpoint_steps:
                return False
            self._checkpoint_steps.add(step)
        try:
            self._uploader.add_checkpoint(Path(adapter_dir), step)
        except BaseException:
            with self._lock:
                self._checkpoint_steps.discard(step)
            raise
        return True

    def log_eval(self, data_source: str, solve_rate: float, rows: list[dict], step: int,
                 metrics: Mapping[str, float] | None = None) -> None:
        """Log `eval/<data_source>/avg_score` (linked to this step's checkpoint), the per-maze table, and
        any further named scores of the same eval as `eval/<data_source>/<name>`."""
        self._check_open()
        step = _check_step(step)
        rate = as_float("solve_rate", solve_rate)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"solve_rate must be within [0, 1], got {rate}")
        if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
            raise TypeError("rows must be a list of dicts with seed, solved, steps, final_distance")
        for i, row in enumerate(rows):
            missing = [k for k in EVAL_ROW_KEYS if k not in row]
            if missing:
                raise ValueError(f"eval row {i} lacks {', '.join(missing)} (need {', '.join(EVAL_ROW_KEYS)})")
        metrics = {} if metrics is None else metrics
        _check_metrics(metrics)
        self.log_eval_metrics({eval_key(data_source): rate, **{eval_key(data_source, k): v for k, v in metrics.items()}}, step)
        table = [{k: _plain(row[k]) for k in EVAL_ROW_KEYS} | {"step": step} for row in rows]
        if table:
            self._uploader.add_table(f"{TABLE_DIR}/{data_source.strip('/')}/step_{step:06d}.json", table)

    def log_eval_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log eval metrics (`eval/<data_source>/<name>`) and link them to this step's checkpoint, whether
        the checkpoint is logged before or after the eval."""
        self._check_open()
        step = _check_step(step)
        _check_metrics(metrics)
        now = int(time.time() * 1000)
        points = [Point(metric_key(k), as_float(k, v), now, step) for k, v in metrics.items()]
        with self._lock:
            model_id = self._linked.get(step)
            if model_id is None:
                self._unlinked.setdefault(step, []).extend(points)
            else:
                points = [_linked(p, model_id) for p in points]
                self._queue_registration(points)
            for p in points:
                self._note_eval_source(p.key)
            self._record_eval({"step": step, "points": [[p.key, p.value, p.timestamp_ms] for p in points]})
            self._send(points)

    # ------------------------------------------------------------------------------- registration

    def register_best(self, data_source: str | None = None) -> ModelVersion | None:
        """Register the checkpoint with the best `eval/<data_source>/<best_metric>` of this run into
        `config.registered_model` and set `tracking.register_aliases` (default: `candidate` only).
        Returns None when no checkpoint carries that metric. Waits (bounded) for pending uploads."""
        if not self.flush(self.config.tracking.flush_timeout_s):
            log.warning("register_best: some checkpoints or metrics are still pending; choosing among landed ones")
        return self._register(data_source or self._default_eval_source())

    def _register(self, source: str) -> ModelVersion | None:
        key = eval_key(source, self.config.tracking.best_metric)
        models = registry.run_checkpoints(self._client, self._experiment_id, self._run_id)
        scored = registry.rank_checkpoints(models, key)
        if not scored:
            log.warning("register_best: no checkpoint of run %s carries %s", self._run_id, key)
            return None
        name = self.config.registered_model
        version = registry.register_checkpoint(self._client, name, self._run_id, scored[0], key,
                                               self.config.tracking.register_aliases)
        keep_best = self.config.tracking.keep_best_checkpoints
        if keep_best:
            protected = registry.registered_sources(self._client, name, self._run_id)
            for model_id in registry.retention_victims(models, scored, keep_best, protected):
                self._client.delete_logged_model(model_id)
        return version

    def _default_eval_source(self) -> str:
        with self._lock:
            sources = sorted(self._eval_sources)
        return sources[0] if len(sources) == 1 else self.config.training.eval_data_source

    # ---------------------------------------------------------------------------------- lifecycle

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until every checkpoint, table and metric so far has landed."""
        deadline = time.monotonic() + timeout_s
        uploaded = self._uploader.flush(timeout_s)
        return self._sender.flush(max(0.0, deadline - time.monotonic())) and uploaded

    def finish(self) -> None:
        self._end(RunStatus.to_string(RunStatus.FINISHED), {TAG_END_REASON: "completed"})

    def fail(self, exc: BaseException) -> None:
        message = str(mask_value("message", str(exc)))[:MAX_TAG_VALUE]
        self._end(RunStatus.to_string(RunStatus.FAILED), {
            TAG_END_REASON: "exception", TAG_EXCEPTION_TYPE: type(exc).__name__, TAG_EXCEPTION_MESSAGE: message})

    def kill(self, reason: str) -> None:
        self._end(RunStatus.to_string(RunStatus.KILLED), {TAG_END_REASON: reason})

    def __enter__(self) -> "RunSession":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.finish()
        elif isinstance(exc, RunTerminated):
            self.kill("SIGTERM")
        elif isinstance(exc, KeyboardInterrupt):
            self.kill("KeyboardInterrupt")
        else:
            self.fail(exc)
        return False

    def _end(self, status: str, tags: dict[str, str]) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = status
        self._heartbeat_stop.set()
        atexit.unregister(self._flush_at_exit)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        flushed = self.flush(self.config.tracking.flush_timeout_s)
        if not flushed:
            log.warning("run %s ended with %d metric points and %d uploads not yet landed; they stay in %s "
                        "and land when a session resumes this run dir", self._run_id, self._sender.pending,
                        self._uploader.pending, self._state)
        try:
            self._rest.set_tags(self._run_id, tags)
            self._rest.update_run(self._run_id, status, int(time.time() * 1000))
        except Exception as exc:  # noqa: BLE001 - the heartbeat stopped, so `rlops runs sweep` settles it
            log.warning("could not mark run %s %s: %s", self._run_id, status, exc)
        self._sender.stop()
        self._uploader.stop()
        self._spool.close()
        os.close(self._evals_fd)

    def _check_open(self) -> None:
        if self._ended:
            raise RuntimeError(f"run session {self._run_id} already ended ({self._ended})")

    def _flush_at_exit(self) -> None:
        if not self._ended:
            self._heartbeat_stop.set()
            self.flush(self.config.tracking.flush_timeout_s)

    def _on_sigterm(self, signum, frame) -> None:
        raise RunTerminated("SIGTERM")

    def _heartbeat(self) -> None:
        while not self._heartbeat_stop.wait(self.config.tracking.heartbeat_interval_s):
            try:
                self._rest.set_tags(self._run_id, {TAG_HEARTBEAT: str(int(time.time()))})
            except Exception:  # noqa: BLE001 - a missed beat is retried next interval
                pass

    # ------------------------------------------------------------------------------ eval links

    def _checkpoint_landed(self, step: int, model_id: str) -> None:
        """Uploader thread: the step's LoggedModel exists; link evals of that step to it."""
        with self._lock:
            self._linked[step] = model_id
            points = [_linked(p, model_id) for p in self._unlinked.pop(step, [])]
            self._record_eval({"step": step, "model_id": model_id})
            self._send(points)
            self._queue_registration(points)

    def _send(self, points: list[Point]) -> None:
        self._sender.submit(self._spool.append([encode(*p) for p in points]))

    def _queue_registration(self, linked: list[Point]) -> None:
        """With `tracking.register_on_eval`, re-pick the best checkpoint of each eval set just linked."""
        if not self.config.tracking.register_on_eval:
            return
        suffix = "/" + self.config.tracking.best_metric
        for source in sorted({_eval_source(p.key) for p in linked if p.key.endswith(suffix)} - {None}):
            self._uploader.add_registration(source)

    def _register_in_background(self, data_source: str) -> None:
        """Uploader thread: once the linked metrics have landed, register the current best."""
        if not self._sender.flush(self.config.tracking.flush_timeout_s):
            raise TimeoutError("linked eval metrics not acknowledged yet")  # the uploader retries the job
        self._register(data_source)

    def _note_eval_source(self, key: str) -> None:
        source = _eval_source(key)
        if source:
            self._eval_sources.add(source)

    def _record_eval(self, record: dict) -> None:
        os.write(self._evals_fd, (json.dumps(record) + "\n").encode())

    def _restore_eval_links(self) -> None:
        """Rebuild step -> checkpoint links and unlinked evals from earlier sessions; re-send the links
        (MLflow drops a point that already landed, so this is safe)."""
        with open(self._state / EVALS_FILE) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        for record in records:
            step = record["step"]
            if "model_id" in record:
                self._linked[step] = record["model_id"]
            else:
                self._unlinked.setdefault(step, []).extend(Point(k, v, t, step) for k, v, t in record["points"])
        relink = []
        for step in [s for s in self._unlinked if s in self._linked]:
            relink += [_linked(p, self._linked[step]) for p in self._unlinked.pop(step)]
        for record in records:
            for key, _, _ in record.get("points", []):
                self._note_eval_source(key)
        self._send(relink)


# ------------------------------------------------------------------------------------------ helpers


def _eval_source(key: str) -> str | None:
    """`eval/<data_source>/<metric>` -> data_source (None for other keys and SkyRL's `eval/all/*`)."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] == "eval" and parts[1] != "all":
        return "/".join(parts[1:-1])
    return None


def _linked(point: Point, model_id: str) -> Point:
    return Point(point.key, point.value, point.timestamp_ms, point.step, model_id)


def _plain(value: Any) -> Any:
    """numpy/torch scalars -> Python scalars, so a table row serializes to JSON."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 else value


def _check_metrics(metrics: Any) -> None:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of name -> number, got {type(metrics).__name__}")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


def _experiment_id(client: MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        # Tells the MLflow UI this is model training (runs, charts), not a GenAI experiment (traces).
        return client.create_experiment(name, tags={"mlflow.experimentKind": "custom_model_development"})
    if experiment.lifecycle_stage != "active":
        raise ValueError(f"experiment {name!r} is deleted; restore it or set tracking.experiment to another name")
    return experiment.experiment_id


def _resume(client: MlflowClient, run_id: str, state: Path):
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        raise ValueError(f"{state / RUN_FILE} names run {run_id}, which the tracking server does not have; "
                         "remove that file to start a new run") from None
    if run.info.lifecycle_stage != "active":
        raise ValueError(f"run {run_id} stored in {state / RUN_FILE} is deleted; restore it or remove that file")
    if run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
    return run


def _default_tags(config: Config) -> dict[str, str]:
    tags = {TAG_HOST: socket.gethostname(), TAG_BASE_MODEL: config.training.base_model,
            TAG_LORA_RANK: str(config.training.lora_rank), TAG_HEARTBEAT: str(int(time.time()))}
    commit = _git_commit()
    if commit:
        tags[TAG_GIT_COMMIT] = tags["mlflow.source.git.commit"] = commit
    return tags


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _log_params_and_tags(client: MlflowClient, run, params: dict[str, str], tags: dict[str, str]) -> None:
    """Log params the run lacks; a changed value on resume becomes a `rlops.param_changed.<key>` tag
    (MLflow forbids changing a param)."""
    to_log, changed = split_param_changes(run.data.params, params)
    for key, value in changed.items():
        tags[TAG_PARAM_CHANGED + key] = value
    items = sorted(to_log.items())
    tag_items = [RunTag(k, str(v)[:MAX_TAG_VALUE]) for k, v in tags.items()]
    for i in range(0, max(len(items), len(tag_items)), MAX_TAGS_PER_BATCH):
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items[i:i + MAX_TAGS_PER_BATCH]],
                         tags=tag_items[i:i + MAX_TAGS_PER_BATCH])
