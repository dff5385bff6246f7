"""Stage times of a full `rlops demo` (SFT base, GRPO, promotion, serving, answer) from an empty data dir,
and the fixed-eval solve rate before/after GRPO. Goal: < 10 min in total after installs on this machine.

Runs on its own ports and data dir, then `rlops down`. Usage: python bench/demo_walltime.py [--fast]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402
from rlops.processes import free_port  # noqa: E402
from rlops.stack import free_s3_port  # noqa: E402

BUDGET_S = 600.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fast", action="store_true", help="time `rlops demo --fast` instead (CI variant, goal < 4 min)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "mlflow.yaml"
        cfg.write_text(yaml.safe_dump({
            "data_dir": str(Path(tmp) / "data"), "server": {"port": free_port()},
            "storage": {"endpoint_url": f"http://127.0.0.1:{free_s3_port()}"},
            "serving": {"port": free_port()}, "hooks": {"port": free_port()},
        }))
        env = dict(os.environ, RLOPS_CONFIG=str(cfg), HF_HUB_OFFLINE="1")
        cmd = [sys.executable, "-m", "rlops", "demo", "--json"] + (["--fast"] if args.fast else [])
        started = time.monotonic()
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            total = time.monotonic() - started
        finally:
            subprocess.run([sys.executable, "-m", "rlops", "down"], env=env, capture_output=True, timeout=300)
    if out.returncode != 0:
        sys.exit(f"rlops demo failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout)
    for stage, seconds in summary["stages"].items():
        print(f"  {seconds:7.1f} s  {stage}")
    budget = 240.0 if args.fast else BUDGET_S
    print(f"total {total:.1f} s (budget {budget:.0f} s: {'met' if total < budget else 'MISSED'}); "
          f"ratio total/budget {total / budget:.2f}")
    print(f"fixed-eval pass rate before GRPO {summary['pass_rate_before']} -> after {summary['pass_rate_after']}; "
          f"served v{summary['served_version']} answered {summary['answer']!r} (solved: {summary['solved']})")
    name = "demo_walltime.py" + (" --fast" if args.fast else "")
    record(name, total, "s", budget, total / budget, f"whole `rlops demo{' --fast' if args.fast else ''}` < {budget:.0f} s after installs (baseline = budget)")


if __name__ == "__main__":
    main()
