"""Cost of a shadow to the primary's answers: AliasIngress apps on the echo engine (bench/echo_engine.py, as
bench/ingress_overhead.py: the engine costs next to nothing, the ingress is what differs), one model served as
a plain alias (production -> v1) and one whose production (v1) is shadowed by v2 at 20% (`--percent`): a fifth
of its requests are copied to v2 after the answer (serving/shadow.py) and each pair is traced into the scratch
stack's real MLflow (the shipped behaviour: pairs are traced even with the sample rate at 0; both versions are
registered there so the traces are recorded, not refused). Each side is its own app, so the copies, and the trace
recorder process beside the replica, run for the shadowed side's replicas only; each side is deployed first
once (bench/ingress_overhead.py's order bias).

Two loads, each in paired rounds that alternate the sides so that machine noise hits both alike:
- steady (the goal's): an open loop at `--load` (0.5) times the plain side's capacity, each request sent on its
  schedule whether or not earlier ones were answered, as production traffic arrives; latency counts from the
  scheduled send. Throughput = answers per second; p50 per round, paired.
- saturation (reported, not the goal): `--concurrency` clients back to back, the capacity a shadow costs, and
  latency at concurrency 1 in interleaved pairs.
The result is refused when the steady rounds disagree (bench/ingress_overhead.py's bounds, for throughput and
for p50). The copies are counted from the ingress's `rlops_serving_shadow_copies` metric: none is a failed run.
Goal (issue 31): under steady load, throughput >= 0.95x the plain alias and p50 within +5%.
figure = shadowed-alias answers/s under the steady load, baseline = plain alias. With `--pin` (recorded as
`shadow.py --pin`) MLflow and S3 run on one core, Ray and the load generator on the other: the MLflow server's
work per pair trace off the serving core and off the client, as with the tracking server on its own machine in
the cluster (the client's work is the same on both sides).

Usage: python bench/shadow.py [--requests 1200] [--latency-requests 600] [--rounds 12] [--percent 20]
       [--load 0.5 | --rate R] [--steady-seconds 15] [--pin]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402
from canary import route  # noqa: E402
from ingress_overhead import (PairedFigures, PairedRatio, bench_environ, chat_body, counterbalanced,  # noqa: E402
                              echo_args, echo_serve, load, paired_arguments)

from rlops import stack as rlops_stack  # noqa: E402
from rlops.config import load_config  # noqa: E402
from rlops.layout import (ADAPTER_CONFIG, AliasRoute, RoutesManifest, ShadowRoute, parse_s3_uri,  # noqa: E402
                          routes_key, version_folder)
from rlops.processes import free_port  # noqa: E402
from registry_hooks.storage import stamp_routes  # noqa: E402
from serving.shadow import SHADOW_OUTCOMES  # noqa: E402
from serving.traces import trace_counts  # noqa: E402

PLAIN, SHADOW = "bench-plain", "bench-shadow"
COPIES_METRIC, REQUESTS_METRIC = "ray_rlops_serving_shadow_copies_total", "ray_rlops_serving_requests_total"


def seed_s3(config, percent: float) -> None:
    s3 = rlops_stack.s3_client(config, timeout_s=10)
    location = parse_s3_uri(config.lora_path)
    for model, version in ((PLAIN, 1), (SHADOW, 1), (SHADOW, 2)):
        s3.put_object(Bucket=location.bucket, Key=location.key(version_folder(model, version), ADAPTER_CONFIG),
                      Body=json.dumps({"peft_type": "LORA", "r": 8}).encode())
    for manifest in (
            RoutesManifest(model=PLAIN, generation=1, aliases={"production": AliasRoute(**route(PLAIN, 1))}),
            RoutesManifest(model=SHADOW, generation=1, aliases={"production": AliasRoute(**route(SHADOW, 1))},
                           shadows={"production": ShadowRoute(**route(SHADOW, 2), percent=percent)})):
        s3.put_object(Bucket=location.bucket, Key=routes_key(location, manifest.model),
                      Body=manifest.model_dump_json().encode())
    stamp_routes(s3, location)


def register_shadowed(config) -> None:
    """SHADOW's two versions in the scratch MLflow: the pair writer looks each traced version up there (an
    unknown one fails its trace at once, which would make the copies cheaper than in production)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
    client.create_registered_model(SHADOW)
    for _ in (1, 2):
        client.create_model_version(SHADOW, source=f"{config.lora_path}/{SHADOW}-source")


