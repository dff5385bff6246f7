"""Hands sampled served requests to the trace recorder process, from the ingress replica.

The request path only offers a `ServedRequest` to a bounded queue (never blocking): when the queue is full
(entries, or bytes of the queue and the batch in flight together) the request is dropped and counted. One
thread hands what is queued, as one batch of up to `BATCH_MAX`, to `serving.trace_recorder` running as a child
process (started by that thread, so the replica's start does not wait for MLflow's imports) and counts the
outcomes it reports: the busier the endpoint, the larger the batches, the fewer MLflow calls per trace. A
recorder that dies is started again after a capped backoff; the batch it held is counted as failed. Nothing
here imports MLflow.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from pydantic import BaseModel, Field

from serving.traces import ServedRequest, sampled

log = logging.getLogger("ray.serve.rlops")
RECORDER_MODULE = "serving.trace_recorder"
BATCH_MAX = 32  # requests per hand-over: one `log_spans` call for all of them
_RESPAWN_MAX_S = 30.0


class TraceWriterSettings(BaseModel):
    """`serving.traces` as the ingress replica gets it (plain values, no secrets)."""

    sample_rate: float = Field(ge=0, le=1)
    content: bool
    queue_size: int = Field(ge=1)
    queue_mib: float = Field(gt=0)
    experiment: str  # where traces of the bare base (and of versions without a LoggedModel) go
    tracking_uri: str
    task_path: str | None = None
    task_options: dict[str, Any] = Field(default_factory=dict)


class TraceWriter:
    """A bounded queue and one thread feeding the recorder process. `count(outcome, n)` reports recorded /
    scored / failed (as the recorder reports them) and dropped (queue full)."""

    def __init__(self, settings: TraceWriterSettings, count: Callable[[str, int], None]):
        self.settings = settings
        self._count = count
        self._queue: queue.Queue[ServedRequest] = queue.Queue(maxsize=settings.queue_size)
        self._bytes_left = int(settings.queue_mib * 2**20)  # request + answer bytes the queue may still hold
        self._bytes_lock = threading.Lock()
        self._stop = threading.Event()
        self._recorder: tuple[subprocess.Popen, Connection] | None = None
        self._respawn_s = 0.0
        self._thread = threading.Thread(target=self._run, name="rlops-traces", daemon=True)

    def start(self) -> "TraceWriter":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread and the recorder (a batch it was writing is not recorded)."""
        self._stop.set()
        recorder = self._recorder
        if recorder is not None:
            recorder[0].kill()

    def sample(self) -> bool:
        return sampled(self.settings.sample_rate, random.random())

    def offer(self, served: ServedRequest) -> None:
        size = served.size
        with self._bytes_lock:
            if size > self._bytes_left:
                self._count("dropped", 1)
                return
            self._bytes_left -= size
        try:
            self._queue.put_nowait(served)
        except queue.Full:
            self._release(size)
            self._count("dropped", 1)

    def _release(self, size: int) -> None:
        with self._bytes_lock:
            self._bytes_left += size

    # ------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._queue.get(timeout=0.5)]
            except queue.Empty:
                continue
            while len(batch) < BATCH_MAX:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            outcomes = self._hand_over(batch)
            self._release(sum(served.size for served in batch))
            for outcome, n in outcomes.items():
                self._count(outcome, n)
        self._close()

    def _hand_over(self, batch: list[ServedRequest]) -> dict[str, int]:
        try:
            if self._recorder is None:
                self._recorder = self._spawn()
            _, conn = self._recorder
            conn.send(batch)
            outcomes = conn.recv()
            self._respawn_s = 0.0
            return outcomes
        except (OSError, EOFError) as exc:
            if not self._stop.is_set():
                self._respawn_s = min(_RESPAWN_MAX_S, max(0.5, 2 * self._respawn_s))
                log.error("the trace recorder ended (%s: %s): another starts in %.1f s", type(exc).__name__, exc,
                          self._respawn_s)
            self._close()
            self._stop.wait(self._respawn_s)
            return {"failed": len(batch)}

    def _spawn(self) -> tuple[subprocess.Popen, Connection]:
        ours, theirs = socket.socketpair()
        with theirs:
            # the replica's own import path (its working dir and runtime env), so the child finds this package
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            process = subprocess.Popen([sys.executable, "-m", RECORDER_MODULE, str(theirs.fileno())],
                                       pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        conn = Connection(ours.detach())
        conn.send(self.settings.model_dump())
        return process, conn

    def _close(self) -> None:
        if self._recorder is not None:
            process, conn = self._recorder
            self._recorder = None
            conn.close()
            process.kill()
            process.wait()
