"""Cost of tracing served requests: the same alias ingress with tracing off, at the default sample rate and
at 100%, in one run.

Three real `ray.serve.llm` apps in one local Ray Serve on the echo engine (bench/echo_engine.py), reading the
same manifests from a real local S3 (bench/ingress_overhead.py's setup) and writing traces to the scratch
stack's real MLflow server, where the bench model's version 1 is a registered LoggedModel (the traces link
to it). Every request is a maze with its picture (what the writer stores by digest and the maze task
scores). Paired rounds alternate the sides. Goal (issue 30): >= 0.97x tracing-off throughput at the default
rate, >= 0.9x at 100%. figure = traced throughput (req/s), baseline = tracing-off throughput.

Usage: python bench/tracing.py [--requests 1200] [--latency-requests 600] [--rounds 12]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402
from ingress_overhead import (MODEL, bench_environ, echo_args, echo_serve, load, paired_arguments,  # noqa: E402
                              paired_rounds, percentile)

from rlops.config import TracesConfig, load_config  # noqa: E402
from rlops.processes import free_port  # noqa: E402
from rlops.task import load_task  # noqa: E402
from serving.traces import trace_counts  # noqa: E402


def register_bench_version(config) -> None:
    """Version 1 of the bench model, registered from a LoggedModel, as the tracker registers one."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
    experiment_id = client.create_experiment("bench-tracing")
    run = client.create_run(experiment_id)
    logged = client.create_logged_model(experiment_id, name="lora", source_run_id=run.info.run_id)
    client.finalize_logged_model(logged.model_id, "READY")
    client.set_terminated(run.info.run_id)
    mlflow.set_registry_uri(config.tracking_uri)
    mlflow.register_model(f"models:/{logged.model_id}", MODEL)


def main() -> None:
    parser = paired_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    args = parser.parse_args()

    from ray import serve
    from ray.serve.llm import build_openai_app

    default_rate = TracesConfig().sample_rate
    root = Path(tempfile.mkdtemp(prefix="rlops-bench-tracing-"))
    metrics_port = free_port()
    environ = bench_environ(root, RLOPS_SERVING__METRICS_PORT=str(metrics_port))
    configs = {side: load_config(environ={**environ, "RLOPS_SERVING__TRACES__SAMPLE_RATE": str(rate)})
               for side, rate in (("off", 0.0), ("default", default_rate), ("all", 1.0))}
    maze = load_task(configs["off"].task.path)
    messages = maze.eval_items(maze.eval_sets()[0])[0].messages()  # a maze with its picture
    with echo_serve(configs["off"], root, pin=args.pin) as port:
        register_bench_version(configs["off"])
        for side, config in configs.items():
            serve.run(build_openai_app(echo_args(config)), name=side, route_prefix=f"/{side}")
        name = f"{configs['off'].serving.base_model_id}:{MODEL}"
        sides = {side: (f"http://127.0.0.1:{port}/{side}", name) for side in configs}
        for url, model in sides.values():  # warm-up
            _, _, failed = asyncio.run(load(url, model, 50, args.concurrency, messages=messages))
            assert failed == 0, f"{url}: {failed} of 50 warm-up requests failed"
        rounds, latencies, failures = paired_rounds(sides, args.rounds, args.requests, args.latency_requests,
                                                    args.concurrency, messages=messages)
        counts = trace_counts(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text)

    p50 = {side: percentile(values, 50) for side, values in latencies.items()}
    for side in sides:
        print(f"tracing {side}: {statistics.median(rounds[side]):7.1f} req/s at concurrency {args.concurrency}; "
              f"p50 {p50[side]:6.2f} ms at concurrency 1; non-200 {failures[side]}")
    print(f"traces (both traced sides): {counts}")
    assert not any(failures.values()), failures
    for side, goal in (("default", 0.97), ("all", 0.9)):
        ratios = [a / b for a, b in zip(rounds[side], rounds["off"])]
        ratio = statistics.median(ratios)
        rps, off_rps = statistics.median(rounds[side]), statistics.median(rounds["off"])
        rate = default_rate if side == "default" else 1.0
        print(f"{side} ({rate:.0%}) / off = {ratio:.3f}x, median of {args.rounds} paired rounds (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}; goal >= {goal}x); ratio of medians {rps / off_rps:.3f}x; "
              f"+p50 {p50[side] - p50['off']:+.2f} ms")
        record(f"{Path(__file__).name}:{side}", rps, "req/s (ratio = median of paired rounds)", off_rps, ratio,
               f">= {goal}x the same ingress with tracing off, {rate:.0%} of maze requests traced (echo engine)")


if __name__ == "__main__":
    main()
