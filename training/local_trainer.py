"""The local CPU trainer: SFT warm start (cached in the data dir), then TRL GRPO + LoRA on the maze task,
tracked by `tracker.RunSession`, evaluated on the fixed local eval set, best checkpoint registered.

Single-turn variant: the model sees the maze image once and answers the whole path as words
(`right right down stop`); the answer is walked from the start (`training.maze.walk_answer`). The
production SkyRL job is multi-turn (one action per turn); both score the same unshaped task reward.

Entry point for the CLI, the demo and the bench: `train(config, run_dir, budget_s=..., steps=..., fast=...)`.
"""
from __future__ import annotations

import functools
import json
import math
import random
import re
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from transformers import ProgressCallback, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rlops.config import Config
from rlops.layout import TAG_BASE_MODEL_SHA256, TAG_TRAINER
from training import datasets as ds
from training.maze import Maze, WalkResult, answer_moves, answer_text, random_walk, render, solve, walk_answer
from training.vision_cache import VisionCache

TINY_INIT_DIR = "tiny-init"
TINY_INIT_MARKER = "rlops-tiny-init.json"
SFT_MARKER = "rlops-sft.json"
# LoRA on the language model only: the vision tower stays as the base trained it.
# An explicit list, not a regex: promotion checks the adapter's target modules against the served base.
# In Qwen3-VL these names exist only in the language model (the vision tower uses qkv/proj/linear_fc*).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# CPU training keeps fp32 weights, grads of the LoRA part and activations: a rough bytes-per-parameter
# bound used to refuse models that cannot fit before anything is loaded.
CPU_BYTES_PER_PARAM = 6


class TrainingError(RuntimeError):
    """A training request that cannot run, with a message saying why and what to do instead."""


# ------------------------------------------------------------------------------------------- prompts


def prompt_messages(answer: str | None = None) -> list[dict]:
    """The single-turn conversation: image + instruction (+ the answer, for SFT)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ds.LOCAL_PROMPT}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages


def maze_image(maze: Maze):
    from PIL import Image

    return Image.fromarray(render(maze))


# ------------------------------------------------------------------------------------------- rewards


def shaped_reward(result: WalkResult) -> float:
    """GRPO's training reward. Solving pays 1.0; otherwise partial credit for getting closer (BFS distance)
    and for ending the answer with `stop`, minus a little per move past the target: without that
    penalty the policy learnt to stop ending its answers (seen here). Eval uses `result.solved` only."""
    if result.solved:
        return 1.0 - 0.05 * result.moves_past_goal
    progress = max(0.0, (result.start_distance - result.final_distance) / max(1, result.start_distance))
    return 0.5 * progress + (0.1 if result.stopped else 0.0) - 0.05 * result.moves_past_goal


def completion_text(completion: Any) -> str:
    """TRL passes conversational completions as message lists, plain ones as strings."""
    if isinstance(completion, str):
        return completion
    return " ".join(m["content"] if isinstance(m.get("content"), str)
                    else " ".join(p.get("text", "") for p in m.get("content") or []) for m in completion)


def sample_row(maze: Maze, answer: str, walk: WalkResult) -> dict:
    """One row of a sample table: the maze image (rendered later, off the training thread), the answer,
    how it was read and what it scored."""
    return {"image": functools.partial(maze_image, maze), "seed": maze.seed, "prompt": ds.LOCAL_PROMPT,
            "completion": answer, "moves": " ".join(answer_moves(answer)), "reward": shaped_reward(walk),
            "solved": walk.solved}


def maze_reward(prompts: list, completions: list, layout: list[str], **_: Any) -> list[float]:
    """TRL reward function; `layout` is the dataset column naming each prompt's maze."""
    return [shaped_reward(walk_answer(ds.maze_from_layout(lay), completion_text(c)))
            for c, lay in zip(completions, layout)]


def solved_reward(prompts: list, completions: list, layout: list[str], **_: Any) -> list[float]:
    """The unshaped task reward, logged beside the shaped one (weight 0)."""
    return [float(walk_answer(ds.maze_from_layout(lay), completion_text(c)).solved)
            for c, lay in zip(completions, layout)]


# ---------------------------------------------------------------------------------------------- eval


