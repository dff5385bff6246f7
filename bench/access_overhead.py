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
import sys
import tempfile
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingress_overhead import (MODEL, PairedFigures, bench_environ, echo_args, echo_serve, load,  # noqa: E402
                              paired_arguments, paired_rounds)

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

    figures = PairedFigures.of("keys", "open", rounds, latencies)
    figures.show(args, failures, ">= 0.98x", "< 0.5 ms")
    figures.record(Path(__file__).name, f">= 0.98x the same ingress without keys, {args.keys} scoped keys with limits "
                   "(echo engine)", "scoped keys add < 0.5 ms to the p50")

if __name__ == "__main__":
    main()
