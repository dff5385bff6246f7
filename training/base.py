"""The local trainer's base model: a set `training.local.base_model` (checked against this machine), or the
tiny random-init Qwen3-VL warm-started by supervised fine-tuning on the task's demonstrations, built once
and cached in the data dir (serving's default base)."""
from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Callable

from rlops.config import Config
from rlops.task import Task, TaskItem
from training.evaluation import evaluate, pil_image, prompt_messages

TINY_INIT_DIR = "tiny-init"
TINY_INIT_MARKER = "rlops-tiny-init.json"
SFT_MARKER = "rlops-sft.json"
# CPU training keeps fp32 weights, grads of the LoRA part and activations: a rough bytes-per-parameter
# bound used to refuse models that cannot fit before anything is loaded.
CPU_BYTES_PER_PARAM = 6


class TrainingError(RuntimeError):
    """A training request that cannot run, with a message saying why and what to do instead."""


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


def _sft_settings(config: Config, task: Task) -> dict:
    """What the cached SFT base depends on, the task's eval items included: SFT never trains on them, so a
    base built against other eval sets could have seen today's."""
    from training.tiny_vlm import architecture_digest

    local = config.training.local
    return {"architecture_sha256": architecture_digest(),
            "steps": local.sft_steps, "learning_rate": local.sft_learning_rate, "seed": local.seed,
            "task": config.task.path, "task_options": task.options.model_dump(mode="json"),
            "excluded_items_sha256": task.items_digest([it for source in task.eval_sets()
                                                        for it in task.eval_items(source)])}


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


def ensure_base(config: Config, task: Task, *, log: Callable[[str], None] = print) -> Path:
    """The local trainer's base: `training.local.base_model` if set (checked against this machine), else
    the tiny model SFT-warm-started on the task's demonstrations, built once and cached in the data dir
    (the marker file records the SFT settings; other settings rebuild it)."""
    local = config.training.local
    if local.base_model:
        check_fits_machine(local.base_model)
        return Path(local.base_model)  # an HF id stays a relative "path" that from_pretrained resolves
    out = sft_base_dir(config)
    marker = out / SFT_MARKER
    settings = _sft_settings(config, task)
    if marker.is_file() and json.loads(marker.read_text()).get("settings") == settings:
        return out
    init = ensure_tiny_init(config)
    log(f"SFT warm start: {local.sft_steps} steps on {task.name} demonstrations -> {out}")
    report = sft(init, out, config, task)
    marker.write_text(json.dumps({"settings": settings, **report}, indent=2) + "\n")
    return out


class _SftCollator:
    """Batches (image, prompt, target answer) with the loss on the answer tokens only. A target is the
    task's demonstration, drawn anew each time an item comes round."""

    def __init__(self, processor, task: Task, seed: int = 0):
        self.processor = processor
        self.task = task
        self.rng = random.Random(seed)
        self._prompt_lengths: dict[str, int] = {}

    def __call__(self, items: list[TaskItem]) -> dict:
        processor = self.processor
        processor.tokenizer.padding_side = "right"
        images = [pil_image(it) for it in items]
        texts = [processor.apply_chat_template(prompt_messages(it.text, self.task.demonstration(it, self.rng)),
                                               tokenize=False) for it in items]
        batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
        labels = batch["input_ids"].clone()
        for row, (item, image) in enumerate(zip(items, images)):
            labels[row, :self._prompt_length(item, image)] = -100
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch

    def _prompt_length(self, item: TaskItem, image) -> int:
        """Tokens before the answer; one per prompt text (a task's images have one size)."""
        if item.text not in self._prompt_lengths:
            prompt = self.processor.apply_chat_template(prompt_messages(item.text), tokenize=False,
                                                        add_generation_prompt=True)
            self._prompt_lengths[item.text] = len(self.processor(text=[prompt], images=[image])["input_ids"][0])
        return self._prompt_lengths[item.text]


def sft_items(config: Config, task: Task) -> list[TaskItem]:
    """The SFT set: the task's demonstration items (never an eval item)."""
    return task.demonstration_items(max(64, config.training.local.sft_steps * 16 // 3))


def sft(init_dir: Path, out_dir: Path, config: Config, task: Task) -> dict:
    """Supervised warm start of the full tiny model (transformers `Trainer`) on the task's demonstrations."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer, TrainingArguments

    local = config.training.local
    processor = AutoProcessor.from_pretrained(str(init_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(init_dir), dtype=torch.float32)
    items = sft_items(config, task)
    work = Path(out_dir).with_name(Path(out_dir).name + ".sft-work")
    args = TrainingArguments(
        output_dir=str(work), max_steps=max(1, local.sft_steps), per_device_train_batch_size=16,
        learning_rate=local.sft_learning_rate, lr_scheduler_type="cosine", warmup_steps=min(20, local.sft_steps // 10),
        weight_decay=0.0, logging_steps=50, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False, dataloader_num_workers=0, seed=local.seed,
    )
    started = time.monotonic()
    if local.sft_steps > 0:
        Trainer(model=model, args=args, train_dataset=items, data_collator=_SftCollator(processor, task, local.seed)).train()
    seconds = time.monotonic() - started
    pass_rate = evaluate(model, processor, task, task.eval_sets()[0]).pass_rate
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    return {"sft_seconds": round(seconds, 1), "eval_pass_rate": pass_rate}
