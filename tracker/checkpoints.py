"""LoRA checkpoints and eval tables: snapshotted on the training thread, uploaded by a worker thread
(which also runs the optional registration after each linked eval, so it follows the uploads).

A job is a JSON file in `<state>/jobs/` (its snapshot beside it), so a restart finishes what a crash
left: a checkpoint whose LoggedModel was created keeps its `model_id` and is not created twice (one
created by a process killed before it could note the id is found again by its step and checksums).
An offline session starts no worker: its jobs wait in the run dir, sample tables among them, for the sync.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput, LoggedModelStatus

from rlops.layout import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, TAG_BASE_MODEL, TAG_BASE_MODEL_SHA256, TAG_LORA_RANK, TAG_SHA256,
                          TAG_STEP, TAG_TRAINER)
from tracker.lineage import checkpoint_params
from tracker.samples import IMAGE_COLUMN, upload_samples
from tracker.sender import wait_for_worker

log = logging.getLogger(__name__)

JOBS_DIR = "jobs"
MODEL_TYPE = "lora-adapter"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
# run tags every checkpoint of the run carries
MODEL_TAG_KEYS = (TAG_BASE_MODEL, TAG_BASE_MODEL_SHA256, TAG_LORA_RANK, TAG_TRAINER)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def snapshot_adapter(adapter_dir: Path, dest: Path) -> None:
    """Hard-link (copy across filesystems) the adapter files into `dest`, so the trainer may delete its
    checkpoint right after the hook returns. Raises ValueError naming a missing file."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise ValueError(f"adapter dir {adapter_dir} does not exist or is not a directory")
    missing = [name for name in ADAPTER_FILES if not (adapter_dir / name).is_file()]
    if missing:
        raise ValueError(f"adapter dir {adapter_dir} lacks {', '.join(missing)} (a PEFT LoRA adapter has both)")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ADAPTER_FILES:
        try:
            os.link(adapter_dir / name, tmp / name)
        except OSError:
            shutil.copy2(adapter_dir / name, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


class ArtifactUploader:
    """Worker thread for checkpoint and table jobs, retried with backoff until they land."""

    def __init__(self, client: MlflowClient, run_id: str, experiment_id: str, state_dir: Path, *,
                 model_tags: dict[str, str], on_checkpoint: Callable[[int, str], None],
                 on_register: Callable[[str, dict | None], None], max_backoff_s: float, start: bool = True):
        self._client = client
        self._run_id = run_id
        self._experiment_id = experiment_id
        self._dir = Path(state_dir) / JOBS_DIR
        self._dir.mkdir(parents=True, exist_ok=True)
        self.model_tags = model_tags
        self._on_checkpoint = on_checkpoint
        self._on_register = on_register
        self._max_backoff_s = max_backoff_s
        self._cond = threading.Condition()
        self._queue: list[Path] = sorted(self._dir.glob("*.json"))  # left over from a crash: resume them
        self._next = 1 + max((int(p.stem.split("-")[0]) for p in self._queue), default=0)
        self._busy = False
        self._stopping = False
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="rlops-tracker-uploader", daemon=True)
        self._started = start
        if start:
            self._thread.start()

    # ---- called on the training thread: only local file work
    def add_checkpoint(self, adapter_dir: Path, step: int) -> None:
        with self._cond:
            job = self._dir / f"{self._next:06d}-ckpt-{step}.json"
            self._next += 1
        snapshot_adapter(adapter_dir, job.with_suffix(""))
        self._enqueue(job, {"kind": "checkpoint", "step": step, "model_id": None})

    def add_table(self, artifact_file: str, rows: list[dict[str, Any]]) -> None:
        with self._cond:
            job = self._dir / f"{self._next:06d}-table.json"
            self._next += 1
        columns = {key: [row[key] for row in rows] for key in rows[0]} if rows else {}
        self._enqueue(job, {"kind": "table", "artifact_file": artifact_file, "data": columns})

    def add_samples(self, kind: str, step: int, columns: dict[str, list]) -> None:
        """Keep a sample table for the sync (an offline run's samples): its images as PNG files beside it."""
        with self._cond:
            job = self._dir / f"{self._next:06d}-samples.json"
            self._next += 1
        images = columns.get(IMAGE_COLUMN)
        folder = job.with_suffix("")
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, image in enumerate(images or []):
            image.save(tmp / f"{i:04d}.png", format="PNG")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        data = {key: value for key, value in columns.items() if key != IMAGE_COLUMN}
        self._enqueue(job, {"kind": "samples", "sample_kind": kind, "step": step, "data": _plain(data),
                            "images": len(images) if images is not None else None})

    def add_registration(self, data_source: str, rule: dict) -> None:
        """Queue a best-checkpoint registration (by `rule`, tracker.registration) behind the uploads queued so far."""
        with self._cond:
            job = self._dir / f"{self._next:06d}-register.json"
            self._next += 1
        self._enqueue(job, {"kind": "register", "data_source": data_source, "rule": rule})

    def _enqueue(self, job: Path, spec: dict) -> None:
        _write_json(job, spec)
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()

    def queued_checkpoint_steps(self) -> set[int]:
        with self._cond:
            return {int(job.stem.rsplit("-", 1)[1]) for job in self._queue if "-ckpt-" in job.stem}

    # ---- lifecycle
    def flush(self, timeout_s: float) -> bool:
        if not self._started:
            return True  # offline: the jobs are files in the run dir, which is where they go
        with self._cond:
            return wait_for_worker(self._cond, lambda: not (self._queue or self._busy), self._thread, timeout_s)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the worker and join it (bounded: an upload in flight may outlast the bound); True once the
        thread has ended, so the session's files may be closed under it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._started:
            self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + int(self._busy)

    def _run(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return  # job files stay on disk; the next start resumes them
                job = self._queue[0]
                self._busy = True
            try:
                self._process(job)
            except Exception as exc:  # noqa: BLE001 - retried; the job file keeps the work
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("checkpoint/table upload failed, retrying: %s", self.last_error)
                backoff = min(self._max_backoff_s, max(0.2, backoff * 2))
                with self._cond:
                    self._busy = False
                    self._cond.wait_for(lambda: self._stopping, timeout=backoff)
                continue
            backoff = 0.0
            self.last_error = None
            with self._cond:
                self._queue.pop(0)
                self._busy = False
                self._cond.notify_all()

    def _process(self, job: Path) -> None:
        spec = json.loads(job.read_text())
        if spec["kind"] == "checkpoint":
            self._upload_checkpoint(job, spec)
        elif spec["kind"] == "register":
            self._on_register(spec["data_source"], spec.get("rule"))
        elif spec["kind"] == "samples":
            self._upload_samples(job, spec)
        else:
            self._upload_table(spec)
        job.unlink()
        shutil.rmtree(job.with_suffix(""), ignore_errors=True)

    def _upload_checkpoint(self, job: Path, spec: dict) -> None:
        step, files_dir = int(spec["step"]), job.with_suffix("")
        if spec["model_id"] is None:
            sums = {name: sha256_of(files_dir / name) for name in ADAPTER_FILES}
            tags = {**self.model_tags, TAG_STEP: str(step), **{TAG_SHA256 + n: s for n, s in sums.items()}}
            found = self._created_before(tags)
            if found is not None:  # its output may have been logged too: look before logging it
                spec["model_id"], spec["output_sent"] = found, True
            else:
                spec["model_id"] = self._client.create_logged_model(
                    experiment_id=self._experiment_id, name=f"lora-step-{step}", source_run_id=self._run_id,
                    tags=tags, params=checkpoint_params(files_dir / ADAPTER_CONFIG, self.model_tags),
                    model_type=MODEL_TYPE).model_id
            _write_json(job, spec)  # from here on a retry reuses this LoggedModel
        model_id = spec["model_id"]
        self._client.log_model_artifacts(model_id, str(files_dir))
        self._client.finalize_logged_model(model_id, LoggedModelStatus.READY)
        # log_outputs is not idempotent (a second call is a 400 forever): after a lost response, look first
        if not (spec.get("output_sent") and self._has_output(model_id)):
            spec["output_sent"] = True
            _write_json(job, spec)
            self._client.log_outputs(self._run_id, [LoggedModelOutput(model_id, step)])
        self._on_checkpoint(step, model_id)

    def _created_before(self, tags: dict[str, str]) -> str | None:
        """The id of this run's LoggedModel of the same step and checksums, if a process that was killed
        before it noted the id created it (all statuses: it may not be finalized)."""
        token = None
        while True:
            page = self._client.search_logged_models(experiment_ids=[self._experiment_id], max_results=100,
                                                     filter_string=f"source_run_id = '{self._run_id}'", page_token=token)
            for model in page:
                if model.model_type == MODEL_TYPE and all(model.tags.get(k) == v for k, v in tags.items()):
                    return model.model_id
            token = page.token
            if not token:
                return None

    def _upload_samples(self, job: Path, spec: dict) -> None:
        columns = dict(spec["data"])
        if spec["images"] is not None:
            folder = job.with_suffix("")
            columns[IMAGE_COLUMN] = [_load_png(folder / f"{i:04d}.png") for i in range(spec["images"])]
        upload_samples(self._client, self._run_id, spec["sample_kind"], int(spec["step"]), columns)

    def _has_output(self, model_id: str) -> bool:
        outputs = self._client.get_run(self._run_id).outputs
        return any(o.model_id == model_id for o in (outputs.model_outputs if outputs else []) or [])

    def _upload_table(self, spec: dict) -> None:
        artifact_file = spec["artifact_file"]
        folder, _, name = artifact_file.rpartition("/")
        if any(f.path.endswith(name) for f in self._client.list_artifacts(self._run_id, folder or None)):
            return  # landed before a crash; log_table would append the rows a second time
        self._client.log_table(self._run_id, spec["data"], artifact_file)


def _load_png(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return image


def _plain(data: Any) -> Any:
    """Sample columns as JSON (numpy scalars become numbers, anything else unknown its text)."""
    return json.loads(json.dumps(data, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
