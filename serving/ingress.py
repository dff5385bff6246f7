"""`AliasIngress`: Ray Serve LLM's `OpenAiIngress`, made alias-aware.

Clients name a model by registry alias (`<base>:<model>[@<alias>|@v<N>]`); the ingress resolves the name
against the cached routes manifests (no I/O per request), rewrites the routing id and `body.model` to the
immutable folder (`<base>:<folder>`, what Ray's LoRA loader and the engine match on), then answers with
the client's own name and the resolved version/alias in headers. Folder names and bucket URIs never
leave: not in bodies, not in errors, not in `/v1/models`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import random
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

from fastapi import HTTPException, Request
from pydantic import BaseModel, Field, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from ray.llm._internal.serve.constants import DEFAULT_LLM_ROUTER_HTTP_TIMEOUT
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    OpenAIHTTPException,
)
from ray.llm._internal.serve.core.ingress.ingress import router_request_timeout
from ray.llm._internal.serve.core.ingress.utils import _sanitize_chat_completion_request
from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray import serve
from ray.serve._private.http_util import session_id_from_headers
from ray.serve.llm.ingress import OpenAiIngress
from rlops.layout import TRACE_TAG_SHADOW_PAIR, TRACE_TAG_SHADOW_ROLE, ModelNameError, Resolution, ShadowRoute
from serving.access import AccessControl, AccessError, KeyScope, RateLimiter, env_scopes
from serving.routes import RoutesSettings, internal_model_id, replica_routes_cache
from serving.shadow import ShadowAnswer, ShadowJob, ShadowMirror, shadowed
from serving.trace_writer import TraceWriter, TraceWriterSettings
from serving.traces import ServedRequest
from serving.validation import RequestError, RequestLimits, check_body

# A child of Ray Serve's logger: replica logs with its request/replica context, at its level.
log = logging.getLogger("ray.serve.rlops")

VERSION_HEADER = "x-rlops-model-version"
ALIAS_HEADER = "x-rlops-model-alias"
REPLICA_HEADER = "x-rlops-replica"  # which ingress replica answered (Serve's replica id): several run at once
# The LLM replica's unary method per call method (`serving.preload.PreloadingLLMServer`), for non-streamed requests
ANSWER_METHODS = {"chat": "chat_answer", "completions": "completions_answer"}


class IngressSettings(RoutesSettings):
    """What the ingress replica needs, passed through `ingress_extra_kwargs` (plain, serializable, no secrets)."""

    max_request_bytes: int = Field(gt=0)
    max_image_pixels: int = Field(gt=0)
    max_n: int = Field(gt=0)
    max_request_tokens: int = Field(gt=0)
    api_keys_env: str | None = None  # name of the env var with comma-separated all-models keys
    keys_file: str | None = None  # scoped keys (serving.access); neither: no auth
    ingress_replicas: int = Field(1, ge=1)  # each replica enforces its share of a key's rate limits
    request_log: bool = False  # a JSON line per answer in the replica log
    shadow_concurrency: int = Field(4, ge=1)  # copies to shadows in flight at once, per replica
    shadow_queue_size: int = Field(100, ge=1)  # copies waiting; beyond it a copy is dropped (counted)
    traces: TraceWriterSettings | None = None  # None or sample rate 0: nothing is traced


class ClientError(Exception):
    """An OpenAI-shaped error answer: status, message (client-safe), type, code, param."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"www-authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(self.retry_after_s)
        return JSONResponse(body, status_code=self.status, headers=headers)


# ------------------------------------------------------------------------------------------ pure helpers


