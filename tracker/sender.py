"""The background sender: drains spooled points into `log_batch` calls, in order, with backoff."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from tracker.rest import MAX_METRICS_PER_BATCH, MlflowRest
from tracker.spool import Chunk, MetricSpool

log = logging.getLogger(__name__)

MAX_TIMEOUT_DOUBLINGS = 3


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
    watermark. Whatever is queued while a request is in flight forms the next batch (no linger)."""

    def __init__(self, spool: MetricSpool, rest: MlflowRest, run_id: str, *, batch_size: int,
                 max_backoff_s: float):
        self._spool = spool
        self._rest = rest
        self._run_id = run_id
        self._batch_size = min(batch_size, MAX_METRICS_PER_BATCH)
        self._max_backoff_s = max_backoff_s
        self._queue: deque[Chunk] = deque()
        self._offset = 0  # points of the head chunk already acknowledged
        self._queued_points = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._submitted = spool.acked
        self.sent_points = 0
        self.failed_requests = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="rlops-tracker-sender", daemon=True)
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
            return wait_for_worker(self._cond, lambda: self._spool.acked >= target, self._thread, timeout_s)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
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
                if self._stopping:
                    return  # unacknowledged points stay in the spool for the next start
                bodies, last_seq = self._next_batch()
            try:
                self._spool.sync()  # off the training thread: the points now survive the node too
                # A timed-out request keeps running on the server; waiting longer on the retry avoids
                # piling duplicate work onto a server that is only slow.
                timeout_s = self._rest.timeout_s * 2 ** min(timeouts, MAX_TIMEOUT_DOUBLINGS)
                self._rest.log_metrics(self._run_id, bodies, timeout_s=timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure is retried; the spool keeps the points
                self.failed_requests += 1
                timeouts = timeouts + 1 if "timed out" in str(exc).lower() else 0
                if self.last_error is None:
                    log.warning("MLflow unreachable, metrics stay spooled and are retried: %s", exc)
                self.last_error = f"{type(exc).__name__}: {exc}"
                backoff = min(self._max_backoff_s, max(0.1, backoff * 2))
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, timeout=backoff)
                continue
            backoff, timeouts = 0.0, 0
            self.last_error = None
            self._spool.acknowledge(last_seq)
            self.sent_points += len(bodies)
            with self._cond:
                self._acknowledged(len(bodies))
                self._cond.notify_all()
