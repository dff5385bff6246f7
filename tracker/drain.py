"""`rlops runs flush` and `rlops runs sync`: land what a crashed, stopped or offline run left in its run dir
(or a bundle of it), and say what landed."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException

from rlops.config import Config, mask_uri
from tracker import state
from tracker.bundle import unpack_bundle
from tracker.lock import RunDirLock
from tracker.session import RunSession


@dataclass(frozen=True)
class FlushReport:
    run_dir: Path
    run_id: str
    offline_id: str | None  # set for a run that started offline
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
        return FlushReport(run_dir, session.run_id, (state.stored_run(run_dir) or {}).get("offline_id"),
                           session.sent_points, session.landed_checkpoints,
                           f"{registered.name} v{registered.version}" if registered else None,
                           end["status"] if end and state.intended_end(run_dir) is None else None, left)
    finally:
        lock.release()


def sync_runs(config: Config, sources: list[Path], timeout_s: float | None = None) -> list[FlushReport]:
    """Replay runs into MLflow: each source is a run dir or a bundle (`tracker.bundle`), checked whole and
    unpacked under the data dir first. An offline run becomes the server run that carries its offline id
    (made on the first sync), so syncing again, or after a sync was killed, gives the same one run."""
    run_dirs = [unpack_bundle(source, config.data_path) if Path(source).is_file() else Path(source)
                for source in sources]  # every bundle is checked before anything is logged
    return [flush_run_dir(config, run_dir, timeout_s) for run_dir in run_dirs]
