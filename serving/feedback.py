"""`POST /v1/feedback`: a client's own verdict on an answer it got, attached to that answer's trace.

Body: `{"id": "<the answer's id>", "score": 0.0-1.0 | "thumbs": "up"|"down", "comment": "..."}`, with the
same API key as the endpoint. The answer's trace (serving.trace_writer: the engine's id is the trace's
`client_request_id`) gets a HUMAN feedback assessment (`user_feedback`; the client as a hash, never the key).
An answer that was not sampled, or whose trace is not written yet, or that the key may not call, is one
404 (the answer does not tell a key about other teams' traffic). A second small Serve app beside the LLM app
(`serving.app.run`): Ray's `build_openai_app` wires a fixed set of routes into its ingress.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from typing import Any, Literal, Mapping

from fastapi import FastAPI, Request
from mlflow.entities import AssessmentSource, AssessmentSourceType, Feedback
from mlflow.exceptions import MlflowException
from mlflow.tracing.client import TracingClient
from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray import serve
from requests.exceptions import RequestException
from starlette.responses import JSONResponse

from rlops.layout import ModelNameError, parse_model_name
from rlops.trace_locations import trace_experiments
from serving.access import AccessControl, AccessError, env_scopes
from serving.ingress import ClientError, client_error, client_key
from serving.traces import TAG_NAME, client_hash

log = logging.getLogger("ray.serve.rlops")
FEEDBACK_NAME = "user_feedback"
MAX_BODY_BYTES = 16 * 1024
RESPONSE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")  # goes into a search filter: nothing else passes
EXPERIMENTS_TTL_S = 60.0
EXPERIMENTS_RECHECK_S = 1.0  # the soonest a miss reads the experiments again: bogus ids cannot load MLflow


class FeedbackSettings(BaseModel):
    """What the feedback replica needs (plain values, no secrets: keys come from its environment)."""

    tracking_uri: str
    models: list[str]  # registered models whose versions' experiments hold traces
    base_experiment: str
    default_alias: str
    api_keys_env: str | None = None
    keys_file: str | None = None
    staleness_s: float = Field(gt=0)


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=RESPONSE_ID.pattern)
    score: float | None = Field(None, ge=0, le=1)
    thumbs: Literal["up", "down"] | None = None
    comment: str | None = Field(None, max_length=2000)

    @model_validator(mode="after")
    def _one_verdict(self) -> "FeedbackBody":
        if (self.score is None) == (self.thumbs is None):
            raise ValueError("give one of 'score' (0 to 1) or 'thumbs' ('up' or 'down')")
        return self

    @property
    def value(self) -> float | bool:
        return self.score if self.score is not None else self.thumbs == "up"


def parse_feedback(raw: bytes) -> FeedbackBody:
    """The body, or a 400 naming the first problem."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ClientError(400, "The request body is not valid JSON.", code="invalid_json") from None
    try:
        return FeedbackBody.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ClientError(400, f"Invalid feedback: {first['msg']} at {where}.", param=where) from None


app = FastAPI()


@app.middleware("http")
async def _route_prefix_itself(request: Request, call_next):
    """`POST /v1/feedback` is the route prefix itself: Starlette would redirect it to `/v1/feedback/`
    (a 307 that clients do not follow for a POST), so it is routed as that."""
    if request.scope["path"] == request.scope.get("root_path"):
        request.scope["path"] += "/"
    return await call_next(request)


# No CPU reserved: a few requests a minute, and a cluster sized for its LLM and ingress replicas has no
# spare CPU to reserve (`serve.run` would wait for one forever).
@serve.deployment(name="FeedbackIngress", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class FeedbackIngress:
    def __init__(self, settings: Mapping[str, Any]):
        self.settings = FeedbackSettings.model_validate(dict(settings))
        # The replica is an entry point: keys come from its environment, as the alias ingress's do.
        self._access = AccessControl(self.settings.keys_file, env_scopes(os.environ, self.settings.api_keys_env),
                                     self.settings.staleness_s)
        uri = self.settings.tracking_uri
        self._client, self._tracing = MlflowClient(tracking_uri=uri, registry_uri=uri), TracingClient(uri)
        self._experiments: tuple[float, list[str]] = (0.0, [])

    @app.post("/")
    async def feedback(self, request: Request) -> JSONResponse:
        try:
            try:
                scope = self._access.scope(request.headers.get("authorization"))
            except AccessError as exc:
                raise client_error(exc) from None
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise ClientError(413, f"Request body is larger than {MAX_BODY_BYTES} bytes.", code="request_too_large")
            body = parse_feedback(raw)
            source = client_hash(client_key(None, request.headers.get("x-rlops-session"),
                                            request.headers.get("authorization"))) or "anonymous"
            trace_id = await asyncio.to_thread(self._attach, body, scope, source)
        except ClientError as err:
            return err.response()
        return JSONResponse({"id": body.id, "trace_id": trace_id, "object": "feedback", "status": "recorded"})

    def _attach(self, body: FeedbackBody, scope, source: str) -> str:
        try:
            trace = self._find(body.id, self._trace_experiments())
            if trace is None and time.monotonic() - self._experiments[0] >= EXPERIMENTS_RECHECK_S:
                # an experiment created since the list was read (the base's, at its first traced answer)
                trace = self._find(body.id, self._trace_experiments(refresh=True))
            if trace is None or not self._may_see(trace, scope):
                raise ClientError(404, f"No recorded answer {body.id!r}: it was not sampled for tracing, is not "
                                  "written yet (retry in a few seconds), or this key may not see it.",
                                  code="answer_not_found", param="id")
            self._tracing.log_assessment(trace.info.trace_id, Feedback(
                name=FEEDBACK_NAME, value=body.value, rationale=body.comment,
                source=AssessmentSource(source_type=AssessmentSourceType.HUMAN, source_id=source)))
        except (MlflowException, RequestException, OSError) as exc:
            log.error("feedback for %s not recorded: %s: %s", body.id, type(exc).__name__, exc)
            raise ClientError(503, "Feedback cannot be recorded right now.", type="server_error",
                              code="tracking_unavailable", retry_after_s=5) from None
        return trace.info.trace_id

    def _may_see(self, trace, scope) -> bool:
        if scope is None:
            return True
        try:
            ref = parse_model_name(trace.info.tags.get(TAG_NAME, ""), self.settings.default_alias)
        except ModelNameError:
            return False
        return scope.may_call(ref)

    def _find(self, answer_id: str, experiments: list[str]):
        found = self._client.search_traces(locations=experiments, max_results=1, include_spans=False,
                                           filter_string=f"trace.client_request_id = '{answer_id}'")
        return found[0] if found else None

    def _trace_experiments(self, refresh: bool = False) -> list[str]:
        at, ids = self._experiments  # cached a minute, or re-read on a miss (at most every EXPERIMENTS_RECHECK_S)
        if refresh or not ids or time.monotonic() - at >= EXPERIMENTS_TTL_S:
            ids = sorted(trace_experiments(self._client, self.settings.models, self.settings.base_experiment))
            self._experiments = (time.monotonic(), ids)
        return ids


def build(args: Mapping[str, Any]):
    """The app builder a RayService's `import_path` names (`serving.feedback:build`); args: {"settings": ...}."""
    return FeedbackIngress.bind(args["settings"])
