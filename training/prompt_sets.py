"""Prompt sets from production traces: what a served version was asked becomes the next run's prompts.

`export_traces` reads a version's traces (MLflow, linked to its LoggedModel), keeps those the filters pick
(failed only, a score cap, since a time, a limit), rebuilds each as a task item from its own request (the
task reads the picture: `Task.request_item`) and writes a folder: `prompts.jsonl` (one item per line, its
trace id and score), `images/<sha256>.png` (each picture once) and `manifest.json` (where it came from and
the set's digest). The set is logged to MLflow as a dataset input of a small export run, which the traces
are linked to. `load_prompt_set` reads it back for `rlops train --local --prompts`, refusing an altered one.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, RunStatus, TraceState
from mlflow.exceptions import MlflowException
from PIL import Image

from rlops.config import Config
from rlops.layout import (TRACE_IMAGE_REF, TRACE_IMAGES_DIR, TRACE_MODEL_ID, TRACE_PASSED, TRACE_SCORE, TRACE_TAG_IMAGES,
                          TRACE_TAG_PASSED, version_model_id)
from rlops.task import Task, TaskItem
from tracker.inputs import CONTEXT_TAG, DIGEST_CHARS, TRAINING, DatasetRef

PROMPTS_FILE, MANIFEST_FILE, IMAGES_FOLDER = "prompts.jsonl", "manifest.json", "images"
EXPORT_CONTEXT = "export"
LINK_BATCH = 100  # MLflow links at most 100 traces to a run per call
PAGE = 200


class PromptSetError(ValueError):
    """A prompt set that cannot be made or read, with what is wrong."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    name: str
    digest: str
    prompts: int
    failed: int
    traces_read: int
    unreadable: int  # traces the task could not read back as an item (no image, another picture)
    run_id: str


@dataclass(frozen=True)
class PromptSet:
    path: Path
    name: str
    digest: str
    items: list[TaskItem]
    trace_ids: list[str]

    def dataset(self) -> DatasetRef:
        return DatasetRef(self.name, self.digest, source=str(self.path), context=TRAINING, rows=len(self.items))


def _digest(rows_text: str, images: list[str]) -> str:
    digest = hashlib.sha256(rows_text.encode())
    for name in sorted(images):
        digest.update(name.encode())
    return digest.hexdigest()


def _request_parts(trace) -> tuple[str | None, str]:
    """The image digest and the user's text of a traced chat request."""
    inputs = trace.data.spans[0].inputs if trace.data and trace.data.spans else None
    digest, texts = trace.info.tags.get(TRACE_TAG_IMAGES), []
    for message in (inputs or {}).get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if message.get("role") != "user":
            continue
        if isinstance(content, str):
            texts.append(content)
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            url = (part.get("image_url") or {}).get("url") if isinstance(part, dict) else None
            if isinstance(url, str) and url.startswith(TRACE_IMAGE_REF):
                digest = url.removeprefix(TRACE_IMAGE_REF)
    return (digest if digest and "," not in digest else None), " ".join(texts)


def _score(trace) -> tuple[float | None, bool | None]:
    values = {a.name: a.value for a in trace.info.assessments or []}
    score, passed = values.get(TRACE_SCORE), values.get(TRACE_PASSED)
    return (float(score) if isinstance(score, (int, float)) else None), (passed if isinstance(passed, bool) else None)


def resolve_version(client: MlflowClient, model: str, alias: str | None, version: int | None):
    try:
        if version is not None:
            return client.get_model_version(model, str(version))
        return client.get_model_version_by_alias(model, alias or "production")
    except MlflowException as exc:
        what = f"version {version}" if version is not None else f"alias {alias or 'production'!r}"
        raise PromptSetError(f"registered model {model!r} has no {what} ({exc.message.splitlines()[0]})") from None


