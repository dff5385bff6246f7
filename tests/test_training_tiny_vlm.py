"""The tiny offline Qwen3-VL: builds without a hub, reloads with HF_HUB_OFFLINE=1 and the stock processor, sees
the image, and has the shape vLLM's CPU engine can serve (the serving tests load it in vLLM itself)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from transformers import AutoProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

from rlops.config import Config
from training.base import TINY_INIT_MARKER, ensure_tiny_init
from training.tiny_vlm import IMAGE_SIDE_PX, build_tiny_vlm

# Head sizes vLLM 0.29's CPU attention backend supports (vllm/v1/attention/backends/cpu_attn.py).
VLLM_CPU_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


def _weights_digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny") / "base", seed=0)


def test_build_is_deterministic_per_seed(tiny_dir, tmp_path):
    same = build_tiny_vlm(tmp_path / "same", seed=0)
    other = build_tiny_vlm(tmp_path / "other", seed=1)
    assert _weights_digest(same) == _weights_digest(tiny_dir)
    assert _weights_digest(other) != _weights_digest(tiny_dir)


def test_folder_has_the_shape_vllm_cpu_serves(tiny_dir):
    text = json.loads((tiny_dir / "config.json").read_text())["text_config"]
    assert text["head_dim"] in VLLM_CPU_HEAD_SIZES
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
    assert text["num_attention_heads"] % text["num_key_value_heads"] == 0
    processor_config = json.loads((tiny_dir / "processor_config.json").read_text())
    assert processor_config["processor_class"] == "Qwen3VLProcessor"
    assert processor_config["video_processor"]["video_processor_type"] == "Qwen3VLVideoProcessor"
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (tiny_dir / name).is_file(), name


def test_processor_reloads_and_counts_image_tokens(tiny_dir):
    processor = AutoProcessor.from_pretrained(str(tiny_dir))
    assert isinstance(processor, Qwen3VLProcessor) and isinstance(processor.video_processor, Qwen3VLVideoProcessor)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "move the blue agent"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    image = Image.fromarray(np.full((225, 225, 3), 255, dtype=np.uint8))
    batch = processor(images=[image], text=[text], return_tensors="pt")
    image_tokens = int((batch["input_ids"] == processor.image_token_id).sum())
    assert image_tokens == (IMAGE_SIDE_PX // 32) ** 2  # 16 px patches, 2x2 merge
    assert processor.tokenizer.decode(processor.tokenizer("right up stop")["input_ids"]) == "right up stop"


def test_reloads_offline_in_a_fresh_process_and_uses_the_image(tiny_dir):
    script = f"""
import numpy as np, torch
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration
from transformers import AutoProcessor
model = Qwen3VLForConditionalGeneration.from_pretrained({str(tiny_dir)!r}).eval()
processor = AutoProcessor.from_pretrained({str(tiny_dir)!r})
text = processor.apply_chat_template([{{"role": "user", "content": [{{"type": "image"}}]}}], add_generation_prompt=True, tokenize=False)
logits = []
for fill in (0, 255):
    batch = processor(images=[Image.fromarray(np.full((175, 175, 3), fill, dtype=np.uint8))], text=[text], return_tensors="pt")
    with torch.no_grad():
        logits.append(model(**batch).logits[0, -1])
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > batch["input_ids"].shape[1]
print("DIFF", float((logits[0] - logits[1]).abs().max()))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    diff = float(proc.stdout.split("DIFF")[-1])
    assert diff > 0, "the next-token logits must depend on the image"


def test_a_stale_cached_init_is_rebuilt(tmp_path):
    """A data dir from before an architecture change holds an init vLLM cannot serve: it is not reused."""
    config = Config.model_validate({"data_dir": str(tmp_path)})
    init = ensure_tiny_init(config)
    marker = init / TINY_INIT_MARKER
    built = marker.read_text()
    weights = _weights_digest(init)
    (init / "model.safetensors").write_bytes(b"stale")
    assert ensure_tiny_init(config) == init and (init / "model.safetensors").read_bytes() == b"stale"
    marker.write_text(json.dumps({**json.loads(built), "architecture_sha256": "an older architecture"}))
    ensure_tiny_init(config)
    assert _weights_digest(init) == weights and marker.read_text() == built


def test_vision_cache_gives_the_towers_own_features_and_encodes_each_image_once(tiny_dir):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from tasks.maze import MazeTask
    from training.evaluation import pil_image
    from training.vision_cache import VisionCache

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(str(tiny_dir))
    items = MazeTask(MazeTask.Options()).eval_items("maze_2d/local7")[:3]
    images = [pil_image(it) for it in items for _ in range(4)]  # GRPO's repeated prompts: 3 distinct images
    pixels = processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        plain = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        cache = VisionCache.install(model)
        cached = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        again = model.model.get_image_features(pixels["pixel_values"][: len(pixels["pixel_values"]) // 4],
                                               pixels["image_grid_thw"][:3])
    assert (cache.misses, cache.hits) == (3, 9 + 3)
    assert all(torch.equal(a, b) for a, b in zip(plain.pooler_output, cached.pooler_output))
    assert all(torch.equal(a, b) for a, b in zip(plain.deepstack_features[0], cached.deepstack_features[0]))
    assert torch.equal(again.pooler_output[0], plain.pooler_output[0])
    assert not any(p.requires_grad for p in model.model.visual.parameters())
