"""The local CPU trainer: TRL GRPO + LoRA on any task (rlops.task), tracked by `tracker.RunSession`,
evaluated on the task's fixed eval set after each checkpoint, best checkpoint registered.

Single-turn: the model sees the item's image once and answers in one completion, which the task scores.
The base is `training.base` (the tiny model warm-started on the task's demonstrations, or a set one).

Entry point for the CLI, the demo and the bench: `train(config, run_dir, budget_s=..., steps=..., fast=...)`.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import ProgressCallback, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rlops.config import Config
from rlops.layout import TAG_BASE_MODEL_SHA256, TAG_TRAINER
from rlops.task import TAG_TASK, TASK_PARAM_PREFIX, Task, TaskItem
from training.base import TrainingError, ensure_base, ensure_tiny_init
from training.prompt_sets import PromptSet, mixed_items
from training.evaluation import SAMPLED_METRIC, EvalResult, completion_text, evaluate, pil_image, sample_row
from training.lean_decode import LeanDecoder
from training.lean_loss import LeanLoss
from training.rope_index import RopeIndex
from training.vision_cache import DistinctRows, PixelCache, SharedImage, VisionCache, shared

# LoRA on the language model only: the vision tower stays as the base trained it.
# An explicit list, not a regex: promotion checks the adapter's target modules against the served base.
# In Qwen3-VL these names exist only in the language model (the vision tower uses qkv/proj/linear_fc*).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GRPO_PROMPTS = 2048
SHARED_IMAGES = 64  # rendered pictures kept: a step draws prompts_per_step of them


# ---------------------------------------------------------------------------------------------- GRPO


@dataclass
class TrainResult:
    run_id: str
    base_model: str
    steps: int
    seconds: float
    seconds_per_step: float
    eval_data_source: str
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, fixed-eval greedy pass rate)
    sampled_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, pass@1 at the training temperature)
    registered_version: str | None = None
    registration_refused: str | None = None  # why nothing registered: no checkpoint beat the base
    registration_evidence: str | None = None  # how the registered checkpoint beat the base
    adapter_dir: Path | None = None  # the last checkpoint's adapter folder
    offline: bool = False  # tracked offline: the run, and its registration, wait for `rlops runs sync`

    # The fixed-eval score before training (step 0) and of the last checkpoint, for each decoding.
    @property
    def before(self) -> float | None:
        return self.curve[0][1] if self.curve else None

    @property
    def after(self) -> float | None:
        return self.curve[-1][1] if self.curve else None

    @property
    def best(self) -> tuple[int, float] | None:
        """(step, fixed-eval greedy pass rate) of the best eval, the earliest on a tie (step 0 = the base)."""
        return max(self.curve, key=lambda point: (point[1], -point[0])) if self.curve else None

    @property
    def sampled_before(self) -> float | None:
        return self.sampled_curve[0][1] if self.sampled_curve else None

    @property
    def sampled_after(self) -> float | None:
        return self.sampled_curve[-1][1] if self.sampled_curve else None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["adapter_dir"] = str(self.adapter_dir) if self.adapter_dir else None
        return data | {k: getattr(self, k) for k in ("before", "after", "best", "sampled_before", "sampled_after")}


def item_row(item: TaskItem) -> dict:
    """A GRPO dataset row: what TRL passes to the reward functions, the item rebuilt from id and target."""
    return {"prompt": [{"role": "user", "content": item.text}], "item_id": item.id, "item_text": item.text,
            "target": json.dumps(item.target, sort_keys=True)}


def row_item(item_id: str, text: str, target: str) -> TaskItem:
    """The item of a dataset row as the scorer sees it (id and target; no image: scoring never renders)."""
    return TaskItem(item_id, text, image=lambda: None, target=json.loads(target))


def _grpo_dataset(items: list[TaskItem], shared_images: bool):
    """The items as TRL's dataset. With `shared_images`, a row's picture is rendered when the row is drawn and
    `shared` by its repeats in the step (one object: DistinctRows processes it once); else, as TRL takes it,
    an image column, PNG-encoded up front and decoded anew for every repeat."""
    from datasets import Dataset

    if not shared_images:
        return Dataset.from_list([item_row(it) | {"image": pil_image(it)} for it in items])

    @functools.lru_cache(maxsize=SHARED_IMAGES)
    def image(index: int) -> SharedImage:
        return shared(pil_image(items[index]))

    rows = Dataset.from_list([item_row(it) | {"row": i} for i, it in enumerate(items)])
    return rows.with_transform(lambda batch: batch | {"image": [image(i) for i in batch["row"]]})


def run_datasets(config: Config, task: Task, train_items: list[TaskItem]) -> list:
    """The run's inputs: the GRPO prompt set and the fixed eval set, both built in memory by the task."""
    from tracker.inputs import EVAL, TRAINING, DatasetRef

    eval_source = task.eval_sets()[0]
    eval_items = task.eval_items(eval_source)
    return [
        DatasetRef(f"{task.name}/train", task.items_digest(train_items), source_type="generated",
                   source=f"{config.task.path}.train_items({len(train_items)}): eval items excluded",
                   context=TRAINING, rows=len(train_items)),
        DatasetRef(eval_source, task.items_digest(eval_items), source_type="generated",
                   source=f"{config.task.path}.eval_items({eval_source!r})", context=EVAL, rows=len(eval_items)),
    ]


