"""One client for sending a task's items through the OpenAI-compatible endpoint, greedy: what `promote
verify`, the demo and the benches use, so the three ask the same way the trainer's eval answered."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from rlops.task import TaskItem

REQUEST_WORKERS = 4
REQUEST_TIMEOUT_S = 120


class ChatError(RuntimeError):
    """The endpoint refused a request; the message carries its status and OpenAI error message."""


class ChatClient:
    def __init__(self, endpoint: str, api_key: str | None = None):
        self.url = f"{endpoint.rstrip('/').removesuffix('/v1')}/v1/chat/completions"
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def answer(self, model: str, item: TaskItem, max_tokens: int) -> tuple[str, httpx.Headers]:
        """The greedy answer of `model` to one item, and the response's headers (the served version)."""
        body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "messages": item.messages()}
        response = httpx.post(self.url, json=body, headers=self.headers, timeout=REQUEST_TIMEOUT_S)
        if response.status_code != 200:
            try:
                message = response.json().get("error", {}).get("message")
            except ValueError:
                message = None
            raise ChatError(f"the endpoint answered {response.status_code} for {model}: "
                            f"{message or response.text[:200]}")
        return response.json()["choices"][0]["message"]["content"] or "", response.headers

    def answers(self, model: str, items: list[TaskItem], max_tokens: int) -> list[str]:
        """Greedy answers to every item, in order. The first goes alone: Ray's LLMServer loads an adapter
        racily, and a second concurrent first use of one adapter fails ("already loaded", a 500), which is
        not the version's fault."""
        def one(item: TaskItem) -> str:
            return self.answer(model, item, max_tokens)[0]

        with ThreadPoolExecutor(REQUEST_WORKERS) as pool:
            return [one(it) for it in items[:1]] + list(pool.map(one, items[1:]))
