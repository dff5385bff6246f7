"""Cost of alias routing: the alias ingress vs the stock `OpenAiIngress` addressed by folder name.

Both are real `ray.serve.llm` apps in one local Ray Serve, on the same echo engine (bench/echo_engine.py, a
fixture: the engine costs next to nothing and the ingress is what differs), reading the same adapter folder
from a real local S3; the manifests are published with the routes stamp, as promotion publishes them.
Each side is deployed twice, once first and once second (an A/A run showed a deployment-order bias). Each
throughput round loads both sides at once for `--round-seconds`, 8 clients each, so that machine noise hits both
alike (rounds taken in turn spread 0.70-1.31x on this 2-core machine, bench/README.md); the rounds go to the two
deployments in turn. Latency is measured at concurrency 1 in interleaved pairs (one request to each side, back
to back, the order alternating).
With `--pin` Ray runs on all cores but the last, and the load generator and the stack (MLflow, S3) on the last
(on 2 cores this made the rounds noisier, bench/README.md). The result is refused (exit 1, nothing
recorded) when the rounds do not pin the figure down: the paired median's 95% interval (order statistics, no
assumption about the rounds' distribution) wider than 0.06, or the median more than 0.03 from the ratio of the
medians. More rounds narrow the interval; a noisier machine needs more of them. Goals (issue 38): alias
throughput >= 0.97x stock at 10k `/v1/models` entries (3334 registered models x base name + 2 served aliases),
+p50 <= 0.2 ms, and `/v1/models` < 50 ms.
figure = alias throughput (req/s), baseline = stock throughput.

Usage: python bench/ingress_overhead.py [--round-seconds 3] [--rounds 64] [--latency-requests 1200] [--models 3334]
       [--pin]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402

from rlops import stack as rlops_stack  # noqa: E402
from rlops.config import load_config, s3_environment  # noqa: E402
from rlops.layout import ADAPTER_CONFIG, AliasRoute, RoutesManifest, parse_s3_uri, routes_key, version_folder  # noqa: E402
from rlops.processes import free_port  # noqa: E402
from registry_hooks.storage import stamp_routes  # noqa: E402
from serving.app import app_args  # noqa: E402

BENCH_DIR = str(Path(__file__).resolve().parent)
ECHO_ENGINE = "echo_engine:EchoEngine"  # Ray's engine class override (RAYLLM_VLLM_ENGINE_CLS), bench only
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
    stamp_routes(s3, location)


def echo_args(config, engine_env: dict[str, str] | None = None) -> dict:
    """The alias app's `build_openai_app` args on the echo engine; `engine_env` adds variables to its replica."""
    args = app_args(config, "cpu")
    args["llm_configs"][0]["runtime_env"] = {"env_vars": {"RAYLLM_VLLM_ENGINE_CLS": ECHO_ENGINE,
                                                          "PYTHONPATH": BENCH_DIR, **(engine_env or {})}}
    return args


def bench_environ(root: Path, **overrides: str) -> dict[str, str]:
    """`RLOPS_*` settings of a scratch stack in `root` on free ports, serving the bench model from the echo engine;
    tracing off unless `overrides` turn it on (bench/tracing.py measures its cost)."""
    return {"RLOPS_DATA_DIR": str(root), "RLOPS_SERVER__PORT": str(free_port()),
            "RLOPS_STORAGE__ENDPOINT_URL": f"http://127.0.0.1:{rlops_stack.free_s3_port()}",
            "RLOPS_SERVING__MODEL_SOURCE": str(root / "no-weights-needed"),
            "RLOPS_SERVING__DYNAMIC_LORA_LOADING_PATH": f"s3://rlops/bench-{uuid.uuid4().hex[:8]}",
            "RLOPS_SERVING__REPLICA_CPUS": "0.5", "RLOPS_REGISTRY__MODELS": f"[{MODEL}]",
            "RLOPS_SERVING__TRACES__SAMPLE_RATE": "0", **overrides}


def paired_arguments(parser: argparse.ArgumentParser, windows: bool = False) -> argparse.ArgumentParser:
    """The load options every paired-rounds bench takes; `windows`: rounds last `--round-seconds` with every side
    loaded at once (`simultaneous_rounds`) instead of a number of requests per side in turn."""
    if windows:
        parser.add_argument("--round-seconds", type=float, default=3.0, help="length of each simultaneous round")
    else:
        parser.add_argument("--requests", type=int, default=1200, help="throughput requests per side, all rounds")
    parser.add_argument("--latency-requests", type=int, default=600, help="concurrency-1 requests per side")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=False,
                        help="the load generator and the stack (MLflow, S3) on the last core, Ray on the others")
    return parser


