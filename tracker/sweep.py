"""Settle runs whose process died without running any handler (a Ray task killed, a node lost):
a RUNNING run whose `rlops.heartbeat` is older than `tracking.heartbeat_timeout_s` is marked FAILED."""
from __future__ import annotations

import time
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities import RunStatus

from rlops.config import Config
from tracker.session import TAG_END_REASON, TAG_HEARTBEAT

TAG_FAILURE_REASON = "rlops.failure_reason"


@dataclass(frozen=True)
class StaleRun:
    run_id: str
    run_name: str
    silent_s: float


def stale_runs(runs: list, now_s: float, timeout_s: float) -> list[StaleRun]:
    """Pure: the RUNNING runs of ours (they carry a heartbeat) that have been silent past the timeout."""
    found = []
    for run in runs:
        beat = run.data.tags.get(TAG_HEARTBEAT)
        if run.info.status != "RUNNING" or beat is None:
            continue  # not started by the tracker: not ours to judge
        try:
            silent = now_s - float(beat)
        except ValueError:
            continue
        if silent > timeout_s:
            found.append(StaleRun(run.info.run_id, run.info.run_name, silent))
    return found


def sweep_stale_runs(config: Config, *, timeout_s: float | None = None, dry_run: bool = False,
                     now_s: float | None = None) -> list[StaleRun]:
    """Mark the configured experiment's stale RUNNING runs FAILED, with the reason as a tag. Idempotent."""
    timeout_s = config.tracking.heartbeat_timeout_s if timeout_s is None else timeout_s
    if timeout_s <= 0:
        raise ValueError(f"timeout must be positive, got {timeout_s}")
    client = MlflowClient(tracking_uri=config.tracking_uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        return []
    runs, token = [], None
    while True:
        page = client.search_runs([experiment.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    stale = stale_runs(runs, time.time() if now_s is None else now_s, timeout_s)
    if not dry_run:
        for run in stale:
            client.set_tag(run.run_id, TAG_END_REASON, "heartbeat_lost")
            client.set_tag(run.run_id, TAG_FAILURE_REASON,
                           f"no heartbeat for {run.silent_s:.0f}s (timeout {timeout_s:.0f}s): the process died "
                           "without ending the run")
            client.set_terminated(run.run_id, RunStatus.to_string(RunStatus.FAILED))
    return stale