def export_traces(config: Config, task: Task, model: str, out: Path, *, alias: str | None = None,
                  version: int | None = None, since: datetime | None = None, failed_only: bool = False,
                  max_score: float | None = None, limit: int | None = None) -> ExportResult:
    """Write the prompt set of a version's traces to `out` (which must not exist) and log it to MLflow."""
    out = Path(out)
    if out.exists():
        raise PromptSetError(f"{out} exists: a prompt set is written once, pick a new folder")
    client = MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
    model_version = resolve_version(client, model, alias, version)
    model_id = version_model_id(model_version.model_id, model_version.source)
    if model_id is None:
        raise PromptSetError(f"{model} v{model_version.version} has no LoggedModel: its traces cannot be found")
    experiment_id = client.get_logged_model(model_id).experiment_id
    artifact_root = client.get_experiment(experiment_id).artifact_location
    query = [f"metadata.`{TRACE_MODEL_ID}` = '{model_id}'"]
    if since is not None:
        query.append(f"trace.timestamp_ms >= {int(since.timestamp() * 1000)}")
    if failed_only:
        query.append(f"tags.`{TRACE_TAG_PASSED}` = 'false'")
    name = f"traces/{model}-v{model_version.version}"
    rows, images, trace_ids = [], {}, []
    read = unreadable = 0
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    try:
        (staging / IMAGES_FOLDER).mkdir()
        token = None
        while limit is None or len(rows) < limit:
            page = client.search_traces(locations=[experiment_id], filter_string=" AND ".join(query),
                                        max_results=PAGE, order_by=["timestamp_ms ASC"], page_token=token)
            for trace in page:
                read += 1
                if trace.info.state != TraceState.OK:  # an error answer is not a prompt to learn from
                    continue
                score, passed = _score(trace)
                if max_score is not None and (score is None or score > max_score):
                    continue
                digest, text = _request_parts(trace)
                item = None
                if digest is not None:
                    if digest not in images:
                        images[digest] = _fetch_image(config, artifact_root, digest, staging / IMAGES_FOLDER)
                    item = task.request_item(images[digest], text) if images[digest] is not None else None
                if item is None:
                    unreadable += 1
                    continue
                trace_id = trace.info.trace_id
                rows.append({"id": f"trace-{trace_id}", "text": item.text, "image": f"{IMAGES_FOLDER}/{digest}.png",
                             "target": item.target, "trace_id": trace_id, "score": score, "passed": passed})
                trace_ids.append(trace_id)
                if limit is not None and len(rows) >= limit:
                    break
            token = page.token
            if not token:
                break
        if not rows:
            raise PromptSetError(f"no trace of {model} v{model_version.version} matches ({read} read, "
                                 f"{unreadable} the task could not read back)")
        for digest, image in images.items():  # only the pictures a row uses stay
            if image is None or not any(r["image"] == f"{IMAGES_FOLDER}/{digest}.png" for r in rows):
                (staging / IMAGES_FOLDER / f"{digest}.png").unlink(missing_ok=True)
        rows_text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        used = sorted(p.name for p in (staging / IMAGES_FOLDER).iterdir())
        digest = _digest(rows_text, used)
        (staging / PROMPTS_FILE).write_text(rows_text)
        manifest = {"name": name, "digest": digest, "registered_model": model, "version": int(model_version.version),
                    "model_id": model_id, "task": f"{type(task).__module__}:{type(task).__name__}",
                    "filters": {"alias": alias, "version": version, "since": since.isoformat() if since else None,
                                "failed_only": failed_only, "max_score": max_score, "limit": limit},
                    "rows": len(rows), "images": used, "trace_ids": trace_ids,
                    "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(staging, out)  # the set appears whole or not at all
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    run_id = _log_export(client, experiment_id, out, manifest)
    return ExportResult(out, name, digest, len(rows), sum(1 for r in rows if r["passed"] is False), read, unreadable,
                        run_id)


def _fetch_image(config: Config, artifact_root: str, digest: str, folder: Path) -> np.ndarray | None:
    try:
        path = mlflow.artifacts.download_artifacts(artifact_uri=f"{artifact_root}/{TRACE_IMAGES_DIR}/{digest}.png",
                                                   dst_path=str(folder), tracking_uri=config.tracking_uri)
    except (MlflowException, OSError):
        return None  # stored with another type, or content recording was off
    data = Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        Path(path).unlink()
        return None
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _log_export(client: MlflowClient, experiment_id: str, out: Path, manifest: dict[str, Any]) -> str:
    """An export run holding the set as a dataset input (name, digest, source folder) and its manifest; the
    traces it came from are linked to it."""
    run = client.create_run(experiment_id, run_name=f"{manifest['name'].replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}",
                            tags={"rlops.export": "traces", "rlops.registered_model": manifest["registered_model"],
                                  "rlops.version": str(manifest["version"])})
    run_id = run.info.run_id
    try:
        dataset = Dataset(name=manifest["name"], digest=manifest["digest"][:DIGEST_CHARS], source_type="local",
                          source=json.dumps({"uri": str(out.resolve())}),
                          profile=json.dumps({"num_rows": manifest["rows"], "sha256": manifest["digest"]}))
        client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag(CONTEXT_TAG, EXPORT_CONTEXT)])])
        client.log_artifact(run_id, str(out / MANIFEST_FILE))
        for at in range(0, len(manifest["trace_ids"]), LINK_BATCH):
            client.link_traces_to_run(manifest["trace_ids"][at:at + LINK_BATCH], run_id)
    except BaseException:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    client.set_terminated(run_id)
    return run_id


def load_prompt_set(path: Path) -> PromptSet:
    """The set written by `export_traces`; PromptSetError when a file is missing or its digest differs."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        rows_text = (path / PROMPTS_FILE).read_text()
    except (OSError, ValueError) as exc:
        raise PromptSetError(f"{path} is not a prompt set (rlops data from-traces writes one): {exc}") from None
    images = sorted(p.name for p in (path / IMAGES_FOLDER).iterdir()) if (path / IMAGES_FOLDER).is_dir() else []
    if _digest(rows_text, images) != manifest.get("digest"):
        raise PromptSetError(f"{path}: its rows or images differ from the manifest's digest (altered after export)")
    items = []
    for line in rows_text.splitlines():
        row = json.loads(line)
        image_path = path / row["image"]
        if image_path.name not in images:
            raise PromptSetError(f"{path}: row {row['id']} names a missing image {row['image']}")
        items.append(TaskItem(row["id"], row["text"], _image_loader(image_path), row["target"]))
    return PromptSet(path, manifest["name"], manifest["digest"], items, list(manifest.get("trace_ids", [])))


def _image_loader(path: Path):
    def load() -> np.ndarray:
        return np.asarray(Image.open(path).convert("RGB"))
    return load


def mixed_items(task_items: list[TaskItem], prompt_set: PromptSet, share: float, seed: int) -> list[TaskItem]:
    """`share` of the GRPO prompts from the set (cycled, ids made unique), the rest the task's own, shuffled
    together so every step sees both."""
    total = len(task_items)
    from_set = max(1, round(share * total))
    picked = [prompt_set.items[i % len(prompt_set.items)] for i in range(from_set)]
    picked = [TaskItem(f"{it.id}#{i // len(prompt_set.items)}", it.text, it.image, it.target)
              for i, it in enumerate(picked)]
    items = picked + task_items[:total - from_set]
    random.Random(seed).shuffle(items)
    return items
