"""SkyRL adapter: a `TrainingCallback`, an HF-export hook and an experiment class around RunSession.

Our session owns the run. It starts before SkyRL's `Tracking` is built; with `trainer.logger=mlflow`
SkyRL's own MLflow backend is replaced by `SessionBackend`, because that backend would (a) open its own
run state through the fluent API, (b) log the raw config as params (unredacted, and in conflict with ours
on resume), (c) log every payload a second time, synchronously, and (d) end the run FINISHED from
`Tracking.finish()`/`__del__` even after a crash. Metrics reach MLflow once, through `on_log`.

At each eval, `on_eval_end` reads the trajectories SkyRL's evaluate() dumped (`trainer.dump_eval_results`):
the eval table registration compares, and the first `tracking.sample_items` of them as the run's sample
table (`eval/samples/step_N.json` + grid), with the task's own columns (`task_columns`) first. In a Ray job,
system metrics are per node (`tracker.ray_nodes`).

Usage (what `training/skyrl_main.py` needs):

    exp = TrackedPPOExp(skyrl_cfg, rlops_config, task_columns=...)  # instead of BasePPOExp(skyrl_cfg)
    exp.run()                                         # FINISHED / FAILED / KILLED like RunSession

Importing this module imports SkyRL; the rest of `tracker/` never does.
"""
from __future__ import annotations

import functools
import json
import logging
import numbers
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.trainer import RayPPOTrainer
from skyrl.train.utils.callbacks import TrainingCallback
from skyrl.train.utils.tracking import Tracking, _compute_mlflow_params_from_objects

from rlops.config import Config
from rlops.eval_table import LEGACY_ID
from rlops.layout import ADAPTER_CONFIG, TAG_BASE_MODEL, TAG_LORA_RANK
from rlops.task import TAG_TASK
from tracker import ray_nodes
from tracker import state as tracker_state
from tracker.session import RunSession

log = logging.getLogger(__name__)

LORA_ADAPTER_DIR = Path("policy") / "lora_adapter"  # inside `global_step_N/`
EVAL_PREFIX = "eval/"
BLOCKING_METRIC = "tracker/blocking_s"
SAMPLE_TEXT_CHARS = 4000
REPEATED_SPECIAL_TOKEN = re.compile(r"(<\|[^|<>]{1,40}\|>)(?:\1)+")
# A task's own sample columns from one dumped eval trajectory (`Task.skyrl_sample_columns`)
TaskColumns = Callable[[Mapping[str, Any]], Mapping[str, Any]]


def numeric(payload: Mapping[str, Any]) -> dict[str, float]:
    """Numeric scalars of a SkyRL payload (it may also carry strings, lists or tensors); a bool counts as
    0/1, as the session's own check takes it."""
    out = {}
    for key, value in payload.items():
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        if isinstance(value, numbers.Real):
            out[key] = float(value)
    return out


def training_metrics(payload: Mapping[str, Any]) -> dict[str, float]:
    """The numeric scalars of a payload without its eval/* keys (on_eval_end logs those, linked to the
    checkpoint)."""
    return {k: v for k, v in numeric(payload).items() if not k.startswith(EVAL_PREFIX)}


def named_by_data_source(metrics: Mapping[str, float], sources) -> dict[str, float]:
    """SkyRL names an eval set's metrics after its data source with `/` made `_` (`sanitize_data_source`,
    trainer_utils.py:219): `eval/maze_2d_easy/avg_score`. The tracker logs them under the data source itself,
    `eval/maze_2d/easy/avg_score`: the contract's key, the local trainer's, the one registration ranks by."""
    renamed = {f"{EVAL_PREFIX}{s.replace('/', '_')}/": f"{EVAL_PREFIX}{s}/" for s in sources if "/" in s}
    out = {}
    for key, value in metrics.items():
        prefix = next((p for p in renamed if key.startswith(p)), None)
        out[renamed[prefix] + key[len(prefix):] if prefix else key] = value
    return out


def skyrl_params(cfg: Any) -> dict[str, Any]:
    """The SkyRL config flattened exactly as SkyRL's own MLflow backend names params (`a/b/c`)."""
    return _compute_mlflow_params_from_objects(cfg)


