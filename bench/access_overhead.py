"""Cost of scoped API keys and rate limits: the alias ingress with 100 scoped keys (each with request and
token limits, never reached) vs the same ingress with no keys, in one run.

Both are real `ray.serve.llm` apps in one local Ray Serve on the echo engine (bench/echo_engine.py), reading
the same manifests from a real local S3 (bench/ingress_overhead.py's setup); the same requests, with the same
`Authorization` header, go to both in paired rounds (latency in interleaved pairs; `--pin` and the refusal on
disagreement as in bench/ingress_overhead.py). Goal (issue 33): keys-on throughput >= 0.98x keys-off and
+p50 < 0.5 ms at concurrency 1. figure = keys-on throughput (req/s), baseline = keys-off throughput.

Usage: python bench/access_overhead.py [--requests 1200] [--latency-requests 600] [--rounds 12] [--keys 100]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402
from ingress_overhead import (MODEL, PairedRatio, bench_environ, echo_args, echo_serve, latency_delta,  # noqa: E402
                              load, paired_arguments, paired_rounds, percentile)

from rlops.config import load_config  # noqa: E402
from serving.access import digest  # noqa: E402


def keys_file(path: Path, count: int) -> str:
    """`count` scoped keys with limits no bench run reaches; the client uses the one in the middle."""
    keys = [f"sk-bench-{i:04d}-{uuid.uuid4().hex}" for i in range(count)]
    path.write_text(yaml.safe_dump({"keys": [
        {"name": f"team-{i:04d}", "sha256": digest(key), "models": ["bench-*", f"team-{i:04d}-*"],
         "aliases": ["production", "staging"], "requests_per_minute": 10**7, "tokens_per_minute": 10**9}
        for i, key in enumerate(keys)]}))
    return keys[count // 2]


def main() -> None:
    parser = paired_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--keys", type=int, default=100)
    args = parser.parse_args()

    from ray import serve
    from ray.serve.llm import build_openai_app

    root = Path(tempfile.mkdtemp(prefix="rlops-bench-access-"))
    environ = bench_environ(root)
    open_config = load_config(environ=environ)
    key = keys_file(root / "keys.yaml", args.keys)
    scoped_config = load_config(environ={**environ, "RLOPS_SERVING__KEYS_FILE": str(root / "keys.yaml")})
    with echo_serve(open_config, root, pin=args.pin) as port:
        serve.run(build_openai_app(echo_args(scoped_config)), name="keys", route_prefix="/keys")
        serve.run(build_openai_app(echo_args(open_config)), name="open", route_prefix="/open")
        name = f"{open_config.serving.base_model_id}:{MODEL}"
        sides = {"keys": (f"http://127.0.0.1:{port}/keys", name), "open": (f"http://127.0.0.1:{port}/open", name)}
        headers = {"authorization": f"Bearer {key}"}
        for url, model in sides.values():  # warm-up
            _, _, failed = asyncio.run(load(url, model, 50, args.concurrency, headers=headers))
            assert failed == 0, f"{url}: {failed} of 50 warm-up requests failed"
        rounds, latencies, failures = paired_rounds(sides, args.rounds, args.requests, args.latency_requests,
                                                    args.concurrency, headers=headers)

    ratio = PairedRatio.of(rounds["keys"], rounds["open"])
    keys_rps, open_rps = statistics.median(rounds["keys"]), statistics.median(rounds["open"])
    p50 = {side: percentile(values, 50) for side, values in latencies.items()}
    delta, delta_q1, delta_q3 = latency_delta(latencies["keys"], latencies["open"])
    for side in sides:
        print(f"{side}: {statistics.median(rounds[side]):7.1f} req/s at concurrency {args.concurrency}; p50 "
              f"{p50[side]:6.2f} ms at concurrency 1; non-200 {failures[side]}")
    print(f"throughput keys/open over {args.rounds} paired rounds: {ratio.text()} (goal >= 0.98x)"
          f"{'; pinned' if args.pin else ''}")
    print(f"+p50 = {delta:+.2f} ms, median of {len(latencies['keys'])} interleaved pairs (IQR {delta_q1:+.2f} to "
          f"{delta_q3:+.2f}; goal < 0.5 ms)")
    assert failures["keys"] == failures["open"] == 0, failures
    if (why := ratio.disagreement()) is not None:
        sys.exit(f"not recorded: {why}; run it again on a quieter machine")
    record(Path(__file__).name, keys_rps, "req/s (ratio = median of paired rounds)", open_rps, ratio.median,
           f">= 0.98x the same ingress without keys, {args.keys} scoped keys with limits (echo engine)")
    record(f"{Path(__file__).name}:p50", p50["keys"], "ms p50 at concurrency 1", p50["open"],
           p50["keys"] / p50["open"], "scoped keys add < 0.5 ms to the p50")


if __name__ == "__main__":
    main()