def base_identity(config: Config, base: Path) -> tuple[str, str | None]:
    """(portable id, content sha256) of the run's base: the served id when it is serving's base."""
    from tracker.lineage import content_digest, portable_base_id

    return portable_base_id(base, {config.base_model_source: config.serving.base_model_id}), content_digest(base)


def _run_config(config: Config, base_model: str) -> Config:
    """The config the run records: this run's base (portable id) and LoRA rank (tags on every checkpoint)."""
    run_config = config.model_copy(deep=True)
    run_config.training.base_model = base_model
    run_config.training.lora_rank = config.training.local.lora_rank
    return run_config


class FixedEvalCallback(TrainerCallback):
    """Score the model at the start and after every checkpoint (so each score measures the checkpoint of
    its step); `on_result(step, EvalResult)` records it. A step `already_scored` (the checkpoint a resumed
    run starts from) is not scored again."""

    def __init__(self, score: Callable[[Any], EvalResult], on_result: Callable[[int, EvalResult], None],
                 already_scored: Callable[[int], bool] = lambda step: False):
        self.score, self.on_result, self.already_scored = score, on_result, already_scored

    def _eval(self, model, step: int) -> None:
        if not self.already_scored(step):
            self.on_result(step, self.score(model))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._eval(model, state.global_step)

    def on_save(self, args, state, control, model=None, **kwargs):
        self._eval(model, state.global_step)


class ThreadsBackCallback(TrainerCallback):
    """Gives torch `threads` back at the first step begun once `released` is set: the core that
    `training.local.torch_threads` left to a process starting beside training idles once that one is up."""

    def __init__(self, released: threading.Event, threads: int, log: Callable[[str], None]):
        self.released, self.threads, self.log = released, threads, log
        self.done = False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.done and self.released.is_set():
            torch.set_num_threads(self.threads)  # per thread in OpenMP: here, in the thread that trains
            self.done = True
            self.log(f"step {state.global_step}: torch back on {self.threads} threads")


def group_rows(task: Task, items: list[TaskItem], completions: list[str], rewards: list[float],
               group_size: int) -> list[dict]:
    """Sample rows of one GRPO generation batch: consecutive `group_size` completions share a prompt; the
    advantage is GRPO's default (TRL `scale_rewards="group"`): (reward - group mean) / (group std + 1e-4)."""
    rows = []
    for start in range(0, len(completions) - group_size + 1, group_size):
        group = rewards[start:start + group_size]
        mean, std = sum(group) / len(group), statistics.stdev(group) if len(group) > 1 else 0.0
        for i in range(start, start + group_size):
            outcome = task.score(items[i], completions[i])
            rows.append({"group": start // group_size, **sample_row(task, items[i], completions[i], outcome, rewards[i]),
                         "advantage": (rewards[i] - mean) / (std + 1e-4)})
    return rows


class GroupSampleCallback(TrainerCallback):
    """Keeps the last generation batch the training reward scored (TRL calls it with every batch) and logs
    the first groups of it at the logging steps the tracker samples: what the policy tried, and what GRPO made of it."""

    def __init__(self, session, task: Task, items: dict[str, TaskItem], group_size: int):
        self.session, self.task, self.items, self.group_size = session, task, items, group_size
        self._batch: tuple[list[TaskItem], list[str], list[float]] | None = None

    def observe(self, reward: Callable) -> Callable:
        """`reward`, under its own name (TRL logs it by name), keeping each batch it scores."""
        @functools.wraps(reward)
        def scored(prompts: list, completions: list, item_id: list[str], **kwargs: Any) -> list[float]:
            rewards = reward(prompts, completions, item_id=item_id, **kwargs)
            self._batch = ([self.items[i] for i in item_id], [completion_text(c) for c in completions], rewards)
            return rewards
        return scored

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._batch is not None and state.is_world_process_zero and self.session.train_samples_due(state.global_step):
            self.session.log_samples(group_rows(self.task, *self._batch, self.group_size), step=state.global_step,
                                     kind="train")
        self._batch = None


