"""The local trainer's decode loop outside HF `generate` gives HF's own tokens: greedy and sampled (same RNG),
with LoRA adapters on or off, left-padded rows and GRPO's repeated prompts; a setting it does not implement
goes to HF's `generate`. The preprocessing caches give the processor's own answer."""
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
from training.local_trainer import LORA_TARGETS
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


@pytest.mark.parametrize("args", [["--speed-steps", "5"], ["--speed-rounds", "0"]])
def test_local_training_bench_refuses_a_speed_phase_it_cannot_time(args):
    bench = Path(__file__).resolve().parents[1] / "bench" / "local_training.py"
    proc = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--speed-steps must be 0 or at least 10" in proc.stderr and "Traceback" not in proc.stderr
