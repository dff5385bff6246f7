"""Best-checkpoint selection, registration and retention.

Selection is pure (`rank_checkpoints`) and compares one eval set only (`eval/<data_source>/<metric>`
linked to each LoggedModel); the rest are thin MlflowClient calls."""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from mlflow import MlflowClient
from mlflow.entities import LoggedModel
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from rlops.eval_table import table_outcomes
from rlops.layout import LOGGED_MODEL_URI, TAG_EVAL_SET, TAG_METRIC_KEY, TAG_METRIC_VALUE, TAG_RUN_ID, TAG_STEP, version_model_id
from tracker.checkpoints import MODEL_TYPE
from tracker.evals import table_artifact


@dataclass(frozen=True)
class ScoredCheckpoint:
    model_id: str
    step: int
    value: float


def run_checkpoints(client: MlflowClient, experiment_id: str, run_id: str) -> list[LoggedModel]:
    """The run's READY LoRA checkpoints (all pages)."""
    models: list[LoggedModel] = []
    token = None
    while True:
        page = client.search_logged_models(
            experiment_ids=[experiment_id],
            filter_string=f"source_run_id = '{run_id}'",
            max_results=100, page_token=token)
        # status is filtered here: this server's filter on `status` matched nothing
        models.extend(m for m in page if m.model_type == MODEL_TYPE and str(m.status) == "READY")
        token = page.token
        if not token:
            return models


def eval_outcomes(client: MlflowClient, run_id: str, data_source: str, step: int) -> dict[str, bool] | None:
    """id -> passed from the eval table the tracker logged for `data_source` at `step`; None if absent."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(run_id, table_artifact(data_source, step), tmp)
        except Exception:  # noqa: BLE001 - MLflow raises several types for a missing artifact
            return None
        return table_outcomes(json.loads(Path(local).read_text()))


def checkpoint_step(model: LoggedModel) -> int:
    return int(model.tags[TAG_STEP])


def rank_checkpoints(models: list[LoggedModel], metric_key: str,
                     dataset_digest: str | None = None) -> list[ScoredCheckpoint]:
    """Checkpoints that carry `metric_key`, best (highest) first; a tie goes to the later step. With
    `dataset_digest`, only scores measured on that eval set count: scores of other sets never compare."""
    scored = []
    for model in models:
        values = [m for m in (model.metrics or []) if m.key == metric_key
                  and (dataset_digest is None or m.dataset_digest == dataset_digest)]
        if values:
            latest = max(values, key=lambda m: (m.step, m.timestamp))
            scored.append(ScoredCheckpoint(model.model_id, checkpoint_step(model), latest.value))
    return sorted(scored, key=lambda s: (s.value, s.step), reverse=True)


def register_checkpoint(client: MlflowClient, name: str, run_id: str, best: ScoredCheckpoint, metric_key: str,
                        aliases: list[str], *, eval_set_sha256: str | None = None,
                        description: str | None = None, tags: Mapping[str, str] | None = None) -> ModelVersion:
    """Register `models:/<model_id>` as a version of `name` (reusing a version already made from the same
    LoggedModel, so a repeated call is idempotent) and point `aliases` at it. `eval_set_sha256` (the eval
    set's full layout hash) is what the promotion guardrail compares; `tags` are set with the version."""
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    source = f"{LOGGED_MODEL_URI}{best.model_id}"
    existing = [v for v in client.search_model_versions(f"name = '{name}' AND run_id = '{run_id}'")
                if v.source == source]
    if existing:
        version = existing[0]
    else:
        version_tags = {**(tags or {}), TAG_RUN_ID: run_id, TAG_STEP: str(best.step), TAG_METRIC_KEY: metric_key,
                        TAG_METRIC_VALUE: repr(float(best.value))}
        if eval_set_sha256:
            version_tags[TAG_EVAL_SET] = eval_set_sha256
        version = client.create_model_version(name=name, source=source, run_id=run_id, tags=version_tags,
                                              model_id=best.model_id, description=description)
    for alias in aliases:
        client.set_registered_model_alias(name, alias, version.version)
    return client.get_model_version(name, version.version)


def registered_sources(client: MlflowClient, name: str, run_id: str) -> set[str]:
    """model ids of this run's checkpoints that are registered versions of `name`."""
    return {version_model_id(v.model_id, v.source) for v in client.search_model_versions(
        f"name = '{name}' AND run_id = '{run_id}'")} - {None}


def retention_victims(models: list[LoggedModel], scored: list[ScoredCheckpoint], keep_best: int,
                      protected: set[str]) -> list[str]:
    """Checkpoints that are neither among the best `keep_best`, nor the latest, nor `protected`."""
    if not models:
        return []
    keep = {s.model_id for s in scored[:keep_best]} | protected
    keep.add(max(models, key=checkpoint_step).model_id)
    return [m.model_id for m in models if m.model_id not in keep]