@dataclass
class EvalResult:
    """Greedy solve rate (the headline: what picks the best checkpoint) and, when asked for, the solve rate
    of the sampling policy: pass@1 at the training temperature, the mean over `samples` answers per maze.
    GRPO optimises the second one; logging both shows whether it changed the greedy answer or only
    sharpened sampling towards it."""

    data_source: str
    solve_rate: float
    ci95: tuple[float, float]
    rows: list[dict]
    sampled_rate: float | None = None
    sampled_ci95: tuple[float, float] | None = None
    samples: list[dict] = field(default_factory=list)  # greedy answers, per maze (the tracker logs a bounded few)
    seconds: float = 0.0  # wall time of the eval


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def maze_mean_interval(per_maze: list[float], z: float = 1.96) -> tuple[float, float]:
    """95% normal interval of a mean over mazes. Several samples of one maze are not independent trials,
    so the spread is taken between per-maze rates (a Wilson interval over all samples would be too narrow)."""
    n = len(per_maze)
    if n < 2:
        return (0.0, 1.0)
    mean = sum(per_maze) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in per_maze) / (n - 1))
    return (max(0.0, mean - z * sd / math.sqrt(n)), min(1.0, mean + z * sd / math.sqrt(n)))


# `eval/<data_source>/sampled_avg_score`: pass@1 at the training temperature, beside greedy `avg_score`.
SAMPLED_METRIC = "sampled_avg_score"
# Sampled evals draw from their own generator, seeded the same at every checkpoint: the training RNG is
# left alone, and checkpoints are compared on the same random numbers.
EVAL_SAMPLING_SEED = 1234


def generate_answers(model, processor, mazes: list[Maze], max_new_tokens: int, batch_size: int = 64,
                     temperature: float = 0.0) -> list[str]:
    """One answer per maze (left-padded batches): greedy at temperature 0, else sampled from the full
    distribution at `temperature` (no top-k/top-p, like GRPO's rollouts)."""
    import torch

    tokenizer = processor.tokenizer
    previous_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    prompt = processor.apply_chat_template(prompt_messages(), tokenize=False, add_generation_prompt=True)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    answers: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(EVAL_SAMPLING_SEED)
            for i in range(0, len(mazes), batch_size):
                chunk = mazes[i:i + batch_size]
                batch = processor(text=[prompt] * len(chunk), images=[maze_image(m) for m in chunk],
                                  padding=True, return_tensors="pt")
                out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     **sampling)
                answers += processor.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = previous_side
        model.train(was_training)
    return answers


def evaluate(model, processor, maze_set: ds.MazeSet, max_new_tokens: int, samples: int = 0,
             temperature: float = 1.0) -> EvalResult:
    """Greedy solve rate (unshaped task reward) on a named maze set, with its eval-table rows (id = the maze's
    seed; steps and final distance as extras); with `samples` > 0
    also pass@1 of `samples` answers per maze sampled at `temperature`."""
    mazes = maze_set.mazes()
    answers = generate_answers(model, processor, mazes, max_new_tokens)
    walks = [walk_answer(m, a) for m, a in zip(mazes, answers)]
    rows = [{"id": m.seed, "passed": w.solved, "score": float(w.solved),
             "extras": {"steps": w.steps, "final_distance": w.final_distance}} for m, w in zip(mazes, walks)]
    solved = sum(w.solved for w in walks)
    result = EvalResult(maze_set.data_source, solved / len(mazes), wilson_interval(solved, len(mazes)), rows,
                        samples=[sample_row(m, a, w) for m, a, w in zip(mazes, answers, walks)])
    if samples > 0:
        repeated = [m for m in mazes for _ in range(samples)]
        answers = generate_answers(model, processor, repeated, max_new_tokens, temperature=temperature)
        hits = [walk_answer(m, a).solved for m, a in zip(repeated, answers)]
        per_maze = [sum(hits[i:i + samples]) / samples for i in range(0, len(hits), samples)]
        result.sampled_rate = sum(per_maze) / len(per_maze)
        result.sampled_ci95 = maze_mean_interval(per_maze)
    return result


# ---------------------------------------------------------------------------------------------- base


def estimate_parameters(model_source: str) -> int | None:
    """Parameter count from a local folder's safetensors sizes, or from an `-8B`-style name; None if unknown."""
    path = Path(model_source)
    if path.is_dir():
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return weights // 2 if weights else None  # checkpoints are published in 16-bit
    match = re.search(r"(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])", model_source.rsplit("/", 1)[-1])
    return int(float(match.group(1)) * 1e9) if match else None