@dataclass
class TrainProgress:
    """Where a run stands, for a live line: the step, the mean training reward of the last logged step and
    the fixed eval's greedy pass rate at the latest scored step."""
    step: int
    steps: int
    reward: float | None = None
    last_eval: float | None = None

    def line(self) -> str:
        reward = "-" if self.reward is None else f"{self.reward:.2f}"
        last_eval = "-" if self.last_eval is None else f"{self.last_eval:.3f}"
        return f"step {self.step}/{self.steps}, reward {reward}, last eval {last_eval}"


class ProgressReport(TrainerCallback):
    """Tells `report` after every logged step and every fixed eval."""

    def __init__(self, report: Callable[[TrainProgress], None], steps: int):
        self.report, self.progress = report, TrainProgress(0, steps)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.progress.step = state.global_step
        if logs and "reward" in logs:
            self.progress.reward = logs["reward"]
        self.report(self.progress)

    def evaluated(self, step: int, pass_rate: float) -> None:
        self.progress.step, self.progress.last_eval = step, pass_rate
        self.report(self.progress)


class QuietProgressCallback(ProgressCallback):
    """The progress bar without a printed dict per step (every step is logged to MLflow instead)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class BudgetCallback(TrainerCallback):
    """Stop at the time budget or the last step, with a checkpoint either way. The budget counts the time
    inside GRPO steps only: the evals and checkpoint saves between them do not take steps away."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.step_seconds = 0.0
        self._step_started = time.monotonic()

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds += time.monotonic() - self._step_started
        if self.step_seconds >= self.budget_s or state.global_step >= state.max_steps:
            control.should_training_stop = True
            control.should_save = True


def training_rewards(task: Task) -> tuple[Callable, Callable]:
    """TRL reward functions over the dataset's item columns: (the task's training reward, its eval score
    logged beside it with weight 0: the same figure unless the task shapes its reward)."""
    def task_reward(prompts: list, completions: list, item_id: list[str], item_text: list[str], target: list[str],
                    **_: Any) -> list[float]:
        return [task.reward(row_item(*row), completion_text(c)) for c, row in zip(completions, zip(item_id, item_text, target))]

    def task_score(prompts: list, completions: list, item_id: list[str], item_text: list[str], target: list[str],
                   **_: Any) -> list[float]:
        return [task.score(row_item(*row), completion_text(c)).score
                for c, row in zip(completions, zip(item_id, item_text, target))]

    return task_reward, task_score


