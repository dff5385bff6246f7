"""Rollouts you can look at: a bounded sample of what the policy answered, per eval (and a few GRPO groups
per logging interval), as one MLflow table with an image column plus a grid image of the same rows.

The training thread only hands over the rows (an image may be a zero-argument callable that renders it);
rendering, PNG encoding and the uploads run on this module's worker thread. Samples are for looking at,
not for recovery: a job that keeps failing (or one left when the run ends) is dropped with a warning,
and when the worker falls behind the oldest queued job is dropped, so the training thread never waits.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import deque
from typing import Any, Callable, Mapping

from mlflow import MlflowClient

from tracker.sender import wait_for_worker

log = logging.getLogger(__name__)

EVAL_SAMPLES_DIR = "eval/samples"  # eval/samples/step_<N>.json (table) and step_<N>.png (grid)
TRAIN_SAMPLES_DIR = "train/samples"  # the same for GRPO groups
KINDS = {"eval": EVAL_SAMPLES_DIR, "train": TRAIN_SAMPLES_DIR}
IMAGE_COLUMN = "image"
GROUP_COLUMN = "group"
TILE_PX = 96
BORDER_PX = 4
PASSED_RGB, FAILED_RGB, NEUTRAL_RGB = (40, 160, 60), (200, 40, 40), (128, 128, 128)
MAX_QUEUED = 8
ATTEMPTS = 4


def bounded(rows: list[Mapping[str, Any]], kind: str, limit: int) -> list[Mapping[str, Any]]:
    """At most `limit` rows of an eval; for GRPO samples, the rows of the first `limit` groups."""
    if kind != "train" or not rows or GROUP_COLUMN not in rows[0]:
        return rows[:limit]
    groups: list[Any] = []
    for row in rows:
        if row[GROUP_COLUMN] not in groups:
            groups.append(row[GROUP_COLUMN])
    keep = set(groups[:limit])
    return [row for row in rows if row[GROUP_COLUMN] in keep]


def check_rows(rows: Any) -> None:
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        raise TypeError("sample rows must be a list of dicts (column -> value)")
    if rows and any(set(r) != set(rows[0]) for r in rows):
        raise ValueError("every sample row needs the same columns")


def as_image(value: Any):
    """A PIL image from a PIL image, an HxWx3 uint8 array, or a callable returning either."""
    from PIL import Image

    if callable(value) and not hasattr(value, "save"):
        value = value()
    return value if hasattr(value, "save") else Image.fromarray(value)


def grid_image(images: list, passed: list[bool | None]):
    """The rows' images side by side, framed green (passed), red (not) or gray (unknown)."""
    from PIL import Image

    columns = max(1, math.ceil(math.sqrt(len(images))))
    rows = max(1, math.ceil(len(images) / columns))
    cell = TILE_PX + 2 * BORDER_PX
    grid = Image.new("RGB", (columns * cell, rows * cell), (255, 255, 255))
    for i, (image, ok) in enumerate(zip(images, passed)):
        colour = NEUTRAL_RGB if ok is None else (PASSED_RGB if ok else FAILED_RGB)
        frame = Image.new("RGB", (cell, cell), colour)
        frame.paste(image.convert("RGB").resize((TILE_PX, TILE_PX), Image.NEAREST), (BORDER_PX, BORDER_PX))
        grid.paste(frame, ((i % columns) * cell, (i // columns) * cell))
    return grid


def upload_samples(client: MlflowClient, run_id: str, kind: str, step: int, columns: dict[str, list]) -> None:
    """One sample table (its image column holds PIL images) and its grid, unless they landed already."""
    folder = KINDS[kind]
    name = f"step_{step}"
    images = columns.get(IMAGE_COLUMN) or []
    landed = {f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(run_id, folder)}
    if f"{name}.json" not in landed:  # log_table appends to a table that landed before a retry
        client.log_table(run_id, columns, f"{folder}/{name}.json")
    if images and f"{name}.png" not in landed:
        passed = columns.get("passed") or [None] * len(images)
        client.log_image(run_id, grid_image(images, passed), artifact_file=f"{folder}/{name}.png")


class SampleUploader:
    """Worker thread that renders sample tables and hands them to `write(kind, step, columns)` (an upload,
    or an offline run's job file); `add` never blocks the caller."""

    def __init__(self, write: Callable[[str, int, dict[str, list]], None], *, max_backoff_s: float):
        self._write = write
        self._max_backoff_s = max_backoff_s
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, int, list]] = deque()
        self._busy = False
        self._stopping = False
        self.dropped = 0
        self.uploaded = 0
        self._thread = threading.Thread(target=self._run, name="rlops-tracker-samples", daemon=True)
        self._thread.start()

    def add(self, kind: str, step: int, rows: list) -> None:
        with self._cond:
            if len(self._queue) >= MAX_QUEUED:
                self._queue.popleft()
                self.dropped += 1
                log.warning("sample uploads fall behind: dropped the oldest queued sample table")
            self._queue.append((kind, step, rows))
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        with self._cond:
            return wait_for_worker(self._cond, lambda: not (self._queue or self._busy), self._thread, timeout_s)

    def stop(self, timeout_s: float = 5.0) -> bool:
        with self._cond:
            self._stopping = True
            self.dropped += len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                self._busy = True
            try:
                self._upload_with_retries(*job)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _upload_with_retries(self, kind: str, step: int, rows: list) -> None:
        backoff = 0.2
        for attempt in range(1, ATTEMPTS + 1):
            try:
                self._upload(kind, step, rows)
                self.uploaded += 1
                return
            except Exception as exc:  # noqa: BLE001 - samples are best effort; metrics never depend on them
                if attempt == ATTEMPTS:
                    self.dropped += 1
                    log.warning("dropped the %s samples of step %s after %d attempts: %s", kind, step, attempt, exc)
                    return
                with self._cond:
                    if self._cond.wait_for(lambda: self._stopping, timeout=backoff):
                        return
                backoff = min(self._max_backoff_s, backoff * 2)

    def _upload(self, kind: str, step: int, rows: list) -> None:
        columns: dict[str, list] = {key: [row[key] for row in rows] for key in rows[0]}
        if IMAGE_COLUMN in columns:
            columns[IMAGE_COLUMN] = [as_image(v) for v in columns[IMAGE_COLUMN]]
        self._write(kind, step, columns)
