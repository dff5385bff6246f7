"""The tracker's files in a run dir, and what they say without asking the server (`rlops runs status`).

`<run_dir>/.rlops-tracker/` holds one MLflow run's state: `run.json` (its id), the spool and its watermark,
`deadletter.jsonl`, `jobs/` (uploads and registrations not yet done), `evals.jsonl` (eval links) and
`end.json` (the status the run should end with, kept until the server has it); an offline run also
`pending_run.json` (`tracker.offline`). Starting a new run in the same run dir first moves that folder to
`<run_dir>/previous-<run_id>/`.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tracker import offline
from tracker.checkpoints import JOBS_DIR
from tracker.lock import Holder, read_holder
from tracker.sender import dead_letter_count
from tracker.spool import ACK_FILE, SPOOL_FILE, write_atomically

STATE_DIR = ".rlops-tracker"
RUN_FILE = "run.json"
END_FILE = "end.json"
EVALS_FILE = "evals.jsonl"
PREVIOUS_PREFIX = "previous-"
REMOTE_STATE_DIR = "tracker-state"  # under the data dir, for runs whose checkpoints live on S3


def state_dir(run_dir: Path) -> Path:
    return Path(run_dir) / STATE_DIR


def stored_run(run_dir: Path) -> dict | None:
    path = state_dir(run_dir) / RUN_FILE
    return json.loads(path.read_text()) if path.exists() else None


def stored_run_id(run_dir: Path) -> str | None:
    run = stored_run(run_dir)
    return run["run_id"] if run else None


def write_run(run_dir: Path, record: dict) -> None:
    write_atomically(state_dir(run_dir) / RUN_FILE, json.dumps(record))


def intended_end(run_dir: Path) -> dict | None:
    """`{"status", "tags", "end_time_ms"}` of an end the server has not recorded yet (the server was down at
    the end, or the run is offline)."""
    path = state_dir(run_dir) / END_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def record_intended_end(run_dir: Path, status: str, tags: dict[str, str]) -> None:
    write_atomically(state_dir(run_dir) / END_FILE, json.dumps({"status": status, "tags": tags,
                                                               "end_time_ms": int(time.time() * 1000)}))


def clear_intended_end(run_dir: Path) -> None:
    (state_dir(run_dir) / END_FILE).unlink(missing_ok=True)


def archive_state(run_dir: Path, run_id: str) -> Path:
    """Move a finished run's state aside so a new run can start in `run_dir`; returns the folder it is in
    (the trainer moves that run's checkpoints there too)."""
    dest = Path(run_dir) / f"{PREVIOUS_PREFIX}{run_id}"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.move(str(state_dir(run_dir)), str(dest / STATE_DIR))
    return dest


def local_state_dir(data_path: Path, checkpoint_uri: str) -> Path:
    """A local run dir for a remote checkpoint location (`s3://bucket/ckpts`), keyed by the URI, so a
    restart of the same job on this machine finds the same state; never a folder named `s3:`."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", checkpoint_uri.split("://", 1)[-1]).strip("-")[:80]
    digest = hashlib.sha256(checkpoint_uri.encode()).hexdigest()[:12]
    return Path(data_path) / REMOTE_STATE_DIR / f"{readable}-{digest}"


@dataclass(frozen=True)
class RunDirStatus:
    run_dir: Path
    run_id: str | None
    offline_id: str | None  # an offline run's stable id (`tracker.offline`)
    unsynced: bool  # an offline run not bound to a server run yet, or with params/tags not sent yet
    spooled_points: int  # written to the spool, not yet acknowledged by MLflow
    dead_letters: int
    pending_checkpoints: int
    pending_tables: int
    pending_registrations: int
    last_ack_at: float | None  # when MLflow last acknowledged points (the watermark file's mtime)
    intended_end: str | None
    holder: Holder | None

    @property
    def drained(self) -> bool:
        return not (self.unsynced or self.spooled_points or self.pending_checkpoints or self.pending_tables
                    or self.pending_registrations or self.intended_end)


def run_dir_status(run_dir: Path) -> RunDirStatus:
    """Read the run dir's state files only (works while the server or the trainer is down)."""
    state = state_dir(run_dir)
    if not state.is_dir():
        raise FileNotFoundError(f"{run_dir} holds no tracker state ({STATE_DIR}/ is missing)")
    try:
        acked = int((state / ACK_FILE).read_text().strip())
        last_ack_at = (state / ACK_FILE).stat().st_mtime
    except (FileNotFoundError, ValueError):
        acked, last_ack_at = 0, None
    spooled = 0
    if (state / SPOOL_FILE).exists():
        with open(state / SPOOL_FILE, "rb") as fh:
            for line in fh:
                seq, sep, _ = line.partition(b"\t")
                if sep and seq.isdigit() and int(seq) > acked:
                    spooled += 1
    jobs = [p.stem for p in (state / JOBS_DIR).glob("*.json")] if (state / JOBS_DIR).is_dir() else []
    end = intended_end(run_dir)
    record = stored_run(run_dir) or {}
    return RunDirStatus(
        run_dir=Path(run_dir), run_id=record.get("run_id"), offline_id=record.get("offline_id"),
        unsynced=offline.unbound(record) or offline.has_pending(state), spooled_points=spooled,
        dead_letters=dead_letter_count(state),
        pending_checkpoints=sum("-ckpt-" in j for j in jobs), pending_tables=sum(j.endswith("-table") for j in jobs),
        pending_registrations=sum(j.endswith("-register") for j in jobs), last_ack_at=last_ack_at,
        intended_end=end["status"] if end else None, holder=read_holder(run_dir))
