"""The write-ahead spool: every metric point is appended to a local file before it is sent.

Files (in the tracker's state dir beside the trainer's checkpoints):
- `spool.jsonl`: one JSON line per point, with a sequence number assigned at append time.
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
from dataclasses import dataclass
from pathlib import Path

SPOOL_FILE = "spool.jsonl"
ACK_FILE = "spool.ack"


@dataclass(frozen=True)
class Point:
    key: str
    value: float
    timestamp_ms: int
    step: int
    model_id: str | None = None
    seq: int = 0

    def to_rest(self) -> dict:
        """The REST `Metric` shape; non-finite values use protobuf-JSON names."""
        value: float | str = self.value
        if math.isnan(self.value):
            value = "NaN"
        elif math.isinf(self.value):
            value = "Infinity" if self.value > 0 else "-Infinity"
        body = {"key": self.key, "value": value, "timestamp": self.timestamp_ms, "step": self.step}
        if self.model_id:
            body["model_id"] = self.model_id
        return body


def _encode(point: Point) -> str:
    row = {"s": point.seq, "k": point.key, "v": point.value, "t": point.timestamp_ms, "p": point.step}
    if point.model_id:
        row["m"] = point.model_id
    return json.dumps(row, separators=(",", ":"))  # NaN/Infinity round-trip through Python's json


def _decode(line: str) -> Point | None:
    try:
        row = json.loads(line)
        return Point(row["k"], float(row["v"]), int(row["t"]), int(row["p"]), row.get("m"), int(row["s"]))
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
        existing = self._read_points()
        self._pending_at_open = [p for p in existing if p.seq > self.acked]
        self._next_seq = max((p.seq for p in existing), default=self.acked) + 1
        if existing and not self._pending_at_open:
            self._compact()
        # O_APPEND + one os.write per call: a kill -9 leaves whole lines in the page cache.
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def unacknowledged(self) -> list[Point]:
        """Points from earlier sessions that MLflow never acknowledged, in order (read at open)."""
        return list(self._pending_at_open)

    def append(self, points: list[Point]) -> list[Point]:
        """Assign sequence numbers and write the points; returns them numbered."""
        with self._lock:
            numbered = []
            for point in points:
                numbered.append(Point(point.key, point.value, point.timestamp_ms, point.step, point.model_id, self._next_seq))
                self._next_seq += 1
            os.write(self._fd, "".join(_encode(p) + "\n" for p in numbered).encode())
            return numbered

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

    def _read_points(self) -> list[Point]:
        if not self._path.exists():
            return []
        with self._path.open() as fh:
            return [p for line in fh if (p := _decode(line)) is not None]

    def _compact(self) -> None:
        # Everything landed: start an empty file but keep numbering monotonic via the watermark.
        self._path.write_text("")
