"""The write-ahead spool: every metric point is appended to a local file before it is sent.

Files (in the tracker's state dir beside the trainer's checkpoints):
- `spool.jsonl`: one line per point, `<seq>\t<REST JSON of the point>`; the sequence number is assigned at
  append time, and the JSON is exactly what the sender posts, so it is encoded once, on append.
- `spool.ack`: the highest sequence number MLflow acknowledged (the sender sends in order).
- `spool.last_step`: the highest step of any point spooled by earlier sessions of this run (the spool file
  is emptied once everything landed, so the step a resumed run continues after is kept here).

The file is emptied when a session opens it with everything acknowledged, and during a session whenever the
sender has caught up and the file holds more than COMPACT_BYTES: a long run's spool stays bounded on disk.

A restart replays every point above the watermark. Exactly once holds because the timestamp is fixed
at enqueue: MLflow keys a metric row by (key, timestamp, step, value), so a replayed point that had
already landed (acknowledged by the server but not yet recorded here) is dropped by the server.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

SPOOL_FILE = "spool.jsonl"
ACK_FILE = "spool.ack"
LAST_STEP_FILE = "spool.last_step"
COMPACT_BYTES = 4 << 20


class Point(NamedTuple):
    key: str
    value: float
    timestamp_ms: int
    step: int
    model_id: str | None = None


class Chunk(NamedTuple):
    """Consecutive spooled points: `bodies[i]` has sequence number `first_seq + i`. The training thread
    hands over one chunk per call, not one object per point, so it feeds the garbage collector little."""

    first_seq: int
    bodies: list[str]  # each point as REST `Metric` JSON

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.bodies) - 1


@lru_cache(maxsize=65536)
def _json_string(text: str) -> str:
    return json.dumps(text)


def encode(key: str, value: float, timestamp_ms: int, step: int, model_id: str | None = None,
           dataset: tuple[str, str] | None = None) -> str:
    """REST `Metric` JSON; non-finite values use protobuf-JSON's string names. `dataset`: the (name, digest)
    of the eval set an eval point was measured on."""
    if math.isfinite(value):
        number = repr(value)
    else:
        number = '"NaN"' if math.isnan(value) else ('"Infinity"' if value > 0 else '"-Infinity"')
    body = '{"key":%s,"value":%s,"timestamp":%d,"step":%d' % (_json_string(key), number, timestamp_ms, step)
    if model_id:
        body += ',"model_id":%s' % _json_string(model_id)
    if dataset:
        body += ',"dataset_name":%s,"dataset_digest":%s' % (_json_string(dataset[0]), _json_string(dataset[1]))
    return body + "}"


def decode(body: str) -> Point:
    row = json.loads(body)
    return Point(row["key"], float(row["value"]), int(row["timestamp"]), int(row["step"]), row.get("model_id"))


def _parse_line(line: str) -> tuple[int, str, int] | None:
    """(seq, body, step) of one spool line; None for a torn line."""
    seq, sep, body = line.rstrip("\n").partition("\t")
    if not sep:
        return None
    try:
        return int(seq), body, decode(body).step
    except (ValueError, KeyError, TypeError):
        return None  # a torn last line from a crash mid-write: that point was never acknowledged either


def drop_torn_tail(path: Path) -> None:
    """Cut a torn last line (a crash mid-write, or a short write on a full disk) before appending, so the
    next whole line does not land on the same line and get lost with it."""
    try:
        with open(path, "rb+") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return
            fh.seek(max(0, size - 65536))
            tail = fh.read()
            if tail.endswith(b"\n"):
                return
            cut = tail.rfind(b"\n")
            fh.truncate(size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= 65536 else size))
    except FileNotFoundError:
        pass


def append_whole(fd: int, data: bytes | bytearray) -> None:
    """One O_APPEND write of `data`, all or nothing: a short write (the disk filled mid-way) is cut back
    and raised, so a file never holds part of an append (a resumed run would count a half-spooled step
    as logged)."""
    written = os.write(fd, data)
    if written < len(data):
        os.ftruncate(fd, os.fstat(fd).st_size - written)
        raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)")


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class MetricSpool:
    """Append-only point log plus an acknowledgement watermark. Thread-safe."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._path = self.state_dir / SPOOL_FILE
        self._ack_path = self.state_dir / ACK_FILE
        self._lock = threading.Lock()
        self._closed = False
        self.acked = _read_int(self._ack_path, 0)
        existing = self._read()
        self._pending_at_open = [(seq, body) for seq, body, _ in existing if seq > self.acked]
        self._next_seq = max((seq for seq, _, _ in existing), default=self.acked) + 1
        self.previous_last_step = max([_read_int(state_dir / LAST_STEP_FILE, -1)] + [s for _, _, s in existing])
        if existing:
            write_atomically(state_dir / LAST_STEP_FILE, str(self.previous_last_step))
        if existing and not self._pending_at_open:
            self._path.write_text("")  # everything landed; numbering stays monotonic via the watermark
        self._unwritten = bytearray()  # spool bytes a full disk held back, in order
        self._written_seq = self.last_seq  # the last point whose line is in the file
        self.last_error: str | None = None
        drop_torn_tail(self._path)
        # O_APPEND + one os.write per call: a kill -9 leaves whole lines in the page cache.
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def unacknowledged(self) -> list[Chunk]:
        """Points from earlier sessions that MLflow never acknowledged, in order (read at open)."""
        chunks: list[Chunk] = []
        for seq, body in self._pending_at_open:
            if chunks and chunks[-1].last_seq + 1 == seq:
                chunks[-1].bodies.append(body)
            else:
                chunks.append(Chunk(seq, [body]))
        return chunks

    def append(self, bodies: list[str]) -> Chunk:
        """Number and write encoded points (one write call). A failed or short write (disk full) never
        reaches the training thread: the rest stays buffered in order, and `sync()` (the sender, before
        it sends) writes it out, so a point is never sent before it is in the spool file; a crash meanwhile
        loses only points that never landed, which the resumed trainer logs again."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the spool is closed: the run session has ended")
            chunk = Chunk(self._next_seq, bodies)
            self._next_seq += len(bodies)
            if bodies:
                self._unwritten += "".join([f"{chunk.first_seq + i}\t{b}\n" for i, b in enumerate(bodies)]).encode()
                self._write_unwritten()
        return chunk

    def sync(self) -> None:
        """Write out what a full disk held back, then fsync, so every point appended so far survives the
        node (called off the training thread). Raises OSError while the disk is still full."""
        with self._lock:
            if not self._write_unwritten():
                raise OSError(errno.ENOSPC, f"{len(self._unwritten)} bytes of the spool {self._path} still unwritten")
        os.fsync(self._fd)

    def _write_unwritten(self) -> bool:
        """(Under the lock) write the buffered bytes; True once none are left."""
        try:
            if self._unwritten:
                append_whole(self._fd, self._unwritten)
                self._unwritten.clear()
            self._written_seq = self._next_seq - 1
            self.last_error = None
            return True
        except OSError as exc:
            if self.last_error is None:
                log.error("cannot write the metric spool %s (%s): points wait in memory (training goes on) and "
                          "are sent once they are written", self._path, exc)
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False

    def acknowledge(self, seq: int) -> None:
        """Record the watermark, then empty the file if it is large and every line in it is acknowledged;
        raises OSError (disk full) with the watermark unchanged."""
        if seq <= self.acked:
            return
        write_atomically(self._ack_path, str(seq))
        self.acked = seq
        self._compact()

    def _compact(self) -> None:
        """Empty a caught-up file larger than COMPACT_BYTES. Its highest step goes to LAST_STEP_FILE first
        (read outside the lock: acknowledged lines never change), so a crash at any point leaves either the
        old lines, all acknowledged (dropped at the next open), or an empty file and the step."""
        with self._lock:
            size = os.fstat(self._fd).st_size
            if self._closed or size <= COMPACT_BYTES or self._unwritten or self._written_seq > self.acked:
                return
        # LAST_STEP_FILE already holds the earlier sessions' last step; a line appended
        # meanwhile only raises the step, and the size check below then keeps the file
        last_step = max([_read_int(self.state_dir / LAST_STEP_FILE, -1), *(step for _, _, step in self._read())])
        write_atomically(self.state_dir / LAST_STEP_FILE, str(last_step))
        with self._lock:  # only if nothing was appended meanwhile; else the next acknowledgement tries again
            if not self._closed and os.fstat(self._fd).st_size == size and not self._unwritten:
                os.ftruncate(self._fd, 0)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                os.close(self._fd)
            except OSError:
                pass

    def _read(self) -> list[tuple[int, str, int]]:
        if not self._path.exists():
            return []
        with self._path.open() as fh:
            return [row for line in fh if (row := _parse_line(line)) is not None]


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return default
