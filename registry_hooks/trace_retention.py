"""Trace retention: the served requests' traces (serving.trace_writer) older than
`serving.traces.retention_days` are deleted, by the hooks service's periodic work, and logged.

Only traces the ingress wrote (they carry `rlops.layout.TRACE_TAG_ENDPOINT`) in the experiments it writes to (those of the
configured models' versions, and `serving.traces.experiment`) are touched: an app's own traces in the same
experiment stay.
"""
from __future__ import annotations

import logging
import time

from mlflow import MlflowClient

from rlops.config import Config
from rlops.layout import TRACE_TAG_ENDPOINT
from rlops.trace_locations import trace_experiments

log = logging.getLogger(__name__)
DELETE_BATCH = 100
PAGE = 500


def prune_traces(config: Config, now: float | None = None) -> dict[str, int]:
    """Delete the ingress's traces older than the retention; {experiment id: traces deleted}."""
    client = MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
    retention_days = config.serving.traces.retention_days
    cutoff_ms = int(((time.time() if now is None else now) - retention_days * 86400) * 1000)
    deleted: dict[str, int] = {}
    for experiment_id in sorted(trace_experiments(client, config.registry.models, config.serving.traces.experiment)):
        victims, token = [], None
        while True:
            page = client.search_traces(locations=[experiment_id], filter_string=f"trace.timestamp_ms < {cutoff_ms}",
                                        max_results=PAGE, include_spans=False, page_token=token)
            victims += [t.info.trace_id for t in page if TRACE_TAG_ENDPOINT in t.info.tags]
            token = page.token
            if not token:
                break
        for at in range(0, len(victims), DELETE_BATCH):
            count = client.delete_traces(experiment_id, trace_ids=victims[at:at + DELETE_BATCH])
            deleted[experiment_id] = deleted.get(experiment_id, 0) + count
        if victims:
            log.warning("trace retention: deleted %d traces older than %g days from experiment %s",
                        deleted.get(experiment_id, 0), retention_days, experiment_id)
    return deleted
