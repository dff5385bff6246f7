"""Copies of an alias's requests to its shadow version (issue 31), sent after the primary answer is on its way.

The request path only offers a job and never waits for it: a bounded queue drained by a fixed number of worker
tasks on the replica's event loop. A full queue drops the copy and counts it, so a slow or failing shadow never
delays or fails a primary answer, and a copy is never charged to the client's rate limit (it is not a client
request). The shadow's answer never reaches the client: the pair (the primary's answer, the shadow's) goes to
`on_pair`.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from rlops.layout import Resolution

log = logging.getLogger("ray.serve.rlops")

SHADOW_OUTCOMES = ("sent", "dropped", "failed")


def shadowed(percent: float, draw: float) -> bool:
    """A request is copied when a uniform draw in [0, 1) falls below its shadow's share."""
    return draw * 100 < percent


@dataclass(frozen=True)
class ShadowJob:
    """One copy to send: the primary's request and answer, and where the copy goes."""

    endpoint: str  # chat | completions
    body: Any  # the parsed request the primary got (the copy goes with the shadow's routing id)
    primary: Resolution
    shadow_version: int
    shadow_folder: str
    request: bytes  # the raw body, for the pair's traces
    client: str | None
    primary_status: int
    primary_answer: bytes | list  # the JSON body, or the SSE chunks of a stream
    primary_latency_ms: float
    started_ns: int
    stream: bool = False
    primary_ttft_ms: float | None = None
    primary_usage: tuple[int, int] | None = None


@dataclass(frozen=True)
class ShadowAnswer:
    status: int
    answer: bytes
    latency_ms: float


class ShadowMirror:
    """`send(job)` runs the copy and returns the shadow's answer; `on_pair(job, answer)` gets each pair;
    `count(outcome, n)` reports sent / dropped (queue full) / failed (send raised)."""

    def __init__(self, send: Callable[[ShadowJob], Awaitable[ShadowAnswer]],
                 on_pair: Callable[[ShadowJob, ShadowAnswer], None], count: Callable[[str, int], None], *,
                 concurrency: int, queue_size: int):
        self._send, self._on_pair, self._count = send, on_pair, count
        self._concurrency = concurrency
        self._queue: asyncio.Queue[ShadowJob] = asyncio.Queue(maxsize=queue_size)
        self._workers: list[asyncio.Task] = []

    def offer(self, job: ShadowJob) -> bool:
        """Queue a copy (called on the event loop, never blocks); False when it was dropped."""
        if not self._workers:
            loop = asyncio.get_running_loop()
            self._workers = [loop.create_task(self._work()) for _ in range(self._concurrency)]
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self._count("dropped", 1)
            return False
        return True

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                answer = await self._send(job)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed copy must not end the worker
                log.warning("shadow copy to v%s failed: %s: %s", job.shadow_version, type(exc).__name__, exc)
                self._count("failed", 1)
                continue
            finally:
                self._queue.task_done()
            self._count("sent", 1)
            try:
                self._on_pair(job, answer)
            except Exception as exc:  # noqa: BLE001
                log.warning("shadow pair not recorded: %s: %s", type(exc).__name__, exc)

    async def drain(self) -> None:
        """Wait until every queued copy has been sent (tests; a replica's shutdown)."""
        await self._queue.join()

    def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()
        self._workers = []
