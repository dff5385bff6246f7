"""Cost of a shadow to the primary's answers: AliasIngress apps on the echo engine (bench/echo_engine.py, as
bench/ingress_overhead.py: the engine costs next to nothing, the ingress is what differs), one model served as
a plain alias (production -> v1) and one whose production (v1) is shadowed by v2 at 20% (`--percent`): a fifth
of its requests are copied to v2 after the answer (serving/shadow.py) and each pair is traced into the scratch
stack's real MLflow (the shipped behaviour: pairs are traced even with the sample rate at 0; both versions are
registered there so the traces are recorded, not refused). Each side is its own app, so the copies, and the trace writer
thread that holds the replica's GIL, run in the shadowed side's replicas only; each side is deployed first once
(bench/ingress_overhead.py's order bias). Paired rounds alternate the two so that machine noise hits both alike;
latency at concurrency 1 in interleaved pairs; the refusal on disagreement as in bench/ingress_overhead.py. The
copies are counted from the ingress's `rlops_serving_shadow_copies` metric: none is a failed run.
Goal (issue 31): throughput >= 0.95x the plain alias, p50 within +5%. figure = shadowed-alias req/s,
baseline = plain alias.

Usage: python bench/shadow.py [--requests 1200] [--latency-requests 600] [--rounds 12] [--percent 20] [--pin]
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
from ingress_overhead import (PairedRatio, bench_environ, counterbalanced, echo_args, echo_serve,  # noqa: E402
                              latency_delta, load, paired_arguments, percentile)

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


def main() -> None:
    parser = paired_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--percent", type=float, default=20.0, help="the shadow's share of the alias's requests")
    args = parser.parse_args()

    from ray import serve
    from ray.serve.llm import build_openai_app

    root = Path(tempfile.mkdtemp(prefix="rlops-bench-shadow-"))
    metrics_port = free_port()
    config = load_config(environ=bench_environ(root, RLOPS_SERVING__METRICS_PORT=str(metrics_port),
                                               RLOPS_REGISTRY__MODELS=f"[{PLAIN}, {SHADOW}]"))

    def seed(config) -> None:
        seed_s3(config, args.percent)
        register_shadowed(config)

    with echo_serve(config, root, seed, pin=args.pin) as port:
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
        copies, shadowed, traces = settled_counts(f"http://127.0.0.1:{metrics_port}/metrics")

    ratio = PairedRatio.of(rounds["shadow"], rounds["plain"])
    shadow_rps, plain_rps = statistics.median(rounds["shadow"]), statistics.median(rounds["plain"])
    p50 = {side: percentile(values, 50) for side, values in latencies.items()}
    delta, delta_q1, delta_q3 = latency_delta(latencies["shadow"], latencies["plain"])
    for side in models:
        print(f"{side} alias: {statistics.median(rounds[side]):7.1f} req/s at concurrency {args.concurrency}; "
              f"p50 {p50[side]:6.2f} ms at concurrency 1; non-200 {failures[side]}")
    print(f"throughput shadow/plain over {args.rounds} paired rounds: {ratio.text()} (goal >= 0.95x)"
          f"{'; pinned' if args.pin else ''}")
    print(f"p50 shadow/plain = {p50['shadow'] / p50['plain']:.3f}x (goal <= 1.05x); +p50 = {delta:+.2f} ms, median "
          f"of {len(latencies['shadow'])} interleaved pairs (IQR {delta_q1:+.2f} to {delta_q3:+.2f})")
    offered = sum(copies.values())
    print(f"shadow copies: {copies['sent']} sent, {copies['dropped']} dropped (queue full), {copies['failed']} failed "
          f"= {offered / max(shadowed, 1):.1%} of the {shadowed} requests the shadowed alias answered (share "
          f"{args.percent:g}%); pair traces: {traces}")
    assert failures["shadow"] == failures["plain"] == 0, failures
    if copies["sent"] == 0:
        sys.exit("not recorded: no copy reached the shadow, so the run measured no shadow")
    if (why := ratio.disagreement()) is not None:
        sys.exit(f"not recorded: {why}; run it again on a quieter machine")
    record(Path(__file__).name, shadow_rps, "req/s (ratio = median of paired rounds)", plain_rps, ratio.median,
           f">= 0.95x the plain alias's throughput with a {args.percent:g}% shadow, pairs traced (echo engine)")
    record(f"{Path(__file__).name}:p50", p50["shadow"], "ms p50 at concurrency 1", p50["plain"],
           p50["shadow"] / p50["plain"], f"p50 within +5% of the plain alias's with a {args.percent:g}% shadow")


if __name__ == "__main__":
    main()
