"""The local trainer's eval: a task's eval set answered by the model in-process (left-padded batches) and
scored by the task, with the intervals and sample rows the tracker logs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlops.task import Outcome, Task, TaskItem

# `eval/<data_source>/sampled_avg_score`: pass@1 at the training temperature, beside greedy `avg_score`.
SAMPLED_METRIC = "sampled_avg_score"
# Sampled evals draw from their own generator, seeded the same at every checkpoint: the training RNG is
# left alone, and checkpoints are compared on the same random numbers.
EVAL_SAMPLING_SEED = 1234


def prompt_messages(text: str, answer: str | None = None) -> list[dict]:
    """The single-turn conversation as the HF processor takes it: image + the item's text (+ the answer, for SFT)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages


def pil_image(item: TaskItem):
    from PIL import Image

    return Image.fromarray(item.image())


def completion_text(completion: Any) -> str:
    """TRL passes conversational completions as message lists, plain ones as strings."""
    if isinstance(completion, str):
        return completion
    return " ".join(m["content"] if isinstance(m.get("content"), str)
                    else " ".join(p.get("text", "") for p in m.get("content") or []) for m in completion)


def sample_row(task: Task, item: TaskItem, answer: str, outcome: Outcome, reward: float) -> dict:
    """One row of a sample table: the item's image (rendered later, off the training thread), the answer,
    how the task read it and what it scored."""
    return {"image": item.image, "id": item.id, "prompt": item.text, "completion": answer,
            **task.sample_columns(item, answer), "reward": reward, "passed": outcome.passed}


@dataclass
class EvalResult:
    """Greedy pass rate (the headline: what picks the best checkpoint) and, when asked for, the pass rate
    of the sampling policy: pass@1 at the training temperature, the mean over `samples` answers per item.
    GRPO optimises the second one; logging both shows whether it changed the greedy answer or only
    sharpened sampling towards it."""

    data_source: str
    pass_rate: float
    ci95: tuple[float, float]
    rows: list[dict]
    sampled_rate: float | None = None
    sampled_ci95: tuple[float, float] | None = None
    samples: list[dict] = field(default_factory=list)  # greedy answers, per item (the tracker logs a bounded few)
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


def item_mean_interval(per_item: list[float], z: float = 1.96) -> tuple[float, float]:
    """95% normal interval of a mean over items. Several samples of one item are not independent trials,
    so the spread is taken between per-item rates (a Wilson interval over all samples would be too narrow)."""
    n = len(per_item)
    if n < 2:
        return (0.0, 1.0)
    mean = sum(per_item) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in per_item) / (n - 1))
    return (max(0.0, mean - z * sd / math.sqrt(n)), min(1.0, mean + z * sd / math.sqrt(n)))


def generate_answers(model, processor, items: list[TaskItem], max_new_tokens: int, batch_size: int = 64,
                     temperature: float = 0.0) -> list[str]:
    """One answer per item (left-padded batches): greedy at temperature 0, else sampled from the full
    distribution at `temperature` (no top-k/top-p, like GRPO's rollouts)."""
    import torch

    tokenizer = processor.tokenizer
    previous_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    prompts: dict[str, str] = {}
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    answers: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(EVAL_SAMPLING_SEED)
            for i in range(0, len(items), batch_size):
                chunk = items[i:i + batch_size]
                texts = [prompts.setdefault(it.text, processor.apply_chat_template(
                    prompt_messages(it.text), tokenize=False, add_generation_prompt=True)) for it in chunk]
                batch = processor(text=texts, images=[pil_image(it) for it in chunk], padding=True, return_tensors="pt").to(model.device)
                out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     **sampling)
                answers += processor.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = previous_side
        model.train(was_training)
    return answers


def evaluate(model, processor, task: Task, data_source: str, samples: int = 0, temperature: float = 1.0) -> EvalResult:
    """Greedy pass rate of the task's eval set `data_source`, with its eval-table rows; with `samples` > 0
    also pass@1 of `samples` answers per item sampled at `temperature`."""
    items = task.eval_items(data_source)
    answers = generate_answers(model, processor, items, task.answer_length)
    outcomes = [task.score(it, a) for it, a in zip(items, answers)]
    passed = sum(o.passed for o in outcomes)
    result = EvalResult(data_source, passed / len(items), wilson_interval(passed, len(items)), [o.row() for o in outcomes],
                        samples=[sample_row(task, it, a, o, task.reward(it, a))
                                 for it, a, o in zip(items, answers, outcomes)])
    if samples > 0:
        repeated = [it for it in items for _ in range(samples)]
        answers = generate_answers(model, processor, repeated, task.answer_length, temperature=temperature)
        hits = [task.score(it, a).passed for it, a in zip(repeated, answers)]
        per_item = [sum(hits[i:i + samples]) / samples for i in range(0, len(hits), samples)]
        result.sampled_rate = sum(per_item) / len(per_item)
        result.sampled_ci95 = item_mean_interval(per_item)
    return result