def metric_sums(text: str, name: str, by: str) -> dict[str, int]:
    """Counter `name` in the Prometheus text, summed over replicas per value of label `by`."""
    sums: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                value = sample.labels.get(by, "")
                sums[value] = sums.get(value, 0) + int(sample.value)
    return sums


def settled_counts(metrics_url: str, timeout_s: float = 60) -> tuple[dict[str, int], int, dict[str, int]]:
    """(copies by outcome, requests the shadowed alias answered, trace outcomes) once two reads a Ray report
    interval apart agree on the first two (Ray exports every few seconds; the trace writer drains for longer)."""
    previous, deadline = None, time.monotonic() + timeout_s
    while True:
        text = httpx.get(metrics_url, timeout=10).text
        outcomes = metric_sums(text, COPIES_METRIC, "outcome")
        copies = {outcome: outcomes.get(outcome, 0) for outcome in SHADOW_OUTCOMES}
        current = (copies, metric_sums(text, REQUESTS_METRIC, "registered_model").get(SHADOW, 0))
        if current == previous or time.monotonic() > deadline:
            return (*current, trace_counts(text))
        previous = current
        time.sleep(11)


async def steady(url: str, model: str, rate: float, seconds: float) -> tuple[float, list[float], int]:
    """(answers/s, latencies in ms, non-200 count) for requests sent at `rate` a second for `seconds`, each on
    its schedule whether or not earlier ones were answered; a latency counts from the scheduled send, so a
    load generator that falls behind charges the delay to the server rather than hiding it."""
    latencies: list[float] = []
    failures = 0
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        warm = [http.post(f"{url}/v1/chat/completions", json=chat_body(model, n, False, None)) for n in range(8)]
        await asyncio.gather(*warm)  # connections open before the clock starts, as a long-running client has them
        start = time.perf_counter() + 0.05

        async def one(n: int) -> None:
            nonlocal failures
            due = start + n / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            r = await http.post(f"{url}/v1/chat/completions", json=chat_body(model, n, False, None))
            latencies.append((time.perf_counter() - due) * 1000)
            failures += r.status_code != 200

        count = int(rate * seconds)
        await asyncio.gather(*(one(n) for n in range(count)))
        elapsed = time.perf_counter() - start
    return count / elapsed, latencies, failures


