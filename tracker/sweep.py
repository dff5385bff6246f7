"""Settle runs whose process died without running any handler (a Ray task killed, a node lost): a RUNNING
run whose `rlops.heartbeat` stopped changing for `tracking.heartbeat_timeout_s` is marked FAILED.

Silence is measured on one clock, the sweeper's: it remembers (in `<data_dir>/sweep-observations.json`)
each run's last heartbeat value and when it first saw it, so the trainer's clock never enters. A sweep
that could not reach the server records that it was blind; the next look starts its observations afresh,
so a tracking outage longer than the timeout does not fail the runs that were alive through it (they beat
again once the server is back). A run this sweeper never observed is judged by its heartbeat's own time."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import RunStatus

from rlops.config import Config
from tracker.heartbeat import TAG_HEARTBEAT
from tracker.lifecycle import TAG_END_REASON
from tracker.spool import write_atomically

TAG_FAILURE_REASON = "rlops.failure_reason"
OBSERVATIONS_FILE = "sweep-observations.json"


@dataclass(frozen=True)
class StaleRun:
    run_id: str
    run_name: str
    silent_s: float


@dataclass
class Observations:
    """What the sweeper saw: run id -> (heartbeat value, first seen at), and whether a look failed since."""

    seen: dict[str, tuple[str, float]]
    blind: bool = False

    @classmethod
    def load(cls, path: Path) -> "Observations":
        try:
            data = json.loads(path.read_text())
            return cls({k: (str(v[0]), float(v[1])) for k, v in data["seen"].items()}, bool(data["blind"]))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return cls({})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"seen": self.seen, "blind": self.blind}))


def stale_runs(runs: list, now_s: float, timeout_s: float, observed: Observations) -> list[StaleRun]:
    """Pure: the RUNNING runs of ours (they carry a heartbeat) silent past the timeout on the sweeper's
    clock; updates `observed` with this look."""
    found, seen = [], {}
    for run in runs:
        beat = run.data.tags.get(TAG_HEARTBEAT)
        if run.info.status != "RUNNING" or beat is None:
            continue  # not started by the tracker: not ours to judge
        run_id = run.info.run_id
        previous = None if observed.blind else observed.seen.get(run_id)
        since = previous[1] if previous and previous[0] == beat else now_s
        seen[run_id] = (beat, since)
        if previous is not None:
            silent = now_s - since
        elif observed.blind:
            continue  # just back from an outage: alive runs have not had a chance to beat yet
        else:
            try:
                silent = now_s - float(beat)  # never observed: its own stamp is all there is
            except ValueError:
                continue
        if silent > timeout_s:
            found.append(StaleRun(run_id, run.info.run_name, silent))
    observed.seen, observed.blind = seen, False
    return found


def sweep_stale_runs(config: Config, *, timeout_s: float | None = None, dry_run: bool = False,
                     now_s: float | None = None) -> list[StaleRun]:
    """Mark the configured experiment's stale RUNNING runs FAILED, with the reason as a tag. Idempotent."""
    timeout_s = config.tracking.heartbeat_timeout_s if timeout_s is None else timeout_s
    if timeout_s <= 0:
        raise ValueError(f"timeout must be positive, got {timeout_s}")
    path = config.data_path / OBSERVATIONS_FILE
    observed = Observations.load(path)
    client = MlflowClient(tracking_uri=config.tracking_uri)
    try:
        experiment = client.get_experiment_by_name(config.tracking.experiment)
        runs, token = [], None
        while experiment is not None:
            page = client.search_runs([experiment.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                      max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
    except Exception:
        observed.blind = True  # the next look must not count this outage as silence
        observed.save(path)
        raise
    stale = stale_runs(runs, time.time() if now_s is None else now_s, timeout_s, observed)
    observed.save(path)
    if not dry_run:
        for run in stale:
            client.set_tag(run.run_id, TAG_END_REASON, "heartbeat_lost")
            client.set_tag(run.run_id, TAG_FAILURE_REASON,
                           f"no heartbeat for {run.silent_s:.0f}s (timeout {timeout_s:.0f}s): the process died "
                           "without ending the run")
            client.set_terminated(run.run_id, RunStatus.to_string(RunStatus.FAILED))
    return stale
