"""A trivial engine that echoes the prompt's words: isolates ingress/routing cost in benchmarks."""
from __future__ import annotations

from serving.engines.base import EngineRequestError, Prepared, TextGenerationEngine


class EchoEngine(TextGenerationEngine):
    """Answers with the words of the last user message (chat) or of the prompt (completions)."""

    async def start(self) -> None:
        return None

    async def resolve_lora(self, disk_multiplex_config) -> None:
        return None  # nothing to load: the text does not depend on the adapter

    async def _prepare_chat(self, request) -> Prepared:
        text = ""
        for message in request.messages:
            content = message.get("content")
            if isinstance(content, str):
                text = content
            elif content:
                text = " ".join(part.get("text", "") for part in content if part.get("type") == "text")
        return _words(text)

    async def _prepare_completion(self, request) -> Prepared:
        if not isinstance(request.prompt, str):
            raise EngineRequestError("'prompt' must be a string on this engine.")
        return _words(request.prompt)

    async def _tokens(self, prepared: Prepared, sampling, selected):
        for index in range(min(len(prepared.inputs), sampling.max_tokens)):
            yield index


def _words(text: str) -> Prepared:
    words = text.split() or ["echo"]
    return Prepared(prompt_tokens=len(words), inputs=words, decode=lambda ids: " ".join(words[i] for i in ids))
