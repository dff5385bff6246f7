"""What a served request becomes as an MLflow trace: pure, no I/O (serving.trace_writer writes it).

The ingress hands over the raw request and answer bytes of a sampled request; everything here runs on the
writer's thread, off the request path. Images leave the messages as references to their content digest
(`rlops.layout.TRACE_IMAGE_REF` + hex), so a maze sent a thousand times is stored once. The client is a hash of
its identity (the OpenAI `user`, the session header or the key's digest), never the key itself.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from rlops.layout import (TRACE_IMAGE_REF, TRACE_TAG_ENDPOINT as TAG_ENDPOINT, TRACE_TAG_IMAGES as TAG_IMAGES,
                          TRACE_TAG_LATENCY_MS as TAG_LATENCY_MS, TRACE_TAG_MODEL as TAG_MODEL,
                          TRACE_TAG_STATUS as TAG_STATUS, TRACE_TAG_VERSION as TAG_VERSION)

_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+);base64,(.*)$", re.DOTALL)

PREVIEW_CHARS = 1000
# trace tags (searchable in the MLflow UI and `search_traces`); those others read are in rlops.layout
TAG_ALIAS, TAG_CANARY, TAG_CLIENT = "rlops.alias", "rlops.canary", "rlops.client"
TAG_NAME = "rlops.model_name"
TAG_PROMPT_TOKENS, TAG_COMPLETION_TOKENS = "rlops.prompt_tokens", "rlops.completion_tokens"
TAG_TTFT_MS, TAG_CONTENT = "rlops.ttft_ms", "rlops.content"


@dataclass(frozen=True)
class ServedRequest:
    """One sampled request as the ingress saw it; bytes are parsed later, on the writer's thread."""

    endpoint: str  # chat | completions
    model_name: str  # what the client sent in `model`
    registered_model: str | None  # None: the bare base
    alias: str | None
    version: int | None
    canary: bool
    client: str | None  # client_key(...) of the ingress, hashed again here
    started_ns: int  # wall clock (ns since the epoch)
    latency_ms: float
    ttft_ms: float | None
    status: int
    usage: tuple[int, int] | None
    request: bytes
    answer: bytes | list = b""  # the JSON body, or the SSE chunks of a stream
    stream: bool = False
    tags: dict[str, str] = field(default_factory=dict)  # more trace tags (a shadow pair's id and role)

    @property
    def size(self) -> int:
        """Bytes it holds (what bounds the writer's queue in memory)."""
        if isinstance(self.answer, bytes):
            return len(self.request) + len(self.answer)
        return len(self.request) + sum(len(chunk) for chunk in self.answer)


@dataclass
class TracePayload:
    """What a trace is made of: the root span's inputs and outputs, the trace's tags and previews, the
    request's images (digest -> (media type, bytes): stored only with content on, scored either way) and
    the id the engine gave the answer."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    tags: dict[str, str]
    request_preview: str
    response_preview: str
    response_id: str | None
    ok: bool
    images: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)  # the user's text parts, for a task scorer
    answer_text: str | None = None


def sampled(rate: float, draw: float) -> bool:
    """A request is traced when a uniform draw in [0, 1) falls below the sample rate."""
    return draw < rate


def client_hash(client: str | None) -> str | None:
    return hashlib.sha256(client.encode()).hexdigest()[:16] if client else None


def image_ref(digest: str) -> str:
    return TRACE_IMAGE_REF + digest


def split_images(messages: Any) -> tuple[Any, dict[str, tuple[str, bytes]], list[str]]:
    """The messages with every inline (data URL) image replaced by a reference to its sha256, the images by
    digest, and the user's text parts in order. Other URLs stay as sent (nothing is fetched)."""
    images: dict[str, tuple[str, bytes]] = {}
    texts: list[str] = []
    if not isinstance(messages, list):
        return messages, images, texts
    out = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)
            continue
        content = message.get("content")
        if isinstance(content, str):
            if message.get("role") == "user":
                texts.append(content)
            out.append(message)
            continue
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and message.get("role") == "user":
                texts.append(str(part.get("text", "")))
            url = part.get("image_url", {}).get("url") if isinstance(part, dict) and isinstance(
                part.get("image_url"), dict) else None
            match = _DATA_URL.match(url) if isinstance(url, str) else None
            if match:
                try:
                    data = base64.b64decode(match.group(2), validate=False)
                except (binascii.Error, ValueError):
                    parts.append(part)
                    continue
                digest = hashlib.sha256(data).hexdigest()
                images[digest] = (match.group(1), data)
                part = {**part, "image_url": {**part["image_url"], "url": image_ref(digest)}}
            parts.append(part)
        out.append({**message, "content": parts})
    return out, images, texts


