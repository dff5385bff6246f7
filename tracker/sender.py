"""The background sender: drains spooled points into `log_batch` calls, in order, with backoff.

A batch MLflow rejects (400/404: a bad value, a deleted run) is split in halves until the rejected points
are found; those go to `deadletter.jsonl` beside the spool with MLflow's message, the rest land, and the
watermark moves past them, so one poison point never blocks the points behind it.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from mlflow.exceptions import RestException

from tracker.rest import MAX_METRICS_PER_BATCH, MlflowRest
from tracker.spool import Chunk, MetricSpool

log = logging.getLogger(__name__)

MAX_TIMEOUT_DOUBLINGS = 3
DEAD_LETTER_FILE = "deadletter.jsonl"
TAG_DEAD_LETTERS = "rlops.dead_letters"  # the run's dead-letter count
REJECTED_STATUS = (400, 404)  # MLflow refuses these points for good; 401/403/429/5xx are retried


def is_rejection(exc: Exception) -> bool:
    return isinstance(exc, RestException) and exc.get_http_status_code() in REJECTED_STATUS


def dead_letter_count(state_dir: Path) -> int:
    try:
        with open(Path(state_dir) / DEAD_LETTER_FILE, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except FileNotFoundError:
        return 0


def wait_for_worker(cond: threading.Condition, done: Callable[[], bool], worker: threading.Thread,
                    timeout_s: float) -> bool:
    """With `cond` held: wait until `done()`; False when the bound runs out or `worker` died (a dead
    thread never notifies, so the wait re-checks twice a second)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        left = deadline - time.monotonic()
        if left <= 0 or not worker.is_alive():
            return False
        cond.wait(min(left, 0.5))
    return True

