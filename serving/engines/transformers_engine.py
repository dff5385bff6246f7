"""A CPU engine for Ray Serve LLM built on transformers + peft (used where vLLM's engine cannot run).

Plugged in through `RAYLLM_VLLM_ENGINE_CLS=serving.engines.transformers_engine:TransformersEngine` in the
LLM deployment's runtime env. One base model per replica; adapters are loaded into one `PeftModel` from
the folder Ray downloaded (`resolve_lora`), kept up to `max_loras` (least recently used evicted), and
selected per request by the routing id the ingress wrote into `request.model`.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from rlops.layout import ADAPTER_CONFIG, is_allowed_adapter_file
from serving.engines.base import EngineRequestError, Prepared, Sampling, TextGenerationEngine

log = logging.getLogger("ray.serve.rlops.engine")

MAX_IMAGES_PER_REQUEST = 8


def decode_data_url_image(url: str):
    """`data:image/<fmt>;base64,<data>` -> RGB PIL image; anything else is a 400 (no fetching of remote URLs)."""
    from PIL import Image, UnidentifiedImageError

    head, sep, data = url.partition(",")
    if not url.startswith("data:image/") or not sep or not head.endswith(";base64"):
        raise EngineRequestError("image_url must be a base64 data URL (data:image/png;base64,...); remote URLs are not fetched.")
    try:
        raw = base64.b64decode(data, validate=True)
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError):
        raise EngineRequestError("image_url does not hold a readable image.") from None
    return image.convert("RGB")


def chat_to_template(messages: list[dict]) -> tuple[list[dict], list]:
    """OpenAI chat messages -> (processor chat-template messages with image placeholders, PIL images)."""
    converted, images = [], []
    for message in messages:
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise EngineRequestError(f"message role {role!r} is not supported (system, user, assistant).")
        content = message.get("content")
        if content is None or isinstance(content, str):
            converted.append({"role": role, "content": content or ""})
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind == "image_url":
                url = part.get("image_url", {})
                images.append(decode_data_url_image(url.get("url", "") if isinstance(url, dict) else str(url)))
                parts.append({"type": "image"})
            else:
                raise EngineRequestError(f"content part type {kind!r} is not supported (text, image_url).")
        converted.append({"role": role, "content": parts})
    if len(images) > MAX_IMAGES_PER_REQUEST:
        raise EngineRequestError(f"at most {MAX_IMAGES_PER_REQUEST} images per request.")
    return converted, images


def check_adapter_folder(path: Path, max_lora_rank: int) -> None:
    """Refuse folders that are not a safe, servable LoRA adapter (pickles, missing config, rank too high)."""
    names = [p.name for p in path.iterdir() if p.is_file()]
    if ADAPTER_CONFIG not in names:
        raise EngineRequestError("adapter folder has no adapter_config.json", status=404)
    unsafe = [n for n in names if not is_allowed_adapter_file(n)]
    if unsafe:
        raise EngineRequestError(f"adapter folder holds files that are not .safetensors/.json: {sorted(unsafe)}", 500)
    rank = json.loads((path / ADAPTER_CONFIG).read_text()).get("r", 0)
    if rank > max_lora_rank:
        raise EngineRequestError(f"adapter rank {rank} exceeds max_lora_rank {max_lora_rank}", 400)


class _TokenBridge:
    """A transformers streamer that hands generated token ids from the generate thread to asyncio."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._prompt_seen = False
        self.cancelled = threading.Event()

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first passes the prompt ids
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self._send(int(token))

    def end(self) -> None:
        self._send(None)

    def fail(self, exc: BaseException) -> None:
        self._send(exc)

    def _send(self, item) -> None:
        if self.cancelled.is_set():
            return  # the request is gone; nobody reads the queue any more
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed
            self.cancelled.set()


