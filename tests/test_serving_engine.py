"""The transformers + peft CPU engine in-process (no Ray cluster): adapter residency, streaming with stop,
request validation, adapter folder checks. The Ray Serve path is covered by test_serving_app."""
from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest

from serving.engines.base import EngineRequestError
from serving.engines.transformers_engine import check_adapter_folder, chat_to_template, decode_data_url_image


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny base and two random (non-zero) LoRA adapters with only .json/.safetensors files."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from training.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("engine")
    base = build_tiny_vlm(root / "base")
    adapters = []
    for seed in (1, 2):
        import torch

        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForImageTextToText.from_pretrained(str(base)),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        out = root / f"adapter-{seed}"
        model.save_pretrained(str(out))
        (out / "README.md").unlink(missing_ok=True)
        adapters.append(out)
    return base, adapters


def make_engine(base: Path, max_loras: int = 4):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    from serving.app import CPU_ENGINE_KEY
    from serving.engines.transformers_engine import TransformersEngine

    config = LLMConfig(model_loading_config={"model_id": "base", "model_source": str(base)},
                       engine_kwargs={"max_loras": max_loras, "max_lora_rank": 8},
                       experimental_configs={CPU_ENGINE_KEY: {"torch_threads": 1, "default_max_tokens": 6}})
    engine = TransformersEngine(config)
    asyncio.run(engine.start())
    return engine


def disk(model_id: str, path: Path, int_id: int):
    from ray.llm._internal.serve.core.configs.llm_config import DiskMultiplexConfig

    return DiskMultiplexConfig(model_id=model_id, max_total_tokens=None, local_path=str(path), lora_assigned_int_id=int_id)


def collect(agen) -> list:
    async def run():
        return [item async for item in agen]

    return asyncio.run(run())


def chat(model: str, **kwargs):
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    return ChatCompletionRequest(model=model, messages=[{"role": "user", "content": "navigate the maze"}], **kwargs)


def test_adapters_are_selected_per_request_and_evicted_lru(tiny):
    base, (first, second) = tiny
    engine = make_engine(base, max_loras=1)
    asyncio.run(engine.resolve_lora(disk("base:a-v1", first, 1)))
    [one] = collect(engine.chat(chat("base:a-v1", temperature=0)))
    [plain] = collect(engine.chat(chat("base", temperature=0)))
    asyncio.run(engine.resolve_lora(disk("base:a-v2", second, 2)))  # evicts a-v1 (max_loras=1)
    [two] = collect(engine.chat(chat("base:a-v2", temperature=0)))
    [gone] = collect(engine.chat(chat("base:a-v1", temperature=0)))
    assert gone.error.code == 404 and "not loaded" in gone.error.message
    texts = {one.choices[0].message.content, two.choices[0].message.content, plain.choices[0].message.content}
    assert len(texts) == 3  # base, adapter 1 and adapter 2 answer differently
    [again] = collect(engine.chat(chat("base", temperature=0)))
    assert again.choices[0].message.content == plain.choices[0].message.content  # base unaffected by adapters
    assert one.usage.completion_tokens <= 6 and one.usage.prompt_tokens > 0


def test_stream_honours_stop_and_reports_usage(tiny):
    base, _ = tiny
    engine = make_engine(base)
    [full] = collect(engine.chat(chat("base", temperature=0, max_tokens=6)))
    words = full.choices[0].message.content.split()
    assert len(words) >= 2
    events = collect(engine.chat(chat("base", temperature=0, max_tokens=6, stream=True, stop=[" " + words[1]],
                                      stream_options={"include_usage": True})))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == words[0]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_tokens": 0}, "at least 1"),
    ({"n": 3}, "'n' must be 1"),
    ({"temperature": 3}, "between 0 and 2"),
    ({"logprobs": True}, "logprobs"),
])
def test_unsupported_sampling_is_a_400(tiny, kwargs, needle):
    engine = make_engine(tiny[0])
    [error] = collect(engine.chat(chat("base", **kwargs)))
    assert error.error.code == 400 and needle in error.error.message


def test_chat_parts_and_images_are_validated():
    from PIL import Image

    image = Image.new("RGB", (8, 8), (255, 0, 0))
    import io

    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages, images = chat_to_template([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "go"}]}])
    assert messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "go"}]}]
    assert images[0].size == (8, 8) and decode_data_url_image(url).mode == "RGB"
    for bad, needle in (("http://x/y.png", "data URL"), ("data:image/png;base64,!!!", "readable image"),
                        ("data:text/plain;base64,aGk=", "data URL")):
        with pytest.raises(EngineRequestError, match=needle):
            decode_data_url_image(bad)
    with pytest.raises(EngineRequestError, match="role 'tool'"):
        chat_to_template([{"role": "tool", "content": "x"}])
    with pytest.raises(EngineRequestError, match="input_audio"):
        chat_to_template([{"role": "user", "content": [{"type": "input_audio"}]}])


def test_adapter_folders_are_checked_before_loading(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    with pytest.raises(EngineRequestError, match="no adapter_config.json"):
        check_adapter_folder(folder, 32)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 64}))
    with pytest.raises(EngineRequestError, match="rank 64 exceeds"):
        check_adapter_folder(folder, 32)
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(EngineRequestError, match="not .safetensors/.json"):
        check_adapter_folder(folder, 64)
