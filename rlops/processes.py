"""Supervised child processes recorded in the data dir, so `rlops down` stops what rlops started and nothing else.

A record is `<data_dir>/run/<name>.json` with the pid and the process's create time: a pid reused by an
unrelated process after a reboot or crash does not match the create time and is never signalled.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import psutil


class ProcessError(RuntimeError):
    """A supervised process could not be started or did not become healthy."""


@dataclass
class ProcessRecord:
    name: str
    pid: int
    create_time: float
    argv: list[str]
    log: str
    urls: dict[str, str] = field(default_factory=dict)

    def process(self) -> psutil.Process | None:
        """The live process this record names, or None (exited, or the pid now belongs to someone else)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None


def run_dir(data_path: Path) -> Path:
    return data_path / "run"


def log_dir(data_path: Path) -> Path:
    return data_path / "logs"


def log_path(data_path: Path, name: str) -> Path:
    """Where a process started by rlops (or a command's library output) is logged."""
    return log_dir(data_path) / f"{name}.log"


def _record_path(data_path: Path, name: str) -> Path:
    return run_dir(data_path) / f"{name}.json"


def read_record(data_path: Path, name: str) -> ProcessRecord | None:
    try:
        return ProcessRecord(**json.loads(_record_path(data_path, name).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def list_records(data_path: Path) -> list[ProcessRecord]:
    records = []
    for path in sorted(run_dir(data_path).glob("*.json")):
        record = read_record(data_path, path.stem)
        if record is not None:
            records.append(record)
    return records


def write_record(data_path: Path, record: ProcessRecord) -> None:
    path = _record_path(data_path, record.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=2))
    os.replace(tmp, path)


def record_current_process(data_path: Path, name: str, urls: Mapping[str, str] | None = None) -> ProcessRecord:
    """For a foreground command (`rlops serve`, `rlops hooks serve`) that must be stoppable by `rlops down`."""
    me = psutil.Process()
    record = ProcessRecord(name, me.pid, me.create_time(), me.cmdline(), "", dict(urls or {}))
    write_record(data_path, record)
    return record


def forget(data_path: Path, name: str) -> None:
    _record_path(data_path, name).unlink(missing_ok=True)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


AUTOGROUP = "/proc/{pid}/autogroup"  # a session's niceness under Linux's autogroup scheduling (sched(7))


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The niceness of a process's session under autogroup scheduling; None without it."""
    try:
        fd = os.open(AUTOGROUP.format(pid=pid), os.O_RDONLY)
        try:
            return int(os.read(fd, 256).decode().rsplit("nice", 1)[1])
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return None


def lower_priority(nice: int) -> None:
    """Make the calling process (and what it starts from now on) at least this nice; never raises its priority,
    which only root may do. With autogroup scheduling a process's niceness counts only inside its session, and
    sessions share the cores equally: a session leader (what `start` runs) lowers its session's niceness too.
    Plain os calls only: this runs in a forked child before exec."""
    if nice > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    if os.getsid(0) == os.getpid() and (autogroup_nice() or 0) < nice:
        try:
            fd = os.open(AUTOGROUP.format(pid="self"), os.O_WRONLY)
            try:
                os.write(fd, str(nice).encode())
            finally:
                os.close(fd)
        except OSError:  # no autogroup scheduling here: the process's niceness is all there is
            pass


def start(
    data_path: Path,
    name: str,
    argv: list[str],
    env: Mapping[str, str],
    urls: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    nice: int = 0,
) -> ProcessRecord:
    """Start `argv` detached in its own session with its own log file, and record it; `nice` lowers its
    priority (and its children's)."""
    log_file = log_path(data_path, name)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=str(cwd) if cwd else None,
                preexec_fn=(lambda: lower_priority(nice)) if nice else None,
            )
        except FileNotFoundError:
            raise ProcessError(f"{name}: executable not found: {argv[0]}") from None
    record = ProcessRecord(name, proc.pid, psutil.Process(proc.pid).create_time(), list(argv), str(log_file), dict(urls or {}))
    write_record(data_path, record)
    return record


def wait_healthy(record: ProcessRecord | None, check: Callable[[], bool], timeout_s: float,
                 what: str | None = None) -> float:
    """Poll `check` until it passes and return the seconds waited; fail early, with the log's tail, if the
    process dies. Without a record (waiting on a state, not a process) only the timeout applies."""
    what = what or (record.name if record else "condition")
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if record is not None and record.process() is None:
            raise ProcessError(f"{what} exited during startup; last log lines:\n{log_tail(record)}")
        try:
            if check():
                return time.monotonic() - started
        except Exception:  # noqa: BLE001 - any failure of a health probe means "not yet"
            pass
        time.sleep(0.2)
    tail = f"; last log lines:\n{log_tail(record)}" if record is not None else ""
    raise ProcessError(f"{what} did not become healthy within {timeout_s:.0f}s{tail}")


def log_tail(record: ProcessRecord, lines: int = 15) -> str:
    try:
        text = Path(record.log).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


def stop(data_path: Path, name: str, timeout_s: float = 15.0) -> bool:
    """Stop a recorded process and its descendants (TERM, then KILL). True if something was running."""
    return bool(stop_together(data_path, [name], timeout_s))


def stop_together(data_path: Path, names: Sequence[str], timeout_s: float = 15.0) -> list[str]:
    """Stop recorded processes and their descendants at once: TERM to all, one wait, KILL what is left (their
    shutdowns overlap instead of adding up). Returns the names that were running."""
    records = [record for record in (read_record(data_path, name) for name in names) if record is not None]
    running, family = [], []
    for record in records:
        proc = record.process()
        if proc is None:
            continue
        running.append(record.name)
        try:
            family += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            family.append(proc)
    for p in family:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(family, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    for record in records:
        forget(data_path, record.name)
    return running
