"""The points' way to MLflow: an in-memory queue, the spool they are written to, the sender that lands them.

The training thread only checks and appends to the queue (`put_metrics`: no encoding, no file write, no
lock); the spool-writer thread encodes what queued up, writes it to the spool in one append and hands it
to the sender thread, which fsyncs before it sends. `barrier()` writes the queue out on the caller's
thread: the session calls it before a checkpoint or an eval is declared, so a trainer killed -9 after
that loses only points of steps after its last checkpoint, which the resumed trainer logs again.
`resumed_after_step` is the last step an earlier session of this run spooled: a resumed trainer replays
the steps after its checkpoint, and those already logged are dropped here. Offline (`send=False`) the
spool is the destination: nothing is sent, and a flush means written and fsynced.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Mapping

from tracker.naming import as_float, metric_key
from tracker.rest import MlflowRest
from tracker.sender import MetricSender
from tracker.spool import MetricSpool, Point, encode

WRITE_INTERVAL_S = 0.01  # how long handed-over points may wait in memory before the writer spools them


class MetricOutbox:
    def __init__(self, state_dir: Path, rest: MlflowRest, run_id: str, *, batch_size: int, max_backoff_s: float,
                 on_dead_letters: Callable[[int], None], linger_s: float = 0.0, send: bool = True):
        self._spool = MetricSpool(state_dir)
        self.resumed_after_step = self._spool.previous_last_step
        self.replayed_points = 0
        self._send = send
        self._sender = MetricSender(self._spool, rest, run_id, batch_size=batch_size, max_backoff_s=max_backoff_s,
                                    linger_s=linger_s, on_dead_letters=on_dead_letters, start=send)
        for chunk in self._spool.unacknowledged() if send else ():
            self._sender.submit(chunk)
        # (step, timestamp_ms, metrics) from the training thread, or encoded bodies (evals and links), in order;
        # deque.append/popleft are atomic, so the training thread takes no lock
        self._queue: deque = deque()
        self._names: set[str] = set()  # metric names already checked against MLflow's key rules
        self._write_lock = threading.Lock()  # one drain at a time keeps the spool in queue order
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._run, name="rlops-tracker-spool-writer", daemon=True)
        self._writer.start()

    def put_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One step's metrics (timestamp fixed now), unless an earlier session logged that step. Raises,
        naming the metric, for a key MLflow would refuse or a value that is not a number."""
        if step <= self.resumed_after_step:
            self.replayed_points += len(metrics)
            return
        if not self._names.issuperset(metrics):
            for name in metrics:
                metric_key(name)  # raises naming the metric
            self._names.update(metrics)
        try:
            plain = type(sum(metrics.values(), 0.0)) is float  # C speed: floats, ints and bools only
        except Exception:  # noqa: BLE001 - a str, None or tensor value: the slow path names it
            plain = False
        # a copy: the trainer may reuse its dict; bools and ints become floats on the writer thread
        metrics = dict(metrics) if plain else {k: as_float(k, v) for k, v in metrics.items()}
        self._queue.append((step, time.time_ns() // 1_000_000, metrics))

    def put_points(self, points: list[Point], dataset_of: Callable[[str], tuple[str, str] | None] = lambda key: None
                   ) -> None:
        """Points built elsewhere (evals and their links), whatever their step; `dataset_of(key)`: the
        (name, digest) of the eval set a point was measured on."""
        if points:
            self._queue.append([encode(*p, dataset=dataset_of(p.key)) for p in points])

    def barrier(self) -> None:
        """Write every point handed over so far to the spool file (on the caller's thread)."""
        self._write_queued()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything put so far is acknowledged (offline: written and fsynced); False if the
        bound ran out (offline: the disk is full)."""
        self._write_queued()
        if not self._send:
            try:
                self._spool.sync()
            except OSError:
                return False
            return True
        return self._sender.flush(timeout_s)

    @property
    def pending(self) -> int:
        queued = sum(len(item) if isinstance(item, list) else len(item[2]) for item in list(self._queue))
        return queued + self._sender.pending

    @property
    def sender(self) -> MetricSender:
        """Its counters: sent_points, failed_requests, dead_letters, disk_errors, last_error."""
        return self._sender

    def stop(self) -> None:
        """Spool what is queued, stop the writer and the sender; what the sender has not landed stays in
        the spool for the next start."""
        self._stop.set()
        self._writer.join(timeout=5)
        self._write_queued()
        self._sender.stop()

    def close(self) -> None:
        self._spool.close()

    def _run(self) -> None:
        while not self._stop.wait(WRITE_INTERVAL_S):
            if self._write_queued():
                try:
                    self._spool.sync()  # the sender syncs again before it sends (a full disk shows there)
                except OSError:
                    pass

    def _write_queued(self) -> bool:
        """Encode and spool what is queued, in order; True if anything was."""
        with self._write_lock:
            bodies: list[str] = []
            while self._queue:
                item = self._queue.popleft()
                if isinstance(item, list):
                    bodies += item
                else:
                    step, now, metrics = item
                    bodies += [encode(metric_key(k), as_float(k, v), now, step) for k, v in metrics.items()]
            if bodies:
                chunk = self._spool.append(bodies)
                if self._send:
                    self._sender.submit(chunk)
            return bool(bodies)