def grpo_trainer(config: Config, task: Task, base: Path, run_dir: Path, steps: int, callbacks: list, processor,
                 items: list[TaskItem], observe: Callable[[Callable], Callable] = lambda reward: reward):
    """TRL's GRPOTrainer on the task's items: LoRA on the language model, the training reward (`observe`d,
    e.g. to keep its batches) and the eval score logged beside it, checkpoints every min(eval, ckpt) interval."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText
    with environ_kept():  # TRL's import sets VLLM_LOGGING_LEVEL=ERROR, which every process started after it inherits
        from trl import GRPOConfig, GRPOTrainer

    local = config.training.local
    torch.manual_seed(local.seed)
    # TRL reads this deprecated transformers property at every generation: one FutureWarning per step
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    model = AutoModelForImageTextToText.from_pretrained(str(base), dtype=torch.float32)
    VisionCache.install(model)  # LoRA leaves the tower frozen: each image is encoded once
    if local.lean_rollouts:  # bench/README.md: where a GRPO step's time went
        LeanDecoder.install(model)
        RopeIndex.install(model)
        callbacks = [*callbacks, DistinctRows(processor), PixelCache(processor.image_processor)]
    args = GRPOConfig(
        output_dir=str(run_dir), max_steps=steps, learning_rate=local.learning_rate, lr_scheduler_type=local.lr_schedule,
        per_device_train_batch_size=local.num_generations * local.prompts_per_step,
        num_generations=local.num_generations, max_completion_length=task.answer_length,
        temperature=local.temperature, beta=local.beta,
        reward_weights=[1.0, 0.0],
        use_cpu=not torch.cuda.is_available(), bf16=False,  # a GPU where there is one (scripts/gpu_offline_run.sh)
        gradient_checkpointing=False, report_to="none", logging_steps=1,
        # full checkpoints (optimizer, scheduler, RNG, global step): a rerun on the run dir resumes from them
        save_strategy="steps", save_steps=min(local.ckpt_interval, local.eval_interval), save_only_model=False,
        seed=local.seed, dataloader_num_workers=0, remove_unused_columns=False,
    )
    peft_config = LoraConfig(r=local.lora_rank, lora_alpha=local.lora_alpha, lora_dropout=0.0,
                             target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trained, beside = training_rewards(task)
    trainer = GRPOTrainer(model=model, reward_funcs=[observe(trained), beside], args=args,
                          train_dataset=_grpo_dataset(items, local.lean_rollouts), processing_class=processor,
                          peft_config=peft_config, callbacks=callbacks)
    if local.lean_rollouts:  # on the model TRL gave its fused head: the loss's forward, outside HF's text modules
        LeanLoss.install(trainer.model.get_base_model(), args.temperature)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(QuietProgressCallback)
    return trainer


@contextlib.contextmanager
def environ_kept():
    """os.environ as it was on the way in, whatever an import inside changed in it."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update((key, value) for key, value in before.items() if os.environ.get(key) != value)


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op threads set to `threads` inside (None: left as they are), restored on the way out."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resume_checkpoint(run_dir: Path, logged_steps: frozenset[int]) -> Path | None:
    """The latest complete checkpoint of this run in `run_dir` (one the tracker logged: a checkpoint
    saved just before a crash, whose hook never ran, is redone)."""
    from transformers.trainer import TRAINER_STATE_NAME

    found = [(int(p.name.rsplit("-", 1)[1]), p) for p in Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
             if p.name.rsplit("-", 1)[1].isdigit() and (p / TRAINER_STATE_NAME).is_file()]
    found = [(step, p) for step, p in found if step in logged_steps]
    return max(found)[1] if found else None


def archive_checkpoints(run_dir: Path, dest: Path) -> None:
    """Move a finished run's checkpoints beside its archived tracker state (a new run starts at step 0)."""
    for folder in Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        folder.rename(dest / folder.name)


