"""RunSession: one MLflow run owned by one training job, resumable from the trainer's output dir.

The training thread only validates, stamps and appends (spool write + in-memory queue); everything that
talks to MLflow runs on background threads: the metric sender, the artifact uploader, the heartbeat.
State lives in `<run_dir>/.rlops-tracker/` (`tracker.state`), so it moves with the checkpoints and a
restarted job continues the same run without losing or doubling a point: a resumed trainer replays the
steps after its checkpoint, and the points of steps an earlier session already logged are dropped.
One process at a time writes a run dir (`tracker.lock`).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from mlflow import MlflowClient
from mlflow.entities import Param, RunStatus, RunTag
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from rlops.config import Config, mask_uri, mask_value
from tracker import lineage, registry, state, system
from tracker.checkpoints import MODEL_TAG_KEYS, TABLE_DIR, TAG_BASE_MODEL, TAG_LORA_RANK, ArtifactUploader
from tracker.evals import EvalLinks, eval_source
from tracker.inputs import DatasetRef, EvalDatasets, log_datasets, store_datasets, stored_datasets
from tracker.lock import RunDirLock
from tracker.naming import as_float, eval_key, metric_key, redacted_params, split_param_changes
from tracker.rest import MAX_TAGS_PER_BATCH, MlflowRest
from tracker.samples import KINDS, SampleUploader, bounded, check_rows
from tracker.sender import MetricSender
from tracker.spool import MetricSpool, Point, encode
from tracker.state import STATE_DIR, state_dir, stored_run_id  # noqa: F401  (part of this module's face)

log = logging.getLogger(__name__)

TAG_HEARTBEAT = "rlops.heartbeat"
TAG_END_REASON = "rlops.end_reason"
TAG_EXCEPTION_TYPE = "rlops.exception_type"
TAG_EXCEPTION_MESSAGE = "rlops.exception_message"
TAG_PARAM_CHANGED = "rlops.param_changed."
TAG_RESUMES = "rlops.resumes"
TAG_HOST = "rlops.host"
TAG_GIT_COMMIT = "rlops.git_commit"
TAG_DEAD_LETTERS = "rlops.dead_letters"
TAG_REGISTRATION = "rlops.registration"
TAG_RESUMED_FROM_STEP = "rlops.resumed_after_step"
EVAL_ROW_KEYS = ("seed", "solved", "steps", "final_distance")
MAX_TAG_VALUE = 5000


class RunTerminated(BaseException):
    """Raised on the main thread by SIGTERM while a session is open; ends the run KILLED."""


class RunSession:
    """Use `RunSession.start(...)`, ideally as a context manager (exception -> FAILED,
    SIGTERM/KeyboardInterrupt -> KILLED, clean exit -> FINISHED)."""

    def __init__(self, config: Config, run_dir: Path, client: MlflowClient, run_id: str, experiment_id: str,
                 model_tags: dict[str, str], lock: RunDirLock, *, live: bool = True,
                 archived: Path | None = None):
        self.config = config
        self.run_dir = Path(run_dir)
        self.archived = archived  # where the run dir's previous (finished) run was moved, if any
        self._state = state_dir(run_dir)
        self._client = client
        self._run_id = run_id
        self._experiment_id = experiment_id
        self._run_lock = lock
        self._live = live
        self._rest = MlflowRest(config.tracking_uri, config.tracking.request_timeout_s)
        self._lock = threading.Lock()
        self._ended: str | None = None
        self._spool = MetricSpool(self._state)
        # a resumed trainer replays the steps after its checkpoint: those an earlier session logged are dropped
        self.resumed_after_step = self._spool.previous_last_step
        self.replayed_points = 0
        self.landed_checkpoints = 0
        self.registered: ModelVersion | None = None
        self._sender = MetricSender(self._spool, self._rest, run_id, batch_size=config.tracking.batch_size,
                                    max_backoff_s=config.tracking.retry_max_backoff_s,
                                    on_dead_letters=self._tag_dead_letters)
        for chunk in self._spool.unacknowledged():
            self._sender.submit(chunk)
        self._evals = EvalLinks(self._state / state.EVALS_FILE)
        self._datasets = EvalDatasets(stored_datasets(self._state))
        self._send(self._evals.restore())
        self._uploader = ArtifactUploader(
            client, run_id, experiment_id, self._state,
            model_tags=model_tags,
            on_checkpoint=self._checkpoint_landed, on_register=self._register_in_background,
            max_backoff_s=config.tracking.retry_max_backoff_s)
        self._checkpoint_steps = set(self._evals.linked) | self._uploader.queued_checkpoint_steps()
        self._heartbeat_stop = threading.Event()
        self._previous_sigterm = None
        self._samples: SampleUploader | None = None
        self._system: system.SystemMetrics | None = None
        if not live:
            return
        self._samples = SampleUploader(client, run_id, max_backoff_s=config.tracking.retry_max_backoff_s)
        self._system = system.start(run_id, config.tracking_uri, config.tracking.system_metrics_interval_s,
                                    enabled=config.tracking.system_metrics, resume=self.resumed_after_step >= 0)
        state.clear_intended_end(self.run_dir)  # this session decides the end now
        threading.Thread(target=self._heartbeat, name="rlops-tracker-heartbeat", daemon=True).start()
        # An interpreter exit without finish(): still land what is spooled (bounded); the run stays RUNNING
        # until `rlops runs sweep` fails it, since an unclean end is not FINISHED.
        atexit.register(self._flush_at_exit)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # ------------------------------------------------------------------------------------- starting

    @classmethod
    def start(cls, config: Config, run_dir: Path, *, params: Mapping[str, Any] = {}, tags: Mapping[str, str] = {},
              run_name: str | None = None, resume: bool | None = None,
              datasets: Sequence[DatasetRef] = ()) -> "RunSession":
        """Start a run, or continue the one stored in `run_dir` (the trainer's output dir). `datasets`: the
        train/eval sets, logged as run inputs; eval points of a listed eval set are linked to it.

        `resume=None`: continue a stored run unless it FINISHED (then a new run starts and the finished
        one's state moves to `<run_dir>/previous-<run_id>/`); True: always continue it; False: always a
        new run. Raises `tracker.lock.RunDirBusy` while another process holds the run dir."""
        if not isinstance(config, Config):
            raise TypeError(f"config must be rlops.config.Config, got {type(config).__name__}")
        if not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"run_dir must be a path, got {type(run_dir).__name__}")
        if not isinstance(params, Mapping) or not isinstance(tags, Mapping):
            raise TypeError("params and tags must be mappings")
        if resume not in (None, True, False):
            raise TypeError(f"resume must be None, True or False, got {resume!r}")
        run_dir = Path(run_dir)
        lock = RunDirLock(run_dir, config.tracking.lock_lease_s)
        lock.acquire()
        try:
            session = cls._start_locked(config, run_dir, lock, params, tags, run_name, resume, datasets)
        except BaseException:
            lock.release()
            raise
        lock.start_renewing()
        return session

    @classmethod
    def _start_locked(cls, config, run_dir: Path, lock: RunDirLock, params, tags, run_name, resume,
                      datasets) -> "RunSession":
        client = MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
        run_tags = _default_tags(config) | {str(k): str(mask_value(str(k), v)) for k, v in tags.items()}
        run_id, archived = stored_run_id(run_dir), None
        try:
            if run_id and resume is not True and (resume is False or _finished(client, run_dir, run_id)):
                cls._drain_before_archiving(config, run_dir, client, run_id, lock)
                archived, run_id = state.archive_state(run_dir, run_id), None
            state_dir(run_dir).mkdir(parents=True, exist_ok=True)
            if run_id:
                run = _resume(client, run_id, state_dir(run_dir))
                run_tags[TAG_RESUMES] = str(int(run.data.tags.get(TAG_RESUMES, "0")) + 1)
            else:
                experiment_id = _experiment_id(client, config.tracking.experiment)
                run = client.create_run(experiment_id, run_name=run_name)
                state.write_run(run_dir, {"run_id": run.info.run_id, "experiment_id": experiment_id,
                                          "tracking_uri": mask_uri(config.tracking_uri)})
            _log_params_and_tags(client, run, redacted_params(params), run_tags)
            log_datasets(client, run.info.run_id, datasets)
            store_datasets(state_dir(run_dir), datasets)
        except MlflowException as exc:
            raise ConnectionError(f"cannot {'resume' if run_id else 'start'} the MLflow run at "
                                  f"{mask_uri(config.tracking_uri)}: {exc.message}") from exc
        log.info("tracking run %s (%s) in %s", run.info.run_id, "resumed" if run_id else "new", config.tracking_uri)
        # each checkpoint carries the run's base model and rank (the trainer's tags win over config defaults)
        model_tags = {key: run_tags[key] for key in MODEL_TAG_KEYS if key in run_tags}
        session = cls(config, run_dir, client, run.info.run_id, run.info.experiment_id, model_tags, lock,
                      archived=archived)
        if session.resumed_after_step >= 0:
            try:
                session._rest.set_tags(session.run_id, {TAG_RESUMED_FROM_STEP: str(session.resumed_after_step)})
            except Exception:  # noqa: BLE001 - informative only
                pass
        return session

    @classmethod
    def open_stored(cls, config: Config, run_dir: Path, lock: RunDirLock) -> "RunSession":
        """A session that only drains what the stored run left (no heartbeat, no status change): what
        `flush_run_dir` and a new run over a finished one use. The caller holds `lock`."""
        record = state.stored_run(run_dir)
        if record is None:
            raise FileNotFoundError(f"{run_dir} holds no tracked run ({STATE_DIR}/{state.RUN_FILE} is missing)")
        client = MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
        run = client.get_run(record["run_id"])
        defaults = _default_tags(config)
        model_tags = {key: run.data.tags.get(key, defaults.get(key)) for key in MODEL_TAG_KEYS}
        model_tags = {key: value for key, value in model_tags.items() if value is not None}
        return cls(config, run_dir, client, run.info.run_id, run.info.experiment_id, model_tags, lock, live=False)

    @classmethod
    def _drain_before_archiving(cls, config, run_dir: Path, client, run_id: str, lock: RunDirLock) -> None:
        drain = cls.open_stored(config, run_dir, lock)
        left = drain.drain(config.tracking.flush_timeout_s)
        if left:
            raise RuntimeError(f"run dir {run_dir} still holds {left} of finished run {run_id} that MLflow has "
                               f"not taken; run `rlops runs flush {run_dir}` first")

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
    def dead_letters(self) -> int:
        return self._sender.dead_letters

    @property
    def sent_points(self) -> int:
        return self._sender.sent_points

    @property
    def checkpoint_steps(self) -> frozenset[int]:
        """Steps whose checkpoint this run has logged (landed or queued), in any session."""
        with self._lock:
            return frozenset(self._checkpoint_steps)

    def eval_history(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of an eval metric as this run logged it, earlier sessions included."""
        with self._lock:
            return sorted(self._evals.history.get(key, {}).items())

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
        if step <= self.resumed_after_step:  # replayed after a resume: the earlier session logged this step
            self.replayed_points += len(metrics)
            return
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
        logged = self.log_eval_metrics(
            {eval_key(data_source): rate, **{eval_key(data_source, k): v for k, v in metrics.items()}}, step)
        table = [{k: _plain(row[k]) for k in EVAL_ROW_KEYS} | {"step": step} for row in rows]
        if table and logged:
            self._uploader.add_table(f"{TABLE_DIR}/{data_source.strip('/')}/step_{step:06d}.json", table)

    def log_samples(self, rows: list[dict], step: int, *, kind: str = "eval") -> int:
        """Log a bounded sample of answers (`tracking.sample_mazes` eval rows, or the rows of the first
        `tracking.sample_groups` GRPO groups for kind="train") as `<eval|train>/samples/step_<N>.json`
        with an image column (`image`: PIL image, HxWx3 array, or a callable rendering one) and a grid
        `step_<N>.png`. Returns the rows queued; everything else happens on a background thread."""
        self._check_open()
        step = _check_step(step)
        if kind not in KINDS:
            raise ValueError(f"sample kind must be one of {', '.join(KINDS)}, got {kind!r}")
        check_rows(rows)
        limit = self.config.tracking.sample_mazes if kind == "eval" else self.config.tracking.sample_groups
        rows = bounded(rows, kind, limit)
        if not rows or self._samples is None or (kind == "train" and step <= self.resumed_after_step):
            return 0
        self._samples.add(kind, step, rows)
        return len(rows)

    def log_eval_metrics(self, metrics: Mapping[str, float], step: int) -> int:
        """Log eval metrics (`eval/<data_source>/<name>`) and link them to this step's checkpoint, whether
        the checkpoint is logged before or after the eval. Returns how many points were logged (an eval of
        a step an earlier session of this run logged already is dropped)."""
        self._check_open()
        step = _check_step(step)
        _check_metrics(metrics)
        now = int(time.time() * 1000)
        points = [Point(metric_key(k), as_float(k, v), now, step) for k, v in metrics.items()]
        with self._lock:
            points = self._evals.add(points, step)
            if any(p.model_id for p in points):
                self._queue_registration(points)
            self._send(points)
        return len(points)

    # ------------------------------------------------------------------------------- registration

    def register_best(self, data_source: str | None = None) -> ModelVersion | None:
        """Register the checkpoint with the best `eval/<data_source>/<best_metric>` of this run into
        `config.registered_model` and set `tracking.register_aliases` (default: `candidate` only).

        Never among a partial set: it waits (up to `tracking.flush_timeout_s`) for every checkpoint and
        eval logged so far; if they have not all landed, the registration is queued as a job (kept in the
        run dir, tagged `rlops.registration=pending`) that completes once they land, in this session or
        the next one on this run dir (or `rlops runs flush`). Returns None then, and when no checkpoint
        carries that metric."""
        source = data_source or self._default_eval_source()
        if self.flush(self.config.tracking.flush_timeout_s):
            return self._register(source)
        log.warning("register_best: checkpoints or evals are still pending; registration of %s waits for "
                    "them (pending in %s)", source, self._state)
        self._uploader.add_registration(source)
        try:
            self._rest.set_tags(self._run_id, {TAG_REGISTRATION: "pending"})
        except Exception:  # noqa: BLE001 - the job in the run dir is the record; the tag is a courtesy
            pass
        return None

    def _register(self, source: str) -> ModelVersion | None:
        key = eval_key(source, self.config.tracking.best_metric)
        models = registry.run_checkpoints(self._client, self._experiment_id, self._run_id)
        dataset = self._datasets.get(source)  # scores of other eval sets than the logged one never compare
        scored = registry.rank_checkpoints(models, key, dataset.digest if dataset else None)
        if not scored:
            log.warning("register_best: no checkpoint of run %s carries %s", self._run_id, key)
            return None
        name = self.config.registered_model
        description = lineage.version_description(
            metric_key=key, value=scored[0].value, step=scored[0].step, run_id=self._run_id,
            run_name=self._client.get_run(self._run_id).info.run_name,
            base_model=self._uploader.model_tags.get(TAG_BASE_MODEL),
            base_digest=self._uploader.model_tags.get(lineage.TAG_BASE_MODEL_SHA256),
            eval_set=source, eval_digest=dataset.layout_sha256 if dataset else None)
        version = registry.register_checkpoint(self._client, name, self._run_id, scored[0], key,
                                               self.config.tracking.register_aliases,
                                               eval_set_sha256=dataset.layout_sha256 if dataset else None,
                                               description=description)
        self._client.set_tag(self._run_id, TAG_REGISTRATION, f"{name} v{version.version} (step {scored[0].step})")
        self.registered = version
        keep_best = self.config.tracking.keep_best_checkpoints
        if keep_best:
            protected = registry.registered_sources(self._client, name, self._run_id)
            for model_id in registry.retention_victims(models, scored, keep_best, protected):
                self._client.delete_logged_model(model_id)
        return version

    def _default_eval_source(self) -> str:
        with self._lock:
            sources = sorted(self._evals.sources)
        return sources[0] if len(sources) == 1 else self.config.training.eval_data_source

    # ---------------------------------------------------------------------------------- lifecycle

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until every checkpoint, table and metric so far has landed."""
        deadline = time.monotonic() + timeout_s
        uploaded = self._uploader.flush(timeout_s)
        sent = self._sender.flush(max(0.0, deadline - time.monotonic()))
        if self._samples is not None:
            self._samples.flush(max(0.0, deadline - time.monotonic()))  # best effort: not part of the verdict
        return sent and uploaded

    def drain(self, timeout_s: float) -> str:
        """(A drain session) land what the stored run left, apply the end it recorded, close. Returns what
        is still left, in words ('' when everything landed)."""
        flushed = self.flush(timeout_s)
        end = state.intended_end(self.run_dir)
        if flushed and end is not None:
            try:
                self._mark_end(end["status"], end["tags"])
                state.clear_intended_end(self.run_dir)
            except Exception as exc:  # noqa: BLE001 - reported as left over
                log.warning("could not mark run %s %s: %s", self._run_id, end["status"], exc)
        left = self._leftovers()
        self._close()
        return left

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
        # kept until the server has it, so a flush after an outage still ends the run as it ended
        state.record_intended_end(self.run_dir, status, tags)
        if not self.flush(self.config.tracking.flush_timeout_s):
            log.warning("run %s ended with %s not yet landed; they stay in %s and land with `rlops runs flush` "
                        "or when a session resumes this run dir", self._run_id, self._leftovers(), self._state)
        try:
            self._mark_end(status, tags)
            state.clear_intended_end(self.run_dir)
        except Exception as exc:  # noqa: BLE001 - the heartbeat stopped, so `rlops runs sweep` settles it
            log.warning("could not mark run %s %s: %s", self._run_id, status, exc)
        self._close()

    def _mark_end(self, status: str, tags: dict[str, str]) -> None:
        if self._sender.dead_letters:
            tags = tags | {TAG_DEAD_LETTERS: str(self._sender.dead_letters)}
        self._rest.set_tags(self._run_id, tags)
        self._rest.update_run(self._run_id, status, int(time.time() * 1000))

    def _leftovers(self) -> str:
        parts = [(self._sender.pending, "metric point(s)"), (self._uploader.pending, "upload/registration job(s)")]
        if state.intended_end(self.run_dir):
            parts.append((1, "unrecorded end status"))
        return ", ".join(f"{n} {what}" for n, what in parts if n)

    def _close(self) -> None:
        """Stop the workers, then close the files they write (an upload still in flight past the bound
        finds them closed and leaves its job for the next start)."""
        self._sender.stop()
        if self._system is not None:
            self._system.stop(self.config.tracking.request_timeout_s)
        if self._samples is not None:
            self._samples.stop()
        if not self._uploader.stop():
            log.warning("run %s: an upload is still in flight; its job stays in %s", self._run_id, self._state)
        with self._lock:
            self._spool.close()
            self._evals.close()
        if self._live:
            self._run_lock.release()  # a drain session's caller holds the lock and releases it

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
                self._rest.set_tags(self._run_id, {TAG_HEARTBEAT: _beat()})
            except Exception:  # noqa: BLE001 - a missed beat is retried next interval
                pass

    def _tag_dead_letters(self, count: int) -> None:
        """Sender thread: show the dead-letter count on the run (best effort; the end tags it again)."""
        try:
            self._rest.set_tags(self._run_id, {TAG_DEAD_LETTERS: str(count)})
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------------------ eval links

    def _checkpoint_landed(self, step: int, model_id: str) -> None:
        """Uploader thread: the step's LoggedModel exists; link evals of that step to it."""
        with self._lock:
            points = self._evals.checkpoint_landed(step, model_id)
            self.landed_checkpoints += 1
            self._send(points)
            self._queue_registration(points)

    def _send(self, points: list[Point]) -> None:
        self._sender.submit(self._spool.append([encode(*p, dataset=self._datasets.link(p.key)) for p in points]))

    def _queue_registration(self, linked: list[Point]) -> None:
        """With `tracking.register_on_eval`, re-pick the best checkpoint of each eval set just linked."""
        if not self.config.tracking.register_on_eval:
            return
        suffix = "/" + self.config.tracking.best_metric
        for source in sorted({eval_source(p.key) for p in linked if p.key.endswith(suffix)} - {None}):
            self._uploader.add_registration(source)

    def _register_in_background(self, data_source: str) -> None:
        """Uploader thread: once the linked metrics have landed, register the current best."""
        if not self._sender.flush(self.config.tracking.flush_timeout_s):
            raise TimeoutError("linked eval metrics not acknowledged yet")  # the uploader retries the job
        self._register(data_source)


# ------------------------------------------------------------------------------------------ helpers


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


def _finished(client: MlflowClient, run_dir: Path, run_id: str) -> bool:
    """Did the stored run end FINISHED (on the server, or as recorded locally when the server was down)?"""
    end = state.intended_end(run_dir)
    if end is not None:
        return end["status"] == RunStatus.to_string(RunStatus.FINISHED)
    try:
        return client.get_run(run_id).info.status == RunStatus.to_string(RunStatus.FINISHED)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        return False  # _resume explains


def _resume(client: MlflowClient, run_id: str, state_path: Path):
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        raise ValueError(f"{state_path / state.RUN_FILE} names run {run_id}, which the tracking server does not have; "
                         "remove that file to start a new run") from None
    if run.info.lifecycle_stage != "active":
        raise ValueError(f"run {run_id} stored in {state_path / state.RUN_FILE} is deleted; restore it or remove that file")
    if run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
    return run


def _beat() -> str:
    """A heartbeat value: the time in ms resolution (a whole second of rounding would count as silence)."""
    return f"{time.time():.3f}"


def _default_tags(config: Config) -> dict[str, str]:
    tags = {TAG_HOST: socket.gethostname(), TAG_BASE_MODEL: config.training.base_model,
            TAG_LORA_RANK: str(config.training.lora_rank), TAG_HEARTBEAT: _beat()}
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


@dataclass(frozen=True)
class FlushReport:
    run_id: str
    points_landed: int
    checkpoints_landed: int
    registered: str | None  # "<model> v<N>" when a pending registration completed
    ended: str | None  # the end status the flush recorded on the server
    left: str  # what is still pending, in words ('' = drained)


def flush_run_dir(config: Config, run_dir: Path, timeout_s: float | None = None) -> FlushReport:
    """Land what a crashed or stopped run left in `run_dir` (points, checkpoints, a pending registration,
    an end status the server missed). Refused while a live process holds the run dir."""
    run_dir = Path(run_dir)
    lock = RunDirLock(run_dir, config.tracking.lock_lease_s)
    lock.acquire()
    try:
        try:
            session = RunSession.open_stored(config, run_dir, lock)
        except MlflowException as exc:
            raise ConnectionError(f"cannot reach the MLflow run at {mask_uri(config.tracking_uri)}: "
                                  f"{exc.message}") from exc
        end = state.intended_end(run_dir)
        left = session.drain(config.tracking.flush_timeout_s if timeout_s is None else timeout_s)
        registered = session.registered
        return FlushReport(session.run_id, session.sent_points, session.landed_checkpoints,
                           f"{registered.name} v{registered.version}" if registered else None,
                           end["status"] if end and state.intended_end(run_dir) is None else None, left)
    finally:
        lock.release()