@contextmanager
def echo_serve(config, root: Path, seed: Callable[[Any], None] | None = None, timeout_s: float = 90,
               pin: bool = False, client_with_serving: bool = False) -> Iterator[int]:
    """A scratch stack (MLflow + S3) seeded by `seed` (default: the bench model's folder and manifests) and a
    local Ray Serve; yields its port. `pin`: the stack (the control plane) runs on the last core, Ray and what its
    replicas start on the others: the serving host apart from MLflow and S3, as in the cluster deployment; the
    calling thread (the load generator) goes with the stack, or with Ray where `client_with_serving` (where the
    stack's own work differs between the sides, as a shadow's traces do, it must not slow one side's client).
    Everything is stopped and `root` removed on the way out."""
    import ray
    from ray import serve

    cores = sorted(os.sched_getaffinity(0))
    if pin:  # processes and threads inherit the affinity of the thread that starts them
        os.sched_setaffinity(0, cores[-1:])
    rlops_stack.up(config, timeout_s=timeout_s)
    try:
        (seed or (lambda c: seed_s3(c, 0)))(config)
        os.environ.update(s3_environment(config))  # the node's env, as `rlops serve` does: no secret in runtime_env
        if pin:
            os.sched_setaffinity(0, cores[:-1])
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                 _metrics_export_port=config.serving.metrics_port)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        if pin and not client_with_serving:
            os.sched_setaffinity(0, cores[-1:])
        yield port
    finally:
        os.sched_setaffinity(0, cores)
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            rlops_stack.down(config)
            shutil.rmtree(root, ignore_errors=True)


def build_apps(config, engine_env: dict[str, str] | None = None):
    """(alias app, stock app) on the echo engine."""
    from ray.serve.llm import build_openai_app

    alias_args = echo_args(config, engine_env)
    stock_args = json.loads(json.dumps(alias_args))
    del stock_args["ingress_cls_config"]  # the stock OpenAiIngress
    return build_openai_app(alias_args), build_openai_app(stock_args)


def chat_body(model: str, n: int, users: bool, messages: list | None) -> dict:
    """The n-th bench request; `users`: each names another OpenAI `user` (what a canary's sticky pick hashes)."""
    return {"model": model, "messages": messages or PROMPT, "max_tokens": 4, **({"user": f"user-{n}"} if users else {})}


async def load(url: str, model: str, requests: int, concurrency: int, *, users: bool = False,
               headers: dict[str, str] | None = None, messages: list | None = None) -> tuple[float, list[float], int]:
    """(requests/s, latencies in ms, non-200 count) for `requests` chat calls from `concurrency` clients;
    `users`: each request names another OpenAI `user` (what a canary's sticky pick hashes); `messages`
    replaces the short text prompt."""
    latencies: list[float] = []
    failures = 0
    queue: asyncio.Queue = asyncio.Queue()
    for n in range(requests):
        queue.put_nowait(n)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while not queue.empty():
            n = queue.get_nowait()
            started = time.perf_counter()
            r = await http.post(f"{url}/v1/chat/completions", json=chat_body(model, n, users, messages))
            latencies.append((time.perf_counter() - started) * 1000)
            failures += r.status_code != 200

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits, headers=headers) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return requests / elapsed, latencies, failures


async def interleaved_latency(sides: dict[str, tuple[str, str]], requests: int, *, users: bool = False,
                              headers: dict[str, str] | None = None,
                              messages: list | None = None) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Latencies (ms) at concurrency 1, index-aligned across sides: request n goes to every side back to back,
    the order rotating with n, so each side's n-th latency was taken under the same machine state."""
    latencies: dict[str, list[float]] = {side: [] for side in sides}
    failures = {side: 0 for side in sides}
    clients = {side: httpx.AsyncClient(timeout=60, headers=headers) for side in sides}
    order = list(sides)
    try:
        for n in range(requests):
            for side in order[n % len(order):] + order[:n % len(order)]:
                url, model = sides[side]
                started = time.perf_counter()
                r = await clients[side].post(f"{url}/v1/chat/completions", json=chat_body(model, n, users, messages))
                latencies[side].append((time.perf_counter() - started) * 1000)
                failures[side] += r.status_code != 200
    finally:
        for client in clients.values():
            await client.aclose()
    return latencies, failures