def stream_answer(chunks: list) -> dict[str, Any]:
    """The streamed SSE chunks folded into one answer: id, each choice's text, finish reason, usage."""
    answer: dict[str, Any] = {"id": None, "choices": {}, "usage": None}
    for chunk in chunks:
        text = chunk.decode(errors="replace") if isinstance(chunk, bytes) else str(chunk)
        for line in text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                event = json.loads(line[len("data: "):])
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if "error" in event:
                answer["error"] = event["error"]
            answer["id"] = answer["id"] or event.get("id")
            answer["usage"] = event.get("usage") or answer["usage"]
            for choice in event.get("choices") or []:
                index = choice.get("index", 0)
                slot = answer["choices"].setdefault(index, {"index": index, "text": "", "finish_reason": None})
                delta = choice.get("delta") or {}
                slot["text"] += (delta.get("content") or "") if isinstance(delta, dict) else ""
                slot["text"] += choice.get("text") or ""
                slot["finish_reason"] = choice.get("finish_reason") or slot["finish_reason"]
    answer["choices"] = [answer["choices"][i] for i in sorted(answer["choices"])]
    return answer


def answer_texts(answer: dict[str, Any]) -> list[str]:
    """Each choice's text, from a chat or completions body (or a folded stream)."""
    texts = []
    for choice in answer.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict):
            texts.append(message.get("content") or "")
        else:
            texts.append(choice.get("text") or "")
    return texts


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def trace_payload(served: ServedRequest, content: bool) -> TracePayload:
    """The trace of a served request; with `content` off only metadata (no messages, prompt or answer)."""
    request = _parse(served.request)
    request = request if isinstance(request, dict) else {}
    answer = stream_answer(served.answer) if served.stream else _parse(served.answer) or {}
    answer = answer if isinstance(answer, dict) else {}
    settings = {k: request[k] for k in ("temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "seed",
                                        "stop", "stream") if k in request}
    inputs: dict[str, Any] = {"model": served.model_name, **settings}
    images: dict[str, tuple[str, bytes]] = {}
    texts: list[str] = []
    if "messages" in request:
        messages, images, texts = split_images(request["messages"])
        if content:
            inputs["messages"] = messages
    elif "prompt" in request:
        texts = [request["prompt"]] if isinstance(request["prompt"], str) else []
        if content:
            inputs["prompt"] = request["prompt"]
    choices = answer_texts(answer)
    outputs: dict[str, Any] = {"id": answer.get("id"), "usage": answer.get("usage")}
    if "error" in answer:
        outputs["error"] = answer["error"]
    if content:
        outputs["choices"] = choices
    usage = served.usage
    tags = {TAG_NAME: served.model_name, TAG_ENDPOINT: served.endpoint, TAG_STATUS: str(served.status),
            TAG_CANARY: "true" if served.canary else "false", TAG_LATENCY_MS: f"{served.latency_ms:.1f}",
            TAG_CONTENT: "true" if content else "false"}
    optional = {TAG_MODEL: served.registered_model, TAG_ALIAS: served.alias,
                TAG_VERSION: None if served.version is None else str(served.version),
                TAG_CLIENT: client_hash(served.client),
                TAG_TTFT_MS: None if served.ttft_ms is None else f"{served.ttft_ms:.1f}",
                TAG_PROMPT_TOKENS: None if usage is None else str(usage[0]),
                TAG_COMPLETION_TOKENS: None if usage is None else str(usage[1]),
                TAG_IMAGES: ",".join(sorted(images)) or None}
    tags.update({k: v for k, v in optional.items() if v is not None})
    tags.update(served.tags)
    preview_in = json.dumps(inputs.get("messages", inputs.get("prompt", served.model_name)), ensure_ascii=False)
    return TracePayload(
        inputs=inputs, outputs=outputs, tags=tags, request_preview=preview_in[:PREVIEW_CHARS],
        response_preview=(choices[0] if content and choices else "")[:PREVIEW_CHARS],
        response_id=answer.get("id") if isinstance(answer.get("id"), str) else None,
        ok=served.status < 400 and "error" not in answer, images=images, texts=texts,
        answer_text=choices[0] if choices else None)


TRACES_METRIC = "ray_rlops_serving_traces_total"
TRACE_OUTCOMES = ("recorded", "scored", "dropped", "failed")


def trace_counts(metrics_text: str) -> dict[str, int]:
    """The ingress replicas' trace outcomes (summed) from the serving Prometheus text."""
    counts = dict.fromkeys(TRACE_OUTCOMES, 0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == TRACES_METRIC and sample.labels.get("outcome") in counts:
                counts[sample.labels["outcome"]] += int(sample.value)
    return counts
