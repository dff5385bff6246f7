"""The image-only Qwen3-VL processor shared by the trainer and the serving engine.

Why it exists: `Qwen3VLProcessor` always builds its video processor, which needs torchvision, and the
registry's torchvision builds do not work with the CPU torch used here. Text + images is all the maze
task needs, so this subclass drops the video half and keeps everything else (chat template, image
tokens, `mm_token_type_ids`). It lives beside the config so that serving can load it without importing
`training/`.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

PROCESSOR_CONFIG = "processor_config.json"


class MazeVLProcessor(Qwen3VLProcessor):
    """Qwen3-VL processor with an image processor and a tokenizer, no video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # ProcessorMixin derives the sub-processors from this signature, so the video slot disappears.
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(model_dir: str | Path):
    """The processor saved in `model_dir`: ours for the tiny offline model, `AutoProcessor` otherwise.

    Production checkpoints (e.g. `Qwen/Qwen3-VL-8B-Instruct`) carry the stock processor and need
    torchvision; the tiny model's `processor_config.json` names `MazeVLProcessor`.
    """
    path = Path(model_dir)
    config_file = path / PROCESSOR_CONFIG
    if config_file.is_file():
        declared = json.loads(config_file.read_text()).get("processor_class")
        if declared == MazeVLProcessor.__name__:
            return MazeVLProcessor.from_pretrained(str(path))
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))
