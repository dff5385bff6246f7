"""A bench fixture for Ray's `LLMEngine` protocol that echoes the last user message: it costs next to nothing,
so an ingress benchmark measures the ingress. Plugged in with `RAYLLM_VLLM_ENGINE_CLS=echo_engine:EchoEngine`
(bench/ on the replica's PYTHONPATH). Not part of the product: production serves with Ray's own VLLMEngine.
`ECHO_FAIL_MODELS` (comma-separated engine model ids, `<base>:<folder>`): those answer a 500, an engine fault
of one version (bench/canary.py's SLO breach).
"""
from __future__ import annotations

import os
import time
import uuid

from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionResponse, ErrorInfo, ErrorResponse
from ray.llm._internal.serve.core.engine.protocol import LLMEngine
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseChoice, ChatMessage
from vllm.entrypoints.serve.engine.protocol import UsageInfo


class EchoEngine(LLMEngine):
    def __init__(self, llm_config):
        self.llm_config = llm_config

    async def start(self) -> None:
        return None

    def routing_stats(self) -> dict:
        return {}

    async def resolve_lora(self, lora_model) -> None:
        return None  # the echo does not depend on the adapter's weights

    async def reset_prefix_cache(self) -> None:
        return None

    async def chat(self, request, raw_request_info=None):
        if request.model in os.environ.get("ECHO_FAIL_MODELS", "").split(","):
            yield ErrorResponse(error=ErrorInfo(message="injected engine fault", type="server_error", code=500))
            return
        content = request.messages[-1].get("content") or ""
        text = content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
        words = text.split()[: request.max_tokens or 16]
        choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=" ".join(words)),
                                              finish_reason="length")
        usage = UsageInfo(prompt_tokens=len(text.split()), completion_tokens=len(words),
                          total_tokens=len(text.split()) + len(words))
        yield ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=request.model,
                                     choices=[choice], usage=usage)

    async def completions(self, request, raw_request_info=None):
        yield ErrorResponse(error=ErrorInfo(message="completions are not echoed", type="invalid_request_error", code=400))

    async def embeddings(self, request, raw_request_info=None):
        yield ErrorResponse(error=ErrorInfo(message="embeddings are not echoed", type="invalid_request_error", code=400))

    async def transcriptions(self, request, raw_request_info=None):
        yield ErrorResponse(error=ErrorInfo(message="not echoed", type="invalid_request_error", code=400))