class TransformersEngine(TextGenerationEngine):
    """transformers + peft on CPU: one generation at a time per replica (a lock), adapters selected per request."""

    def __init__(self, llm_config):
        super().__init__(llm_config)
        kwargs = llm_config.engine_kwargs or {}
        self.model_id = llm_config.model_id
        self.source = llm_config.model_loading_config.model_source
        self.max_loras = int(kwargs.get("max_loras", 4))
        self.max_lora_rank = int(kwargs.get("max_lora_rank", 32))
        self.torch_threads = self.settings.get("torch_threads")
        self._lock = threading.Lock()  # generate() and adapter (un)loading never overlap
        self._adapters: OrderedDict[str, str] = OrderedDict()  # routing id -> peft adapter name, LRU order
        self.model = None
        self.processor = None

    async def start(self) -> None:
        await asyncio.to_thread(self._load_base)

    def _load_base(self) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if self.torch_threads:
            torch.set_num_threads(int(self.torch_threads))
        if not self.source:
            raise RuntimeError("model_loading_config.model_source is not set")
        self.processor = AutoProcessor.from_pretrained(str(self.source))
        self.model = AutoModelForImageTextToText.from_pretrained(str(self.source), dtype=torch.float32).eval()
        log.info("engine ready: base %s", self.model_id)

    async def resolve_lora(self, disk_multiplex_config) -> None:
        model_id = disk_multiplex_config.model_id
        if model_id in self._adapters:
            self._adapters.move_to_end(model_id)
            return
        await asyncio.to_thread(self._load_adapter, model_id, Path(disk_multiplex_config.local_path),
                                f"a{disk_multiplex_config.lora_assigned_int_id}")

    def _load_adapter(self, model_id: str, path: Path, name: str) -> None:
        from peft import PeftModel

        check_adapter_folder(path, self.max_lora_rank)
        with self._lock:
            if model_id in self._adapters:
                return
            # Adapter names are module keys: Ray's int id, since folder names may contain '.'.
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(str(path), adapter_name=name)
            else:
                self.model = PeftModel.from_pretrained(self.model, str(path), adapter_name=name).eval()
            self._adapters[model_id] = name
            while len(self._adapters) > self.max_loras:
                _, evicted = self._adapters.popitem(last=False)
                self.model.set_adapter(name)  # never delete the active adapter
                self.model.delete_adapter(evicted)
        log.info("adapter loaded (%d resident)", len(self._adapters))

    def _select(self, model_id: str) -> str | None:
        """None = the base model; else the peft adapter name."""
        if model_id == self.model_id:
            return None
        name = self._adapters.get(model_id)
        if name is None:
            raise EngineRequestError("The requested adapter is not loaded on this replica.", 404)
        self._adapters.move_to_end(model_id)
        return name

    async def _prepare_chat(self, request) -> Prepared:
        messages, images = chat_to_template(list(request.messages))
        prompt = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        return self._prepared(inputs)

    async def _prepare_completion(self, request) -> Prepared:
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise EngineRequestError("'prompt' must be one string on this engine.")
        return self._prepared(self.processor.tokenizer([prompt], return_tensors="pt"))

    def _prepared(self, inputs) -> Prepared:
        tokenizer = self.processor.tokenizer
        prompt_tokens = int(inputs["input_ids"].shape[1])
        if self.max_model_tokens is not None and prompt_tokens > int(self.max_model_tokens):
            raise EngineRequestError(f"The prompt has {prompt_tokens} tokens; the limit is {self.max_model_tokens}.")
        return Prepared(prompt_tokens, dict(inputs), lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))

    async def _tokens(self, prepared: Prepared, sampling: Sampling, selected: str | None):
        bridge = _TokenBridge(asyncio.get_running_loop())
        worker = threading.Thread(target=self._generate, args=(prepared, sampling, selected, bridge), daemon=True)
        worker.start()
        try:
            while (item := await bridge.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            bridge.cancelled.set()  # the consumer stopped early (stop string, client gone): end generate()

    def _generate(self, prepared: Prepared, sampling: Sampling, selected: str | None, bridge: _TokenBridge) -> None:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return bridge.cancelled.is_set()

        try:
            with self._lock:
                if selected is None:
                    adapter_scope = self.model.disable_adapter() if self._adapters else contextlib.nullcontext()
                else:
                    if selected not in self._adapters.values():  # evicted by a burst of other adapters
                        raise EngineRequestError("The adapter was unloaded by other traffic; retry the request.", 503)
                    self.model.set_adapter(selected)
                    adapter_scope = contextlib.nullcontext()
                options: dict[str, Any] = dict(max_new_tokens=sampling.max_tokens, do_sample=not sampling.greedy)
                if not sampling.greedy:
                    options.update(temperature=sampling.temperature, top_p=sampling.top_p)
                    if sampling.seed is not None:
                        torch.manual_seed(sampling.seed)
                with adapter_scope, torch.inference_mode():
                    self.model.generate(**prepared.inputs, **options, streamer=bridge,
                                        stopping_criteria=StoppingCriteriaList([_Cancelled()]))
            bridge.end()
        except Exception as exc:  # noqa: BLE001 - handed to the request's coroutine, which answers the client
            bridge.fail(exc)