async def together(sides: dict[str, tuple[str, str]], seconds: float,
                   concurrency: int) -> tuple[dict[str, float], dict[str, int]]:
    """Answers/s of every side (url, model) over one window in which all sides are loaded at once, `concurrency`
    clients each, and their non-200 counts. A burst of machine noise lands on every side alike, which rounds
    taken in turn cannot promise on 2 shared cores; an answer that ends after the window does not count."""
    answers = {side: 0 for side in sides}
    failures = {side: 0 for side in sides}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    https = {side: httpx.AsyncClient(timeout=60, limits=limits) for side in sides}

    async def client(side: str, first: int) -> None:
        url, model = sides[side]
        n = first
        while time.perf_counter() < ends:
            r = await https[side].post(f"{url}/v1/chat/completions", json=chat_body(model, n, False, None))
            n += concurrency
            if time.perf_counter() <= ends:
                answers[side] += 1
                failures[side] += r.status_code != 200

    try:
        ends = time.perf_counter() + seconds
        await asyncio.gather(*(client(side, first) for side in sides for first in range(concurrency)))
    finally:
        for http in https.values():
            await http.aclose()
    return {side: count / seconds for side, count in answers.items()}, failures


def simultaneous_rounds(deployments: list[dict[str, tuple[str, str]]], rounds: int, seconds: float,
                        concurrency: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Per side: answers/s of each `together` round, the rounds going to each deployment in turn (each deploys
    the sides in another order), and the non-200 count."""
    throughput: dict[str, list[float]] = {side: [] for side in deployments[0]}
    failures = {side: 0 for side in deployments[0]}
    for round_ in range(rounds):
        rps, failed = asyncio.run(together(deployments[round_ % len(deployments)], seconds, concurrency))
        for side in throughput:
            throughput[side].append(rps[side])
            failures[side] += failed[side]
    return throughput, failures


def pooled(parts: list[tuple[dict, ...]]) -> tuple[dict, ...]:
    """Per-side results of several deployments merged, position by position: lists joined, counts summed."""
    merged: tuple[dict, ...] = tuple({} for _ in parts[0])
    for part in parts:
        for into, piece in zip(merged, part):
            for side, value in piece.items():
                into[side] = into.get(side, 0 if isinstance(value, int) else []) + value
    return merged


def pooled_latency(deployments: list[dict[str, tuple[str, str]]],
                   requests: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """`interleaved_latency` over each deployment in turn, the requests shared out and the results pooled."""
    return pooled([asyncio.run(interleaved_latency(sides, requests // len(deployments))) for sides in deployments])


def paired_rounds(sides: dict[str, tuple[str, str]], rounds: int, requests: int, latency_requests: int,
                  concurrency: int, **load_kwargs) -> tuple[dict, dict, dict]:
    """Per side (url, model): requests/s of each round, latencies at concurrency 1 (`interleaved_latency`),
    non-200 count. Rounds are paired (order alternating) so a drifting background load hits both sides alike."""
    throughput = {side: [] for side in sides}
    failures = {side: 0 for side in sides}
    for round_ in range(rounds):
        for side in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
            rps, _, failed = asyncio.run(load(*sides[side], requests // rounds, concurrency, **load_kwargs))
            throughput[side].append(rps)
            failures[side] += failed
    latencies, latency_failures = asyncio.run(interleaved_latency(sides, latency_requests, **load_kwargs))
    return throughput, latencies, {side: failures[side] + latency_failures[side] for side in sides}


def counterbalanced(deployments: list[dict[str, tuple[str, str]]], rounds: int, requests: int, latency_requests: int,
                    concurrency: int, **load_kwargs) -> tuple[dict, dict, dict]:
    """`paired_rounds` over several deployments of the same sides (each deployed in another order), the
    rounds and requests shared out and the results pooled: an A/A run of two identical apps showed the app
    deployed first +0.5 ms slower at p50, a bias a single deployment order would pin on one side."""
    return pooled([paired_rounds(sides, rounds // len(deployments), requests // len(deployments),
                                 latency_requests // len(deployments), concurrency, **load_kwargs)
                   for sides in deployments])


INTERVAL_BOUND = 0.06  # the paired median's 95% interval wider than this: the rounds do not pin it down
AGREE_BOUND = 0.03  # paired median vs ratio of medians


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval of the median: the k-th smallest and k-th largest value, k the largest rank
    whose Binomial(n, 1/2) tail below it stays within (1 - confidence) / 2; None when n is too small for one."""
    ordered, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while k < n // 2 and tail + math.comb(n, k) / 2 ** n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


@dataclass(frozen=True)
class PairedRatio:
    """Throughput of one side over another, round by round: the paired median, its 95% interval and spread."""
    median: float
    interval: tuple[float, float] | None
    low: float
    high: float
    q1: float
    q3: float
    of_medians: float

    @classmethod
    def of(cls, side: list[float], base: list[float]) -> "PairedRatio":
        ratios = sorted(a / b for a, b in zip(side, base))
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        return cls(statistics.median(ratios), median_interval(ratios), ratios[0], ratios[-1], q1, q3,
                   statistics.median(side) / statistics.median(base))

    def text(self) -> str:
        interval = "none: too few rounds" if self.interval is None else \
            f"{self.interval[0]:.3f}-{self.interval[1]:.3f}"
        return (f"{self.median:.3f}x paired median (95% interval {interval}; IQR {self.q1:.3f}-{self.q3:.3f}, "
                f"min {self.low:.3f}, max {self.high:.3f}); {self.of_medians:.3f}x ratio of medians")

    def disagreement(self) -> str | None:
        """Why these rounds cannot be trusted, or None."""
        if self.interval is None:
            return "too few rounds for a 95% interval of the median (6 at least)"
        if (width := self.interval[1] - self.interval[0]) > INTERVAL_BOUND:
            return (f"the paired median's 95% interval is {width:.3f} wide, above {INTERVAL_BOUND} (more rounds "
                    "narrow it)")
        if abs(self.median - self.of_medians) > AGREE_BOUND:
            return (f"the paired median {self.median:.3f}x and the ratio of medians {self.of_medians:.3f}x differ by "
                    f"more than {AGREE_BOUND}")
        return None


@dataclass(frozen=True)
class PairedFigures:
    """A paired bench's figures for `side` against `base`: throughput of the paired rounds, latency at
    concurrency 1 from the interleaved pairs."""
    side: str
    base: str
    rps: dict[str, float]  # median req/s of the rounds
    ratio: PairedRatio
    p50: dict[str, float]
    p99: dict[str, float]
    delta: tuple[float, float, float]  # +p50 (ms): median of the pairs' differences, its q1 and q3
    delta_interval: tuple[float, float] | None  # the median difference's 95% interval
    pairs: int

    @classmethod
    def of(cls, side: str, base: str, rounds: dict[str, list[float]], latencies: dict[str, list[float]]) -> "PairedFigures":
        return cls(side, base, {s: statistics.median(rounds[s]) for s in (side, base)},
                   PairedRatio.of(rounds[side], rounds[base]),
                   {s: percentile(latencies[s], 50) for s in (side, base)},
                   {s: percentile(latencies[s], 99) for s in (side, base)},
                   *latency_delta(latencies[side], latencies[base]), len(latencies[side]))

    def show(self, args: argparse.Namespace, failures: dict[str, int], throughput_goal: str, latency_goal: str) -> None:
        """Print both sides and the two comparisons; any non-200 fails the run."""
        for s in (self.side, self.base):
            print(f"{s}: {self.rps[s]:7.1f} req/s at concurrency {args.concurrency}; p50 {self.p50[s]:6.2f} ms, "
                  f"p99 {self.p99[s]:6.2f} ms at concurrency 1; non-200 {failures[s]}")
        print(f"throughput {self.side}/{self.base} over {args.rounds} paired rounds: {self.ratio.text()} "
              f"(goal {throughput_goal}){'; pinned' if args.pin else ''}")
        delta, q1, q3 = self.delta
        low, high = self.delta_interval or (float("nan"), float("nan"))
        print(f"p50 {self.side}/{self.base} = {self.p50[self.side] / self.p50[self.base]:.3f}x; +p50 = {delta:+.2f} ms, "
              f"median of {self.pairs} interleaved pairs (95% interval {low:+.2f} to {high:+.2f}, IQR {q1:+.2f} to "
              f"{q3:+.2f}; goal {latency_goal})")
        assert failures[self.side] == failures[self.base] == 0, failures

    def record(self, script: str, throughput_goal: str, p50_goal: str,
               unit: str = "req/s (ratio = median of paired rounds)") -> None:
        """Record throughput and p50 under `script`, or exit with nothing recorded when the rounds disagree."""
        if (why := self.ratio.disagreement()) is not None:
            sys.exit(f"not recorded: {why}; run it again on a quieter machine")
        record(script, self.rps[self.side], unit, self.rps[self.base], self.ratio.median, throughput_goal)
        record(f"{script}:p50", self.p50[self.side], "ms p50 at concurrency 1", self.p50[self.base],
               self.p50[self.side] / self.p50[self.base], p50_goal)


def latency_delta(side: list[float],
                  base: list[float]) -> tuple[tuple[float, float, float], tuple[float, float] | None]:
    """Median of the paired differences (ms) with its interquartile range, and the median's 95% interval,
    from `interleaved_latency`."""
    differences = [a - b for a, b in zip(side, base)]
    q1, median, q3 = statistics.quantiles(differences, n=4, method="inclusive")
    return (median, q1, q3), median_interval(differences)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    parser = paired_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), windows=True)
    parser.add_argument("--models", type=int, default=3334, help="registered models in _routes/ (3 entries each)")
    parser.set_defaults(rounds=64, latency_requests=1200)
    args = parser.parse_args()

    from ray import serve

    root = Path(tempfile.mkdtemp(prefix="rlops-bench-ingress-"))
    config = load_config(environ=bench_environ(root))
    with echo_serve(config, root, lambda c: seed_s3(c, args.models), pin=args.pin) as port:
        base = config.serving.base_model_id
        deployments = []
        for order in (("alias", "stock"), ("stock", "alias")):  # each side deployed first once
            apps = dict(zip(("alias", "stock"), build_apps(config)))
            for side in order:
                serve.run(apps[side], name=f"{side}-{order[0]}-first", route_prefix=f"/{side}-{order[0]}-first")
            deployments.append({
                "alias": (f"http://127.0.0.1:{port}/alias-{order[0]}-first", f"{base}:{MODEL}"),
                "stock": (f"http://127.0.0.1:{port}/stock-{order[0]}-first", f"{base}:{version_folder(MODEL, 1)}")})
        for sides in deployments:
            for url, model in sides.values():  # warm-up: adapter download, handles, connections
                asyncio.run(load(url, model, 50, args.concurrency))
        sides = deployments[0]
        rounds, failures = simultaneous_rounds(deployments, args.rounds, args.round_seconds, args.concurrency)
        latencies, latency_failures = pooled_latency(deployments, args.latency_requests)
        failures = {side: failures[side] + latency_failures[side] for side in failures}
        models_url = f"{sides['alias'][0]}/v1/models"
        entries = len(httpx.get(models_url, timeout=30).json()["data"])
        models_ms = []
        with httpx.Client(timeout=30) as http:
            for _ in range(30):
                started = time.perf_counter()
                assert http.get(models_url).status_code == 200
                models_ms.append((time.perf_counter() - started) * 1000)

    figures = PairedFigures.of("alias", "stock", rounds, latencies)
    models_p50 = statistics.median(models_ms)
    figures.show(args, failures, ">= 0.97x", "<= 0.2 ms")
    print(f"/v1/models with {entries} entries: p50 {models_p50:.2f} ms over 30 calls (goal < 50 ms)")
    figures.record(Path(__file__).name, f">= 0.97x stock OpenAiIngress throughput at {entries} /v1/models entries "
                   "(same echo engine)", "alias ingress adds <= 0.2 ms to the stock p50",
                   "req/s of each side while both are loaded at once (ratio = median of paired rounds)")
    record(f"{Path(__file__).name}:p50_delta", figures.delta[0], "ms, median of the interleaved pairs' differences at "
           "concurrency 1", None, None, "<= 0.2 ms")
    record(f"{Path(__file__).name}:models", models_p50, f"ms per /v1/models ({entries} entries)", None, None,
           "< 50 ms with 10k entries")


if __name__ == "__main__":
    main()