def check_fits_machine(model_source: str, available_bytes: int | None = None) -> None:
    """Refuse, before loading, a base model too large for CPU training on this machine."""
    import psutil

    params = estimate_parameters(model_source)
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if params is not None and params * CPU_BYTES_PER_PARAM > available:
        need = params * CPU_BYTES_PER_PARAM / 2**30
        raise TrainingError(
            f"base model {model_source} (~{params / 1e9:.1f}B parameters) needs ~{need:.0f} GiB for CPU "
            f"training; this machine has {available / 2**30:.1f} GiB available. Run the SkyRL job on a GPU "
            f"cluster instead (training/train_job.sh), or use the tiny offline base (training.local.base_model unset)."
        )


def tiny_init_dir(config: Config) -> Path:
    return config.data_path / "models" / TINY_INIT_DIR


def sft_base_dir(config: Config) -> Path:
    """Where the SFT warm-started tiny base lives: serving's default base (`config.base_model_source`)."""
    return config.data_path / "models" / "base"


def _sft_settings(config: Config) -> dict:
    """What the cached SFT base depends on, eval layouts included: SFT never trains on them, so a base
    built against other eval sets could have seen today's."""
    from training.tiny_vlm import architecture_digest

    local = config.training.local
    excluded = ds.local_eval_sets(local.eval_size)
    return {"architecture_sha256": architecture_digest(),
            "steps": local.sft_steps, "learning_rate": local.sft_learning_rate, "seed": local.seed,
            "optimal_fraction": local.sft_optimal_fraction,
            "maze_sizes": local.maze_sizes, "eval_size": local.eval_size,
            "excluded_layouts_sha256": ds.layout_digest(m for s in excluded for m in s.mazes())}


def ensure_tiny_init(config: Config) -> Path:
    """The random-init tiny model, rebuilt when its seed or `training.tiny_vlm`'s architecture changed (an
    older data dir may hold a build that vLLM cannot serve)."""
    from training.tiny_vlm import architecture_digest, build_tiny_vlm

    path = tiny_init_dir(config)
    marker = path / TINY_INIT_MARKER
    built = {"architecture_sha256": architecture_digest(), "seed": config.training.local.seed}
    if not (marker.is_file() and json.loads(marker.read_text()) == built):
        build_tiny_vlm(path, seed=config.training.local.seed)
        marker.write_text(json.dumps(built) + "\n")
    return path


def ensure_base(config: Config, *, log: Callable[[str], None] = print) -> Path:
    """The local trainer's base: `training.local.base_model` if set (checked against this machine), else
    the tiny model SFT-warm-started on BFS-optimal answers, built once and cached in the data dir (the
    marker file records the SFT settings; other settings rebuild it)."""
    local = config.training.local
    if local.base_model:
        check_fits_machine(local.base_model)
        return Path(local.base_model)  # an HF id stays a relative "path" that from_pretrained resolves
    out = sft_base_dir(config)
    marker = out / SFT_MARKER
    settings = _sft_settings(config)
    if marker.is_file() and json.loads(marker.read_text()).get("settings") == settings:
        return out
    init = ensure_tiny_init(config)
    log(f"SFT warm start: {local.sft_steps} steps ({local.sft_optimal_fraction:.0%} BFS-optimal answers, the rest "
        f"random walks) -> {out}")
    report = sft(init, out, config)
    marker.write_text(json.dumps({"settings": settings, **report}, indent=2) + "\n")
    return out


class _SftCollator:
    """Batches (image, prompt, target answer) with the loss on the answer tokens only. A target is the
    BFS-optimal answer with probability `optimal_fraction`, else a random walk (`training.maze.random_walk`),
    drawn anew each time a maze comes round."""

    def __init__(self, processor, optimal_fraction: float = 1.0, seed: int = 0):
        self.processor = processor
        self.optimal_fraction = optimal_fraction
        self.rng = random.Random(seed)
        self.prompt = processor.apply_chat_template(prompt_messages(), tokenize=False, add_generation_prompt=True)

    def __call__(self, mazes: list[Maze]) -> dict:
        processor = self.processor
        processor.tokenizer.padding_side = "right"
        images = [maze_image(m) for m in mazes]
        texts = [processor.apply_chat_template(prompt_messages(answer_text(self.target(m))), tokenize=False) for m in mazes]
        batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
        prompt_len = len(processor(text=[self.prompt], images=images[:1])["input_ids"][0])
        labels = batch["input_ids"].clone()
        labels[:, :prompt_len] = -100  # every prompt has the same length: one image of a fixed size
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch

    def target(self, maze: Maze) -> list[int]:
        return solve(maze) if self.rng.random() < self.optimal_fraction else random_walk(maze, self.rng)


