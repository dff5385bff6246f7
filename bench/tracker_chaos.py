"""Chaos run of the tracker: N >= 20 injected faults in one tracked training run, then count what MLflow holds.

A synthetic trainer (20 metrics per 0.1 s step, a checkpoint + eval every 10 steps, deterministic values,
resuming from its latest logged checkpoint like the local trainer) runs as a child process against a
scratch MLflow server while this script injects, in a seeded random order: the server frozen (SIGSTOP,
one of 60 s and several of 3 s), the server killed (kill -9) and restarted, the trainer killed (kill -9)
mid-step and restarted on the same run dir, and the tracker's disk full (a small tmpfs filled for 3 s;
needs root, otherwise those faults become trainer kills). After the last fault the trainer stops at its
next checkpoint, registers the best one and finishes; `flush_run_dir` lands any rest.

Figures: points lost, points duplicated, wrong registrations (the `candidate` version is not the best
checkpoint the trainer reached). Goal: all 0. The baseline is the number of points the trainer logged.

Usage: python bench/tracker_chaos.py [--faults 20] [--seed 7]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlops.layout import TAG_STEP  # noqa: E402

KEYS = [f"chaos/m{i:02d}" for i in range(20)]
SOURCE = "maze_2d/chaos"
STEP_S = 0.1
CKPT_EVERY = 10


def value(step: int, i: int) -> float:
    return step + i / 100


def score(step: int, ckpt_every: int = CKPT_EVERY) -> float:
    """A deterministic eval score per checkpoint whose best is not the last one."""
    return ((step // ckpt_every) * 37 % 101) / 101


# ------------------------------------------------------------------------------------------- trainer


def trainer(config_path: str, run_dir: str, ckpt_dir: str, stop_file: str, ckpt_every: int = CKPT_EVERY) -> None:
    progress = Path(stop_file).with_name("progress")
    from rlops.config import load_config
    from tracker import RunSession

    cfg, ckpts = load_config(config_path, environ={}), Path(ckpt_dir)
    with RunSession.start(cfg, Path(run_dir)) as session:
        done = [s for s in session.checkpoint_steps if (ckpts / f"ckpt-{s}" / "adapter_config.json").is_file()]
        step = max(done, default=0)
        while True:
            step += 1
            time.sleep(STEP_S)  # "training"
            session.log_metrics({k: value(step, i) for i, k in enumerate(KEYS)}, step=step)
            with open(progress, "a") as fh:  # tells the orchestrator that training moves (outside the tmpfs)
                fh.write(f"{step}\n")
            if step % ckpt_every:
                continue
            folder = ckpts / f"ckpt-{step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "adapter_model.safetensors").write_bytes(f"weights of step {step}".encode() * 64)
            (folder / "adapter_config.json").write_text(json.dumps({"step": step}))
            session.log_checkpoint(folder, step=step)
            session.log_eval(SOURCE, score(step, ckpt_every), [], step=step)
            if os.path.exists(stop_file):
                break
        version = session.register_best(SOURCE)
        print(f"DONE {step} {version.version if version else 'pending'}", flush=True)


# ------------------------------------------------------------------------------------------- faults


def fill_disk(tmpfs: Path, seconds: float, wait) -> None:
    """Fill `tmpfs` to the last byte, `wait(seconds)`, free it again."""
    filler = tmpfs / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass
    wait(seconds)
    filler.unlink()


class Chaos:
    def __init__(self, config, config_path: Path, root: Path, tmpfs: Path | None, ckpt_every: int = CKPT_EVERY):
        self.config, self.config_path, self.root, self.ckpt_every = config, config_path, root, ckpt_every
        self.run_dir = (tmpfs or root) / "run"
        self.ckpt_dir, self.stop_file = root / "ckpts", root / "stop"
        self.tmpfs = tmpfs
        self.child: subprocess.Popen | None = None
        self.restarts = 0
        self.final: str | None = None

    def start_trainer(self) -> None:
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--trainer", str(self.config_path), str(self.run_dir), str(self.ckpt_dir),
             str(self.stop_file), "--ckpt-every", str(self.ckpt_every)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def keep_trainer_running(self) -> None:
        """Restart the trainer if it died (killed, or crashed on the full disk)."""
        if self.child is not None and self.child.poll() is not None:
            out = self.child.stdout.read()
            if self.child.returncode == 0 and out.startswith("DONE"):
                self.final = out.strip()
                return
            self.restarts += 1
            self.start_trainer()

    def steps_logged(self) -> int:
        path = self.root / "progress"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def train_a_while(self, steps: int, bound_s: float = 120.0) -> None:
        """Let the trainer log `steps` more steps (a restart takes seconds here), within a bound."""
        target, deadline = self.steps_logged() + steps, time.monotonic() + bound_s
        while self.steps_logged() < target and time.monotonic() < deadline:
            self.wait(0.2)

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.keep_trainer_running()
            time.sleep(0.2)

    def server_pgid(self) -> int:
        from rlops import processes

        return processes.read_record(self.config.data_path, "mlflow").pid  # its own session: pgid = pid

    def inject(self, fault: str) -> None:
        from rlops import stack

        if fault == "trainer_kill":
            self.child.send_signal(signal.SIGKILL)
            self.child.wait()
            self.keep_trainer_running()
        elif fault.startswith("server_stop"):
            pgid = self.server_pgid()
            os.killpg(pgid, signal.SIGSTOP)
            self.wait(60.0 if fault == "server_stop_60" else 3.0)
            os.killpg(pgid, signal.SIGCONT)
        elif fault == "server_kill":
            os.killpg(self.server_pgid(), signal.SIGKILL)
            self.wait(2.0)
            stack.up(self.config, timeout_s=180)
        elif fault == "disk_full":
            fill_disk(self.tmpfs, 3.0, self.wait)


def count(config, run_dir: Path, final_step: int, ckpt_every: int = CKPT_EVERY) -> dict:
    from mlflow import MlflowClient

    from tracker.state import stored_run_id

    client = MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
    run_id = stored_run_id(run_dir)
    expected = {(k, s) for k in KEYS for s in range(1, final_step + 1)}
    expected |= {(f"eval/{SOURCE}/avg_score", s) for s in range(ckpt_every, final_step + 1, ckpt_every)}
    seen: Counter = Counter()
    wrong_values = 0
    for key in KEYS + [f"eval/{SOURCE}/avg_score"]:
        for m in client.get_metric_history(run_id, key):
            seen[(key, m.step)] += 1
            want = score(m.step, ckpt_every) if key.startswith("eval/") else value(m.step, KEYS.index(key))
            wrong_values += abs(m.value - want) > 1e-9
    lost = len(expected - set(seen))
    duplicated = sum(n - 1 for n in seen.values() if n > 1) + sum(n for p, n in seen.items() if p not in expected)
    best = max(range(ckpt_every, final_step + 1, ckpt_every), key=lambda s: (score(s, ckpt_every), s))
    try:
        candidate = client.get_model_version_by_alias(config.registered_model, "candidate")
        wrong = int(candidate.tags.get(TAG_STEP) != str(best))
    except Exception:  # noqa: BLE001 - no candidate at all is a wrong registration too
        wrong = 1
    missing = sorted(expected - set(seen))
    if missing:
        print(f"missing points (first 10): {missing[:10]}")
    return {"run_id": run_id, "expected": len(expected), "lost": lost, "duplicated": duplicated,
            "wrong_values": wrong_values, "wrong_registrations": wrong, "best_step": best,
            "status": client.get_run(run_id).info.status}


def mount_tmpfs(path: Path) -> Path | None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], capture_output=True)
    return path if done.returncode == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--trainer", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-every", type=int, default=CKPT_EVERY, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer(*args.trainer, ckpt_every=args.ckpt_every)
        return

    from _results import record
    from _scratch import scratch_stack

    from tracker import flush_run_dir, run_dir_status

    tracking = {"experiment": "bench-chaos", "request_timeout_s": 5.0, "retry_max_backoff_s": 2.0,
                "flush_timeout_s": 30.0, "heartbeat_interval_s": 5.0}
    with scratch_stack(tracking=tracking, registry={"models": ["chaos"]}) as (config, root):
        tmpfs = mount_tmpfs(root / "tmpfs")
        chaos = Chaos(config, root / "chaos.json", root, tmpfs)
        try:
            kinds = ["server_stop_60"] + ["server_kill"] * 3 + ["server_stop"] * 5
            kinds += ["disk_full" if tmpfs else "trainer_kill"] * 3
            kinds += ["trainer_kill"] * max(0, args.faults - len(kinds))
            rng = random.Random(args.seed)
            rng.shuffle(kinds)
            chaos.config_path.write_text(json.dumps(config.model_dump(mode="json")))
            started = time.monotonic()
            chaos.start_trainer()
            for i, fault in enumerate(kinds):
                chaos.train_a_while(rng.randint(5, 25))  # kills land at random points of a step and a cycle
                print(f"[{time.monotonic() - started:6.1f}s] fault {i + 1}/{len(kinds)}: {fault}", flush=True)
                chaos.inject(fault)
            chaos.stop_file.write_text("stop")
            while chaos.final is None:
                chaos.wait(1.0)
            final_step = int(chaos.final.split()[1])
            report = flush_run_dir(config, chaos.run_dir, timeout_s=120)  # what the last session left, if any
            counts = count(config, chaos.run_dir, final_step)
            counts["dead_letters"] = run_dir_status(chaos.run_dir).dead_letters
            elapsed = time.monotonic() - started
        finally:
            if chaos.child is not None and chaos.child.poll() is None:
                chaos.child.kill()
                chaos.child.wait()
            if tmpfs:
                subprocess.run(["umount", str(tmpfs)], capture_output=True)
    bad = counts["lost"] + counts["duplicated"] + counts["wrong_registrations"] + counts["wrong_values"]
    print(f"{len(kinds)} faults ({', '.join(f'{k} x{n}' for k, n in Counter(kinds).items())}) in {elapsed:.0f} s, "
          f"{chaos.restarts} trainer restarts, {final_step} steps; trainer said {chaos.final!r}; final flush: "
          f"{report.points_landed} points, left {report.left or 'nothing'}")
    print(f"points expected {counts['expected']}: lost {counts['lost']}, duplicated {counts['duplicated']}, "
          f"wrong values {counts['wrong_values']}, dead letters {counts['dead_letters']}; wrong registrations {counts['wrong_registrations']} (best step "
          f"{counts['best_step']}); run {counts['status']}; goal all 0: {'met' if bad == 0 else 'MISSED'}")
    record("tracker_chaos.py", bad, f"points lost + duplicated + wrong registrations after {len(kinds)} faults "
           f"(lost {counts['lost']}, duplicated {counts['duplicated']}, wrong registrations "
           f"{counts['wrong_registrations']})", counts["expected"], bad / counts["expected"], "0 after >= 20 faults")


if __name__ == "__main__":
    main()