class MetricSender:
    """One daemon thread per session. Points are sent in spool order, so the acknowledgement is a
    watermark. Once a point is queued the sender gathers for up to `linger_s` (or until a batch is full,
    or a flush asks) and sends what it has: one request per interval instead of one per training step,
    each of which cost the MLflow server ~14 ms of CPU beside training (bench/README.md)."""

    def __init__(self, spool: MetricSpool, rest: MlflowRest, run_id: str, *, batch_size: int,
                 max_backoff_s: float, linger_s: float = 0.0,
                 on_dead_letters: Callable[[int], None] = lambda count: None, start: bool = True):
        self._spool = spool
        self._rest = rest
        self._run_id = run_id
        self._batch_size = min(batch_size, MAX_METRICS_PER_BATCH)
        self._max_backoff_s = max_backoff_s
        self._linger_s = linger_s
        self._flushing = 0  # flushes waiting: the sender sends at once
        self._queue: deque[Chunk] = deque()
        self._offset = 0  # points of the head chunk already acknowledged
        self._queued_points = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._submitted = spool.acked
        self._dead_letter_path = spool.state_dir / DEAD_LETTER_FILE
        self._on_dead_letters = on_dead_letters
        self.dead_letters = dead_letter_count(spool.state_dir)
        self.sent_points = 0
        self.failed_requests = 0
        self.disk_errors = 0
        self.last_error: str | None = None
        self.last_ack_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="rlops-tracker-sender", daemon=True)
        if start:  # not started: an offline session's counters, nothing to send
            self._thread.start()

    def submit(self, chunk: Chunk) -> None:
        if not chunk.bodies:
            return
        with self._cond:
            self._queue.append(chunk)
            self._queued_points += len(chunk.bodies)
            self._submitted = max(self._submitted, chunk.last_seq)
            self._cond.notify()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted so far is acknowledged; False if the bound ran out."""
        with self._cond:
            target = self._submitted
            self._flushing += 1
            self._cond.notify_all()
            try:
                return wait_for_worker(self._cond, lambda: self._spool.acked >= target, self._thread, timeout_s)
            finally:
                self._flushing -= 1

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def pending(self) -> int:
        with self._cond:
            return self._queued_points

    def _next_batch(self) -> tuple[list[str], int]:
        """Up to batch_size bodies from the head of the queue (under the lock) and the last seq in them."""
        bodies: list[str] = []
        offset, last_seq = self._offset, 0
        for chunk in self._queue:
            take = chunk.bodies[offset:offset + self._batch_size - len(bodies)]
            bodies += take
            last_seq = chunk.first_seq + offset + len(take) - 1
            offset = 0
            if len(bodies) >= self._batch_size:
                break
        return bodies, last_seq

    def _acknowledged(self, count: int) -> None:
        """Drop `count` sent points from the head of the queue (under the lock)."""
        self._queued_points -= count
        while count:
            head = self._queue[0]
            left = len(head.bodies) - self._offset
            if count >= left:
                self._queue.popleft()
                self._offset, count = 0, count - left
            else:
                self._offset, count = self._offset + count, 0

    def _run(self) -> None:
        backoff = 0.0
        timeouts = 0  # consecutive read timeouts: a busy server, not a dead one
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                self._cond.wait_for(lambda: self._stopping or self._flushing or self._queued_points >= self._batch_size,
                                    timeout=self._linger_s)
                if self._stopping:
                    return  # unacknowledged points stay in the spool for the next start
                bodies, last_seq = self._next_batch()
            # off the training thread: the points are written and fsynced before they are sent
            if not self._retry_on_disk_error(self._spool.sync):
                return
            try:
                # A timed-out request keeps running on the server; waiting longer on the retry avoids
                # piling duplicate work onto a server that is only slow.
                timeout_s = self._rest.timeout_s * 2 ** min(timeouts, MAX_TIMEOUT_DOUBLINGS)
                rejected = self._deliver(bodies, timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure is retried; the spool keeps the points
                self.failed_requests += 1
                timeouts = timeouts + 1 if "timed out" in str(exc).lower() else 0
                if self.last_error is None:
                    log.warning("MLflow unreachable, metrics stay spooled and are retried: %s", exc)
                self.last_error = f"{type(exc).__name__}: {exc}"
                backoff = min(self._max_backoff_s, max(0.1, backoff * 2))
                self._pause(backoff)
                continue
            backoff, timeouts = 0.0, 0
            self.last_error = None
            if rejected and not self._retry_on_disk_error(lambda: self._write_dead_letters(rejected)):
                return
            if not self._retry_on_disk_error(lambda: self._spool.acknowledge(last_seq)):
                return  # stopping with the ack unwritten: the next start resends (MLflow drops duplicates)
            self.last_ack_at = time.time()
            self.sent_points += len(bodies)
            with self._cond:
                self._acknowledged(len(bodies))
                self._cond.notify_all()
            if rejected:
                self._on_dead_letters(self.dead_letters)

    def _deliver(self, bodies: list[str], timeout_s: float) -> list[tuple[str, str]]:
        """Send `bodies`; returns the (body, MLflow's message) of points MLflow rejects for good, after
        landing the rest. Transient errors propagate (the whole batch is retried; landed points are
        dropped by MLflow as duplicates)."""
        try:
            self._rest.log_metrics(self._run_id, bodies, timeout_s=timeout_s)
            return []
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_rejection(exc):
                raise
            if len(bodies) == 1:
                return [(bodies[0], str(exc.message))]
        mid = len(bodies) // 2
        return self._deliver(bodies[:mid], timeout_s) + self._deliver(bodies[mid:], timeout_s)

    def _write_dead_letters(self, rejected: list[tuple[str, str]]) -> None:
        lines = "".join(json.dumps({"point": json.loads(body), "error": error, "at": time.time()}) + "\n"
                        for body, error in rejected)
        fd = os.open(self._dead_letter_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        self.dead_letters += len(rejected)
        log.error("MLflow rejected %d metric point(s) for good (%s); moved to %s", len(rejected),
                  rejected[0][1], self._dead_letter_path)

    def _retry_on_disk_error(self, write: Callable[[], None]) -> bool:
        """Run a local write until it succeeds (a full disk frees up); False if stopped meanwhile."""
        backoff = 0.0
        while True:
            try:
                write()
                return True
            except OSError as exc:
                self.disk_errors += 1
                if not (self.last_error or "").startswith("disk:"):
                    log.error("tracker state write failed in %s, retrying: %s", self._spool.state_dir, exc)
                self.last_error = f"disk: {type(exc).__name__}: {exc}"
                backoff = min(self._max_backoff_s, max(0.1, backoff * 2))
                if self._pause(backoff):
                    return False

    def _pause(self, seconds: float) -> bool:
        """Wait `seconds` unless stopped; True when stopping."""
        with self._cond:
            return self._cond.wait_for(lambda: self._stopping, timeout=seconds)
