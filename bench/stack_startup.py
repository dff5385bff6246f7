"""Time from `rlops up` to a healthy stack (MLflow + S3), vs a plain `mlflow server` with its defaults.

Goal: < 10 s on this machine. Both are measured in this run from empty data dirs (sqlite migrations
included); figure = median of the runs. Usage: python bench/stack_startup.py [--runs 3]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402

from rlops.processes import free_port  # noqa: E402
from rlops.stack import free_s3_port  # noqa: E402


def time_rlops_up(root: Path) -> float:
    cfg = root / "mlflow.yaml"
    cfg.write_text(yaml.safe_dump({
        "data_dir": str(root / "data"), "server": {"port": free_port()},
        "storage": {"endpoint_url": f"http://127.0.0.1:{free_s3_port()}"},
    }))
    env = dict(os.environ, RLOPS_CONFIG=str(cfg))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlops.cli", "up"], env=env, check=True, capture_output=True)
    elapsed = time.perf_counter() - start
    subprocess.run([sys.executable, "-m", "rlops.cli", "down"], env=env, check=True, capture_output=True)
    return elapsed


def time_plain_mlflow(root: Path) -> float:
    port = free_port()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--port", str(port), "--host", "127.0.0.1",
         "--backend-store-uri", f"sqlite:///{root}/plain.db", "--default-artifact-root", str(root / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("plain mlflow server exited")
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    ours, plain = [], []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            ours.append(time_rlops_up(Path(tmp)))
        with tempfile.TemporaryDirectory() as tmp:
            plain.append(time_plain_mlflow(Path(tmp)))
        print(f"run {i + 1}: rlops up (MLflow + S3, healthy) {ours[-1]:.2f} s | plain mlflow server {plain[-1]:.2f} s")
    figure, baseline = statistics.median(ours), statistics.median(plain)
    ratio = baseline / figure
    print(f"rlops up -> healthy: {figure:.2f} s (median of {args.runs}); plain `mlflow server` defaults: "
          f"{baseline:.2f} s; ratio (baseline / ours) {ratio:.2f}x; goal < 10 s: {'met' if figure < 10 else 'MISSED'}")
    record("stack_startup.py", figure, "s", baseline, ratio, "rlops up to healthy < 10 s")


if __name__ == "__main__":
    main()