def parse_request(raw: bytes, request_cls: type[BaseModel], limits: RequestLimits) -> Any:
    """JSON body -> the OpenAI request model, or a 400 naming the first problem."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ClientError(400, "The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ClientError(400, "The request body must be a JSON object.", code="invalid_json")
    if not isinstance(data.get("model"), str):
        raise ClientError(400, "'model' is required and must be a string.", code="invalid_model_name", param="model")
    try:
        check_body(data, chat="messages" in request_cls.model_fields, limits=limits)
    except RequestError as exc:
        raise ClientError(400, exc.message, code=exc.code, param=exc.param) from None
    try:
        return request_cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ClientError(400, f"Invalid request: {first['msg']} at {where}.", param=where) from None
    except (TypeError, ValueError) as exc:  # vLLM's model validators raise these directly on odd shapes
        raise ClientError(400, f"Invalid request: {exc}.") from None


SESSION_HEADER = "x-rlops-session"


def client_key(user: object, session: str | None, authorization: str | None) -> str | None:
    """Who the client is, for a sticky canary pick: the OpenAI `user` field, else the `x-rlops-session`
    header, else the API key (as a digest: the key itself goes nowhere); None: no identity, pick per request."""
    if isinstance(user, str) and user:
        return "user:" + user
    if session:
        return "session:" + session
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()
    return None


def resolve(table, raw_name: str, key: str | None = None, scope: KeyScope | None = None) -> Resolution:
    """The route of `raw_name` for a caller with `scope` (None: no keys configured). A name out of the
    scope is a 403 whether or not it exists: the answer does not tell a key what other teams serve."""
    try:
        ref = table.parse(raw_name)
        if scope is not None and not scope.may_call(ref):
            raise ClientError(403, f"This API key may not call the model {ref.raw!r}.", code="model_not_permitted",
                              param="model")
        return table.resolve_ref(ref, key, canary=scope is None or scope.canary)
    except ModelNameError as exc:
        raise ClientError(exc.status, str(exc), code=exc.code, param="model") from None


def client_error(exc: AccessError) -> ClientError:
    return ClientError(exc.status, exc.message, code=exc.code, retry_after_s=exc.retry_after_s,
                       type="rate_limit_error" if exc.status == 429 else "invalid_request_error")


def charged_tokens(body: Any, max_request_tokens: int) -> int:
    """What a request is charged against a tokens-per-minute limit before it runs: its sequences x its token
    cap (without one, the endpoint's per-request cap); the unused part is given back when usage is known."""
    sequences = max(getattr(body, "n", None) or 1, getattr(body, "best_of", None) or 1)
    cap = getattr(body, "max_completion_tokens", None) or getattr(body, "max_tokens", None)
    return min(max_request_tokens, sequences * cap) if cap else max_request_tokens


def version_headers(resolution: Resolution) -> dict[str, str]:
    headers = {}
    if resolution.version is not None:
        headers[VERSION_HEADER] = str(resolution.version)
    if resolution.alias is not None:
        headers[ALIAS_HEADER] = resolution.alias
    return headers


class NameRewriter:
    """Swaps the internal routing id for the client's name in engine output (JSON-quoted, so text is safe)."""

    def __init__(self, internal_id: str, client_name: str):
        self.old = json.dumps(internal_id)
        self.new = json.dumps(client_name)
        self.active = internal_id != client_name

    def text(self, chunk: str) -> str:
        return chunk.replace(self.old, self.new) if self.active else chunk

    def body(self, data: bytes) -> bytes:
        return data.replace(self.old.encode(), self.new.encode()) if self.active else data


def scrub(message: str, *secrets_to_hide: tuple[str, str]) -> str:
    for hidden, shown in secrets_to_hide:
        message = message.replace(hidden, shown)
    return message


@dataclass(frozen=True)
class Sampled:
    """A request picked for a trace: what the writer needs that the response does not carry."""
    raw: bytes
    started_ns: int
    client: str | None


@dataclass(frozen=True)
class Copy:
    """A request drawn for its alias's shadow: what the copy needs that the response does not carry."""
    route: ShadowRoute
    body: Any  # the request as parsed, before its routing id was rewritten
    raw: bytes
    client: str | None
    started_ns: int


@dataclass(frozen=True)
class Charge:
    """What a scoped request was charged against its key's limits."""
    scope: KeyScope
    tokens: int


# ----------------------------------------------------------------------------------------------- metrics


USAGE_KEY = b'"usage":'
_decoder = json.JSONDecoder()


def usage_in(data: bytes | str) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the last `"usage": {...}` object in a body or SSE chunk, else None.
    Parses only from that key on (the engine writes usage last), not the whole answer."""
    raw = data if isinstance(data, bytes) else data.encode()
    at = raw.rfind(USAGE_KEY)
    if at < 0:
        return None
    try:
        usage, _ = _decoder.raw_decode(raw[at + len(USAGE_KEY):].decode(errors="replace").lstrip())
    except ValueError:
        return None
    if not isinstance(usage, dict):
        return None  # "usage": null in the chunks before the last
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt, completion) if isinstance(prompt, int) and isinstance(completion, int) else None


def is_error_event(chunk: bytes | str) -> bool:
    """An SSE event carrying an OpenAI error object: the engine failed after the 200 headers went out. (A
    quote inside generated text is escaped in its JSON, so this cannot match an answer's content.)"""
    return ('data: {"error"' if isinstance(chunk, str) else b'data: {"error"') in chunk


def is_stream_end(chunk: bytes | str) -> bool:
    """The engine's last SSE event: once it is handed on, the answer is whole."""
    return ("data: [DONE]" if isinstance(chunk, str) else b"data: [DONE]") in chunk


LATENCY_BOUNDARIES_MS = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000]


class IngressMetrics:
    """Prometheus metrics through Ray Serve's metrics API, tagged by resolved model/alias/version only
    (never the raw client string: unknown names would blow up the label cardinality). The request path only
    gathers values (counters summed per tag set); a thread of its own hands them to Ray every `FLUSH_S` (Ray
    exports every few seconds anyway). Ray's record call releases the GIL, and on a busy replica the event loop
    waited ~0.14 ms a call to get it back (py-spy, bench/README.md)."""

    TAGS = ("registered_model", "alias", "version", "canary", "endpoint")
    FLUSH_S = 0.5

    def __init__(self):
        from ray.serve import metrics

        self.requests = metrics.Counter("rlops_serving_requests", "Requests by resolved alias/version.", tag_keys=self.TAGS)
        self.errors = metrics.Counter("rlops_serving_errors", "Error answers by resolved alias/version and status.",
                                      tag_keys=(*self.TAGS, "status"))
        self.latency = metrics.Histogram("rlops_serving_latency_ms", "Request latency (to the last byte) in ms.",
                                         boundaries=LATENCY_BOUNDARIES_MS, tag_keys=self.TAGS)
        self.ttft = metrics.Histogram("rlops_serving_ttft_ms", "Time to the first answer byte (first streamed chunk, "
                                      "or the whole body) in ms.", boundaries=LATENCY_BOUNDARIES_MS, tag_keys=self.TAGS)
        self.tokens = metrics.Counter("rlops_serving_tokens", "Prompt and completion tokens by resolved alias/version.",
                                      tag_keys=(*self.TAGS, "kind"))
        self.traces = metrics.Counter("rlops_serving_traces", "Sampled requests by what became of their trace: "
                                      "recorded, scored, dropped (queue full), failed (MLflow refused it).",
                                      tag_keys=("outcome",))
        self.shadows = metrics.Counter("rlops_serving_shadow_copies", "Copies of requests to shadow versions: "
                                       "sent, dropped (queue full), failed (the copy could not be sent).",
                                       tag_keys=("outcome",))
        self._observed: list[tuple[tuple[str, ...], float, float | None]] = []  # (tag values, latency, ttft)
        self._counts: dict[tuple[str, ...], list[int]] = {}  # tag values -> [requests, prompt, completion]
        self._error_counts: dict[tuple[str, ...], int] = {}  # tag values + status -> errors
        self._flush_due = False
        self._exporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlops-metrics")

    def count_traces(self, outcome: str, n: int) -> None:
        self.traces.inc(n, tags={"outcome": outcome})

    def count_shadows(self, outcome: str, n: int) -> None:
        self.shadows.inc(n, tags={"outcome": outcome})

    def record(self, resolution: Resolution | None, endpoint: str, status: int, latency_ms: float, *,
               ttft_ms: float | None = None, usage: tuple[int, int] | None = None) -> None:
        """Called on the replica's event loop (the request path), which also runs `flush`."""
        ref = resolution.ref if resolution else None
        values = ((ref.model or "(base)") if ref else "(unresolved)",
                  (resolution.alias or "") if resolution else "",
                  str(resolution.version or "") if resolution else "",
                  "true" if resolution and resolution.canary else "false",
                  endpoint)
        self._observed.append((values, latency_ms, ttft_ms))
        counts = self._counts.setdefault(values, [0, 0, 0])
        counts[0] += 1
        if usage is not None:
            counts[1] += usage[0]
            counts[2] += usage[1]
        if status >= 400:
            errors_key = (*values, str(status))
            self._error_counts[errors_key] = self._error_counts.get(errors_key, 0) + 1
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_later(self.FLUSH_S, self.flush)

    def flush(self) -> Future:
        """Hands what the request path gathered to the exporter thread."""
        batch = self._observed, self._counts, self._error_counts
        self._observed, self._counts, self._error_counts = [], {}, {}
        self._flush_due = False
        return self._exporter.submit(self._export, *batch)

    def close(self) -> None:
        """The replica's shutdown: what was gathered is handed to Ray before this returns (the one exporter
        thread works in order). The thread stays up: a flush already scheduled on the loop may still run."""
        self.flush().result()

    def _export(self, observed: list, counts: dict, error_counts: dict) -> None:
        for values, latency_ms, ttft_ms in observed:
            tags = dict(zip(self.TAGS, values))
            self.latency.observe(latency_ms, tags=tags)
            if ttft_ms is not None:
                self.ttft.observe(ttft_ms, tags=tags)
        for values, (requests, prompt, completion) in counts.items():
            tags = dict(zip(self.TAGS, values))
            self.requests.inc(requests, tags=tags)
            for kind, tokens in (("prompt", prompt), ("completion", completion)):
                if tokens > 0:  # Ray's counters refuse an increment of 0
                    self.tokens.inc(tokens, tags={**tags, "kind": kind})
        for values, errors in error_counts.items():
            self.errors.inc(errors, tags={**dict(zip(self.TAGS, values[:-1])), "status": values[-1]})


# ----------------------------------------------------------------------------------------------- ingress


class AliasIngress(OpenAiIngress):
    """Plugged into `build_openai_app` with `ingress_cls_config` (`serving.ingress:AliasIngress`)."""

    def __init__(self, llm_deployments, model_cards, *, lora_paths=None, settings: Mapping[str, Any], **kwargs):
        super().__init__(llm_deployments, model_cards, lora_paths=lora_paths, **kwargs)
        self._settings = IngressSettings.model_validate(dict(settings))
        self._limits = RequestLimits(self._settings.max_image_pixels, self._settings.max_n,
                                     self._settings.max_request_tokens)
        self._limits_card = {"max_n": self._limits.max_n, "max_request_tokens": self._limits.max_request_tokens,
                             "max_image_pixels": self._limits.max_image_pixels,
                             "max_request_bytes": self._settings.max_request_bytes}
        # The replica is an entry point: keys come from its environment (a Kubernetes secret in the cluster).
        self._access = AccessControl(self._settings.keys_file, env_scopes(os.environ, self._settings.api_keys_env),
                                     self._settings.staleness_s, on_reload=self._keys_reloaded)
        self._limiter = RateLimiter(replicas=self._settings.ingress_replicas)
        self._listed: tuple[object, dict[str, bytes]] = (None, {})  # (routes table, scope digest -> /v1/models)
        self._routes = replica_routes_cache(self._settings)
        self._routes.start()
        self._replica_headers = {REPLICA_HEADER: serve.get_replica_context().replica_tag}
        self._metrics = IngressMetrics()
        traces = self._settings.traces
        self._traces = (TraceWriter(traces, self._metrics.count_traces).start()
                        if traces is not None and traces.sample_rate > 0 else None)
        self._shadows = ShadowMirror(self._send_copy, self._record_pair, self._metrics.count_shadows,
                                     concurrency=self._settings.shadow_concurrency,
                                     queue_size=self._settings.shadow_queue_size)
        # A retry after one routes refresh sees whatever the registry now publishes for the name.
        self._retry_after_s = max(1, math.ceil(self._settings.staleness_s))
        self._answer_handles: dict[str, Any] = {}  # routing id -> the LLM handle for unary calls

    def __del__(self):  # Serve's graceful shutdown of the replica
        metrics = getattr(self, "_metrics", None)
        if metrics is not None:
            metrics.close()
        routes = getattr(self, "_routes", None)
        if routes is not None:
            routes.stop(wait=False)
        traces = getattr(self, "_traces", None)
        if traces is not None:
            traces.stop()
        shadows = getattr(self, "_shadows", None)
        if shadows is not None:
            shadows.stop()

    # --------------------------------------------------------------------------------- endpoints

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, "completions")

    async def models(self, request: Request) -> Response:
        try:
            scope = self._scope(request)
        except ClientError as err:
            return err.response()
        return Response(self._models_json(scope), media_type="application/json")

    async def model_data(self, model: str, request: Request) -> Response:
        try:
            scope = self._scope(request)
            resolution = resolve(self._routes.table, model, scope=scope)
        except ClientError as err:
            return err.response()
        metadata: dict[str, Any] = {"kind": "base" if resolution.ref.model is None else "adapter",
                                    "limits": self._limits_card}
        if resolution.ref.model is not None:
            metadata.update(registered_model=resolution.ref.model, alias=resolution.alias, version=resolution.version)
        card = {"id": model, "object": "model", "owned_by": "rlops", "permission": [], "metadata": metadata}
        return JSONResponse(card, headers={**version_headers(resolution), **self._replica_headers})

    async def embeddings(self, request: Request) -> Response:
        return self._not_served("/v1/embeddings")

    async def transcriptions(self, request: Request) -> Response:
        return self._not_served("/v1/audio/transcriptions")

    async def score(self, request: Request) -> Response:
        return self._not_served("/v1/score")

    async def tokenize(self, request: Request) -> Response:
        return self._not_served("/tokenize")

    async def detokenize(self, request: Request) -> Response:
        return self._not_served("/detokenize")

    def _scope(self, request: Request) -> KeyScope | None:
        try:
            return self._access.scope(request.headers.get("authorization"))
        except AccessError as exc:
            raise client_error(exc) from None

    def _keys_reloaded(self, error: str | None) -> None:
        if error:
            log.error("keys file not reloaded, the last good one stays in use: %s", error)
        else:
            self._listed = (None, {})
            log.info("keys file reloaded: %d keys", len(self._access.file_keys))

    def _models_json(self, scope: KeyScope | None) -> bytes:
        """`/v1/models` for the caller: every entry for an all-models key, else those its scope may call
        (serialized once per routes table and scope)."""
        table = self._routes.table
        if scope is None or (scope.models == ["*"] and scope.aliases == ["*"] and scope.base):
            return table.models_json
        if self._listed[0] is not table:
            self._listed = (table, {})
        listed = self._listed[1]
        if scope.sha256 not in listed:
            cards = [c for c in table.model_cards() if scope.lists(c, table.default_alias)]
            listed[scope.sha256] = json.dumps({"object": "list", "data": cards}, separators=(",", ":")).encode()
        return listed[scope.sha256]

    @staticmethod
    def _not_served(path: str) -> Response:
        # Only chat and completions go through alias resolution; the stock handlers would accept raw folders.
        return ClientError(404, f"{path} is not served by this endpoint.", code="unsupported_endpoint").response()

    # --------------------------------------------------------------------------------- the request path

    async def _generate(self, request: Request, request_cls: type[BaseModel], endpoint: str) -> Response:
        started = time.perf_counter()
        resolution: Resolution | None = None
        charge: Charge | None = None
        sample: Sampled | None = None
        copy: Copy | None = None
        try:
            scope = self._scope(request)
            raw = await self._read_body(request)
            body = parse_request(raw, request_cls, self._limits)
            key = client_key(getattr(body, "user", None), request.headers.get(SESSION_HEADER),
                             request.headers.get("authorization"))
            resolution = resolve(self._routes.table, body.model, key, scope)
            started_ns = time.time_ns() - int((time.perf_counter() - started) * 1e9)
            if self._traces is not None and self._traces.sample():
                sample = Sampled(raw, started_ns, key)
            shadow = self._routes.table.shadow(resolution)
            if shadow is not None and shadowed(shadow.percent, random.random()):
                copy = Copy(shadow, body.model_copy(), raw, key, started_ns)
            if scope is not None:
                charge = Charge(scope, charged_tokens(body, self._limits.max_request_tokens))
                try:
                    self._limiter.admit(scope, charge.tokens)
                except AccessError as exc:
                    raise client_error(exc) from None
            response = await self._forward(body, resolution, endpoint, request)
        except ClientError as err:
            if charge is not None and err.status != 429:
                self._limiter.settle(charge.scope, charge.tokens, 0)  # it ran nothing
            response = err.response()
            self._finish(resolution, endpoint, err.status, started, stream=False, sample=sample, answer=response.body)
            response.headers.update(self._replica_headers)
            return response
        response.headers.update(self._replica_headers)
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._finish_after(response.body_iterator, resolution, endpoint, started, charge,
                                                        sample, copy)
        else:
            usage = usage_in(response.body)
            self._settle(charge, usage)
            self._finish(resolution, endpoint, response.status_code, started, stream=False,
                         first_byte=time.perf_counter(), usage=usage, sample=sample, answer=response.body, copy=copy)
        return response

    async def _send_copy(self, job: ShadowJob) -> ShadowAnswer:
        """The copy of a request to its shadow, as one non-streamed answer (an engine error is an answer too)."""
        internal_id = internal_model_id(self._settings.base_model_id, job.shadow_folder)
        body = job.body.model_copy(update={"model": internal_id, "stream": False, "stream_options": None})
        started = time.perf_counter()
        try:
            response = await self._process_llm_request(body, call_method=job.endpoint, raw_request=None)
            status, answer = response.status_code, response.body
        except (OpenAIHTTPException, HTTPException) as exc:
            status, answer = exc.status_code, json.dumps({"error": {"message": "the shadow failed to answer",
                                                                      "code": exc.status_code}}).encode()
        public = NameRewriter(internal_id, self._shadow_name(job))
        return ShadowAnswer(status, public.body(answer), (time.perf_counter() - started) * 1000)

    def _shadow_name(self, job: ShadowJob) -> str:
        return f"{self._settings.base_model_id}:{job.primary.ref.model}@v{job.shadow_version}"

    def _record_pair(self, job: ShadowJob, answer: ShadowAnswer) -> None:
        """Both answers as traces that share the pair's id (scored by the task where it can read the request)."""
        if self._traces is None:  # tracing is off: the writer starts with the first pair
            traces = self._settings.traces
            if traces is None:
                return
            self._traces = TraceWriter(traces, self._metrics.count_traces).start()
        pair, primary = uuid.uuid4().hex, job.primary
        common = dict(endpoint=job.endpoint, registered_model=primary.ref.model, canary=False, client=job.client,
                      started_ns=job.started_ns, request=job.request)
        self._traces.offer(ServedRequest(
            model_name=primary.ref.raw, alias=primary.alias, version=primary.version, latency_ms=job.primary_latency_ms,
            ttft_ms=job.primary_ttft_ms, usage=job.primary_usage, status=job.primary_status,
            answer=job.primary_answer, stream=job.stream,
            tags={TRACE_TAG_SHADOW_PAIR: pair, TRACE_TAG_SHADOW_ROLE: "primary"}, **common))
        self._traces.offer(ServedRequest(
            model_name=self._shadow_name(job), alias=None, version=job.shadow_version, latency_ms=answer.latency_ms,
            ttft_ms=None, usage=None, status=answer.status, answer=answer.answer,
            tags={TRACE_TAG_SHADOW_PAIR: pair, TRACE_TAG_SHADOW_ROLE: "shadow"}, **common))

    def _settle(self, charge: Charge | None, usage: tuple[int, int] | None) -> None:
        if charge is not None and usage is not None:
            self._limiter.settle(charge.scope, charge.tokens, sum(usage))

    async def _read_body(self, request: Request) -> bytes:
        limit = self._settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and not declared.isdigit():
            raise ClientError(400, "Invalid Content-Length header.", code="invalid_request")
        if declared is not None and int(declared) > limit:
            raise ClientError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ClientError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _process_llm_request(self, body, call_method: str, raw_request: Request | None = None) -> Response:
        """Ray's, except that a non-streamed chat or completion is one unary call to the LLM replica (its
        `ANSWER_METHODS`) instead of a stream of one item: one message fewer per call, answered ~0.5 ms sooner
        (bench/README.md). The handle is Ray's, with its multiplexed routing, and so are the session routing,
        the timeout and the answer."""
        if getattr(body, "stream", False) or call_method not in ANSWER_METHODS:
            return await super()._process_llm_request(body, call_method, raw_request)
        async with router_request_timeout(DEFAULT_LLM_ROUTER_HTTP_TIMEOUT):
            model_id = await self._get_model_id(body.model)
            handle = self._answer_handles.get(model_id)
            if handle is None:
                handle = self._answer_handles[model_id] = self._get_configured_serve_handle(model_id).options(
                    stream=False)
            session_id = session_id_from_headers(raw_request.headers) if raw_request is not None else None
            if session_id:
                handle = handle.options(session_id=session_id)
            if isinstance(body, ChatCompletionRequest):
                body = _sanitize_chat_completion_request(body)
            info = RawRequestInfo.from_starlette_request(raw_request) if raw_request is not None else None
            answer = await getattr(handle, ANSWER_METHODS[call_method]).remote(body, info)
        if isinstance(answer, ErrorResponse):
            raise OpenAIHTTPException(message=answer.error.message, status_code=answer.error.code,
                                      type=answer.error.type)
        return JSONResponse(content=answer.model_dump())

    async def _forward(self, body, resolution: Resolution, endpoint: str, request: Request) -> Response:
        client_name = body.model
        internal_id = internal_model_id(self._settings.base_model_id, resolution.folder)
        body.model = internal_id
        hide = ((self._settings.lora_path, "<adapter store>"), (internal_id, client_name))
        try:
            response = await self._process_llm_request(body, call_method=endpoint, raw_request=request)
        except (OpenAIHTTPException, HTTPException) as exc:
            status = exc.status_code
            detail = exc.message if isinstance(exc, OpenAIHTTPException) else str(exc.detail)
            if status == 404:
                # Ray's LoRA loader answers 404 when the folder is gone (or S3 is unreachable). The name resolved,
                # so the manifest serves it: a transient miss (the next routes refresh may point elsewhere).
                log.error("adapter of %s could not be loaded: %s", client_name, scrub(detail, *hide))
                raise ClientError(503, f"The model {client_name!r} is not available right now: its adapter could not "
                                  "be loaded.", type="server_error", code="model_not_available", param="model",
                                  retry_after_s=self._retry_after_s) from None
            if status >= 500:
                log.error("engine error for %s: %s", client_name, scrub(detail, *hide))
                raise ClientError(status, f"The model {client_name!r} failed to answer.", type="server_error",
                                  retry_after_s=self._retry_after_s if status == 503 else None) from None
            raise ClientError(status, scrub(detail, *hide)) from None
        except Exception as exc:  # noqa: BLE001 - anything else is ours: log it (scrubbed), answer a plain 500
            log.error("error serving %s: %s: %s", client_name, type(exc).__name__, scrub(str(exc), *hide))
            raise ClientError(500, f"The model {client_name!r} failed to answer.", type="server_error") from None
        rewrite = NameRewriter(internal_id, client_name)
        if isinstance(response, StreamingResponse):
            response.body_iterator = _rewrite_stream(response.body_iterator, rewrite)
        else:
            response.body = rewrite.body(response.body)
            response.headers["content-length"] = str(len(response.body))
        response.headers.update(version_headers(resolution))
        return response

    async def _finish_after(self, chunks: AsyncIterator, resolution, endpoint: str, started: float,
                            charge: Charge | None = None, sample: Sampled | None = None, copy: Copy | None = None):
        """Counts a stream when it ends: an engine error after the 200 headers (an error event, or the stream
        raising) is a 500 in the metrics, a client that went away a 499."""
        status, first_byte, usage, ended = 200, None, None, False
        kept: list = []  # a sampled or copied stream's chunks, for its trace
        try:
            async for chunk in chunks:
                if first_byte is None:
                    first_byte = time.perf_counter()
                if is_error_event(chunk):
                    status = 500
                usage = usage_in(chunk) or usage
                if sample is not None or copy is not None:
                    kept.append(chunk)
                ended = ended or is_stream_end(chunk)
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            # the client went away; one that closes as soon as it read [DONE] got the whole answer
            status = status if ended else 499
            raise
        except BaseException:
            status = 500  # the stream broke after the headers were sent
            raise
        finally:
            self._settle(charge, usage)
            self._finish(resolution, endpoint, status, started, stream=True, first_byte=first_byte, usage=usage,
                         sample=sample, answer=kept, copy=copy)

    def _finish(self, resolution: Resolution | None, endpoint: str, status: int, started: float, *, stream: bool,
                first_byte: float | None = None, usage: tuple[int, int] | None = None, sample: Sampled | None = None,
                answer: bytes | list = b"", copy: Copy | None = None) -> None:
        latency_ms = (time.perf_counter() - started) * 1000
        ttft_ms = (first_byte - started) * 1000 if first_byte is not None else None
        copied = copy is not None and resolution is not None and status != 499  # a client that left compares nothing
        if copied:
            self._shadows.offer(ShadowJob(
                endpoint=endpoint, body=copy.body, primary=resolution, shadow_version=copy.route.version,
                shadow_folder=copy.route.folder, request=copy.raw, client=copy.client, primary_status=status,
                primary_answer=answer, primary_latency_ms=latency_ms, started_ns=copy.started_ns, stream=stream,
                primary_ttft_ms=ttft_ms, primary_usage=usage))
        self._metrics.record(resolution, endpoint, status, latency_ms, ttft_ms=ttft_ms, usage=usage)
        ref = resolution.ref if resolution else None
        if sample is not None and resolution is not None and not copied:  # a copied request: its pair traces it
            self._traces.offer(ServedRequest(
                endpoint=endpoint, model_name=ref.raw, registered_model=ref.model, alias=resolution.alias,
                version=resolution.version, canary=resolution.canary, client=sample.client,
                started_ns=sample.started_ns, latency_ms=latency_ms, ttft_ms=ttft_ms, status=status, usage=usage,
                request=sample.raw, answer=answer, stream=stream))
        if self._settings.request_log:
            log.info(json.dumps({
                "event": "request", "endpoint": endpoint, "status": status, "stream": stream,
                "model": ref.raw if ref else None, "alias": resolution.alias if resolution else None,
                "version": resolution.version if resolution else None, "latency_ms": round(latency_ms, 2),
                "canary": bool(resolution and resolution.canary),
            }))


async def _rewrite_stream(chunks: AsyncIterator, rewrite: NameRewriter):
    async for chunk in chunks:
        yield rewrite.text(chunk) if isinstance(chunk, str) else rewrite.body(chunk)
