"""Opening the MLflow run of a run dir: a new run, or the stored one continued (resume rules, params that
changed since, the tags every run carries). Thin MlflowClient calls; the session decides when."""
from __future__ import annotations

import logging
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mlflow import MlflowClient
from mlflow.entities import Param, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request

from rlops.config import Config, mask_uri, mask_value
from rlops.layout import TAG_BASE_MODEL, TAG_LORA_RANK
from tracker import offline, state
from tracker.checkpoints import MODEL_TAG_KEYS
from tracker.heartbeat import TAG_HEARTBEAT, beat
from tracker.inputs import DatasetRef, log_datasets, store_datasets, stored_datasets
from tracker.lifecycle import FINISHED, MAX_TAG_VALUE
from tracker.naming import TAG_PARAM_CHANGED, param_change_tags, redacted_params, split_param_changes
from tracker.rest import MAX_TAGS_PER_BATCH

TAG_RESUMES = "rlops.resumes"
TAG_HOST = "rlops.host"
TAG_GIT_COMMIT = "rlops.git_commit"
TAG_RESUMED_FROM_STEP = "rlops.resumed_after_step"
MODEL_TAGS = MODEL_TAG_KEYS  # copied onto each checkpoint's LoggedModel (those the run has)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenedRun:
    client: MlflowClient
    run_id: str
    experiment_id: str
    model_tags: dict[str, str]  # the run's base model, rank and trainer, for its checkpoints
    archived: Path | None  # where the run dir's previous (finished) run was moved, if any
    offline: bool = False  # the run lives in the run dir alone (client and experiment_id are None)


def open_run(config: Config, run_dir: Path, params: Mapping[str, Any], tags: Mapping[str, str],
             run_name: str | None, resume: bool | None, *, drain_stored: Callable[[], str],
             datasets: Sequence[DatasetRef] = ()) -> OpenedRun:
    """Continue the run stored in `run_dir`, or create one (see `RunSession.start` for `resume`). Before a
    new run replaces a stored one, `drain_stored()` lands what that one left ('' = all of it). `datasets`
    are logged as the run's inputs and kept in its state (evals link to them). Offline (`tracking.mode`, or
    `tracking.offline_fallback` with no answer from the server) the run opens in the run dir alone."""
    run_tags = default_tags(config) | {str(k): str(mask_value(str(k), v)) for k, v in tags.items()}
    if config.tracking.mode == "offline" or (config.tracking.offline_fallback and not server_answers(config)):
        return open_offline_run(config, run_dir, redacted_params(params), run_tags, run_name, resume, datasets)
    client = client_for(config)
    archived = None
    try:
        run_id = bind_stored_run(client, run_dir)
        if run_id and resume is not True and (resume is False or finished(client, run_dir, run_id)):
            left = drain_stored()
            if left:
                raise RuntimeError(f"run dir {run_dir} still holds {left} of finished run {run_id} that MLflow "
                                   f"has not taken; run `rlops runs flush {run_dir}` first")
            archived, run_id = state.archive_state(run_dir, run_id), None
        state.state_dir(run_dir).mkdir(parents=True, exist_ok=True)
        if run_id:
            run = resume_run(client, run_id, state.state_dir(run_dir))
            run_tags[TAG_RESUMES] = str(int(run.data.tags.get(TAG_RESUMES, "0")) + 1)
            state.write_run(run_dir, state.stored_run(run_dir) | {"resumes": int(run_tags[TAG_RESUMES])})  # for offline
        else:
            experiment = experiment_id(client, config.tracking.experiment)
            run = client.create_run(experiment, run_name=run_name)
            state.write_run(run_dir, {"run_id": run.info.run_id, "experiment_id": experiment,
                                      "tracking_uri": mask_uri(config.tracking_uri)})
        log_params_and_tags(client, run, redacted_params(params), run_tags)
        log_datasets(client, run.info.run_id, datasets)
        store_datasets(state.state_dir(run_dir), datasets)
    except MlflowException as exc:
        raise ConnectionError(f"cannot {'resume' if run_id else 'start'} the MLflow run at "
                              f"{mask_uri(config.tracking_uri)}: {exc.message}") from exc
    log.info("tracking run %s (%s) in %s", run.info.run_id, "resumed" if run_id else "new", config.tracking_uri)
    # the trainer's tags win over config defaults
    return OpenedRun(client, run.info.run_id, run.info.experiment_id,
                     {key: run_tags[key] for key in MODEL_TAGS if key in run_tags}, archived)


def open_offline_run(config: Config, run_dir: Path, params: dict[str, str], run_tags: dict[str, str],
                     run_name: str | None, resume: bool | None, datasets: Sequence[DatasetRef]) -> OpenedRun:
    """The run in the run dir alone: params, tags and datasets wait there for `rlops runs sync`. A finished
    stored run moves aside whole (`previous-<id>/`, syncable as it is): offline nothing can drain it first."""
    state_path = state.state_dir(run_dir)
    record, archived = state.stored_run(run_dir), None
    if record and resume is not True:
        end = state.intended_end(run_dir)
        stored_finished = end["status"] == FINISHED if end else False
        if resume is False or stored_finished:
            archived, record = state.archive_state(run_dir, offline.label(record)), None
            log.warning("run dir %s held a finished run; moved to %s: `rlops runs sync %s` lands it", run_dir,
                        archived, archived)
    state_path.mkdir(parents=True, exist_ok=True)
    if record is None:
        record = offline.new_record(config.tracking.experiment, run_name)
        state.write_run(run_dir, record)
    else:
        _, pending_tags = offline.read_pending(state_path)
        run_tags[TAG_RESUMES] = str(int(pending_tags.get(TAG_RESUMES, record.get("resumes", 0))) + 1)
        state.write_run(run_dir, record | {"resumes": int(run_tags[TAG_RESUMES])})
    offline.add_pending(state_path, params, run_tags)
    store_datasets(state_path, datasets)
    log.info("tracking run %s offline in %s: `rlops runs sync %s` sends it to MLflow", offline.label(record),
             state_path, run_dir)
    return OpenedRun(None, offline.label(record), None, {key: run_tags[key] for key in MODEL_TAGS if key in run_tags},
                     archived, offline=True)


