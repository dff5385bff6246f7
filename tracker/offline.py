"""Offline runs: a run whose process never reaches the server keeps in its run dir what MLflow would hold,
and `rlops runs sync` replays it (pure file work here; the binding to a server run is `run_start`'s).

`run.json` of an offline run holds a stable `offline_id` (the synced run carries it as the tag
`rlops.offline_id`, so a second sync finds the same run), its experiment, name and start time, and the
server's `run_id` once a sync or an online session has bound it. `pending_run.json` holds the params and
tags no server has taken yet, merged across sessions; what has no file of its own here (points, uploads,
the registration, the end) already waits in the spool, the jobs and `end.json` as after an outage.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Mapping

from tracker.naming import param_change_tags, split_param_changes
from tracker.spool import write_atomically

TAG_OFFLINE_ID = "rlops.offline_id"
PENDING_FILE = "pending_run.json"
LABEL_PREFIX = "offline-"


def new_record(experiment: str, run_name: str | None) -> dict:
    """`run.json` of a new offline run (not bound to a server run yet)."""
    return {"run_id": None, "offline_id": uuid.uuid4().hex, "experiment": experiment, "run_name": run_name,
            "start_time_ms": int(time.time() * 1000)}


def label(record: Mapping) -> str:
    """The run's name in this process while it has no server id: `offline-<offline_id>`."""
    return record.get("run_id") or LABEL_PREFIX + record["offline_id"]


def unbound(record: Mapping | None) -> bool:
    return bool(record) and not record.get("run_id") and bool(record.get("offline_id"))


def read_pending(state_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(params, tags) waiting for a server."""
    try:
        data = json.loads((Path(state_dir) / PENDING_FILE).read_text())
    except FileNotFoundError:
        return {}, {}
    return dict(data["params"]), dict(data["tags"])


def add_pending(state_dir: Path, params: Mapping[str, str] = {}, tags: Mapping[str, str] = {}) -> None:
    """Keep params and tags for the sync. A param is never changed once given (as MLflow does): a new value
    becomes a `rlops.param_changed.<key>` tag, as on an online resume; later tags win."""
    old_params, old_tags = read_pending(state_dir)
    to_log, changed = split_param_changes(old_params, dict(params))
    merged_tags = old_tags | dict(tags) | param_change_tags(changed)
    write_atomically(Path(state_dir) / PENDING_FILE,
                     json.dumps({"params": old_params | to_log, "tags": merged_tags}, sort_keys=True))


def has_pending(state_dir: Path) -> bool:
    return (Path(state_dir) / PENDING_FILE).exists()


def clear_pending(state_dir: Path) -> None:
    (Path(state_dir) / PENDING_FILE).unlink(missing_ok=True)


class OfflineRest:
    """The session's REST face while offline: its tags wait in `pending_run.json` (an offline session sends
    nothing else: its sender never starts and its end waits in end.json)."""

    def __init__(self, state_dir: Path):
        self._state_dir = Path(state_dir)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        add_pending(self._state_dir, tags=tags)