def steady_rounds(deployments: list[dict[str, tuple[str, str]]], rounds: int, rate: float,
                  seconds: float) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, int]]:
    """Per side: answers/s and p50 of each steady round, non-200 count; rounds alternate the order within
    each deployment and are shared out over the deployments."""
    rps: dict[str, list[float]] = {}
    p50: dict[str, list[float]] = {}
    failures: dict[str, int] = {}
    for sides in deployments:
        for round_ in range(rounds // len(deployments)):
            for side in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
                answered, latencies, failed = asyncio.run(steady(*sides[side], rate, seconds))
                rps.setdefault(side, []).append(answered)
                p50.setdefault(side, []).append(statistics.median(latencies))
                failures[side] = failures.get(side, 0) + failed
    return rps, p50, failures


def main() -> None:
    parser = paired_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--percent", type=float, default=20.0, help="the shadow's share of the alias's requests")
    parser.add_argument("--load", type=float, default=0.5, help="the steady rate as a share of the plain capacity")
    parser.add_argument("--rate", type=float, default=None, help="the steady rate in req/s instead of --load: runs "
                        "whose measured capacities differ then load the sides alike")
    parser.add_argument("--steady-seconds", type=float, default=15.0, help="seconds of each steady round")
    args = parser.parse_args()
    if args.load <= 0 or args.rate is not None and args.rate <= 0:
        parser.error("--load and --rate must be above 0")

    from ray import serve
    from ray.serve.llm import build_openai_app

    root = Path(tempfile.mkdtemp(prefix="rlops-bench-shadow-"))
    metrics_port = free_port()
    config = load_config(environ=bench_environ(root, RLOPS_SERVING__METRICS_PORT=str(metrics_port),
                                               RLOPS_REGISTRY__MODELS=f"[{PLAIN}, {SHADOW}]"))

    def seed(config) -> None:
        seed_s3(config, args.percent)
        register_shadowed(config)

    with echo_serve(config, root, seed, pin=args.pin, client_with_serving=args.pin) as port:
        base = config.serving.base_model_id
        models = {"plain": f"{base}:{PLAIN}", "shadow": f"{base}:{SHADOW}"}
        deployments = []
        for order in (("shadow", "plain"), ("plain", "shadow")):  # each side deployed first once
            names = {side: f"{side}-{order[0]}-first" for side in order}
            for side in order:
                serve.run(build_openai_app(echo_args(config)), name=names[side], route_prefix=f"/{names[side]}")
            deployments.append({side: (f"http://127.0.0.1:{port}/{names[side]}", models[side]) for side in models})
        for sides in deployments:
            for url, model in sides.values():  # warm-up: both versions' adapters loaded, connections open
                _, _, failed = asyncio.run(load(url, model, 80, args.concurrency))
                assert failed == 0, f"{url}: {failed} of 80 warm-up requests failed"
        rounds, latencies, failures = counterbalanced(deployments, args.rounds, args.requests, args.latency_requests,
                                                      args.concurrency)
        plain_capacity = statistics.median(rounds["plain"])
        rate = args.rate or args.load * plain_capacity
        load_share = rate / plain_capacity
        steady_rps, steady_p50, steady_failures = steady_rounds(deployments, args.rounds, rate, args.steady_seconds)
        copies, shadowed, traces = settled_counts(f"http://127.0.0.1:{metrics_port}/metrics")

    print("saturation (reported, not the goal):")
    capacity = PairedFigures.of("shadow", "plain", rounds, latencies)
    capacity.show(args, failures, "none: reported", "none: reported")
    throughput, p50 = PairedRatio.of(steady_rps["shadow"], steady_rps["plain"]), \
        PairedRatio.of(steady_p50["shadow"], steady_p50["plain"])
    print(f"steady load at {rate:.1f} req/s ({load_share:.2f}x the plain capacity), {args.rounds} paired rounds of "
          f"{args.steady_seconds:g} s; non-200 {steady_failures}")
    for side in ("shadow", "plain"):
        print(f"  {side}: {statistics.median(steady_rps[side]):7.2f} answers/s, p50 "
              f"{statistics.median(steady_p50[side]):6.2f} ms (median of the rounds)")
    print(f"  throughput shadow/plain: {throughput.text()} (goal >= 0.95x)")
    print(f"  p50 shadow/plain: {p50.text()} (goal <= 1.05x)")
    offered = sum(copies.values())
    print(f"shadow copies: {copies['sent']} sent, {copies['dropped']} dropped (queue full), {copies['failed']} failed "
          f"= {offered / max(shadowed, 1):.1%} of the {shadowed} requests the shadowed alias answered (share "
          f"{args.percent:g}%); pair traces: {traces}")
    assert steady_failures["shadow"] == steady_failures["plain"] == 0, steady_failures
    if copies["sent"] == 0:
        sys.exit("not recorded: no copy reached the shadow, so the run measured no shadow")
    for what, ratio in (("steady throughput", throughput), ("steady p50", p50)):
        if (why := ratio.disagreement()) is not None:
            sys.exit(f"not recorded: {what}: {why}; run it again on a quieter machine")
    name = Path(__file__).name + (" --pin" if args.pin else "")  # pinned: MLflow apart, another figure
    record(name, statistics.median(steady_rps["shadow"]), f"answers/s at a steady {rate:.1f} req/s (ratio = median "
           "of paired rounds)", statistics.median(steady_rps["plain"]), throughput.median,
           f">= 0.95x the plain alias's throughput under steady load ({load_share:.2f}x capacity) with a "
           f"{args.percent:g}% shadow, pairs traced (echo engine)")
    record(f"{name}:p50", statistics.median(steady_p50["shadow"]), f"ms p50 at a steady {rate:.1f} req/s (ratio = "
           "median of paired rounds)", statistics.median(steady_p50["plain"]), p50.median,
           f"p50 within +5% of the plain alias's under the same steady load with a {args.percent:g}% shadow")
    record(f"{name}:capacity", capacity.rps["shadow"], f"req/s at concurrency {args.concurrency} (saturation)",
           capacity.rps["plain"], capacity.ratio.median, "report only: the capacity a shadow costs on 2 cores")


if __name__ == "__main__":
    main()
