"""The OpenAI surface shared by rlops' engines for Ray's `LLMEngine` protocol.

Subclasses turn a request into a prompt (`_prepare_chat` / `_prepare_completion`) and produce token ids
(`_tokens`); this class handles sampling parameters, `stop`, streaming chunks, `[DONE]`, usage, and
OpenAI-shaped errors (an `ErrorResponse` first item, which Ray's ingress turns into the HTTP status).
"""
from __future__ import annotations

import abc
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
)
from ray.llm._internal.serve.core.engine.protocol import LLMEngine
from serving.app import CPU_ENGINE_KEY
from serving.engines.text import StopTextAssembler
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice, CompletionResponseStreamChoice
from vllm.entrypoints.serve.engine.protocol import UsageInfo

log = logging.getLogger("ray.serve.rlops.engine")

DEFAULT_MAX_TOKENS = 256


class EngineRequestError(Exception):
    """A request the engine cannot serve, with the HTTP status and a client-safe message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_from_request(request: Any, default_max_tokens: int, max_model_tokens: int | None) -> Sampling:
    """Validate the OpenAI sampling fields this engine supports; unsupported ones are a 400, not ignored."""
    if (request.n or 1) != 1:
        raise EngineRequestError("'n' must be 1 on this engine.")
    if getattr(request, "logprobs", None) or getattr(request, "use_beam_search", False):
        raise EngineRequestError("'logprobs' and beam search are not supported on this engine.")
    max_tokens = next((v for v in (getattr(request, "max_completion_tokens", None), request.max_tokens) if v is not None),
                      default_max_tokens)
    if max_tokens < 1:
        raise EngineRequestError("'max_tokens' must be at least 1.")
    if max_model_tokens is not None and max_tokens > max_model_tokens:
        raise EngineRequestError(f"'max_tokens' must be at most {max_model_tokens}.")
    temperature = 1.0 if request.temperature is None else float(request.temperature)
    if not 0.0 <= temperature <= 2.0:
        raise EngineRequestError("'temperature' must be between 0 and 2.")
    top_p = 1.0 if request.top_p is None else float(request.top_p)
    if not 0.0 < top_p <= 1.0:
        raise EngineRequestError("'top_p' must be in (0, 1].")
    stop = request.stop or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > 4:
        raise EngineRequestError("'stop' takes at most 4 strings.")
    return Sampling(max_tokens, temperature, top_p, request.seed, stop)


@dataclass
class Prepared:
    """A request turned into engine input: `inputs` is engine-specific; `decode` maps generated ids to text."""

    prompt_tokens: int
    inputs: Any
    decode: Callable[[Sequence[int]], str]


def error_response(message: str, status: int, type_: str = "invalid_request_error") -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, code=status))


class TextGenerationEngine(LLMEngine, abc.ABC):
    """chat + completions (plain and streaming) over `_tokens`; embeddings and transcriptions are refused."""

    def __init__(self, llm_config):
        self.llm_config = llm_config
        self.settings = dict((llm_config.experimental_configs or {}).get(CPU_ENGINE_KEY) or {})
        self.default_max_tokens = int(self.settings.get("default_max_tokens", DEFAULT_MAX_TOKENS))
        self.max_model_tokens = (llm_config.engine_kwargs or {}).get("max_model_len")

    # ------------------------------------------------------------------------------- subclass hooks

    @abc.abstractmethod
    async def _prepare_chat(self, request) -> Prepared: ...

    @abc.abstractmethod
    async def _prepare_completion(self, request) -> Prepared: ...

    def _select(self, model_id: str) -> Any:
        """The weights a request runs on (e.g. a loaded adapter); raise EngineRequestError if unavailable."""
        return model_id

    @abc.abstractmethod
    def _tokens(self, prepared: Prepared, sampling: Sampling, selected: Any) -> AsyncIterator[int]:
        """Generated token ids, ending at EOS or `max_tokens`; closing the iterator must stop generation."""

    # ------------------------------------------------------------------------------- protocol

    def routing_stats(self) -> dict:
        return {}

    async def reset_prefix_cache(self) -> None:
        return None

    async def embeddings(self, request, raw_request_info=None):
        yield error_response("Embeddings are not supported by this engine.", 400)

    async def transcriptions(self, request, raw_request_info=None):
        yield error_response("Transcriptions are not supported by this engine.", 400)

    async def chat(self, request, raw_request_info=None):
        async for item in self._respond(request, chat=True):
            yield item

    async def completions(self, request, raw_request_info=None):
        async for item in self._respond(request, chat=False):
            yield item

    async def _respond(self, request, *, chat: bool):
        try:
            sampling = sampling_from_request(request, self.default_max_tokens, self.max_model_tokens)
            selected = self._select(request.model)
            prepared = await (self._prepare_chat(request) if chat else self._prepare_completion(request))
        except EngineRequestError as exc:
            yield error_response(str(exc), exc.status)
            return
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        assembler = StopTextAssembler(prepared.decode, sampling.stop)
        if not request.stream:
            try:
                finish = await self._run(prepared, sampling, selected, assembler)
            except EngineRequestError as exc:
                yield error_response(str(exc), exc.status)
                return
            except Exception:  # noqa: BLE001 - logged here; the client gets a plain 500
                log.exception("generation failed")
                yield error_response("Generation failed.", 500, "server_error")
                return
            usage = _usage(prepared, assembler)
            if chat:
                choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=assembler.text),
                                                      finish_reason=finish)
                yield ChatCompletionResponse(id=request_id, created=created, model=request.model, choices=[choice], usage=usage)
            else:
                choice = CompletionResponseChoice(index=0, text=assembler.text, finish_reason=finish)
                yield CompletionResponse(id=request_id, created=created, model=request.model, choices=[choice], usage=usage)
            return
        async for chunk in self._stream(request, prepared, sampling, selected, assembler, chat, request_id, created):
            yield chunk

    async def _run(self, prepared: Prepared, sampling: Sampling, selected: Any, assembler: StopTextAssembler) -> str:
        """Drive generation through the assembler; return the finish reason."""
        tokens = self._tokens(prepared, sampling, selected)
        try:
            async for token in tokens:
                assembler.add(token)
                if assembler.stopped:
                    return "stop"
        finally:
            await tokens.aclose()
        assembler.flush()
        return "length" if assembler.token_count >= sampling.max_tokens else "stop"

    async def _stream(self, request, prepared, sampling, selected, assembler, chat: bool, request_id: str, created: int):
        cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse

        def chunk(text: str | None, finish: str | None = None, *, role: str | None = None) -> str:
            if chat:
                choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role=role, content=text),
                                                            finish_reason=finish)
            else:
                choice = CompletionResponseStreamChoice(index=0, text=text or "", finish_reason=finish)
            return f"data: {cls(id=request_id, created=created, model=request.model, choices=[choice]).model_dump_json()}\n\n"

        if chat:
            yield chunk("", role="assistant")
        tokens = self._tokens(prepared, sampling, selected)
        finish = "stop"
        try:
            async for token in tokens:
                delta = assembler.add(token)
                if delta:
                    yield chunk(delta)
                if assembler.stopped:
                    break
            else:
                tail = assembler.flush()
                if tail:
                    yield chunk(tail)
                finish = "length" if assembler.token_count >= sampling.max_tokens else "stop"
        except Exception as exc:  # noqa: BLE001 - the headers are sent: end the stream with an error event
            log.exception("generation failed mid-stream")
            status = exc.status if isinstance(exc, EngineRequestError) else 500
            message = str(exc) if isinstance(exc, EngineRequestError) else "Generation failed."
            yield f"data: {error_response(message, status).model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            await tokens.aclose()
        yield chunk(None, finish)
        options = getattr(request, "stream_options", None)
        if options is not None and options.include_usage:
            usage = _usage(prepared, assembler)
            yield f"data: {cls(id=request_id, created=created, model=request.model, choices=[], usage=usage).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"


def _usage(prepared: Prepared, assembler: StopTextAssembler) -> UsageInfo:
    completion = assembler.token_count
    return UsageInfo(prompt_tokens=prepared.prompt_tokens, completion_tokens=completion,
                     total_tokens=prepared.prompt_tokens + completion)
