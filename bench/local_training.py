"""Does the local CPU trainer learn? Solve rate before vs after a fixed GRPO budget, with 95% intervals.

Baseline = the SFT base (what GRPO starts from), measured in the same run on the same mazes: the fixed local
eval set (`maze_2d/local7`, 64 mazes) and 256 further held-out mazes (`maze_2d/local7-heldout`: distinct
layouts, none in the fixed set, never trained on), with the exact paired sign test over the mazes. "After" is the checkpoint the product registers: the best on the fixed
set (the held-out mazes play no part in that choice, so their score is not a selected one); the last checkpoint
of the budget is scored beside it. Each model is scored twice: greedy (the goal's metric,
Wilson intervals) and pass@1 of `training.local.eval_samples` answers per maze sampled at the training
temperature, which is what GRPO optimises (intervals over per-maze rates). Also prints seconds per GRPO step
and writes both fixed-eval curves to bench/local_training.png.

Speed (issue 35): before the budgeted run, GRPO steps per second with the shipped `lean_rollouts` against
TRL's stock generate path (`lean_rollouts: false`, today's trainer before it), same base, settings and seed,
`--speed-steps` steps each, alternated `--speed-rounds` times, no tracker on either side; the figure is the
median over rounds of stock s/step / lean s/step (each run's median step after the first five). Runs its own stack (MLflow + S3) in the data dir; the SFT
base is cached there, so a second run skips SFT.

    .venv/bin/python bench/local_training.py [--budget 300] [--data-dir .rlops/bench]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402
from rlops import stack  # noqa: E402
from rlops.config import Config  # noqa: E402
from rlops.processes import free_port  # noqa: E402
from rlops.eval_table import outcomes  # noqa: E402
from tracker.baseline import compare  # noqa: E402

GOAL = "held-out greedy solve rate after GRPO >= before + 10 points with paired p < 0.01, 256 mazes"
PNG = Path(__file__).with_name("local_training.png")


def evaluate_model(model_dir: Path, adapter_dir: Path | None, task, sources: list[str], local) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from training.evaluation import evaluate
    from training.vision_cache import VisionCache

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    VisionCache.install(model)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    processor = AutoProcessor.from_pretrained(str(model_dir))
    return {source: evaluate(model, processor, task, source, local.eval_samples, local.temperature) for source in sources}


def step_seconds(config: Config, task, base: Path, lean: bool, steps: int) -> float:
    """Median seconds of GRPO steps 6.. of a plain run (no tracker) on `base`, lean rollouts or TRL's stock path."""
    import tempfile

    from transformers import AutoProcessor, TrainerCallback

    from training.local_trainer import GRPO_PROMPTS, grpo_trainer

    local = config.training.local.model_copy(update={"lean_rollouts": lean})
    config = config.model_copy(update={"training": config.training.model_copy(update={"local": local})})
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.started)

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = grpo_trainer(config, task, base, Path(run_dir), steps, [StepTimer()],
                               AutoProcessor.from_pretrained(str(base)), task.train_items(GRPO_PROMPTS))
        trainer.args.save_strategy = "no"
        trainer.train()
    return statistics.median(times[5:])


