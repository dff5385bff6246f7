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
from typing import NamedTuple

SPOOL_FILE = "spool.jsonl"
ACK_FILE = "spool.ack"


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


def encode(key: str, value: float, timestamp_ms: int, step: int, model_id: str | None = None) -> str:
    """REST `Metric` JSON; non-finite values use protobuf-JSON's string names."""
    if math.isfinite(value):
        number = repr(value)
    else:
        number = '"NaN"' if math.isnan(value) else ('"Infinity"' if value > 0 else '"-Infinity"')
    body = '{"key":%s,"value":%s,"timestamp":%d,"step":%d' % (_json_string(key), number, timestamp_ms, step)
    if model_id:
        body += ',"model_id":%s' % _json_string(model_id)
    return body + "}"


def decode(body: str) -> Point:
    row = json.loads(body)
    return Point(row["key"], float(row["value"]), int(row["timestamp"]), int(row["step"]), row.get("model_id"))


def _parse_line(line: str) -> tuple[int, str] | None:
    seq, sep, body = line.rstrip("\n").partition("\t")
    if not sep:
        return None
    try:
        decode(body)
        return int(seq), body
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
        self._pending_at_open = [(seq, body) for seq, body in existing if seq > self.acked]
        self._next_seq = max((seq for seq, _ in existing), default=self.acked) + 1
        if existing and not self._pending_at_open:
            self._path.write_text("")  # everything landed; numbering stays monotonic via the watermark
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
        """Number and write encoded points (one write call)."""
        with self._lock:
            chunk = Chunk(self._next_seq, bodies)
            self._next_seq += len(bodies)
            if bodies:
                os.write(self._fd, "".join([f"{chunk.first_seq + i}\t{b}\n" for i, b in enumerate(bodies)]).encode())
        return chunk

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

    def _read(self) -> list[tuple[int, str]]:
        if not self._path.exists():
            return []
        with self._path.open() as fh:
            return [row for line in fh if (row := _parse_line(line)) is not None]
