"""The tiny offline Qwen3-VL: builds without a hub, reloads with HF_HUB_OFFLINE=1, and sees the image."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from rlops.vlm import MazeVLProcessor, load_processor
from training.tiny_vlm import IMAGE_SIDE_PX, build_tiny_vlm


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


def test_processor_reloads_and_counts_image_tokens(tiny_dir):
    processor = load_processor(tiny_dir)
    assert isinstance(processor, MazeVLProcessor)
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
from rlops.vlm import load_processor
model = Qwen3VLForConditionalGeneration.from_pretrained({str(tiny_dir)!r}).eval()
processor = load_processor({str(tiny_dir)!r})
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