def plot(result, before: dict, after: dict, heldout_source: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for points, label in ((result.curve, "greedy"), (result.sampled_curve, "sampled pass@1")):
        if points:
            steps, rates = zip(*points)
            ax.plot(steps, rates, marker="o", label=f"fixed eval (64 mazes), {label}")
    for label, res, style in (("held-out before", before[heldout_source], ":"), ("held-out after", after[heldout_source], "--")):
        ax.axhline(res.pass_rate, linestyle=style, color="gray" if "before" in label else "black", label=f"{label} (256)")
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
    parser.add_argument("--speed-steps", type=int, default=60, help="GRPO steps per speed run (0: skip the speed phase)")
    parser.add_argument("--speed-rounds", type=int, default=5, help="stock/lean speed runs alternated this many times "
                        "(this machine has slow phases of minutes: the median of 5 outlasts one)")
    args = parser.parse_args()
    if args.speed_steps and args.speed_steps < 10 or args.speed_rounds < 1:
        parser.error("--speed-steps must be 0 or at least 10 (the first five steps are not timed); --speed-rounds >= 1")

    from training.base import ensure_base
    from training.local_trainer import train

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
        task = config.load_task()
        base = ensure_base(config, task)
        print(f"SFT base: {base} ({time.monotonic() - started:.0f} s, cached after the first run)")
        speed = []  # (stock s/step, lean s/step) per round
        for round_ in range(args.speed_rounds if args.speed_steps else 0):
            speed.append((step_seconds(config, task, base, False, args.speed_steps),
                          step_seconds(config, task, base, True, args.speed_steps)))
            print(f"speed round {round_ + 1}: stock {speed[-1][0]:.4f} s/step, lean {speed[-1][1]:.4f} s/step, "
                  f"{speed[-1][0] / speed[-1][1]:.2f}x (load average {os.getloadavg()[0]:.1f})")
        sets = task.eval_sets()[:2]  # the fixed set and its held-out set
        before = evaluate_model(base, None, task, sets, local)
        run_dir = config.data_path / "runs" / time.strftime("%Y%m%d-%H%M%S")
        result = train(config, run_dir, budget_s=budget)  # the product's step cap: the lr schedule spans it
        best_step = result.best[0]  # what registration picks
        after = evaluate_model(base, run_dir / f"checkpoint-{best_step}" if best_step else None, task, sets, local)
        last = evaluate_model(base, result.adapter_dir, task, sets, local)
    finally:
        stack.down(config)

    print(f"GRPO: {result.steps} steps at {result.seconds_per_step:.3f} s/step (budget {budget:.0f} s of steps; "
          f"{result.seconds:.0f} s wall with the evals between them; load average {os.getloadavg()[0]:.1f})")
    print("fixed-eval curve, greedy: " + ", ".join(f"{s}:{r:.3f}" for s, r in result.curve))
    print("fixed-eval curve, sampled pass@1: " + ", ".join(f"{s}:{r:.3f}" for s, r in result.sampled_curve))
    print(f"after = step {best_step} (best on the fixed set, what registration picks; registered: "
          f"{result.registered_version or result.registration_refused}); last = step {result.steps}")
    for source in sets:
        b, a = before[source], after[source]
        scores = [("greedy", b.pass_rate, b.ci95, a.pass_rate, a.ci95)]
        if b.sampled_rate is not None:
            scores.append((f"sampled x{local.eval_samples}", b.sampled_rate, b.sampled_ci95, a.sampled_rate, a.sampled_ci95))
        for label, rb, cb, ra, ca in scores:
            print(f"{source:<24} n={len(b.rows):<4} {label:<10} before {rb:.3f} [{cb[0]:.3f}, {cb[1]:.3f}]"
                  f"  after {ra:.3f} [{ca[0]:.3f}, {ca[1]:.3f}]  delta {100 * (ra - rb):+.1f} points  "
                  f"beyond the intervals: {'yes' if ca[0] > cb[1] else 'no'}")
    heldout = sets[1]
    for source in sets:
        for label, scored in (("best", after), ("last", last)):
            paired = compare(outcomes(before[source].rows), outcomes(scored[source].rows))
            print(f"{source:<24} greedy paired sign test, {label} checkpoint: {paired.describe()}")
    plot(result, before, after, heldout, PNG)
    print(f"curve written to {PNG}")
    b, a = before[heldout].pass_rate, after[heldout].pass_rate
    print(f"held-out solve rate after/before ratio {a / b if b else float('nan'):.3f}")
    record("local_training.py", a, f"held-out solve rate (256 mazes) of the registered pick (step {best_step} of "
           f"{result.steps})", b, a / b if b else None, GOAL)
    record("local_training.py:last", last[heldout].pass_rate, f"held-out solve rate (256 mazes) of the last "
           f"checkpoint (step {result.steps})", b, last[heldout].pass_rate / b if b else None, "report only")
    sb, sa = before[heldout].sampled_rate, after[heldout].sampled_rate
    if sb is not None:
        record("local_training.py:sampled", sa, f"held-out pass@1 (256 mazes x {local.eval_samples} samples at "
               f"temperature {local.temperature}) after the GRPO budget", sb, sa / sb if sb else None,
               "report only: GRPO's own objective, beside the greedy goal")
    if speed:
        stock, lean = statistics.median(r[0] for r in speed), statistics.median(r[1] for r in speed)
        ratio = statistics.median(r[0] / r[1] for r in speed)
        print(f"GRPO speed: lean {lean:.4f} s/step vs TRL's stock path {stock:.4f} s/step: {ratio:.2f}x steps/s "
              f"(median of {len(speed)} alternated rounds, {args.speed_steps} steps each)")
        record("local_training.py:speedup", ratio, f"x GRPO steps/s, lean rollouts vs TRL's stock generate path "
               f"(median of {len(speed)} alternated rounds of {args.speed_steps} steps; lean {lean:.4f} s/step)",
               stock, ratio, ">= 2x steps/s with the held-out lift still >= +10 points, p < 0.01")
    record("local_training.py:s_per_step", result.seconds_per_step, "s per GRPO step (32 completions, 2 cores)",
           None, None, "report only")


if __name__ == "__main__":
    main()
