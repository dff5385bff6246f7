"""Eval linking: each eval point goes to MLflow linked to its step's checkpoint (LoggedModel), whether
the checkpoint lands before or after the eval; and where that step's eval table goes (rlops.eval_table).

`EvalLinks` keeps the links in `evals.jsonl` so a restart links evals logged before a crash, and a resumed
run does not log a step's eval a second time. Records are `{"step", "points": [[key, value,
timestamp_ms], ...]}` (an eval) and `{"step", "model_id"}` (that step's checkpoint landed).
`EvalLinking` is what the session uses: thread-safe, it sends the points and says which got linked.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from rlops.layout import EVAL_TABLE_DIR
from tracker.naming import as_float, metric_key
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


def table_artifact(data_source: str, step: int) -> str:
    """Where a step's eval table goes among the run's artifacts."""
    return f"{EVAL_TABLE_DIR}/{data_source.strip('/')}/step_{step:06d}.json"


class EvalLinks:
    """The link file and what it says. Not thread-safe: `EvalLinking` calls it under its lock."""

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


class EvalLinking:
    """Thread-safe eval linking for one session. `send` takes points to spool; `on_linked` hears which
    points just went out linked to a checkpoint (the registration may re-pick the best then)."""

    def __init__(self, path: Path, send: Callable[[list[Point]], None], on_linked: Callable[[list[Point]], None]):
        self._lock = threading.Lock()
        self._links = EvalLinks(path)
        self._send = send
        self._on_linked = on_linked
        self._send(self._links.restore())

    def log(self, metrics: Mapping[str, float], step: int) -> int:
        """Eval metrics of `step`, linked to its checkpoint now or once it lands. Returns how many points
        were logged (an eval of a step an earlier session of this run logged already is dropped)."""
        now = int(time.time() * 1000)
        points = [Point(metric_key(k), as_float(k, v), now, step) for k, v in metrics.items()]
        with self._lock:
            points = self._links.add(points, step)
            if any(p.model_id for p in points):
                self._on_linked(points)
            self._send(points)
        return len(points)

    def checkpoint_landed(self, step: int, model_id: str) -> None:
        """(Uploader thread) the step's LoggedModel exists: send the evals waiting for it, linked."""
        with self._lock:
            points = self._links.checkpoint_landed(step, model_id)
            self._send(points)
            self._on_linked(points)

    @property
    def linked_steps(self) -> set[int]:
        with self._lock:
            return set(self._links.linked)

    def history(self, key: str) -> list[tuple[int, float]]:
        with self._lock:
            return sorted(self._links.history.get(key, {}).items())

    def default_source(self, fallback: str) -> str:
        """The one eval set this run logged, else `fallback`."""
        with self._lock:
            sources = sorted(self._links.sources)
        return sources[0] if len(sources) == 1 else fallback

    def close(self) -> None:
        with self._lock:
            self._links.close()