def skyrl_tags(cfg: Any) -> dict[str, str]:
    model = cfg.trainer.policy.model
    tags = {"rlops.trainer": "skyrl", TAG_BASE_MODEL: str(model.path)}
    if getattr(model, "lora", None) is not None and model.lora.rank:
        tags[TAG_LORA_RANK] = str(model.lora.rank)
    datasets = getattr(cfg.data, "train_data", None)
    if datasets:
        tags["rlops.dataset"] = ",".join(str(d) for d in datasets)[:500]
    return tags


def adapter_dir_of(folder: Path) -> Path | None:
    """The PEFT adapter folder inside a SkyRL checkpoint or HF export, if there is one."""
    for candidate in (folder / LORA_ADAPTER_DIR, folder / "policy", folder / "lora_adapter", folder):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    return None


class SessionBackend:
    """Stands in for SkyRL's `_MlflowLoggingAdapter` inside `Tracking`: no second run, no params, no
    second copy of the metrics (the callback's `on_log` logs each payload), and no end of the run."""

    def __init__(self, session: RunSession):
        self.session = session

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Deliberately nothing: `TrackerCallback.on_log` received this exact payload just before."""

    def finish(self) -> None:
        """Deliberately nothing: the session, not SkyRL, decides FINISHED/FAILED/KILLED."""


def make_tracking(cfg: Any, session: RunSession) -> Tracking:
    """SkyRL's `Tracking` for `cfg.trainer.logger`, with the MLflow backend routed to `session`."""
    if cfg.trainer.logger != "mlflow":
        return Tracking(project_name=cfg.trainer.project_name, experiment_name=cfg.trainer.run_name,
                        backend=cfg.trainer.logger, config=cfg, tags=cfg.trainer.tags)
    tracking = Tracking(project_name=cfg.trainer.project_name, experiment_name=cfg.trainer.run_name,
                        backend="console", config=cfg, tags=cfg.trainer.tags)
    tracking.backend, tracking.logger = "mlflow", SessionBackend(session)
    return tracking


def blocking(hook):
    """Adds the hook's wall time to `self.blocking_s`: what the tracker costs SkyRL's training loop."""
    @functools.wraps(hook)
    def timed(self, *args, **kwargs):
        self.entered = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self.blocking_s += time.perf_counter() - self.entered
    return timed