def server_answers(config: Config) -> bool:
    """Whether the tracking server answers now (one request, no retries, the request timeout)."""
    if not config.tracking_uri.startswith(("http://", "https://")):
        return True  # a local store (sqlite, file) is always there
    try:
        response = http_request(get_default_host_creds(config.tracking_uri), "/health", "GET", max_retries=0,
                                backoff_factor=0, timeout=config.tracking.request_timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure to answer is the same here
        log.warning("tracking server %s does not answer (%s): this run goes offline (tracking.offline_fallback)",
                    mask_uri(config.tracking_uri), type(exc).__name__)
        return False
    return response.status_code < 500


def bind_stored_run(client: MlflowClient, run_dir: Path) -> str | None:
    """The server run of the run dir's stored run: an offline one is bound first, to the run that carries
    its `rlops.offline_id` (made now, with the offline start time and name, if none does); params, tags and
    datasets an offline session kept are logged. None when the run dir holds no run."""
    record = state.stored_run(run_dir)
    if not offline.unbound(record):
        if record and offline.has_pending(state.state_dir(run_dir)):  # an online run continued offline
            log_pending(client, client.get_run(record["run_id"]), state.state_dir(run_dir))
        return record["run_id"] if record else None
    experiment = experiment_id(client, record["experiment"])
    found = client.search_runs([experiment], filter_string=f"tags.`{offline.TAG_OFFLINE_ID}` = '{record['offline_id']}'",
                               run_view_type=ViewType.ALL, max_results=1)
    if found:
        run = found[0]
        if run.info.lifecycle_stage != "active":
            raise ValueError(f"offline run {record['offline_id']} was synced to run {run.info.run_id}, which is "
                             "deleted; restore it to sync again")
    else:
        run = client.create_run(experiment, start_time=record["start_time_ms"], run_name=record["run_name"],
                                tags={offline.TAG_OFFLINE_ID: record["offline_id"]})
    state.write_run(run_dir, record | {"run_id": run.info.run_id, "experiment_id": experiment})
    log_pending(client, run, state.state_dir(run_dir))
    log.info("offline run %s is run %s of experiment %r", record["offline_id"], run.info.run_id, record["experiment"])
    return run.info.run_id


def log_pending(client: MlflowClient, run, state_path: Path) -> None:
    """Log what an offline session kept for the server (params, tags, datasets), then forget it."""
    params, tags = offline.read_pending(state_path)
    if params or tags:
        log_params_and_tags(client, run, params, tags)
        log_datasets(client, run.info.run_id, stored_datasets(state_path))
    offline.clear_pending(state_path)


def client_for(config: Config) -> MlflowClient:
    return MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)


def experiment_id(client: MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        # Tells the MLflow UI this is model training (runs, charts), not a GenAI experiment (traces).
        return client.create_experiment(name, tags={"mlflow.experimentKind": "custom_model_development"})
    if experiment.lifecycle_stage != "active":
        raise ValueError(f"experiment {name!r} is deleted; restore it or set tracking.experiment to another name")
    return experiment.experiment_id


def finished(client: MlflowClient, run_dir: Path, run_id: str) -> bool:
    """Did the stored run end FINISHED (on the server, or as recorded locally when the server was down)?"""
    end = state.intended_end(run_dir)
    if end is not None:
        return end["status"] == FINISHED
    try:
        return client.get_run(run_id).info.status == FINISHED
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        return False  # resume_run explains


def resume_run(client: MlflowClient, run_id: str, state_path: Path):
    """The stored run, set RUNNING again; a clear error when the server lacks it or it is deleted."""
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        raise ValueError(f"{state_path / state.RUN_FILE} names run {run_id}, which the tracking server does not have; "
                         "remove that file to start a new run") from None
    if run.info.lifecycle_stage != "active":
        raise ValueError(f"run {run_id} stored in {state_path / state.RUN_FILE} is deleted; restore it or remove that file")
    if run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
    return run


def default_tags(config: Config) -> dict[str, str]:
    tags = {TAG_HOST: socket.gethostname(), TAG_BASE_MODEL: config.training.base_model,
            TAG_LORA_RANK: str(config.training.lora_rank), TAG_HEARTBEAT: beat()}
    commit = _git_commit()
    if commit:
        tags[TAG_GIT_COMMIT] = tags["mlflow.source.git.commit"] = commit
    return tags


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def log_params_and_tags(client: MlflowClient, run, params: dict[str, str], tags: dict[str, str]) -> None:
    """Log params the run lacks; a changed value on resume becomes a `rlops.param_changed.<key>` tag
    (MLflow forbids changing a param)."""
    to_log, changed = split_param_changes(run.data.params, params)
    tags = tags | param_change_tags(changed)
    items = sorted(to_log.items())
    tag_items = [RunTag(k, str(v)[:MAX_TAG_VALUE]) for k, v in tags.items()]
    for i in range(0, max(len(items), len(tag_items)), MAX_TAGS_PER_BATCH):
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items[i:i + MAX_TAGS_PER_BATCH]],
                         tags=tag_items[i:i + MAX_TAGS_PER_BATCH])
