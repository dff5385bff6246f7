"""`rlops runs flush`: land what a crashed or stopped run left in its run dir, and say what landed."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException

from rlops.config import Config, mask_uri
from tracker import state
from tracker.lock import RunDirLock
from tracker.session import RunSession


@dataclass(frozen=True)
class FlushReport:
    run_id: str
    points_landed: int
    checkpoints_landed: int
    registered: str | None  # "<model> v<N>" when a pending registration completed
    ended: str | None  # the end status the flush recorded on the server
    left: str  # what is still pending, in words ('' = drained)


def flush_run_dir(config: Config, run_dir: Path, timeout_s: float | None = None) -> FlushReport:
    """Land what a crashed or stopped run left in `run_dir` (points, checkpoints, a pending registration,
    an end status the server missed). Refused while a live process holds the run dir."""
    run_dir = Path(run_dir)
    lock = RunDirLock(run_dir, config.tracking.lock_lease_s)
    lock.acquire()
    try:
        try:
            session = RunSession.open_stored(config, run_dir, lock)
        except MlflowException as exc:
            raise ConnectionError(f"cannot reach the MLflow run at {mask_uri(config.tracking_uri)}: "
                                  f"{exc.message}") from exc
        end = state.intended_end(run_dir)
        left = session.drain(config.tracking.flush_timeout_s if timeout_s is None else timeout_s)
        registered = session.registered
        return FlushReport(session.run_id, session.sent_points, session.landed_checkpoints,
                           f"{registered.name} v{registered.version}" if registered else None,
                           end["status"] if end and state.intended_end(run_dir) is None else None, left)
    finally:
        lock.release()
