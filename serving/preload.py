"""`PreloadingLLMServer`: Ray Serve LLM's `LLMServer` that holds the hot adapters on every replica before traffic.

Ray's multiplexing loads an adapter on its first request, on the replica that request landed on, and then
routes the adapter's requests to the replicas that report it: a new alias target is pinned to one replica
(ray-project/ray#65691) and its first requests pay the download. Here each LLM replica follows the routes
manifests itself (the ingress's `RoutesCache`) and, whenever they change, loads every hot adapter
(`serving.routes.hot_adapter_ids`) through the same multiplex loader a request uses. Called outside a request
it works the same (it needs the replica's context, not a request's) and reports the id to Serve's router as
soon as the load starts, so the adapter's requests spread over every replica.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import defaultdict

from ray import serve
from ray.llm._internal.serve.constants import RAYLLM_VLLM_ENGINE_CLS_ENV
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, ErrorResponse
from ray.llm._internal.serve.core.server.llm_server import LLMServer

from serving.engine_start import OneProcessVLLMEngine
from serving.routes import PRELOAD_KEY, RoutesSettings, hot_adapter_ids, replica_routes_cache

log = logging.getLogger("ray.serve.rlops")

RETRY_MAX_S = 60.0  # the longest wait before an adapter that failed to preload is tried again


class PreloadingLLMServer(LLMServer):
    """`llm_config.server_cls` of the app (`serving.preload:PreloadingLLMServer`)."""

    def _get_default_engine_class(self):
        if os.environ.get(RAYLLM_VLLM_ENGINE_CLS_ENV):  # Ray's own override (the benches' echo engine) wins
            return super()._get_default_engine_class()
        return OneProcessVLLMEngine

    def _init_shared(self, *args, **kwargs):
        super()._init_shared(*args, **kwargs)
        self._adapter_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._preloaded: set[str] = set()
        self._preload_task: asyncio.Task | None = None

    async def _start_engine(self):
        """Ray's, less its usage-telemetry report: that starts a `TelemetryAgent` actor, a worker process of its
        own that held each replica's start ~4 s here, to record usage tags for Ray's usage stats, which an
        rlops endpoint does not send anywhere."""
        if self.engine is None:
            raise ValueError("Engine is not set")
        await self.engine.start()

    async def start(self):
        await super().start()
        await self._warm_up()
        settings = self._llm_config.experimental_configs.get(PRELOAD_KEY)
        if settings is not None and self._llm_config.lora_config is not None:
            self._preload_task = asyncio.create_task(self._follow_routes(RoutesSettings.model_validate(settings)))

    async def _warm_up(self) -> None:
        """One 1-token chat for the base before the replica takes traffic: an engine's first request costs
        seconds more than the next (chat rendering and the first forward set themselves up; bench/README.md),
        and the first client after every replica start, a promotion's readiness check included, paid it. A
        failed warm-up is logged, not fatal: the engine answers what it can."""
        started = time.monotonic()
        request = ChatCompletionRequest(model=self._llm_config.model_id, max_tokens=1,
                                        messages=[{"role": "user", "content": "warm-up"}])
        try:
            answer = await self.chat_answer(request)
        except Exception as exc:  # noqa: BLE001 - a client's request will say what is wrong
            answer = exc
        if isinstance(answer, (Exception, ErrorResponse)):
            log.warning("warm-up: the engine's first chat failed: %s", type(answer).__name__)
            return
        log.info(json.dumps({"event": "engine_warmed_up", "seconds": round(time.monotonic() - started, 3)}))

    async def chat_answer(self, request, raw_request_info=None):
        """`chat` of a non-streamed request as one return value: the alias ingress's unary call, answered sooner
        than a one-item stream (`AliasIngress._process_llm_request`)."""
        return _only([answer async for answer in await self.chat(request, raw_request_info)])

    async def completions_answer(self, request, raw_request_info=None):
        """`completions` of a non-streamed request as one return value (as `chat_answer`)."""
        return _only([answer async for answer in await self.completions(request, raw_request_info)])

    async def _maybe_resolve_lora_from_multiplex(self) -> None:
        model_id = serve.get_multiplexed_model_id()
        if model_id and self._llm_config.lora_config is not None:
            await self._hold_adapter(model_id)
        else:
            await super()._maybe_resolve_lora_from_multiplex()

    async def _hold_adapter(self, model_id: str) -> None:
        """What LLMServer does for a request's adapter (download through the multiplex cache, then register it
        with vLLM), one at a time per adapter: vLLM's "loaded?" check comes before its await, so two concurrent
        first uses (a request beside the preloader, or two requests) would fail the second "already loaded"."""
        async with self._adapter_locks[model_id]:
            await self.engine.resolve_lora(await self._load_model(model_id))

    async def _follow_routes(self, settings: RoutesSettings) -> None:
        """Every staleness_s / 2: refresh the routes; on a change (and at start) hold every hot adapter. An
        adapter that failed to load (a download that timed out under load, a folder not there yet) is tried
        again after staleness_s, then twice as long each time up to RETRY_MAX_S: waiting for the next change
        would leave this replica cold for it until the next promotion. Never raises: a failed refresh keeps
        the last table."""
        routes = replica_routes_cache(settings)
        slots = self._llm_config.lora_config.max_num_adapters_per_replica
        hot: list[str] | None = None
        failed: list[str] = []
        retry_s = retry_at = 0.0
        while True:
            try:
                if await asyncio.to_thread(routes.refresh) or hot is None:
                    hot, retry_s = hot_adapter_ids(routes.table, slots), settings.staleness_s
                    failed = await self._preload(hot)
                    retry_at = time.monotonic() + retry_s
                elif failed and time.monotonic() >= retry_at:
                    retry_s = min(2 * retry_s, RETRY_MAX_S)
                    failed = await self._preload(hot)
                    retry_at = time.monotonic() + retry_s
            except Exception as exc:  # noqa: BLE001 - the replica serves on whatever preloading does
                log.warning("preload: pass failed: %s", type(exc).__name__)
            await asyncio.sleep(settings.staleness_s / 2)

    async def _preload(self, model_ids: list[str]) -> list[str]:
        """Hold `model_ids` (newest first), loading the oldest first: whatever is held already costs nothing,
        and the newest ends up the most recently used, the last the multiplex cache would evict. Returns the
        ids that could not be loaded."""
        failed = []
        for model_id in reversed(model_ids):
            started = time.monotonic()
            try:
                await self._hold_adapter(model_id)
            except Exception as exc:  # noqa: BLE001 - a request for it will say what is wrong; retried later
                log.warning("preload: adapter %s could not be loaded: %s", model_id, type(exc).__name__)
                failed.append(model_id)
                continue
            if model_id not in self._preloaded:
                self._preloaded.add(model_id)
                log.info(json.dumps({"event": "adapter_preloaded", "model_id": model_id,
                                     "seconds": round(time.monotonic() - started, 3)}))
        self._preloaded &= set(model_ids)
        return failed


def _only(answers: list):
    """A non-streamed engine call's one answer (a response or an `ErrorResponse`); None if it gave none."""
    return answers[0] if answers else None