def sft_mazes(config: Config) -> list[Maze]:
    """The SFT set: mazes of `maze_sizes`, the fixed eval and held-out layouts excluded."""
    local = config.training.local
    return ds.training_mazes(local.maze_sizes, max(64, local.sft_steps * 16 // 3),
                             exclude=ds.local_eval_sets(local.eval_size))


def sft(init_dir: Path, out_dir: Path, config: Config) -> dict:
    """Supervised warm start of the full tiny model (transformers `Trainer`) on random walks that read the
    walls, with `sft_optimal_fraction` of BFS-optimal answers among them."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer, TrainingArguments

    local = config.training.local
    processor = AutoProcessor.from_pretrained(str(init_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(init_dir), dtype=torch.float32)
    mazes = sft_mazes(config)
    work = Path(out_dir).with_name(Path(out_dir).name + ".sft-work")
    args = TrainingArguments(
        output_dir=str(work), max_steps=max(1, local.sft_steps), per_device_train_batch_size=16,
        learning_rate=local.sft_learning_rate, lr_scheduler_type="cosine", warmup_steps=min(20, local.sft_steps // 10),
        weight_decay=0.0, logging_steps=50, save_strategy="no", report_to="none", use_cpu=True,
        remove_unused_columns=False, dataloader_num_workers=0, seed=local.seed,
    )
    started = time.monotonic()
    if local.sft_steps > 0:
        Trainer(model=model, args=args, train_dataset=mazes, data_collator=_SftCollator(processor, local.sft_optimal_fraction, local.seed)).train()
    seconds = time.monotonic() - started
    solve_rate = evaluate(model, processor, ds.local_eval_set(local.eval_size), local.max_completion_tokens).solve_rate
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    return {"sft_seconds": round(seconds, 1), "eval_solve_rate": solve_rate}


# ---------------------------------------------------------------------------------------------- GRPO


@dataclass
class TrainResult:
    run_id: str
    base_model: str
    steps: int
    seconds: float
    seconds_per_step: float
    eval_data_source: str
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, fixed-eval greedy solve rate)
    sampled_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, pass@1 at the training temperature)
    registered_version: str | None = None
    registration_refused: str | None = None  # why nothing registered: no checkpoint beat the base
    registration_evidence: str | None = None  # how the registered checkpoint beat the base
    adapter_dir: Path | None = None  # the last checkpoint's adapter folder

    # The fixed-eval score before training (step 0) and of the last checkpoint, for each decoding.
    @property
    def before(self) -> float | None:
        return self.curve[0][1] if self.curve else None

    @property
    def after(self) -> float | None:
        return self.curve[-1][1] if self.curve else None

    @property
    def best(self) -> tuple[int, float] | None:
        """(step, fixed-eval greedy solve rate) of the best eval, the earliest on a tie (step 0 = the base)."""
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


GRPO_PROMPTS = 2048


def grpo_mazes(config: Config) -> list[Maze]:
    """GRPO prompts: mazes of the eval size only. On the smaller ones the SFT base is nearly always right,
    so half of all groups had identical rewards (no signal); on the eval size alone ~10% had (tried here)."""
    local = config.training.local
    return ds.training_mazes([local.eval_size], GRPO_PROMPTS, exclude=ds.local_eval_sets(local.eval_size))


def _grpo_dataset(mazes: list[Maze]):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": ds.LOCAL_PROMPT}], "image": maze_image(m),
             "layout": json.dumps(m.layout(), sort_keys=True)} for m in mazes]
    return Dataset.from_list(rows)


def run_datasets(config: Config, train_mazes: list[Maze]) -> list:
    """The run's inputs: the GRPO prompt set and the fixed eval set, both built in memory from seeds."""
    from tracker.inputs import EVAL, TRAINING, DatasetRef

    eval_set = ds.local_eval_set(config.training.local.eval_size)
    size = config.training.local.eval_size
    return [
        DatasetRef(f"maze_2d/local{size}", ds.layout_digest(train_mazes), source_type="generated",
                   source=f"training.local_trainer.grpo_mazes: {len(train_mazes)} mazes {size}x{size} from seed "
                          f"{ds.TRAIN_SEED_START}, eval layouts excluded", context=TRAINING, rows=len(train_mazes)),
        DatasetRef(eval_set.data_source, ds.layout_digest(eval_set.mazes()), source_type="generated",
                   source=f"training.datasets.local_eval_set({size}): seeds {eval_set.seeds[0]}-{eval_set.seeds[-1]}",
                   context=EVAL, rows=len(eval_set.seeds)),
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


def group_rows(layouts: list[str], completions: list[str], rewards: list[float], group_size: int) -> list[dict]:
    """Sample rows of one GRPO generation batch: consecutive `group_size` completions share a prompt; the
    advantage is GRPO's default (TRL `scale_rewards="group"`): (reward - group mean) / (group std + 1e-4)."""
    rows = []
    for start in range(0, len(completions) - group_size + 1, group_size):
        group = rewards[start:start + group_size]
        mean, std = sum(group) / len(group), statistics.stdev(group) if len(group) > 1 else 0.0
        maze = ds.maze_from_layout(layouts[start])
        for i in range(start, start + group_size):
            walk = walk_answer(maze, completions[i])
            rows.append({"group": start // group_size, **sample_row(maze, completions[i], walk),
                         "reward": rewards[i], "advantage": (rewards[i] - mean) / (std + 1e-4)})
    return rows


class GroupSampleCallback(TrainerCallback):
    """Keeps the last generation batch the training reward scored (TRL calls it with every batch) and logs
    the first groups of it at the logging steps the tracker samples: what the policy tried, and what GRPO made of it."""

    def __init__(self, session, group_size: int):
        self.session, self.group_size = session, group_size
        self._batch: tuple[list[str], list[str], list[float]] | None = None

    def observe(self, reward: Callable) -> Callable:
        """`reward`, under its own name (TRL logs it by name), keeping each batch it scores."""
        @functools.wraps(reward)
        def scored(prompts: list, completions: list, layout: list[str], **kwargs: Any) -> list[float]:
            rewards = reward(prompts, completions, layout, **kwargs)
            self._batch = (list(layout), [completion_text(c) for c in completions], rewards)
            return rewards
        return scored

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._batch is not None and state.is_world_process_zero and self.session.train_samples_due(state.global_step):
            self.session.log_samples(group_rows(*self._batch, self.group_size), step=state.global_step, kind="train")
        self._batch = None


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


def training_rewards(local) -> tuple[Callable, Callable]:
    """(the reward GRPO trains on, the other one logged beside it with weight 0): the task reward, or with
    `reward: shaped` the shaped one."""
    return (maze_reward, solved_reward) if local.reward == "shaped" else (solved_reward, maze_reward)


def grpo_trainer(config: Config, base: Path, run_dir: Path, steps: int, callbacks: list, processor,
                 mazes: list[Maze] | None = None, observe: Callable[[Callable], Callable] = lambda reward: reward):
    """TRL's GRPOTrainer for the maze: LoRA on the language model, the training reward (`observe`d, e.g. to
    keep its batches) and the other logged beside it, checkpoints every min(eval, ckpt) interval."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText
    from trl import GRPOConfig, GRPOTrainer

    local = config.training.local
    torch.manual_seed(local.seed)
    # TRL reads this deprecated transformers property at every generation: one FutureWarning per step
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    model = AutoModelForImageTextToText.from_pretrained(str(base), dtype=torch.float32)
    VisionCache.install(model)  # LoRA leaves the tower frozen: each maze image is encoded once
    args = GRPOConfig(
        output_dir=str(run_dir), max_steps=steps, learning_rate=local.learning_rate, lr_scheduler_type=local.lr_schedule,
        per_device_train_batch_size=local.num_generations * local.prompts_per_step,
        num_generations=local.num_generations, max_completion_length=local.max_completion_tokens,
        temperature=local.temperature, beta=local.beta,
        reward_weights=[1.0, 0.0],
        use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
        # full checkpoints (optimizer, scheduler, RNG, global step): a rerun on the run dir resumes from them
        save_strategy="steps", save_steps=min(local.ckpt_interval, local.eval_interval), save_only_model=False,
        seed=local.seed, dataloader_num_workers=0, remove_unused_columns=False,
    )
    peft_config = LoraConfig(r=local.lora_rank, lora_alpha=local.lora_alpha, lora_dropout=0.0,
                             target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trained, beside = training_rewards(local)
    trainer = GRPOTrainer(model=model, reward_funcs=[observe(trained), beside], args=args,
                          train_dataset=_grpo_dataset(grpo_mazes(config) if mazes is None else mazes), processing_class=processor,
                          peft_config=peft_config, callbacks=callbacks)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(QuietProgressCallback)
    return trainer


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
          log: Callable[[str], None] = print) -> TrainResult:
    """Run SFT (cached) if needed, GRPO + LoRA with the tracker, eval on the fixed set after each
    checkpoint, and register the best checkpoint (alias `candidate`). `fast` skips SFT and uses the
    random-init tiny base (tests) and registers without comparing with that base. Returns the curve and the
    before/after solve rates; a best checkpoint that did not beat the step-0 eval registers nothing
    (`registration_refused` says why).

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
    steps = local.steps if steps is None else steps
    budget_s = local.budget_s if budget_s is None else budget_s
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise TrainingError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(budget_s, (int, float)) or isinstance(budget_s, bool) or not budget_s > 0:
        raise TrainingError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    base = ensure_tiny_init(config) if fast else ensure_base(config, log=log)
    if fast:  # a plumbing check on the random-init base: registration does not ask a checkpoint to beat it
        config = config.model_copy(update={"tracking": config.tracking.model_copy(update={"beat_base_max_p": None})})
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base_id, base_sha256 = base_identity(config, base)
    train_mazes = grpo_mazes(config)
    datasets = run_datasets(config, train_mazes)
    params = {**local.model_dump(), "base_model": base_id, "fast": fast, "steps": steps, "budget_s": budget_s,
              "eval_data_source": datasets[1].name, "eval_layout_sha256": datasets[1].layout_sha256,
              "train_layout_sha256": datasets[0].layout_sha256}
    result = TrainResult(run_id="", base_model=base_id, steps=0, seconds=0.0, seconds_per_step=0.0,
                         eval_data_source=datasets[1].name)
    tags = {TAG_TRAINER: "trl-grpo-local", "rlops.task": "maze_2d-single-turn"}
    if base_sha256:
        tags[TAG_BASE_MODEL_SHA256] = base_sha256
    with RunSession.start(_run_config(config, base_id), run_dir, params=params, resume=resume, tags=tags,
                          run_name=run_name or lineage.run_name(base_id, local.lora_rank),
                          datasets=datasets) as session:
        result.run_id = session.run_id
        if session.archived is not None:
            archive_checkpoints(run_dir, session.archived)
            log(f"run dir {run_dir} held a finished run: moved it to {session.archived}; new run {session.run_id}")
        checkpoint = resume_checkpoint(run_dir, session.checkpoint_steps)
        if checkpoint is not None:
            log(f"resuming run {session.run_id} from {checkpoint}")
        processor = AutoProcessor.from_pretrained(str(base))

        eval_set = ds.local_eval_set(local.eval_size)
        scored_steps = {step for step, _ in session.eval_history(eval_key(eval_set.data_source))}

        def score(model) -> EvalResult:
            started = time.monotonic()
            scored = evaluate(model, processor, eval_set, local.max_completion_tokens, local.eval_samples,
                              local.temperature)
            scored.seconds = time.monotonic() - started
            return scored

        def record(step: int, scored: EvalResult) -> None:
            extra = {} if scored.sampled_rate is None else {SAMPLED_METRIC: scored.sampled_rate}
            session.log_eval(scored.data_source, scored.solve_rate, scored.rows, step=step, metrics=extra)
            session.log_samples(scored.samples, step=step)
            session.log_metrics({"perf/eval_s": scored.seconds}, step=step)

        groups = GroupSampleCallback(session, local.num_generations)
        budget = BudgetCallback(budget_s)
        callbacks = [TrackerCallback(session), budget, groups,
                     FixedEvalCallback(score, record, already_scored=scored_steps.__contains__)]
        trainer = grpo_trainer(config, base, run_dir, steps, callbacks, processor, train_mazes, groups.observe)
        started = time.monotonic()
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        result.seconds = round(time.monotonic() - started, 1)
        result.steps = trainer.state.global_step
        done_here = result.steps - (int(checkpoint.name.rsplit("-", 1)[1]) if checkpoint else 0)
        result.seconds_per_step = round(budget.step_seconds / max(1, done_here), 3)  # GRPO alone, evals apart
        # the curves as the run logged them, earlier sessions of a resumed run included
        result.curve = session.eval_history(eval_key(eval_set.data_source))
        result.sampled_curve = session.eval_history(eval_key(eval_set.data_source, SAMPLED_METRIC))
        version = session.register_best(result.eval_data_source)
        result.registered_version = version.version if version is not None else None
        result.registration_refused = session.registration_refused
        result.registration_evidence = session.registration_evidence
    last = run_dir / f"checkpoint-{result.steps}"
    result.adapter_dir = last if last.is_dir() else None
    return result
