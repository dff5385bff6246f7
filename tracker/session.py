"""RunSession: one MLflow run owned by one training job, resumable from the trainer's output dir.

The session composes pieces with one job each: `run_start` opens or continues the run, `outbox` takes
points to MLflow (spool + sender thread), `checkpoints` uploads adapters and tables (uploader thread),
`evals` links eval points to their checkpoint, `registration` registers the best one, `heartbeat` and
`lifecycle` keep the run's status true. The training thread only validates, stamps and hands over.
State lives in `<run_dir>/.rlops-tracker/` (`tracker.state`), so it moves with the checkpoints and a
restarted job continues the same run without losing or doubling a point. One process at a time writes a
run dir (`tracker.lock`).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from rlops.config import Config
from rlops.eval_table import table_rows
from tracker import lifecycle, run_start, state, system
from tracker.checkpoints import ArtifactUploader
from tracker.evals import EvalLinking, table_artifact
from tracker.heartbeat import Heartbeat
from tracker.inputs import DatasetRef, EvalDatasets, stored_datasets
from tracker.lifecycle import ExitGuard
from tracker.lock import RunDirLock
from tracker.naming import as_float, check_metrics, check_step, eval_key
from tracker.outbox import MetricOutbox
from tracker.registration import Registration
from tracker.rest import MlflowRest
from tracker.offline import OfflineRest
from tracker.samples import KINDS, SampleUploader, bounded, check_rows, upload_samples
from tracker.sender import TAG_DEAD_LETTERS
from tracker.state import STATE_DIR, state_dir

log = logging.getLogger(__name__)


class RunSession:
    """Use `RunSession.start(...)`, ideally as a context manager (exception -> FAILED,
    SIGTERM/KeyboardInterrupt -> KILLED, clean exit -> FINISHED)."""

    def __init__(self, config: Config, run_dir: Path, client: MlflowClient | None, run_id: str,
                 experiment_id: str | None, model_tags: dict[str, str], lock: RunDirLock, *, live: bool = True,
                 offline: bool = False, archived: Path | None = None, system_node_id: str | None = None):
        self.config = config
        self.run_dir = Path(run_dir)
        self.archived = archived  # where the run dir's previous (finished) run was moved, if any
        self.offline = offline  # the run stays in the run dir: nothing is sent, `rlops runs sync` sends it
        self._state = state_dir(run_dir)
        self._client = client
        self._run_id = run_id
        self._experiment_id = experiment_id
        self._run_lock = lock
        self._live = live
        self._rest = (OfflineRest(self._state) if offline
                      else MlflowRest(config.tracking_uri, config.tracking.request_timeout_s))
        self._lock = threading.Lock()
        self._ended: str | None = None
        self.landed_checkpoints = 0
        self._outbox = MetricOutbox(self._state, self._rest, run_id, batch_size=config.tracking.batch_size,
                                    max_backoff_s=config.tracking.retry_max_backoff_s,
                                    linger_s=config.tracking.send_interval_s,
                                    on_dead_letters=self._tag_dead_letters, send=not offline)
        self._datasets = EvalDatasets(stored_datasets(self._state))
        # offline nothing lands: a registration always waits as a job for the sync
        self._registration = Registration(config, client, self._rest, run_id, experiment_id, self._state,
                                          landed=(lambda timeout_s: False) if offline else self.flush,
                                          points_landed=self._outbox.flush,
                                          queue=lambda source, rule: self._uploader.add_registration(source, rule),
                                          datasets=self._datasets, model_tags=model_tags)
        self._evals = EvalLinking(self._state / state.EVALS_FILE,
                                  lambda points: self._outbox.put_points(points, self._datasets.link),
                                  self._registration.after_links)
        self._uploader = ArtifactUploader(
            client, run_id, experiment_id, self._state, model_tags=model_tags,
            on_checkpoint=self._checkpoint_landed, on_register=self._registration.in_background,
            max_backoff_s=config.tracking.retry_max_backoff_s, start=not offline)
        self._checkpoint_steps = self._evals.linked_steps | self._uploader.queued_checkpoint_steps()
        self._heartbeat: Heartbeat | None = None
        self._exit_guard: ExitGuard | None = None
        self._samples: SampleUploader | None = None
        self._system: system.SystemMetrics | None = None
        if not live:
            return
        write_samples = self._uploader.add_samples if offline else functools.partial(upload_samples, client, run_id)
        self._samples = SampleUploader(write_samples, max_backoff_s=config.tracking.retry_max_backoff_s)
        self._system = system.start(run_id, config.tracking_uri, config.tracking.system_metrics_interval_s,
                                    enabled=config.tracking.system_metrics, resume=self.resumed_after_step >= 0,
                                    node_id=system_node_id, spool_to=self._outbox.put_points if offline else None)
        state.clear_intended_end(self.run_dir)  # this session decides the end now
        if not offline:
            self._heartbeat = Heartbeat(self._rest, run_id, config.tracking.heartbeat_interval_s)
        # An interpreter exit without finish(): still land what is spooled (bounded); the run stays RUNNING
        # until `rlops runs sweep` fails it, since an unclean end is not FINISHED.
        self._exit_guard = ExitGuard(self._flush_at_exit)

    # ------------------------------------------------------------------------------------- starting

    @classmethod
    def start(cls, config: Config, run_dir: Path, *, params: Mapping[str, Any] = {}, tags: Mapping[str, str] = {},
              run_name: str | None = None, resume: bool | None = None,
              datasets: Sequence[DatasetRef] = (), system_node_id: str | None = None) -> "RunSession":
        """Start a run, or continue the one stored in `run_dir` (the trainer's output dir). `datasets`: the
        train/eval sets, logged as run inputs; eval points of a listed eval set are linked to it.
        `system_node_id`: this machine's name in the system metrics (`system/<id>/...`) of a multi-node job.

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
            session = cls._start_locked(config, run_dir, lock, params, tags, run_name, resume, datasets,
                                        system_node_id)
        except BaseException:
            lock.release()
            raise
        lock.start_renewing()
        return session

    @classmethod
    def _start_locked(cls, config, run_dir: Path, lock: RunDirLock, params, tags, run_name, resume,
                      datasets, system_node_id) -> "RunSession":
        opened = run_start.open_run(config, run_dir, params, tags, run_name, resume, datasets=datasets,
                                    drain_stored=lambda: cls._drain_stored(config, run_dir, lock))
        session = cls(config, run_dir, opened.client, opened.run_id, opened.experiment_id, opened.model_tags, lock,
                      offline=opened.offline, archived=opened.archived, system_node_id=system_node_id)
        if session.resumed_after_step >= 0:
            try:
                session._rest.set_tags(session.run_id,
                                       {run_start.TAG_RESUMED_FROM_STEP: str(session.resumed_after_step)})
            except Exception:  # noqa: BLE001 - informative only
                pass
        return session

    @classmethod
    def open_stored(cls, config: Config, run_dir: Path, lock: RunDirLock) -> "RunSession":
        """A session that only drains what the stored run left (no heartbeat, no status change): what
        `flush_run_dir` (and so `rlops runs sync`) and a new run over a finished one use; an offline run is
        bound to its server run first. The caller holds `lock`."""
        client = run_start.client_for(config)
        run_id = run_start.bind_stored_run(client, run_dir)
        if run_id is None:
            raise FileNotFoundError(f"{run_dir} holds no tracked run ({STATE_DIR}/{state.RUN_FILE} is missing)")
        run = client.get_run(run_id)
        defaults = run_start.default_tags(config)
        model_tags = {key: run.data.tags.get(key, defaults.get(key)) for key in run_start.MODEL_TAGS}
        model_tags = {key: value for key, value in model_tags.items() if value is not None}
        return cls(config, run_dir, client, run.info.run_id, run.info.experiment_id, model_tags, lock, live=False)

    @classmethod
    def _drain_stored(cls, config, run_dir: Path, lock: RunDirLock) -> str:
        """Land what the stored run left before a new run replaces it; returns what is left, in words."""
        return cls.open_stored(config, run_dir, lock).drain(config.tracking.flush_timeout_s)

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def experiment_id(self) -> str:
        return self._experiment_id

    @property
    def resumed_after_step(self) -> int:
        """The last step an earlier session of this run logged (-1: none); a replayed step up to it is dropped."""
        return self._outbox.resumed_after_step

    @property
    def replayed_points(self) -> int:
        return self._outbox.replayed_points

    @property
    def registered(self) -> ModelVersion | None:
        """The version this session registered last, if any."""
        return self._registration.registered

    @property
    def registration_refused(self) -> str | None:
        """Why this session's last registration registered nothing (no checkpoint beat the base), if so."""
        return self._registration.refused

    @property
    def registration_evidence(self) -> str | None:
        """How the version this session registered last beat the base (the paired test), if it was compared."""
        return self._registration.evidence

    @property
    def failed_requests(self) -> int:
        """How many metric requests to MLflow failed and were retried (an outage shows up here)."""
        return self._outbox.sender.failed_requests

    @property
    def dead_letters(self) -> int:
        return self._outbox.sender.dead_letters

    @property
    def sent_points(self) -> int:
        return self._outbox.sender.sent_points

    @property
    def checkpoint_steps(self) -> frozenset[int]:
        """Steps whose checkpoint this run has logged (landed or queued), in any session."""
        with self._lock:
            return frozenset(self._checkpoint_steps)

    def eval_history(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of an eval metric as this run logged it, earlier sessions included."""
        return self._evals.history(key)

    @property
    def ended(self) -> str | None:
        """The final status once the session ended, else None."""
        return self._ended

    # ------------------------------------------------------------------------- training-thread hooks

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Hand one step's metrics over (timestamp fixed now): checked and queued in memory, no I/O; the
        spool writer thread writes them out within `outbox.WRITE_INTERVAL_S`."""
        if self._ended:
            self._check_open()
        # the common case is checked inline: this runs on the training thread at every step
        if type(metrics) is not dict:
            check_metrics(metrics)
        if type(step) is not int or step < 0:
            check_step(step)
        self._outbox.put_metrics(metrics, step)

    def barrier(self) -> None:
        """Write every point handed over so far to the spool. `log_checkpoint` and `log_eval` call it; a
        trainer that resumes from checkpoints it saves itself calls it before each save, so a kill -9
        loses no point of a step at or before the checkpoint it resumes from."""
        self._outbox.barrier()

    def log_checkpoint(self, adapter_dir: Path, step: int) -> bool:
        """Snapshot the adapter folder now (the trainer may delete it next); upload in the background.
        One checkpoint per step: returns False when this step's checkpoint was already logged."""
        self._check_open()
        step = check_step(step)
        with self._lock:
            if step in self._checkpoint_steps:
                return False
            self._checkpoint_steps.add(step)
        self._outbox.barrier()  # before the checkpoint is declared (its job file written)
        try:
            self._uploader.add_checkpoint(Path(adapter_dir), step)
        except BaseException:
            with self._lock:
                self._checkpoint_steps.discard(step)
            raise
        return True

    def log_eval(self, data_source: str, score: float, rows: list[dict], step: int,
                 metrics: Mapping[str, float] | None = None) -> None:
        """Log `eval/<data_source>/avg_score` (linked to this step's checkpoint), the eval table (rows of
        `rlops.eval_table`: id, passed, score, extras), and any further named scores of the same eval as
        `eval/<data_source>/<name>`."""
        self._check_open()
        step = check_step(step)
        rate = as_float("score", score)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"score must be within [0, 1], got {rate}")
        table_rows(rows, step)  # bad rows raise before anything is logged
        metrics = check_metrics({} if metrics is None else metrics)
        logged = self.log_eval_metrics(
            {eval_key(data_source): rate, **{eval_key(data_source, k): v for k, v in metrics.items()}}, step)
        if logged:
            self.log_eval_table(data_source, rows, step)

    def log_eval_table(self, data_source: str, rows: list[dict], step: int) -> None:
        """The eval table of an eval whose scores `log_eval_metrics` logged (SkyRL's path), which the
        registration compares with the base's."""
        self._check_open()
        step = check_step(step)
        table = table_rows(rows, step)
        if table:
            self._uploader.add_table(table_artifact(data_source, step), table)

    def train_samples_due(self, step: int) -> bool:
        """Whether `log_samples(..., kind="train")` keeps GRPO groups of `step` (a caller may skip building them)."""
        return step > self.resumed_after_step and step % self.config.tracking.sample_train_every == 0

    def log_samples(self, rows: list[dict], step: int, *, kind: str = "eval") -> int:
        """Log a bounded sample of answers (`tracking.sample_items` eval rows, or the rows of the first
        `tracking.sample_groups` GRPO groups for kind="train", at steps divisible by
        `tracking.sample_train_every`) as `<eval|train>/samples/step_<N>.json`
        with an image column (`image`: PIL image, HxWx3 array, or a callable rendering one) and a grid
        `step_<N>.png`. Returns the rows queued; everything else happens on a background thread."""
        self._check_open()
        step = check_step(step)
        if kind not in KINDS:
            raise ValueError(f"sample kind must be one of {', '.join(KINDS)}, got {kind!r}")
        check_rows(rows)
        limit = self.config.tracking.sample_items if kind == "eval" else self.config.tracking.sample_groups
        rows = bounded(rows, kind, limit)
        if not rows or self._samples is None or (kind == "train" and not self.train_samples_due(step)):
            return 0
        self._samples.add(kind, step, rows)
        return len(rows)

    def log_eval_metrics(self, metrics: Mapping[str, float], step: int) -> int:
        """Log eval metrics (`eval/<data_source>/<name>`) and link them to this step's checkpoint, whether
        the checkpoint is logged before or after the eval. Returns how many points were logged (an eval of
        a step an earlier session of this run logged already is dropped)."""
        self._check_open()
        logged = self._evals.log(check_metrics(metrics), check_step(step))
        self._outbox.barrier()  # the link file has the eval now; so must the spool
        return logged

    def register_best(self, data_source: str | None = None) -> ModelVersion | None:
        """Register the checkpoint with the best `eval/<data_source>/<best_metric>` of this run into
        `config.registered_model` and set `tracking.register_aliases` (default: `candidate` only).

        Never among a partial set: it waits (up to `tracking.flush_timeout_s`) for every checkpoint and
        eval logged so far; if they have not all landed, the registration is queued as a job (kept in the
        run dir, tagged `rlops.registration=pending`) that completes once they land, in this session or
        the next one on this run dir (or `rlops runs flush`). Returns None then, and when no checkpoint
        carries that metric."""
        source = data_source or self._evals.default_source(self.config.training.eval_data_source)
        return self._registration.register_best(source)

    # ---------------------------------------------------------------------------------- lifecycle

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until every checkpoint, table and metric so far has landed."""
        deadline = time.monotonic() + timeout_s
        uploaded = self._uploader.flush(timeout_s)
        sent = self._outbox.flush(max(0.0, deadline - time.monotonic()))
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
                self._mark_end(end["status"], end["tags"], end.get("end_time_ms"))
                state.clear_intended_end(self.run_dir)
            except Exception as exc:  # noqa: BLE001 - reported as left over
                log.warning("could not mark run %s %s: %s", self._run_id, end["status"], exc)
        left = self._leftovers()
        self._close()
        return left

    def finish(self) -> None:
        self._end(*lifecycle.completed())

    def fail(self, exc: BaseException) -> None:
        self._end(*lifecycle.failed(exc))

    def kill(self, reason: str) -> None:
        self._end(*lifecycle.killed(reason))

    def __enter__(self) -> "RunSession":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._end(*lifecycle.end_of(exc))
        return False

    def _end(self, status: str, tags: dict[str, str]) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = status
        if self._live:
            if self._heartbeat is not None:
                self._heartbeat.stop()
            self._exit_guard.disarm()
        # kept until the server has it, so a flush after an outage still ends the run as it ended
        state.record_intended_end(self.run_dir, status, tags)
        if self.offline:
            self.flush(self.config.tracking.flush_timeout_s)
            self._close()
            log.info("offline run %s ended %s; `rlops runs sync %s` sends it to MLflow", self._run_id, status,
                     self.run_dir)
            return
        if not self.flush(self.config.tracking.flush_timeout_s):
            log.warning("run %s ended with %s not yet landed; they stay in %s and land with `rlops runs flush` "
                        "or when a session resumes this run dir", self._run_id, self._leftovers(), self._state)
        try:
            self._mark_end(status, tags)
            state.clear_intended_end(self.run_dir)
        except Exception as exc:  # noqa: BLE001 - the heartbeat stopped, so `rlops runs sweep` settles it
            log.warning("could not mark run %s %s: %s", self._run_id, status, exc)
        self._close()

    def _mark_end(self, status: str, tags: dict[str, str], end_time_ms: int | None = None) -> None:
        if self._outbox.sender.dead_letters:
            tags = tags | {TAG_DEAD_LETTERS: str(self._outbox.sender.dead_letters)}
        self._rest.set_tags(self._run_id, tags)
        self._rest.update_run(self._run_id, status, end_time_ms or int(time.time() * 1000))

    def _leftovers(self) -> str:
        parts = [(self._outbox.pending, "metric point(s)"), (self._uploader.pending, "upload/registration job(s)")]
        if state.intended_end(self.run_dir):
            parts.append((1, "unrecorded end status"))
        return ", ".join(f"{n} {what}" for n, what in parts if n)

    def _close(self) -> None:
        """Stop the workers, then close the files they write (an upload still in flight past the bound
        finds them closed and leaves its job for the next start)."""
        if self._system is not None:
            self._system.stop()  # first: an offline run's last sample goes to the outbox
        self._outbox.stop()
        if self._samples is not None:
            self._samples.stop()
        if not self._uploader.stop():
            log.warning("run %s: an upload is still in flight; its job stays in %s", self._run_id, self._state)
        self._outbox.close()
        self._evals.close()
        if self._live:
            self._run_lock.release()  # a drain session's caller holds the lock and releases it

    def _check_open(self) -> None:
        if self._ended:
            raise RuntimeError(f"run session {self._run_id} already ended ({self._ended})")

    def _flush_at_exit(self) -> None:
        if not self._ended:
            if self._heartbeat is not None:
                self._heartbeat.stop()
            self.flush(self.config.tracking.flush_timeout_s)

    def _tag_dead_letters(self, count: int) -> None:
        """Sender thread: show the dead-letter count on the run (best effort; the end tags it again)."""
        try:
            self._rest.set_tags(self._run_id, {TAG_DEAD_LETTERS: str(count)})
        except Exception:  # noqa: BLE001
            pass

    def _checkpoint_landed(self, step: int, model_id: str) -> None:
        """Uploader thread: the step's LoggedModel exists; link evals of that step to it."""
        with self._lock:
            self.landed_checkpoints += 1
        self._evals.checkpoint_landed(step, model_id)
