"""Does the local CPU trainer learn? Solve rate before vs after a fixed GRPO budget, with 95% intervals.

Baseline = the SFT base (what GRPO starts from), measured in the same run on the same mazes: the fixed local
eval set (`maze_2d/local7`, 64 mazes) and 256 further held-out mazes (`maze_2d/local7-heldout`, seeds
1000-1255, never trained on). "After" is the last checkpoint of the budget (not the best one on the eval
set, which would be a selected, optimistic number). Also prints seconds per GRPO step and writes the
fixed-eval curve to bench/local_training.png. Runs its own stack (MLflow + S3) in the data dir; the SFT
base is cached there, so a second run skips SFT.

    .venv/bin/python bench/local_training.py [--budget 300] [--data-dir .rlops/bench]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402
from rlops import stack  # noqa: E402
from rlops.config import Config  # noqa: E402
from rlops.processes import free_port  # noqa: E402

GOAL = "held-out solve rate after GRPO > before beyond the 95% intervals (aim +25 points), 256 mazes"
PNG = Path(__file__).with_name("local_training.png")


def evaluate_model(model_dir: Path, adapter_dir: Path | None, maze_sets, max_new_tokens: int) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from rlops.vlm import load_processor
    from training.local_trainer import evaluate

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    processor = load_processor(model_dir)
    return {s.data_source: evaluate(model, processor, s, max_new_tokens) for s in maze_sets}


def plot(curve: list[tuple[int, float]], before: dict, after: dict, heldout_source: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rates = zip(*curve)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rates, marker="o", label="fixed eval (64 mazes), greedy")
    for label, res, style in (("held-out before", before[heldout_source], ":"), ("held-out after", after[heldout_source], "--")):
        ax.axhline(res.solve_rate, linestyle=style, color="gray" if "before" in label else "black", label=f"{label} (256)")
        ax.axhspan(*res.ci95, color="gray", alpha=0.12)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("solve rate")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    ax.set_title("local GRPO + LoRA on the tiny SFT base (maze_2d/local7)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=None, help="GRPO seconds (default: training.local.budget_s)")
    parser.add_argument("--data-dir", default=".rlops/bench", help="stack data + cached SFT base")
    args = parser.parse_args()

    from training import datasets as ds
    from training.local_trainer import ensure_base, train

    config = Config.model_validate({
        "data_dir": args.data_dir, "server": {"port": free_port()},
        "storage": {"endpoint_url": f"http://127.0.0.1:{stack.free_s3_port()}", "bucket": "rlops-bench"},
        "tracking": {"experiment": "bench-local-training"}, "registry": {"models": ["bench-maze-grpo"]},
    })
    local = config.training.local
    budget = args.budget or local.budget_s
    stack.up(config)
    try:
        started = time.monotonic()
        base = ensure_base(config)
        print(f"SFT base: {base} ({time.monotonic() - started:.0f} s, cached after the first run)")
        sets = [ds.local_eval_set(local.eval_size), ds.heldout_set(local.eval_size, 256)]
        before = evaluate_model(base, None, sets, local.max_completion_tokens)
        run_dir = config.data_path / "runs" / time.strftime("%Y%m%d-%H%M%S")
        result = train(config, run_dir, budget_s=budget, steps=100_000)
        after = evaluate_model(base, result.adapter_dir, sets, local.max_completion_tokens)
    finally:
        stack.down(config)

    print(f"GRPO: {result.steps} steps in {result.seconds:.0f} s = {result.seconds_per_step:.3f} s/step "
          f"(budget {budget:.0f} s, 2 CPU cores shared)")
    print("fixed-eval curve: " + ", ".join(f"{s}:{r:.3f}" for s, r in result.curve))
    for maze_set in sets:
        b, a = before[maze_set.data_source], after[maze_set.data_source]
        beyond = a.ci95[0] > b.ci95[1]
        print(f"{maze_set.data_source:<24} n={len(maze_set.seeds):<4} before {b.solve_rate:.3f} "
              f"[{b.ci95[0]:.3f}, {b.ci95[1]:.3f}]  after {a.solve_rate:.3f} [{a.ci95[0]:.3f}, {a.ci95[1]:.3f}]  "
              f"delta {100 * (a.solve_rate - b.solve_rate):+.1f} points  beyond the intervals: {'yes' if beyond else 'no'}")
    heldout = sets[1].data_source
    plot(result.curve, before, after, heldout, PNG)
    print(f"curve written to {PNG}")
    b, a = before[heldout].solve_rate, after[heldout].solve_rate
    print(f"held-out solve rate after/before ratio {a / b if b else float('nan'):.3f}")
    record("local_training.py", a, "held-out solve rate (256 mazes) after the GRPO budget", b,
           a / b if b else None, GOAL)
    record("local_training.py:s_per_step", result.seconds_per_step, "s per GRPO step (32 completions, 2 cores)",
           None, None, "report only")


if __name__ == "__main__":
    main()
