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
from mlflow.entities import Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from rlops.config import Config, mask_uri, mask_value
from rlops.layout import TAG_BASE_MODEL, TAG_LORA_RANK
from tracker import state
from tracker.checkpoints import MODEL_TAG_KEYS
from tracker.heartbeat import TAG_HEARTBEAT, beat
from tracker.inputs import DatasetRef, log_datasets, store_datasets
from tracker.lifecycle import FINISHED, MAX_TAG_VALUE
from tracker.naming import redacted_params, split_param_changes
from tracker.rest import MAX_TAGS_PER_BATCH

TAG_PARAM_CHANGED = "rlops.param_changed."
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


def open_run(config: Config, run_dir: Path, params: Mapping[str, Any], tags: Mapping[str, str],
             run_name: str | None, resume: bool | None, *, drain_stored: Callable[[], str],
             datasets: Sequence[DatasetRef] = ()) -> OpenedRun:
    """Continue the run stored in `run_dir`, or create one (see `RunSession.start` for `resume`). Before a
    new run replaces a stored one, `drain_stored()` lands what that one left ('' = all of it). `datasets`
    are logged as the run's inputs and kept in its state (evals link to them)."""
    client = client_for(config)
    run_tags = default_tags(config) | {str(k): str(mask_value(str(k), v)) for k, v in tags.items()}
    run_id, archived = state.stored_run_id(run_dir), None
    try:
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
    tags = tags | {TAG_PARAM_CHANGED + key: value for key, value in changed.items()}
    items = sorted(to_log.items())
    tag_items = [RunTag(k, str(v)[:MAX_TAG_VALUE]) for k, v in tags.items()]
    for i in range(0, max(len(items), len(tag_items)), MAX_TAGS_PER_BATCH):
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items[i:i + MAX_TAGS_PER_BATCH]],
                         tags=tag_items[i:i + MAX_TAGS_PER_BATCH])
