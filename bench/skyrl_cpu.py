"""SkyRL's real GRPO loop on CPU (`rlops train --skyrl-dry-run`): seconds per step in steady state, and the
tracker's blocking time per SkyRL step inside the same steps.

Runs the dry run (tiny Qwen3-VL, visgym multi-turn env with images, LoRA synced to vLLM over disk) for
--steps steps against a scratch MLflow + S3 stack, then reads back from MLflow, per step: SkyRL's own
`timing/step` (generate + train + checkpoint + weight sync, the loop's own clock) and the tracker's
`tracker/blocking_s` (wall time the loop spent inside our callback's hooks that step). Steady state = the
steps after the first (the first includes vLLM's warm-up). Figures: median s/step (baseline: the first
step), median blocking / median step time (goal <= 1%), and the whole dry run's wall time (goal < 3 min).

Usage: python bench/skyrl_cpu.py [--steps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import record  # noqa: E402
from _scratch import scratch_stack  # noqa: E402

from mlflow import MlflowClient  # noqa: E402

from tracker.skyrl import BLOCKING_METRIC  # noqa: E402
from training.skyrl_dry_run import run_dry_run  # noqa: E402


def per_step(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with scratch_stack() as (config, root):
        result = run_dry_run(config, root / "dry-run", steps=args.steps)
        client = MlflowClient(config.tracking_uri)
        step_s = per_step(client, result.run_id, "timing/step")
        blocking_s = per_step(client, result.run_id, BLOCKING_METRIC)
    steady = [s for s in sorted(step_s) if s > min(step_s)]
    if not steady:
        sys.exit("bench/skyrl_cpu.py: need --steps >= 2 for a steady state")
    s_per_step = statistics.median(step_s[s] for s in steady)
    first = step_s[min(step_s)]
    blocking = statistics.median(blocking_s[s] for s in steady if s in blocking_s)
    share = blocking / s_per_step
    load = os.getloadavg()[1]  # 5-min mean: the machine is shared
    print(f"dry run: {args.steps} steps in {result.seconds:.0f} s (incl. Ray, vLLM and model start), load {load:.1f}")
    print(f"steady state: {s_per_step:.2f} s/step (median of steps {steady[0]}..{steady[-1]}); first step {first:.2f} s")
    print(f"tracker blocking: {blocking * 1e3:.2f} ms/step = {share:.3%} of the step (goal <= 1%)")
    for step in sorted(step_s):
        print(f"  step {step}: {step_s[step]:.2f} s, tracker {blocking_s.get(step, float('nan')) * 1e3:.2f} ms")
    record("skyrl_cpu.py", s_per_step, "s/step", first, s_per_step / first, "reported (steady state)")
    record("skyrl_cpu.py:dry_run", result.seconds, "s", None, None,
           f"< 180 s on 2 cores (here {args.steps} steps at load {load:.1f})")
    record("skyrl_cpu.py:tracker", blocking * 1e3, "ms/step", s_per_step * 1e3, share, "<= 0.01 of step time")


if __name__ == "__main__":
    main()
