"""One writer per run dir: a lock file with a lease, renewed by the holder while it runs.

A second process (an old pod still terminating, a user's second `rlops train`) is refused with the holder's
pid, host and start time. A holder that stops renewing (kill -9, node lost) loses the lock when its lease
runs out; on the same host a holder whose pid is gone loses it at once (kill -9 and an immediate restart).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = ".rlops-tracker.lock"  # beside the state dir, so a state dir can be archived while held


class RunDirBusy(RuntimeError):
    """Another live process holds the run dir."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    since: float
    lease_until: float
    token: str

    def describe(self) -> str:
        return (f"pid {self.pid} on host {self.host} since {_iso(self.since)} "
                f"(lease until {_iso(self.lease_until)})")


def read_holder(run_dir: Path) -> Holder | None:
    try:
        data = json.loads((Path(run_dir) / LOCK_FILE).read_text())
        return Holder(int(data["pid"]), str(data["host"]), float(data["since"]), float(data["lease_until"]),
                      str(data["token"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None  # absent, or torn by a crash mid-write: nobody holds it


def holder_is_live(holder: Holder, now: float) -> bool:
    if holder.lease_until <= now:
        return False
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


class RunDirLock:
    """`acquire()` or raise RunDirBusy; `start_renewing()` keeps the lease; `release()` at the end."""

    def __init__(self, run_dir: Path, lease_s: float):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.lease_s = lease_s
        self._token = uuid.uuid4().hex
        self._since = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            holder = read_holder(self.run_dir)
            if holder is not None and holder.token != self._token and holder_is_live(holder, time.time()):
                raise RunDirBusy(f"run dir {self.run_dir} is in use by {holder.describe()}; stop that process, "
                                 f"or wait for its lease to run out")
            if self.path.exists():
                # Move the stale file aside first: of two processes taking over, only one rename succeeds.
                stale = self.path.with_name(f"{self.path.name}.stale-{self._token}")
                try:
                    os.rename(self.path, stale)
                except FileNotFoundError:
                    continue
                stale.unlink(missing_ok=True)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue  # another process got there first: look at it again
            with os.fdopen(fd, "w") as fh:
                fh.write(self._record())
            return
        raise RunDirBusy(f"run dir {self.run_dir}: another process keeps taking the lock {self.path}")

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="rlops-tracker-lease", daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        """Extend the lease; False (and nothing written) when another process took the lock over."""
        holder = read_holder(self.run_dir)
        if holder is None or holder.token != self._token:
            return False
        tmp = self.path.with_name(f"{self.path.name}.{self._token}.tmp")
        tmp.write_text(self._record())
        os.replace(tmp, self.path)
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder = read_holder(self.run_dir)
        if holder is not None and holder.token == self._token:
            self.path.unlink(missing_ok=True)

    def _record(self) -> str:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": self._since,
                           "lease_until": time.time() + self.lease_s, "token": self._token})

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not self.renew():
                    log.error(
                        "lost the lock on %s to another process; this process should stop writing", self.run_dir)
                    return
            except OSError as exc:  # a full disk: the lease may lapse; keep trying
                log.error("cannot renew the lock on %s: %s", self.run_dir, exc)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
