"""Cost of a canary in the alias ingress: the same `AliasIngress` app, one model served as a plain alias
(production -> v1) and one with a 10% canary (production -> v1, canary v2 at 10%), on the echo engine
(bench/echo_engine.py, as bench/ingress_overhead.py: the engine costs next to nothing, the ingress is what
differs). Every request names another OpenAI `user` on both sides (the canary side hashes it). Paired
rounds alternate the two names so that machine noise hits both alike; latency at concurrency 1.
Goal: throughput >= 0.98x the plain alias, +p50 < 1 ms. figure = canary-alias req/s, baseline = plain alias.

Then the SLO rollback (`canary.py:breach_to_last_bad`): a third model whose 10% canary's engine answers 500
(ECHO_FAIL_MODELS), registered in the scratch MLflow, under steady load from new users at `--concurrency`,
with the canary watcher of `rlops hooks serve` running against Ray's real metrics export (`--window` s SLO
window, `min_requests` 20): the time from the canary's first failed answer to the last answer the bad
version gave (its failures end when the watcher's abort has reached the routes). Goal < 2x the window;
baseline = the window.

Usage: python bench/canary.py [--requests 1200] [--latency-requests 600] [--rounds 12] [--weight 10] [--window 20]
       [--breach-only]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402
from ingress_overhead import (bench_environ, build_apps, echo_serve, load, paired_arguments, paired_rounds,  # noqa: E402
                              percentile)

from rlops import stack as rlops_stack  # noqa: E402
from rlops.config import CanarySLO, load_config  # noqa: E402
from rlops.layout import (  # noqa: E402
    ADAPTER_CONFIG,
    AliasRoute,
    CanaryRoute,
    RoutesManifest,
    canary_bucket,
    parse_s3_uri,
    routes_key,
    version_folder,
)
from rlops.processes import free_port  # noqa: E402
from registry_hooks.storage import stamp_routes  # noqa: E402

PLAIN, CANARY, BREACH = "bench-plain", "bench-canary", "bench-breach"


def route(model: str, version: int) -> dict:
    return {"version": version, "folder": version_folder(model, version), "files": {ADAPTER_CONFIG: "0" * 64},
            "promoted_at": "2026-01-01T00:00:00.000Z", "trigger": "bench"}


def seed_s3(config, weight: float) -> None:
    s3 = rlops_stack.s3_client(config, timeout_s=10)
    location = parse_s3_uri(config.lora_path)
    for model in (PLAIN, CANARY, BREACH):
        for version in (1, 2):
            s3.put_object(Bucket=location.bucket, Key=location.key(version_folder(model, version), ADAPTER_CONFIG),
                          Body=json.dumps({"peft_type": "LORA", "r": 8}).encode())
    manifests = [
        RoutesManifest(model=PLAIN, generation=1, aliases={"production": AliasRoute(**route(PLAIN, 1))}),
        *(RoutesManifest(model=model, generation=1, aliases={"production": AliasRoute(**route(model, 1))},
                         canaries={"production": CanaryRoute(**route(model, 2), weight=weight)})
          for model in (CANARY, BREACH)),
    ]
    for manifest in manifests:
        s3.put_object(Bucket=location.bucket, Key=routes_key(location, manifest.model),
                      Body=manifest.model_dump_json().encode())
    stamp_routes(s3, location)


def register_breach(config, weight: float) -> None:
    """The registry intent the watcher acts on: two versions of BREACH (never copied: their folders and the
    manifest are seeded), production -> v1 and its canary -> v2 at `weight`, as `promote canary` leaves it."""
    from registry_hooks import registry

    client = registry.mlflow_client(config)
    client.create_registered_model(BREACH)
    for _ in (1, 2):
        client.create_model_version(BREACH, source=f"{config.lora_path}/{BREACH}-source")
    registry.set_alias(client, BREACH, "production", 1)
    registry.set_canary(client, BREACH, "production", 2, weight)


def breach_to_last_bad(config, url: str, weight: float, concurrency: int) -> dict:
    """Steady load on BREACH (a new `user` per request) with the watcher running; returns the timings (s)."""
    from registry_hooks.watcher import CanaryWatcher

    slo = config.registry.canary.slo
    model = f"{config.serving.base_model_id}:{BREACH}"
    answers: list[tuple[float, str, int, str | None]] = []
    users, stop = count(), threading.Event()

    def client() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                user = f"breach-{next(users)}"
                r = http.post(f"{url}/v1/chat/completions", json={
                    "model": model, "user": user, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
                answers.append((time.monotonic(), user, r.status_code, r.headers.get("x-rlops-model-version")))

    watcher = CanaryWatcher(config)
    watcher.start()
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(client) for _ in range(concurrency)]
        try:
            while not watcher.aborted and time.monotonic() - started < 6 * slo.window_s:
                time.sleep(0.2)
            aborted_at = time.monotonic()
            time.sleep(2 * config.serving.routes_staleness_s + 3)  # until every request resolves without the canary
        finally:
            stop.set()
            for future in futures:
                future.result()
            watcher.stop()
    if not watcher.aborted:
        raise SystemExit(f"the watcher did not abort the failing canary within {6 * slo.window_s:g} s "
                         f"(last error: {watcher.last_error})")
    on_canary = {u for _, u, _, _ in answers if canary_bucket(BREACH, "production", 2, "user:" + u) < weight}
    bad = [t for t, user, status, version in answers if version == "2" or (user in on_canary and status != 200)]
    return {"first_bad": min(bad) - started, "last_bad": max(bad) - started, "aborted": aborted_at - started,
            "bad": len(bad), "answers": len(answers), "canary_users": len(on_canary),
            "baseline_failures": sum(status != 200 for _, u, status, _ in answers if u not in on_canary),
            "reason": watcher.aborted[0]["reason"]}


def main() -> None:
    parser = paired_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--weight", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=20.0, help="SLO window (registry.canary.slo.window_s), s")
    parser.add_argument("--breach-only", action="store_true", help="only the SLO-rollback figure")
    args = parser.parse_args()

    from ray import serve

    root = Path(tempfile.mkdtemp(prefix="rlops-bench-canary-"))
    config = load_config(environ=bench_environ(root, RLOPS_SERVING__METRICS_PORT=str(free_port()),
                                               RLOPS_REGISTRY__MODELS=f"[{PLAIN}, {CANARY}, {BREACH}]"))
    config.registry.canary.slo = CanarySLO(window_s=args.window, min_requests=20)

    def seed(config) -> None:
        seed_s3(config, args.weight)
        register_breach(config, args.weight)

    with echo_serve(config, root, seed, timeout_s=300, pin=args.pin) as port:
        url, base = f"http://127.0.0.1:{port}", config.serving.base_model_id
        alias_app, _ = build_apps(config, engine_env={"ECHO_FAIL_MODELS": f"{base}:{version_folder(BREACH, 2)}"})
        serve.run(alias_app, name="alias", route_prefix="/")
        sides = {"plain": f"{base}:{PLAIN}", "canary": f"{base}:{CANARY}"}
        if not args.breach_only:
            for model in sides.values():  # warm-up: both versions' adapters downloaded, connections open
                asyncio.run(load(url, model, 80, args.concurrency, users=True))
            rounds, latencies, failures = paired_rounds({side: (url, model) for side, model in sides.items()},
                                                        args.rounds, args.requests, args.latency_requests,
                                                        args.concurrency, users=True)
            split = [httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
                "model": sides["canary"], "user": f"split-{i}", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 1}).headers.get("x-rlops-model-version") for i in range(400)]
        asyncio.run(load(url, f"{base}:{BREACH}@v1", 20, 2))  # the baseline's adapter loaded before the clock runs
        breach = breach_to_last_bad(config, url, args.weight, args.concurrency)

    span = breach["last_bad"] - breach["first_bad"]
    print(f"SLO rollback: canary's first failed answer at {breach['first_bad']:.1f} s, watcher aborted at "
          f"{breach['aborted']:.1f} s, last answer of the bad version at {breach['last_bad']:.1f} s: {span:.1f} s "
          f"= {span / args.window:.2f}x the {args.window:g} s window (goal < 2x); {breach['bad']} bad of "
          f"{breach['answers']} answers, {breach['canary_users']} canary users, baseline failures "
          f"{breach['baseline_failures']}; reason: {breach['reason']}")
    record(f"{Path(__file__).name}:breach_to_last_bad", span, "s from the canary's first failed answer to its last",
           args.window, span / args.window, f"< 2x the SLO window ({args.window:g} s; ratio = figure / window)")
    if args.breach_only:
        return
    canary_rps, plain_rps = statistics.median(rounds["canary"]), statistics.median(rounds["plain"])
    ratio = statistics.median(c / p for c, p in zip(rounds["canary"], rounds["plain"]))
    p50 = {side: percentile(values, 50) for side, values in latencies.items()}
    for side in sides:
        print(f"{side} alias: {statistics.median(rounds[side]):7.1f} req/s at concurrency {args.concurrency}; "
              f"p50 {p50[side]:6.2f} ms at concurrency 1; non-200 {failures[side]}")
    print(f"throughput ratio canary/plain = {ratio:.3f}x, median of {args.rounds} paired rounds (goal >= 0.98x); "
          f"+p50 = {p50['canary'] - p50['plain']:+.2f} ms (goal < 1 ms); "
          f"{split.count('2') / len(split):.1%} of 400 users on the canary (weight {args.weight:g}%)")
    record(Path(__file__).name, canary_rps, "req/s (ratio = median of paired rounds)", plain_rps, ratio,
           f">= 0.98x the plain alias's throughput with a {args.weight:g}% canary (same app, echo engine)")
    record(f"{Path(__file__).name}:p50", p50["canary"], "ms p50 at concurrency 1", p50["plain"],
           p50["canary"] / p50["plain"], "a canary adds < 1 ms to the plain alias's p50")


if __name__ == "__main__":
    main()
