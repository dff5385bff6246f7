"""The write-ahead spool: every metric point is appended to a local file before it is sent.

Files (in the tracker's state dir beside the trainer's checkpoints):
- `spool.jsonl`: one line per point, `<seq>\t<REST JSON of the point>`; the sequence number is assigned at
  append time, and the JSON is exactly what the sender posts, so it is encoded once, on append.
- `spool.ack`: the highest sequence number MLflow acknowledged (the sender sends in order).

A restart replays every point above the watermark. Exactly once holds because the timestamp is fixed
at enqueue: MLflow keys a metric row by (key, timestamp, step, value), so a replayed point that had
already landed (acknowledged by the server but not yet recorded here) is dropped by the server.
"""
from __future__ import annotations

import json
import math
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Iterable, NamedTuple

SPOOL_FILE = "spool.jsonl"
ACK_FILE = "spool.ack"


class Point(NamedTuple):
    key: str
    value: float
    timestamp_ms: int
    step: int
    model_id: str | None = None


class Spooled(NamedTuple):
    seq: int
    body: str  # the point as REST `Metric` JSON


@lru_cache(maxsize=65536)
def _json_string(text: str) -> str:
    return json.dumps(text)


def encode(point: Point) -> str:
    """REST `Metric` JSON; non-finite values use protobuf-JSON's string names."""
    value = point.value
    if math.isfinite(value):
        number = repr(value)
    else:
        number = '"NaN"' if math.isnan(value) else ('"Infinity"' if value > 0 else '"-Infinity"')
    body = '{"key":%s,"value":%s,"timestamp":%d,"step":%d' % (_json_string(point.key), number,
                                                               point.timestamp_ms, point.step)
    if point.model_id:
        body += ',"model_id":%s' % _json_string(point.model_id)
    return body + "}"


def decode(body: str) -> Point:
    row = json.loads(body)
    return Point(row["key"], float(row["value"]), int(row["timestamp"]), int(row["step"]), row.get("model_id"))


def _parse_line(line: str) -> Spooled | None:
    seq, sep, body = line.rstrip("\n").partition("\t")
    if not sep:
        return None
    try:
        decode(body)
        return Spooled(int(seq), body)
    except (ValueError, KeyError, TypeError):
        return None  # a torn last line from a crash mid-write: that point was never acknowledged either


class MetricSpool:
    """Append-only point log plus an acknowledgement watermark. Thread-safe."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._path = self.state_dir / SPOOL_FILE
        self._ack_path = self.state_dir / ACK_FILE
        self._lock = threading.Lock()
        self.acked = self._read_ack()
        existing = self._read()
        self._pending_at_open = [s for s in existing if s.seq > self.acked]
        self._next_seq = max((s.seq for s in existing), default=self.acked) + 1
        if existing and not self._pending_at_open:
            self._path.write_text("")  # everything landed; numbering stays monotonic via the watermark
        # O_APPEND + one os.write per call: a kill -9 leaves whole lines in the page cache.
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def unacknowledged(self) -> list[Spooled]:
        """Points from earlier sessions that MLflow never acknowledged, in order (read at open)."""
        return list(self._pending_at_open)

    def append(self, points: Iterable[Point]) -> list[Spooled]:
        """Number, encode and write the points (one write call); returns them as spooled."""
        bodies = [encode(p) for p in points]
        with self._lock:
            first = self._next_seq
            self._next_seq += len(bodies)
            spooled = [Spooled(first + i, body) for i, body in enumerate(bodies)]
            if spooled:
                os.write(self._fd, "".join(f"{s.seq}\t{s.body}\n" for s in spooled).encode())
        return spooled

    def sync(self) -> None:
        """fsync the spool, so it also survives the node (called off the training thread)."""
        os.fsync(self._fd)

    def acknowledge(self, seq: int) -> None:
        if seq <= self.acked:
            return
        tmp = self._ack_path.with_suffix(".tmp")
        tmp.write_text(str(seq))
        os.replace(tmp, self._ack_path)
        self.acked = seq

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass

    def _read_ack(self) -> int:
        try:
            return int(self._ack_path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _read(self) -> list[Spooled]:
        if not self._path.exists():
            return []
        with self._path.open() as fh:
            return [s for line in fh if (s := _parse_line(line)) is not None]
