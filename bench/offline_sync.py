"""Sync time of an offline run vs logging the same run online, same server (issue 32).

The run: 1000 steps of 100 metrics, an eval (64-row table) and a checkpoint (4 MB adapter) every 100 steps,
a base eval at step 0, then the registration of the best checkpoint. Online: `RunSession` against the
scratch stack, timed from start to the end of the `with` block (everything landed, the run ended). Offline:
the same calls with `tracking.mode: offline` (timed too, no server), then `rlops runs sync`'s library call
`sync_runs`, timed from call to return (everything landed, registration done, the run ended). Both runs
end in the same MLflow state (tests/test_offline_runs.py checks that). Goal: sync <= 30 s on 2 cores.

Usage: python bench/offline_sync.py [--steps 1000] [--metrics 100]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import record  # noqa: E402
from _scratch import scratch_stack  # noqa: E402

from tracker import RunSession, sync_runs  # noqa: E402

SOURCE = "maze_2d/bench"
EVAL_ITEMS = 64
GOAL_S = 30.0


def adapters(root: Path, count: int) -> list[Path]:
    """Adapter folders of the size of a small LoRA (4 MB of weights), different per checkpoint."""
    out = []
    for i in range(count):
        folder = root / f"adapter-{i}"
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(os.urandom(4 << 20))
        (folder / "adapter_config.json").write_text(json.dumps(
            {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}))
        out.append(folder)
    return out


def the_run(config, run_dir: Path, steps: int, metrics: int, checkpoints: list[Path]) -> RunSession:
    every = steps // len(checkpoints)
    names = [f"policy/m{i:03d}" for i in range(metrics)]
    with RunSession.start(config, run_dir, params={"steps": steps}, run_name="offline-sync-bench") as session:
        session.log_eval(SOURCE, 0.0, [{"id": i, "passed": False, "score": 0.0} for i in range(EVAL_ITEMS)], step=0)
        for step in range(1, steps + 1):
            session.log_metrics({name: step + i / 1000 for i, name in enumerate(names)}, step=step)
            if step % every == 0:
                k = step // every
                session.log_checkpoint(checkpoints[k - 1], step=step)
                solved = min(EVAL_ITEMS, 8 * k)
                session.log_eval(SOURCE, solved / EVAL_ITEMS, [{"id": i, "passed": i < solved, "score": float(i < solved)}
                                                               for i in range(EVAL_ITEMS)], step=step)
        session.register_best()
    return session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--metrics", type=int, default=100)
    parser.add_argument("--checkpoints", type=int, default=10)
    args = parser.parse_args()
    with scratch_stack(registry={"models": ["offline-sync-bench"]}) as (config, root), \
            tempfile.TemporaryDirectory() as tmp:
        config.tracking.system_metrics = False  # the machine's samples are not part of either path's cost
        config.tracking.flush_timeout_s = 600
        ckpts = adapters(Path(tmp) / "adapters", args.checkpoints)

        t0 = time.perf_counter()
        online = the_run(config, Path(tmp) / "online", args.steps, args.metrics, ckpts)
        online_s = time.perf_counter() - t0

        offline_config = config.model_copy(deep=True)
        offline_config.tracking.mode = "offline"
        t0 = time.perf_counter()
        the_run(offline_config, Path(tmp) / "offline", args.steps, args.metrics, ckpts)
        offline_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report, = sync_runs(config, [Path(tmp) / "offline"], timeout_s=600)
        sync_s = time.perf_counter() - t0

    points = args.steps * args.metrics
    assert not report.left and report.registered and online.registered, (report, online.registered)
    print(f"run: {args.steps} steps x {args.metrics} metrics = {points} points, {args.checkpoints} checkpoints, "
          f"{args.checkpoints + 1} evals")
    print(f"online logging (start -> all landed, run ended): {online_s:7.1f} s")
    print(f"offline logging (no server):                     {offline_s:7.1f} s")
    print(f"sync of the offline run (-> all landed, registered {report.registered}): {sync_s:7.1f} s "
          f"= {sync_s / online_s:.2f}x online (goal <= {GOAL_S:.0f} s)")
    record("offline_sync.py", sync_s, "s", online_s, sync_s / online_s,
           f"sync of a {args.steps}-step run ({points} points, {args.checkpoints} checkpoints) <= {GOAL_S:.0f} s")


if __name__ == "__main__":
    main()