class TrackerCallback(TrainingCallback):
    """Feeds SkyRL's training events into a RunSession (metric names: SkyRL's, `@` -> `_at_`). Each step
    also logs BLOCKING_METRIC: seconds the loop spent in these hooks since the previous step's log (the
    last log call of a step counts in the next one)."""

    def __init__(self, session: RunSession, *, register_best: bool = True, eval_data_source: str | None = None,
                 task_columns: TaskColumns | None = None):
        if not isinstance(session, RunSession):
            raise TypeError(f"TrackerCallback needs a tracker.RunSession, got {type(session).__name__}")
        self.session = session
        self.register_best = register_best
        self.eval_data_source = eval_data_source
        self.task_columns = task_columns
        self._eval_step: int | None = None  # the step of the last on_eval_end
        self._before_checkpoint: tuple[int, dict[str, float]] = (-1, {})  # what log_before_checkpoint sent
        self.blocking_s = 0.0
        self.entered = 0.0

    @blocking
    def on_train_start(self, trainer, callback_input, control) -> None:
        step = callback_input.global_step
        self.session.log_metrics({"trainer/start_step": step}, step=step)
        # SkyRL fires on_save after the save (trainer.py:474-475): a kill in between left a checkpoint the
        # resumed trainer starts after, never logged. Each is logged once (the session skips known steps).
        for saved_step, folder in saved_checkpoints(trainer.cfg.trainer.ckpt_path):
            log_adapter(self.session, str(folder), saved_step)

    @blocking
    def log_before_checkpoint(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Step `step`'s metrics so far, logged before its checkpoint is written: SkyRL saves step N
        (trainer.py:473) before it logs step N (`on_log`, trainer.py:534), and a run resumed from that
        checkpoint starts at N+1, so a kill in between would lose them. `on_log` then skips these points."""
        early = training_metrics(metrics)
        if early:
            self.session.log_metrics(early, step=step)
        self._before_checkpoint = (step, early)

    @blocking
    def on_log(self, trainer, callback_input, control) -> None:
        logs, step = callback_input.logs, callback_input.global_step
        # the hooks' time since the previous step's log; the rest of this hook (the log call) counts next
        so_far = time.perf_counter() - self.entered
        blocking_s = self.blocking_s + so_far
        logged_step, logged = self._before_checkpoint
        if logs and step != self._eval_step and step != logged_step:
            # the training thread's hot path: outside an eval step a payload holds no eval/* keys, so it
            # goes over as it is (the session checks every value at C speed; no Python loop here)
            try:
                self.session.log_metrics({**logs, BLOCKING_METRIC: blocking_s}, step)
                self.blocking_s = -so_far
                return
            except Exception:  # noqa: BLE001 - a string, list or tensor value: filtered below (the rest re-raise)
                pass
        metrics = training_metrics(logs or {})
        if step == logged_step:  # a value that changed since is logged again, the rest once
            metrics = {k: v for k, v in metrics.items() if logged.get(k) != v}
        if metrics:
            metrics[BLOCKING_METRIC] = blocking_s
            self.blocking_s = -so_far
            self.session.log_metrics(metrics, step=step)

    @blocking
    def on_eval_end(self, trainer, callback_input, control) -> None:
        self._eval_step = step = callback_input.global_step
        entries = dumped_evals(trainer.cfg.trainer.export_path, step)
        sources = {e["data_source"] for e in entries} | {self.eval_data_source or self.session.config.training.eval_data_source}
        metrics = named_by_data_source(numeric(callback_input.metrics or {}), sources)
        if metrics:
            self.session.log_eval_metrics(metrics, step=step)
        # the eval table too, which registration compares with the base's (the step-0 eval)
        for data_source, rows in dumped_eval_rows(entries).items():
            self.session.log_eval_table(data_source, rows, step)
        # what the policy answered: the first `sample_items` trajectories (the session bounds it too; slicing
        # first keeps the task columns' work on this thread to that many)
        try:
            samples = eval_samples(entries[:self.session.config.tracking.sample_items], self.task_columns)
            if samples:
                self.session.log_samples(samples, step=step)
        except Exception as exc:  # noqa: BLE001 - samples are for looking at: never a reason to stop training
            log.warning("step %s: eval samples not logged: %s", step, exc)

    @blocking
    def on_save(self, trainer, callback_input, control) -> None:
        log_adapter(self.session, callback_input.ckpt_path, callback_input.global_step)

    def on_train_end(self, trainer, callback_input, control) -> None:
        if self.register_best:
            self.session.register_best(self.eval_data_source)


def dumped_evals(export_path: str | None, step: int) -> list[dict]:
    """The trajectories of the eval SkyRL dumped at `step` (`trainer.dump_eval_results`, on by default:
    `<export_path>/dumped_evals/global_step_<step>_evals/<data_source>.jsonl`, one entry per trajectory:
    decoded `input_prompt` and `output_response`, `score`, `env_extras`, `data_source`). Entries without
    an item id are skipped, and so is the aggregated-metrics file (no data source)."""
    folder = Path(export_path or "") / "dumped_evals" / f"global_step_{step}_evals"
    if not export_path or "://" in str(export_path) or not folder.is_dir():
        return []
    entries = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line) if line.strip() else {}
            if "data_source" in entry and entry_id(entry) is not None:
                entries.append(entry)
    return entries


def entry_id(entry: Mapping[str, Any]) -> str | None:
    """The eval item's id in the dataset row's `extra_info` (`id`; datasets written before tasks had ids
    carry a `seed`, the same value)."""
    extras = entry.get("env_extras") or {}
    info = extras.get("extra_info") or extras
    item = info.get("id", info.get(LEGACY_ID))
    return None if item is None else str(item)


def entry_reward(entry: Mapping[str, Any]) -> float:
    """A trajectory's reward: SkyRL dumps a float, or per-token rewards (a list) for multi-turn envs."""
    score = entry.get("score")
    return float(sum(score)) if isinstance(score, list) else float(score or 0.0)


def dumped_eval_rows(entries: list[dict]) -> dict[str, list[dict]]:
    """Eval-table rows (rlops.eval_table) of dumped eval trajectories, by data source: id = the item's id,
    score = its reward, passed when the reward is 1 (a verifiable task's full reward)."""
    rows: dict[str, list[dict]] = {}
    for entry in entries:
        reward = entry_reward(entry)
        rows.setdefault(entry["data_source"], []).append(
            {"id": entry_id(entry), "passed": reward >= 1.0, "score": reward, "extras": {}})
    return rows


def readable(text: Any) -> str:
    """Decoded model text for a table cell: a run of one special token (the hundreds of `<|image_pad|>`
    of an image) shown once, and at most SAMPLE_TEXT_CHARS characters."""
    text = REPEATED_SPECIAL_TOKEN.sub(r"\1", str(text or ""))
    return text if len(text) <= SAMPLE_TEXT_CHARS else text[:SAMPLE_TEXT_CHARS] + " [...]"


def eval_samples(entries: list[dict], task_columns: TaskColumns | None) -> list[dict]:
    """Sample-table rows of dumped eval trajectories: id, prompt, completion, reward, passed and data
    source, with the task's own columns first (`task_columns(entry)`, `Task.skyrl_sample_columns`: e.g.
    an image and how the task read the turns; the same keys for every entry)."""
    rows = []
    for entry in entries:
        reward = entry_reward(entry)
        rows.append({**(task_columns(entry) if task_columns else {}), "id": entry_id(entry),
                     "prompt": readable(entry.get("input_prompt")),
                     "completion": readable(entry.get("output_response")),
                     "reward": reward, "passed": reward >= 1.0, "data_source": entry["data_source"]})
    return rows


def saved_checkpoints(ckpt_path: str | None) -> list[tuple[int, Path]]:
    """The checkpoints SkyRL completed and kept under a local `ckpt_path`: `global_step_<N>` folders up to
    the step of `latest_ckpt_global_step.txt`, which it writes last (trainer.py:1669), so a folder of a
    save cut short is never among them."""
    latest = Path(ckpt_path or "") / "latest_ckpt_global_step.txt"
    if not ckpt_path or "://" in str(ckpt_path) or not latest.is_file():
        return []
    last = int(latest.read_text().strip())
    found = ((int(f.name.rsplit("_", 1)[1]), f) for f in latest.parent.glob("global_step_*")
             if f.is_dir() and f.name.rsplit("_", 1)[1].isdigit())
    return sorted((step, folder) for step, folder in found if step <= last)


def log_adapter(session: RunSession, folder: str | None, step: int) -> bool:
    """Log the LoRA adapter of a checkpoint/export folder once per step. False when there is none here
    (full fine-tuning, or a remote `s3://` ckpt_path the hook cannot snapshot locally)."""
    if not folder or "://" in str(folder):
        log.warning("step %s: checkpoint %r is not a local folder; its adapter is not archived", step, folder)
        return False
    adapter = adapter_dir_of(Path(folder))
    if adapter is None:
        log.warning("step %s: no LoRA adapter (adapter_config.json) under %s", step, folder)
        return False
    return session.log_checkpoint(adapter, step)


class TrackedRayPPOTrainer(RayPPOTrainer):
    """RayPPOTrainer whose HF export (`hf_save_interval`, which fires no callback event) is archived too,
    and whose checkpoint saves first log the step's metrics so far and wait for the session's queued
    points to be spooled (`resume_mode=latest` after a kill -9 then replays every step the tracker lost)."""

    rlops_callback: TrackerCallback | None = None

    def save_checkpoints(self) -> str:
        if self.rlops_callback is not None:
            timings = {f"timing/{k}": v for k, v in self.all_timings.items()}
            self.rlops_callback.log_before_checkpoint(self.global_step, {**self.all_metrics, **timings})
            self.rlops_callback.session.barrier()
        return super().save_checkpoints()

    def save_models(self) -> None:
        super().save_models()
        if self.rlops_callback is not None:
            export = Path(self.cfg.trainer.export_path) / f"global_step_{self.global_step}"
            log_adapter(self.rlops_callback.session, str(export), self.global_step)


def tracker_run_dir(cfg: Any, rlops_config: Config) -> Path:
    """Where the tracker keeps its state: beside the checkpoints when `trainer.ckpt_path` is local; for a
    remote one (`s3://...`) a local folder keyed by that URI (a restart on this machine finds it again)."""
    ckpt_path = str(cfg.trainer.ckpt_path)
    if "://" in ckpt_path:
        local = tracker_state.local_state_dir(rlops_config.data_path, ckpt_path)
        log.warning("trainer.ckpt_path %s is remote: the tracker's state is kept in %s; pass run_dir= a "
                    "folder that moves with the job to keep it across machines", ckpt_path, local)
        return local
    return Path(ckpt_path)


def resume_policy(cfg: Any) -> bool | None:
    """The tracker follows the trainer: `resume_mode=none` trains from step 0, so it gets a new run;
    `latest`/`from_path` continue the stored run (unless it FINISHED) after its last logged step."""
    return False if str(cfg.trainer.resume_mode).lower().endswith("none") else None


class TrackedPPOExp(BasePPOExp):
    """`BasePPOExp` whose run is owned by a RunSession kept beside the checkpoints (`trainer.ckpt_path`),
    so `trainer.resume_mode=latest` after a restart continues the same MLflow run at the trainer's next
    step (steps the resumed trainer replays are logged once)."""

    def __init__(self, cfg: Any, rlops_config: Config, *, run_dir: Path | None = None,
                 eval_data_source: str | None = None, task_columns: TaskColumns | None = None,
                 register_best: bool = True):
        if not isinstance(rlops_config, Config):
            raise TypeError(f"rlops_config must be rlops.config.Config, got {type(rlops_config).__name__}")
        super().__init__(cfg)
        self.rlops_config = rlops_config
        self.run_dir = Path(run_dir) if run_dir else tracker_run_dir(cfg, rlops_config)
        self.eval_data_source = eval_data_source
        self.task_columns = task_columns
        self.register_best = register_best
        self.session: RunSession | None = None
        self.node_monitors: ray_nodes.NodeMonitors | None = None

    def get_tracker(self) -> Tracking:
        # system metrics per Ray node: the session's monitor is this node's, an actor runs each other's
        tracking = self.rlops_config.tracking
        nodes, here = ray_nodes.cluster() if tracking.system_metrics else ([], None)
        self.session = RunSession.start(self.rlops_config, self.run_dir, params=skyrl_params(self.cfg),
                                        tags=skyrl_tags(self.cfg) | ray_nodes.node_tags(nodes) |
                                        {TAG_TASK: self.rlops_config.task.path},  # what `promote verify` scores with
                                        run_name=self.cfg.trainer.run_name, resume=resume_policy(self.cfg),
                                        system_node_id=here)
        self.node_monitors = ray_nodes.NodeMonitors.start(
            [n for n in nodes if n.label != here], self.session.run_id, self.rlops_config.tracking_uri,
            tracking.system_metrics_interval_s, resume=self.session.resumed_after_step >= 0)
        return make_tracking(self.cfg, self.session)

    def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client,
                    generator, colocate_pg) -> TrackedRayPPOTrainer:
        trainer = TrackedRayPPOTrainer(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                                       eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                                       generator=generator, colocate_pg=colocate_pg)
        attach(trainer, self.session, eval_data_source=self.eval_data_source, task_columns=self.task_columns,
               register_best=self.register_best)
        return trainer

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:
            self._end(exc)
            raise
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        if self.node_monitors is not None:
            self.node_monitors.stop()
        if self.session is not None:
            self.session.__exit__(None if exc is None else type(exc), exc, None)  # FINISHED / FAILED / KILLED


def attach(trainer: RayPPOTrainer, session: RunSession, *, eval_data_source: str | None = None,
           task_columns: TaskColumns | None = None, register_best: bool = True) -> TrackerCallback:
    """Register the tracker callback (and the HF-export hook, for a TrackedRayPPOTrainer) on `trainer`."""
    callback = TrackerCallback(session, register_best=register_best, eval_data_source=eval_data_source,
                               task_columns=task_columns)
    trainer.add_callback(callback)
    if isinstance(trainer, TrackedRayPPOTrainer):
        trainer.rlops_callback = callback
    return callback
