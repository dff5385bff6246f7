"""The local trainer's decode loop outside HF `generate` gives HF's own tokens: greedy and sampled (same RNG),
with LoRA adapters on or off, left-padded rows and GRPO's repeated prompts; a setting it does not implement
goes to HF's `generate`. Its loss forward gives TRL's fused head's log-probs, entropies and LoRA gradients.
The preprocessing caches give the processor's own answer."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForImageTextToText, AutoProcessor

from tasks.maze import MazeTask
from training.evaluation import pil_image, prompt_messages
from training.lean_decode import LeanDecoder
from training.lean_loss import LeanLoss
from training.local_trainer import LORA_TARGETS, environ_kept
from training.tiny_vlm import build_tiny_vlm
from training.vision_cache import DistinctRows, PixelCache, VisionCache


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = build_tiny_vlm(tmp_path_factory.mktemp("tiny") / "base", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(base), dtype=torch.float32).eval()
    VisionCache.install(model)
    processor = AutoProcessor.from_pretrained(str(base))
    processor.tokenizer.padding_side = "left"
    items = MazeTask(MazeTask.Options()).eval_items("maze_2d/local7")[:6]
    # rows of three lengths (left padding), each prompt twice (GRPO's repeats)
    texts = [processor.apply_chat_template(prompt_messages(it.text + " move" * (i % 3)), tokenize=False,
                                           add_generation_prompt=True) for i, it in enumerate(items)] * 2
    batch = processor(text=texts, images=[pil_image(it) for it in items] * 2, padding=True, return_tensors="pt")
    assert len(set((batch["attention_mask"] == 0).sum(-1).tolist())) == 3
    # init_lora_weights=False: random B as well as A, so the adapters change the answers
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights=False))
    return model, peft.eval(), processor, batch, (texts, items)


def _both(model, peft, batch, **settings):
    """(HF's answer, the lean decoder's answer) from the same RNG state."""
    original = model.generate
    decoder = LeanDecoder.install(model)
    try:
        answers = []
        for generate in (original, decoder.generate):
            model.generate = generate
            torch.manual_seed(7)
            answers.append(peft.generate(**batch, max_new_tokens=12, **settings))
    finally:
        model.generate = original
    return answers, decoder


@pytest.mark.parametrize("settings", [{"do_sample": False}, {"do_sample": True, "temperature": 0.5, "top_k": 0, "top_p": 1.0}],
                         ids=["greedy", "sampled"])
def test_lean_decoding_gives_hfs_tokens(setup, settings):
    model, peft, processor, batch, _ = setup
    (hf, lean), decoder = _both(model, peft, batch, pad_token_id=processor.tokenizer.pad_token_id, **settings)
    assert (decoder.calls, decoder.fallbacks) == (1, 0)
    assert torch.equal(hf, lean)
    with peft.disable_adapter():
        (hf_base, lean_base), _ = _both(model, peft, batch, pad_token_id=processor.tokenizer.pad_token_id, **settings)
    assert torch.equal(hf_base, lean_base)
    assert not torch.equal(hf_base, hf), "the adapters must change the answers, or the test shows nothing"


def test_a_setting_it_does_not_implement_goes_to_hf(setup):
    model, peft, processor, batch, _ = setup
    (hf, lean), decoder = _both(model, peft, batch, do_sample=True, top_k=3)
    assert (decoder.calls, decoder.fallbacks) == (0, 1)
    assert torch.equal(hf, lean)


def test_pixel_cache_gives_the_processors_own_pixels(setup):
    _, _, processor, _, (texts, items) = setup
    images = [[pil_image(it)] for it in items] * 2
    plain = processor(text=texts, images=images, padding=True, return_tensors="pt")
    config = processor.to_json_string()
    cache = PixelCache(processor.image_processor)
    cache.attach()
    try:
        cached = [processor(text=texts, images=images, padding=True, return_tensors="pt") for _ in range(2)]
    finally:
        cache.detach()
    assert (cache.misses, cache.hits) == (6, 6 + 12)
    for again in cached:
        assert set(again) == set(plain) and all(torch.equal(again[k], plain[k]) for k in plain)
    assert processor.to_json_string() == config, "detached, the processor saves as it was"


def test_distinct_rows_give_the_processors_own_batch(setup):
    _, _, processor, _, (texts, items) = setup
    images = [[pil_image(it)] for it in items] * 2
    conversations = [[{"role": "user", "content": [{"type": "image", "image": image[0]}, {"type": "text", "text": it.text}]}]
                     for image, it in zip(images, items * 2)]
    rendered = processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    calls = {  # TRL's two calls per step: tensors for the loss, the chat template's lists for generation
        "tensors": lambda: processor(text=texts, images=images, padding=True, return_tensors="pt"),
        "lists": lambda: processor.apply_chat_template(conversation=conversations, add_generation_prompt=True,
                                                       tokenize=True, return_dict=True),
        "tensors of the lists' rows": lambda: processor(text=rendered, images=images, padding=True, return_tensors="pt"),
        "all distinct": lambda: processor(text=texts[:6], images=images[:6], padding=True, return_tensors="pt"),
        "text only": lambda: processor(text=[it.text for it in items] * 2, padding=True, return_tensors="pt"),
        "positional": lambda: processor(images, texts, padding=True, return_tensors="pt"),
    }
    plain = {name: call() for name, call in calls.items()}
    config = processor.to_json_string()
    rows = DistinctRows(processor)
    rows.attach()
    try:
        split = {name: call() for name, call in calls.items()}
    finally:
        rows.detach()
    assert (rows.rows, rows.processed) == (36, 12), ("the three calls with repeats processed their 6 distinct rows "
                                                     "each, but the same rows asked again were not processed again")
    for name in calls:
        assert list(split[name]) == list(plain[name]), name
        for key, value in plain[name].items():
            same = torch.equal(split[name][key], value) if isinstance(value, torch.Tensor) else split[name][key] == value
            assert same, (name, key)
    assert type(processor) is rows.stock and processor.to_json_string() == config, "detached, the processor is stock"


def test_text_layers_it_does_not_write_out_go_to_hf(setup):
    model, peft, processor, batch, _ = setup
    text = model.config.get_text_config()
    text.attention_bias = True  # a projection bias the lean step has no term for
    try:
        (hf, lean), decoder = _both(model, peft, batch, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    finally:
        text.attention_bias = False
    assert (decoder.calls, decoder.fallbacks) == (0, 1)
    assert torch.equal(hf, lean)


@pytest.mark.parametrize("lora", [{"target_modules": [*LORA_TARGETS, "embed_tokens"]},
                                  {"target_modules": LORA_TARGETS, "lora_dropout": 0.1}], ids=["embeddings", "dropout"])
def test_adapters_it_does_not_merge_go_to_hf(setup, lora):
    """An adapter on the token embeddings (a decode step reads their weight as it is) or with dropout (no term
    for it in the merged weights) is HF's to run."""
    base, _, processor, batch, _ = setup
    model = AutoModelForImageTextToText.from_pretrained(base.name_or_path, dtype=torch.float32)
    VisionCache.install(model)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **lora)).eval()
    (hf, lean), decoder = _both(model, peft, batch, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    assert (decoder.calls, decoder.fallbacks) == (0, 1)
    assert torch.equal(hf, lean)


def test_lean_loss_gives_trls_log_probs_entropies_and_lora_gradients(setup):
    with environ_kept():  # TRL's import sets VLLM_LOGGING_LEVEL: the suite's later Ray nodes would inherit it
        from trl.trainer.utils import add_fused_lm_head
    model, _, _, batch, _ = setup
    torch.manual_seed(3)
    fresh = AutoModelForImageTextToText.from_pretrained(model.name_or_path, dtype=torch.float32)
    VisionCache.install(fresh)
    peft = get_peft_model(fresh, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights=False)).train()
    add_fused_lm_head(fresh, temperature=0.5, outputs=("log_probs", "entropy"))  # as GRPOTrainer does
    # completions after the left-padded prompts, right-padded to three lengths, scored as TRL scores them
    rows, length = batch["input_ids"].shape[0], 6
    completions = torch.randint(0, fresh.config.get_text_config().vocab_size, (rows, length))
    completion_mask = (torch.arange(length) < length - torch.arange(rows).remainder(3).unsqueeze(1)).long()
    inputs = {"input_ids": torch.cat([batch["input_ids"], completions], 1),
              "attention_mask": torch.cat([batch["attention_mask"], completion_mask], 1),
              "mm_token_type_ids": torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completions)], 1),
              "pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    labels[:, :-length] = -100

    def scored(**extra):
        peft.zero_grad()
        out = peft(**inputs, **extra, labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        return out, {name: p.grad.clone() for name, p in peft.named_parameters() if p.requires_grad}

    fused, fused_grads = scored()
    loss = LeanLoss.install(fresh, temperature=0.5)
    lean, lean_grads = scored()
    assert (loss.calls, loss.fallbacks) == (1, 0)
    assert torch.equal(lean.label_mask, fused.label_mask) and int(lean.label_mask.sum()) == 4 * (3 * length - 3)
    for field in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(lean, field), getattr(fused, field), rtol=1e-4, atol=1e-5, msg=field)
    assert set(lean_grads) == set(fused_grads) and len(lean_grads) == 2 * 7 * 2  # A and B of 7 projections, 2 layers
    for name, grad in fused_grads.items():
        assert grad.abs().sum() > 0, name
        # the same gradient up to float rounding (merged weights sum in another order): ~3e-6 of its largest entry
        assert (lean_grads[name] - grad).abs().max() <= 2e-5 * grad.abs().max(), name
    again, _ = scored(output_hidden_states=True)  # an input it does not take goes to TRL's head
    assert (loss.calls, loss.fallbacks) == (1, 1)
    torch.testing.assert_close(again.log_probs, fused.log_probs)


@pytest.mark.parametrize("args", [["--speed-steps", "5"], ["--speed-rounds", "0"]])
def test_local_training_bench_refuses_a_speed_phase_it_cannot_time(args):
    bench = Path(__file__).resolve().parents[1] / "bench" / "local_training.py"
    proc = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--speed-steps must be 0 or at least 10" in proc.stderr and "Traceback" not in proc.stderr