def train(config: Config, run_dir: Path, *, budget_s: float | None = None, steps: int | None = None,
          fast: bool = False, resume: bool | None = None, run_name: str | None = None,
          log: Callable[[str], None] = print,
          report: Callable[[TrainProgress], None] = lambda progress: None,
          prompts: PromptSet | None = None, prompts_share: float = 0.5,
          threads_back: threading.Event | None = None) -> TrainResult:
    """Run SFT (cached) if needed, GRPO + LoRA with the tracker, eval on the fixed set after each
    checkpoint, and register the best checkpoint (alias `candidate`). `fast` skips SFT and uses the
    random-init tiny base (tests) and registers without comparing with that base. Returns the curve and the
    before/after pass rates; a best checkpoint that did not beat the step-0 eval registers nothing
    (`registration_refused` says why). `report` hears each step's reward and each eval (a live line).
    `prompts` (a set exported from production traces) makes `prompts_share` of the GRPO prompts; it is
    one of the run's dataset inputs. With `training.local.torch_threads` set, `threads_back` (once set) gives
    torch its own thread count back at the next step.

    A run dir whose run did not finish continues it: the trainer resumes from its latest checkpoint
    (weights, optimizer, scheduler, RNG, global step) and the MLflow run continues after its last step.
    A FINISHED one starts a new run (its checkpoints move to `previous-<run_id>/`) unless `resume=True`
    (continue it, e.g. with more steps); `resume=False` always starts a new run. A new run is named
    `run_name`, default `grpo-<base>-r<rank>-<date>`."""
    from transformers import AutoProcessor

    from tracker import RunSession, lineage
    from tracker.hf import TrackerCallback
    from tracker.naming import eval_key

    local = config.training.local
    task = config.load_task()
    steps = local.steps if steps is None else steps
    budget_s = local.budget_s if budget_s is None else budget_s
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise TrainingError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(budget_s, (int, float)) or isinstance(budget_s, bool) or not budget_s > 0:
        raise TrainingError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    base = ensure_tiny_init(config) if fast else ensure_base(config, task, log=log)
    if fast:  # a plumbing check on the random-init base: registration does not ask a checkpoint to beat it
        config = config.model_copy(update={"tracking": config.tracking.model_copy(update={"beat_base_max_p": None})})
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base_id, base_sha256 = base_identity(config, base)
    if not 0 < prompts_share <= 1:
        raise TrainingError(f"prompts_share must be in (0, 1], got {prompts_share!r}")
    train_items = task.train_items(GRPO_PROMPTS)
    if prompts is not None:
        train_items = mixed_items(train_items, prompts, prompts_share, local.seed)
    datasets = run_datasets(config, task, train_items) + ([prompts.dataset()] if prompts is not None else [])
    params = {**local.model_dump(), "base_model": base_id, "fast": fast, "steps": steps, "budget_s": budget_s,
              "task": config.task.path, **{f"{TASK_PARAM_PREFIX}{k}": v for k, v in task.options.model_dump(mode="json").items()},
              "eval_data_source": datasets[1].name, "eval_layout_sha256": datasets[1].layout_sha256,
              "train_layout_sha256": datasets[0].layout_sha256,
              **({"prompts": prompts.name, "prompts_sha256": prompts.digest, "prompts_share": prompts_share}
                 if prompts is not None else {})}
    result = TrainResult(run_id="", base_model=base_id, steps=0, seconds=0.0, seconds_per_step=0.0,
                         eval_data_source=datasets[1].name)
    tags = {TAG_TRAINER: "trl-grpo-local", TAG_TASK: config.task.path}
    if base_sha256:
        tags[TAG_BASE_MODEL_SHA256] = base_sha256
    with RunSession.start(_run_config(config, base_id), run_dir, params=params, resume=resume, tags=tags,
                          run_name=run_name or lineage.run_name(base_id, local.lora_rank),
                          datasets=datasets) as session:
        result.run_id, result.offline = session.run_id, session.offline
        if session.archived is not None:
            archive_checkpoints(run_dir, session.archived)
            log(f"run dir {run_dir} held a finished run: moved it to {session.archived}; new run {session.run_id}")
        checkpoint = resume_checkpoint(run_dir, session.checkpoint_steps)
        if checkpoint is not None:
            log(f"resuming run {session.run_id} from {checkpoint}")
        processor = AutoProcessor.from_pretrained(str(base))

        eval_source = task.eval_sets()[0]
        scored_steps = {step for step, _ in session.eval_history(eval_key(eval_source))}

        def score(model) -> EvalResult:
            started = time.monotonic()
            scored = evaluate(model, processor, task, eval_source, local.eval_samples, local.temperature)
            scored.seconds = time.monotonic() - started
            return scored

        def record(step: int, scored: EvalResult) -> None:
            extra = {} if scored.sampled_rate is None else {SAMPLED_METRIC: scored.sampled_rate}
            session.log_eval(scored.data_source, scored.pass_rate, scored.rows, step=step, metrics=extra)
            session.log_samples(scored.samples, step=step)
            session.log_metrics({"perf/eval_s": scored.seconds}, step=step)
            live.evaluated(step, scored.pass_rate)

        groups = GroupSampleCallback(session, task, {it.id: it for it in train_items}, local.num_generations)
        budget = BudgetCallback(budget_s)
        live = ProgressReport(report, steps)
        callbacks = [TrackerCallback(session), budget, groups, live,
                     FixedEvalCallback(score, record, already_scored=scored_steps.__contains__)]
        if threads_back is not None and local.torch_threads is not None:
            callbacks.append(ThreadsBackCallback(threads_back, torch.get_num_threads(), log))
        trainer = grpo_trainer(config, task, base, run_dir, steps, callbacks, processor, train_items, groups.observe)
        started = time.monotonic()
        with torch_threads(local.torch_threads):
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        result.seconds = round(time.monotonic() - started, 1)
        result.steps = trainer.state.global_step
        done_here = result.steps - (int(checkpoint.name.rsplit("-", 1)[1]) if checkpoint else 0)
        result.seconds_per_step = round(budget.step_seconds / max(1, done_here), 3)  # GRPO alone, evals apart
        # the curves as the run logged them, earlier sessions of a resumed run included
        result.curve = session.eval_history(eval_key(eval_source))
        result.sampled_curve = session.eval_history(eval_key(eval_source, SAMPLED_METRIC))
        version = session.register_best(result.eval_data_source)
        result.registered_version = version.version if version is not None else None
        result.registration_refused = session.registration_refused
        result.registration_evidence = session.registration_evidence
    last = run_dir / f"checkpoint-{result.steps}"
    result.adapter_dir = last if last.is_dir() else None
    return result
