"""Thin MLflow REST calls for the background threads: no built-in retries and a short timeout, so the
sender and heartbeat own their retry policy (MlflowClient's default is 7 retries over minutes)."""
from __future__ import annotations

import json
from typing import Iterable, Mapping

from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request, verify_rest_response

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
UPDATE_RUN = "/api/2.0/mlflow/runs/update"
MAX_METRICS_PER_BATCH = 1000  # MLflow's per-request limit
MAX_TAGS_PER_BATCH = 100


class MlflowRest:
    def __init__(self, tracking_uri: str, timeout_s: float):
        self._creds = get_default_host_creds(tracking_uri)
        self._timeout_s = timeout_s

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def log_metrics(self, run_id: str, metrics_json: Iterable[str], timeout_s: float | None = None) -> None:
        """`log_batch` of metrics already encoded as REST JSON (joining strings keeps the GIL short, so
        the training thread is not held up while a batch of 1000 is serialized)."""
        body = '{"run_id":%s,"metrics":[%s]}' % (json.dumps(run_id), ",".join(metrics_json))
        response = http_request(self._creds, LOG_BATCH, "POST", max_retries=0, backoff_factor=0,
                                timeout=timeout_s or self._timeout_s, data=body.encode(),
                                extra_headers={"Content-Type": "application/json"})
        verify_rest_response(response, LOG_BATCH)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        body = {"run_id": run_id, "tags": [{"key": k, "value": v} for k, v in tags.items()]}
        response = http_request(self._creds, LOG_BATCH, "POST", max_retries=0, backoff_factor=0,
                                timeout=self._timeout_s, json=body)
        verify_rest_response(response, LOG_BATCH)

    def update_run(self, run_id: str, status: str, end_time_ms: int) -> None:
        body = {"run_id": run_id, "run_uuid": run_id, "status": status, "end_time": end_time_ms}
        response = http_request(self._creds, UPDATE_RUN, "POST", max_retries=0, backoff_factor=0,
                                timeout=self._timeout_s, json=body)
        verify_rest_response(response, UPDATE_RUN)
