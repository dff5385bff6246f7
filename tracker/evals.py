"""Eval links: which eval points belong to which step's checkpoint, kept in `evals.jsonl` so a restart
links evals logged before a crash, and a resumed run does not log a step's eval a second time.

Records are `{"step", "points": [[key, value, timestamp_ms], ...]}` (an eval) and `{"step", "model_id"}`
(that step's checkpoint landed). Not thread-safe: the session calls it under its lock.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tracker.spool import Point, append_whole, drop_torn_tail

log = logging.getLogger(__name__)


def eval_source(key: str) -> str | None:
    """`eval/<data_source>/<metric>` -> data_source (None for other keys and SkyRL's `eval/all/*`)."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] == "eval" and parts[1] != "all":
        return "/".join(parts[1:-1])
    return None


def linked(point: Point, model_id: str) -> Point:
    return Point(point.key, point.value, point.timestamp_ms, point.step, model_id)


def read_records(path: Path) -> list[dict]:
    """Every whole record; a torn line (a crash mid-write) is skipped like the spool's."""
    records = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                record = json.loads(line)
                int(record["step"])
            except (ValueError, KeyError, TypeError):
                continue
            records.append(record)
    return records


class EvalLinks:
    def __init__(self, path: Path):
        self._path = Path(path)
        drop_torn_tail(self._path)
        self._fd: int | None = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.linked: dict[int, str] = {}  # step -> model_id of that step's checkpoint
        self._unlinked: dict[int, list[Point]] = {}  # eval points waiting for their step's checkpoint
        self._earlier: set[tuple[str, int]] = set()  # (key, step) logged by earlier sessions
        self.history: dict[str, dict[int, float]] = {}  # key -> step -> value, all sessions
        self.sources: set[str] = set()

    def restore(self) -> list[Point]:
        """Rebuild links from earlier sessions; returns the points to re-send linked (MLflow drops a point
        that already landed, so re-sending is safe)."""
        records = read_records(self._path)
        for record in records:
            step = int(record["step"])
            if "model_id" in record:
                self.linked[step] = record["model_id"]
            else:
                points = [Point(k, v, t, step) for k, v, t in record["points"]]
                self._unlinked.setdefault(step, []).extend(points)
                self._note(points)
                self._earlier.update((p.key, step) for p in points)
        relink = []
        for step in [s for s in self._unlinked if s in self.linked]:
            relink += [linked(p, self.linked[step]) for p in self._unlinked.pop(step)]
        return relink

    def add(self, points: list[Point], step: int) -> list[Point]:
        """New eval points of `step`, less those an earlier session logged already; linked when the step's
        checkpoint has landed, else kept until it does. Returns the points to send now."""
        points = [p for p in points if (p.key, step) not in self._earlier]
        if not points:
            return []
        model_id = self.linked.get(step)
        if model_id is None:
            self._unlinked.setdefault(step, []).extend(points)
        else:
            points = [linked(p, model_id) for p in points]
        self._note(points)
        self._write({"step": step, "points": [[p.key, p.value, p.timestamp_ms] for p in points]})
        return points

    def checkpoint_landed(self, step: int, model_id: str) -> list[Point]:
        self.linked[step] = model_id
        self._write({"step": step, "model_id": model_id})
        return [linked(p, model_id) for p in self._unlinked.pop(step, [])]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _note(self, points: list[Point]) -> None:
        for p in points:
            self.history.setdefault(p.key, {}).setdefault(p.step, p.value)
            source = eval_source(p.key)
            if source:
                self.sources.add(source)

    def _write(self, record: dict) -> None:
        if self._fd is None:
            raise RuntimeError("eval links are closed: the run session has ended")
        try:
            append_whole(self._fd, (json.dumps(record) + "\n").encode())
        except OSError as exc:  # a full disk: the points still go out; only a restart would miss the link
            log.error("cannot write %s: %s", self._path, exc)
