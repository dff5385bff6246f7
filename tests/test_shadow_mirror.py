"""The shadow mirror's bounds without servers: never blocking the request path, bounded concurrency, drops and
failures counted, every sent copy paired."""
from __future__ import annotations

import asyncio
from collections import Counter

from rlops.layout import ModelRef, Resolution
from serving.shadow import ShadowAnswer, ShadowJob, ShadowMirror, shadowed


def job(n: int) -> ShadowJob:
    primary = Resolution(ref=ModelRef(raw="b:m", base="b", model="m", alias="production", version=None),
                         folder="m-v1", version=1, alias="production")
    return ShadowJob(endpoint="chat", body={"n": n}, primary=primary, shadow_version=2, shadow_folder="m-v2",
                     request=b"{}", client=None, primary_status=200, primary_answer=b"{}", primary_latency_ms=1.0,
                     started_ns=0)


def test_shadowed_share():
    assert shadowed(20, 0.19) and not shadowed(20, 0.2) and shadowed(100, 0.999) and not shadowed(0.5, 0.005)


def test_copies_never_block_are_bounded_and_every_outcome_is_counted():
    counts, pairs, running = Counter(), [], {"now": 0, "most": 0}
    release = asyncio.Event()

    async def send(j: ShadowJob) -> ShadowAnswer:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await release.wait()
        running["now"] -= 1
        if j.body["n"] == 1:
            raise RuntimeError("engine fault")
        return ShadowAnswer(200, b'{"n": %d}' % j.body["n"], 2.0)

    async def main():
        mirror = ShadowMirror(send, lambda j, a: pairs.append((j.body["n"], a.answer)),
                              lambda outcome, n: counts.update({outcome: n}), concurrency=2, queue_size=3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        offered = [mirror.offer(job(n)) for n in range(8)]
        assert loop.time() - started < 0.05  # offering is synchronous: the request path never waits
        await asyncio.sleep(0.05)
        # all offers came before any worker ran: the queue (3) took the first copies, the rest were dropped
        assert offered == [True] * 3 + [False] * 5 and counts["dropped"] == 5
        release.set()
        await mirror.drain()
        mirror.stop()

    asyncio.run(main())
    assert running["most"] == 2
    assert counts["sent"] == 2 and counts["failed"] == 1  # a failed copy is counted and the worker goes on
    assert sorted(n for n, _ in pairs) == [0, 2]
