"""Cost of alias routing: the alias ingress vs the stock `OpenAiIngress` addressed by folder name.

Both are real `ray.serve.llm` apps in one local Ray Serve, on the same echo engine (so the engine costs
next to nothing and the ingress is what differs), reading the same adapter folder from a real local S3.
Load alternates between the two in rounds so that machine noise hits both alike. Goals: alias throughput
>= 0.95x stock, +p50 < 2 ms; and `/v1/models` with 10k entries (3334 registered models x base name +
2 served aliases) < 50 ms. figure = alias throughput (req/s), baseline = stock throughput.

Usage: python bench/ingress_overhead.py [--requests 1200] [--concurrency 8] [--models 3334]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402

from rlops import stack as rlops_stack  # noqa: E402
from rlops.config import load_config, s3_environment  # noqa: E402
from rlops.layout import ADAPTER_CONFIG, AliasRoute, RoutesManifest, parse_s3_uri, routes_key, version_folder  # noqa: E402
from rlops.processes import free_port  # noqa: E402
from serving.app import ENGINE_CLS_ENV, app_args  # noqa: E402

ECHO_ENGINE = "serving.engines.echo:EchoEngine"
MODEL = "bench-model"
PROMPT = [{"role": "user", "content": "move right then up"}]


def manifest(model: str, version: int) -> RoutesManifest:
    route = AliasRoute(version=version, folder=version_folder(model, version), files={ADAPTER_CONFIG: "0" * 64},
                       promoted_at="2026-01-01T00:00:00.000Z", trigger="bench")
    return RoutesManifest(model=model, generation=1, aliases={"production": route, "staging": route})


def seed_s3(config, extra_models: int) -> None:
    """One adapter folder (the echo engine ignores its weights; Ray only needs adapter_config.json) and
    the manifests: the bench model plus `extra_models` others for the `/v1/models` measurement."""
    s3 = rlops_stack.s3_client(config, timeout_s=10)
    location = parse_s3_uri(config.lora_path)
    s3.put_object(Bucket=location.bucket, Key=location.key(version_folder(MODEL, 1), ADAPTER_CONFIG),
                  Body=json.dumps({"peft_type": "LORA", "r": 8}).encode())
    names = [MODEL, *(f"m{i:05d}" for i in range(extra_models))]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda name: s3.put_object(Bucket=location.bucket, Key=routes_key(location, name),
                                                 Body=manifest(name, 1).model_dump_json().encode()), names))


def build_apps(config):
    from ray.serve.llm import build_openai_app

    alias_args = app_args(config, "transformers")
    alias_args["llm_configs"][0]["runtime_env"]["env_vars"][ENGINE_CLS_ENV] = ECHO_ENGINE
    stock_args = json.loads(json.dumps(alias_args))
    del stock_args["ingress_cls_config"]  # the stock OpenAiIngress
    return build_openai_app(alias_args), build_openai_app(stock_args)


async def load(url: str, model: str, requests: int, concurrency: int) -> tuple[float, list[float], int]:
    """(requests/s, latencies in ms, non-200 count) for `requests` chat calls from `concurrency` clients."""
    latencies: list[float] = []
    failures = 0
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(requests):
        queue.put_nowait(None)
    body = {"model": model, "messages": PROMPT, "max_tokens": 4}

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while not queue.empty():
            queue.get_nowait()
            started = time.perf_counter()
            r = await http.post(f"{url}/v1/chat/completions", json=body)
            latencies.append((time.perf_counter() - started) * 1000)
            failures += r.status_code != 200

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return requests / elapsed, latencies, failures


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1200, help="requests per ingress, over all rounds")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--models", type=int, default=3334, help="registered models in _routes/ (3 entries each)")
    args = parser.parse_args()

    import ray
    from ray import serve

    root = Path(tempfile.mkdtemp(prefix="rlops-bench-ingress-"))
    s3_port = next(p for p in iter(free_port, None) if p + 10000 < 65536)
    config = load_config(environ={"RLOPS_DATA_DIR": str(root), "RLOPS_SERVER__PORT": str(free_port()),
                                  "RLOPS_STORAGE__ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
                                  "RLOPS_SERVING__MODEL_SOURCE": str(root / "no-weights-needed"),
                                  "RLOPS_SERVING__DYNAMIC_LORA_LOADING_PATH": f"s3://rlops/bench-{uuid.uuid4().hex[:8]}",
                                  "RLOPS_SERVING__REPLICA_CPUS": "0.5", "RLOPS_REGISTRY__MODELS": f"[{MODEL}]"})
    rlops_stack.up(config, timeout_s=90)
    try:
        seed_s3(config, args.models)
        ray.init(address="local", num_cpus=8, runtime_env={"env_vars": s3_environment(config)},
                 include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        alias_app, stock_app = build_apps(config)
        serve.run(alias_app, name="alias", route_prefix="/alias")
        serve.run(stock_app, name="stock", route_prefix="/stock")
        base = config.serving.base_model_id
        sides = {"alias": (f"http://127.0.0.1:{port}/alias", f"{base}:{MODEL}"),
                 "stock": (f"http://127.0.0.1:{port}/stock", f"{base}:{version_folder(MODEL, 1)}")}
        for url, model in sides.values():  # warm-up: adapter download, handles, connections
            asyncio.run(load(url, model, 50, args.concurrency))
        results = {side: {"rps": [], "lat": [], "fail": 0} for side in sides}
        per_round = args.requests // args.rounds
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            for side in order:
                rps, latencies, failures = asyncio.run(load(*sides[side], per_round, args.concurrency))
                results[side]["rps"].append(rps)
                results[side]["lat"].extend(latencies)
                results[side]["fail"] += failures

        models_url = f"{sides['alias'][0]}/v1/models"
        entries = len(httpx.get(models_url, timeout=30).json()["data"])
        models_ms = []
        with httpx.Client(timeout=30) as http:
            for _ in range(30):
                started = time.perf_counter()
                assert http.get(models_url).status_code == 200
                models_ms.append((time.perf_counter() - started) * 1000)
    finally:
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            rlops_stack.down(config)

    alias_rps, stock_rps = statistics.median(results["alias"]["rps"]), statistics.median(results["stock"]["rps"])
    p50 = {s: percentile(r["lat"], 50) for s, r in results.items()}
    p99 = {s: percentile(r["lat"], 99) for s, r in results.items()}
    ratio = alias_rps / stock_rps
    models_p50 = statistics.median(models_ms)
    print(f"alias ingress:  {alias_rps:7.1f} req/s  p50 {p50['alias']:6.2f} ms  p99 {p99['alias']:6.2f} ms  "
          f"non-200 {results['alias']['fail']}")
    print(f"stock ingress:  {stock_rps:7.1f} req/s  p50 {p50['stock']:6.2f} ms  p99 {p99['stock']:6.2f} ms  "
          f"non-200 {results['stock']['fail']}")
    print(f"throughput ratio alias/stock = {ratio:.3f}x (goal >= 0.95x); "
          f"+p50 = {p50['alias'] - p50['stock']:+.2f} ms (goal < 2 ms)")
    print(f"/v1/models with {entries} entries: p50 {models_p50:.2f} ms over 30 calls (goal < 50 ms)")
    record(Path(__file__).name, alias_rps, "req/s", stock_rps, ratio,
           ">= 0.95x stock OpenAiIngress throughput, +p50 < 2 ms; /v1/models (10k entries) < 50 ms")


if __name__ == "__main__":
    main()
