"""The points' way to MLflow: the spool they are written to first and the sender that lands them.

The training thread hands points over (`put_metrics`, `put_points`) and returns; the sender thread does
every network call. `resumed_after_step` is the last step an earlier session of this run spooled: a
resumed trainer replays the steps after its checkpoint, and those already logged are dropped here.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Mapping

from tracker.naming import as_float, metric_key
from tracker.rest import MlflowRest
from tracker.sender import MetricSender
from tracker.spool import MetricSpool, Point, encode


class MetricOutbox:
    def __init__(self, state_dir: Path, rest: MlflowRest, run_id: str, *, batch_size: int, max_backoff_s: float,
                 on_dead_letters: Callable[[int], None]):
        self._spool = MetricSpool(state_dir)
        self.resumed_after_step = self._spool.previous_last_step
        self.replayed_points = 0
        self._sender = MetricSender(self._spool, rest, run_id, batch_size=batch_size, max_backoff_s=max_backoff_s,
                                    on_dead_letters=on_dead_letters)
        for chunk in self._spool.unacknowledged():
            self._sender.submit(chunk)

    def put_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One step's metrics (timestamp fixed now), unless an earlier session logged that step."""
        if step <= self.resumed_after_step:
            self.replayed_points += len(metrics)
            return
        now = int(time.time() * 1000)
        # strings only, no per-point objects: the hot path should not wake the garbage collector
        bodies = [encode(metric_key(k), as_float(k, v), now, step) for k, v in metrics.items()]
        self._sender.submit(self._spool.append(bodies))

    def put_points(self, points: list[Point], dataset_of: Callable[[str], tuple[str, str] | None] = lambda key: None
                   ) -> None:
        """Points built elsewhere (evals and their links), whatever their step; `dataset_of(key)`: the
        (name, digest) of the eval set a point was measured on."""
        self._sender.submit(self._spool.append([encode(*p, dataset=dataset_of(p.key)) for p in points]))

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything put so far is acknowledged; False if the bound ran out."""
        return self._sender.flush(timeout_s)

    @property
    def pending(self) -> int:
        return self._sender.pending

    @property
    def sender(self) -> MetricSender:
        """Its counters: sent_points, failed_requests, dead_letters, disk_errors, last_error."""
        return self._sender

    def stop(self) -> None:
        """Stop the sender; what it has not landed stays in the spool for the next start."""
        self._sender.stop()

    def close(self) -> None:
        self._spool.close()
