"""The shared contract between promotion (writer) and serving (reader), as pure code with no I/O.

- Request-name grammar: `<base>`, `<base>:<model>`, `<base>:<model>@<alias>`, `<base>:<model>@v<N>`.
- S3 layout under `dynamic_lora_loading_path` (= `s3://<bucket>/<prefix>`): one immutable folder per
  promoted version `<prefix>/<model>-v<version>/`, and one routes manifest per registered model at
  `<prefix>/_routes/<model>.json` (a folder Ray never lists as an adapter: it has no adapter_config.json).
- The routes manifest schema (`schema_version: 2`; version-1 files still read) and name resolution against it.
- Canaries: a served alias may split its traffic with a second version. Registry intent: the alias
  `<alias>-canary` names the candidate and the registered-model tag `rlops.canary_weight.<alias>` its share in
  percent; the manifest publishes it as `canaries[<alias>]`. Which version a request gets is a deterministic
  hash of the client's identity (`canary_bucket`), so one client stays on one version for a given canary.
- Shadows: a served alias may copy a share of its requests to a candidate whose answers are never returned.
  Registry intent: the alias `<alias>-shadow` names the candidate and the registered-model tag
  `rlops.shadow_percent.<alias>` the share in percent; the manifest publishes it as `shadows[<alias>]`.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
ALIAS_RE = re.compile(r"^[A-Za-z0-9_-]+$")
VERSION_ALIAS_RE = re.compile(r"^v(\d+)$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_NAME_LENGTH = 256

ROUTES_DIR = "_routes"
ROUTES_STAMP = "_routes.stamp"  # rewritten after every manifest write or delete: readers list _routes/ when it moves
# The tags that tie tracker and promotion together: the tracker writes them on LoggedModels and registered
# versions, promotion reads them (checksums, base, guardrail metric), `promote --force` writes TAG_FORCE.
TAG_STEP = "rlops.step"
TAG_SHA256 = "rlops.sha256."  # + file name: the file's sha256, checked after every copy
TAG_BASE_MODEL = "rlops.base_model"  # the base's portable id (served id, HF id or folder name), never a path
TAG_BASE_MODEL_SHA256 = "rlops.base_model_sha256"  # content digest of the base's config and weights
TAG_TRAINER = "rlops.trainer"
TAG_LORA_RANK = "rlops.lora_rank"
TAG_RUN_ID = "rlops.run_id"
TAG_METRIC_KEY = "rlops.metric_key"
TAG_METRIC_VALUE = "rlops.metric_value"
TAG_EVAL_SET = "rlops.eval_set_sha256"  # optional: the guardrail refuses comparing scores of different eval sets
TAG_FORCE = "rlops.force"  # "<who>: <why>" on a version: the guardrail lets it through (a registry-visible act)
EVAL_TABLE_DIR = "eval_tables"  # a run's per-item eval tables (rlops.eval_table), one per data source and step
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALLOWED_SUFFIXES = (".safetensors", ".json")
SCHEMA_VERSION = 2  # 2: canaries, history entries with from/weight/actor/reason, previews (1 is still read)
CANARY_SUFFIX = "-canary"  # the registry alias `<alias>-canary` names the alias's canary version
CANARY_WEIGHT_TAG = "rlops.canary_weight."  # + alias, on the registered model: the canary's share in percent
SHADOW_SUFFIX = "-shadow"  # the registry alias `<alias>-shadow` names the alias's shadow version
SHADOW_PERCENT_TAG = "rlops.shadow_percent."  # + alias, on the registered model: the share of requests copied
MOVE_NOTE_TAG = "rlops.move."  # + alias or <alias>-canary, on the registered model: who moves it (a MoveNote)
REGISTRY_ACTOR = "registry"  # the author of a move that carries no MoveNote (the MLflow UI, a plain client)


# ------------------------------------------------------------------------------------------ name grammar


class ModelNameError(ValueError):
    """Base of name errors; `status` is the HTTP status an endpoint should answer with."""

    status = 400
    code = "invalid_model_name"


class MalformedModelName(ModelNameError):
    status = 400
    code = "invalid_model_name"


class ModelNotFound(ModelNameError):
    status = 404
    code = "model_not_found"


@dataclass(frozen=True)
class ModelRef:
    """A parsed request `model`. `alias` xor `version` is set when `model` is; neither for the bare base."""

    raw: str
    base: str
    model: str | None = None
    alias: str | None = None
    version: int | None = None


def is_valid_name(name: str) -> bool:
    return bool(NAME_RE.match(name)) and ".." not in name and len(name) <= MAX_NAME_LENGTH


def is_valid_alias(alias: str) -> bool:
    return bool(ALIAS_RE.match(alias)) and alias != "latest" and not VERSION_ALIAS_RE.match(alias)


def parse_model_name(raw: object, default_alias: str = "production") -> ModelRef:
    """Parse a client's `model` string; raise MalformedModelName naming what is wrong."""
    if not isinstance(raw, str) or not raw:
        raise MalformedModelName("'model' must be a non-empty string")
    if len(raw) > MAX_NAME_LENGTH:
        raise MalformedModelName(f"'model' is longer than {MAX_NAME_LENGTH} characters")
    base, sep, rest = raw.partition(":")
    if not is_valid_name(base):
        raise MalformedModelName(f"model {raw!r}: base id must match [A-Za-z0-9._-]+ (no '..')")
    if not sep:
        return ModelRef(raw=raw, base=base)
    model, at, selector = rest.partition("@")
    if not is_valid_name(model):
        raise MalformedModelName(f"model {raw!r}: registered model name must match [A-Za-z0-9._-]+ (no '..')")
    if not at:
        return ModelRef(raw=raw, base=base, model=model, alias=default_alias)
    version = VERSION_ALIAS_RE.match(selector)
    if version:
        return ModelRef(raw=raw, base=base, model=model, version=int(version.group(1)))
    if not ALIAS_RE.match(selector):
        raise MalformedModelName(f"model {raw!r}: alias must match [A-Za-z0-9_-]+")
    return ModelRef(raw=raw, base=base, model=model, alias=selector)


# ---------------------------------------------------------------------------------------------- S3 layout


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # no leading or trailing slash; may be ""

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def parse_s3_uri(uri: str) -> S3Location:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"s3 URI has no bucket: {uri!r}")
    return S3Location(bucket=bucket, prefix=prefix.strip("/"))


# Traces of served requests: serving.trace_writer writes them, training.prompt_sets exports them, the hooks
# service's retention deletes them (only those carrying TRACE_TAG_ENDPOINT)
TRACE_TAG_ENDPOINT = "rlops.endpoint"
TRACE_TAG_IMAGES = "rlops.images"  # the request's image digests, comma-separated
TRACE_TAG_PASSED = "rlops.task_passed"  # the task's verdict as a tag: `search_traces` filters on it
TRACE_MODEL_ID = "mlflow.modelId"  # trace metadata linking it to a LoggedModel (MLflow's UI and search)
TRACE_SCORE, TRACE_PASSED = "task_score", "task_passed"  # the task scorer's assessments
TRACE_IMAGE_REF = "rlops-image://sha256/"  # + hex: an image in the messages, stored once...
TRACE_IMAGES_DIR = "rlops-images"  # ...under the experiment's artifact root as <sha256>.<ext>
TRACE_TAG_MODEL, TRACE_TAG_VERSION = "rlops.registered_model", "rlops.version"  # the answering version
TRACE_TAG_STATUS, TRACE_TAG_LATENCY_MS = "rlops.status", "rlops.latency_ms"
# a shadow pair (issue 31): both traces carry its id; role primary (it answered the client) or shadow (a copy)
TRACE_TAG_SHADOW_PAIR, TRACE_TAG_SHADOW_ROLE = "rlops.shadow.pair", "rlops.shadow.role"


LOGGED_MODEL_URI = "models:/"  # + a LoggedModel id: a registered version's source when the tracker made it


def version_model_id(model_id: str | None, source: str) -> str | None:
    """The LoggedModel id of a registered version: its `model_id` where the registry returns one (the REST
    API does not yet), else read from its `models:/<id>` source; None for any other source."""
    if model_id:
        return model_id
    rest = source[len(LOGGED_MODEL_URI):] if source.startswith(LOGGED_MODEL_URI) else ""
    return rest if rest and "/" not in rest else None


def version_folder(model: str, version: int) -> str:
    """The immutable folder name of one promoted version (never accepted from clients)."""
    return f"{model}-v{int(version)}"


def routes_key(location: S3Location, model: str) -> str:
    return location.key(ROUTES_DIR, f"{model}.json")


def routes_prefix(location: S3Location) -> str:
    return location.key(ROUTES_DIR) + "/"


def routes_stamp_key(location: S3Location) -> str:
    return location.key(ROUTES_STAMP)


def model_from_routes_key(location: S3Location, key: str) -> str | None:
    """`<prefix>/_routes/<model>.json` -> `<model>`; None for anything else."""
    head = routes_prefix(location)
    if not key.startswith(head) or not key.endswith(".json"):
        return None
    name = key[len(head):-len(".json")]
    return name if is_valid_name(name) and "/" not in name else None


def is_allowed_adapter_file(name: str) -> bool:
    return "/" not in name and not name.startswith(".") and name.endswith(ALLOWED_SUFFIXES)


# ------------------------------------------------------------------------------------------ manifest schema


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AliasRoute(_Strict):
    version: int = Field(ge=1)
    folder: str
    files: dict[str, str]  # file name -> sha256 hex
    promoted_at: str
    trigger: str


class CanaryRoute(AliasRoute):
    """A second target of an alias: `weight` percent of its clients (by identity hash) get this version."""

    weight: float = Field(gt=0, lt=100)


class ShadowRoute(AliasRoute):
    """A candidate that gets a copy of `percent` percent of an alias's requests; its answers are never returned."""

    percent: float = Field(gt=0, le=100)


class MoveNote(_Strict):
    """Who moves an alias (or ends a canary: `version` None), written on the registered model before the
    registry changes, so that whichever publisher sees the change (the mover's own sync, the webhook, the
    reconciler) records the same author, trigger, reason and move id."""

    move_id: str
    version: int | None = Field(None, ge=1)
    trigger: str
    actor: str | None = None
    reason: str | None = None


class HistoryEntry(_Strict):
    """One published move. `weight` set: a canary started/reweighted at it; `event` says what happened.
    `preview`: the version was published as `@v<N>` only (no alias moved), for a live eval before a move
    to `alias` (`promote --verify`); like every history entry it keeps `@v<N>` servable."""

    alias: str
    version: int = Field(ge=1)
    at: str
    trigger: str
    event: Literal["move", "canary", "canary_promoted", "canary_aborted", "preview", "shadow",
                   "shadow_stopped"] = "move"
    from_version: int | None = None
    weight: float | None = None
    actor: str | None = None
    reason: str | None = None


RefusalKind = Literal["adapter", "guardrail", "collecting"]


class Refusal(_Strict):
    """Why an alias keeps its previous target. `adapter`: the version cannot be served (sticky until the alias
    moves or a promote retries it); `guardrail`: its eval metric lost; `collecting`: gc is deleting its folder."""

    version: int = Field(ge=1)
    reason: str
    at: str
    kind: RefusalKind = "adapter"


class Collected(_Strict):
    """A version whose folder gc deleted (or is deleting since `at`): `@v<N>` answers 404, not a load error."""

    version: int = Field(ge=1)
    at: str


class RoutesManifest(_Strict):
    schema_version: Literal[1, 2] = SCHEMA_VERSION
    model: str
    owner: str | None = None  # the deployment (registry.owner) that writes it; None: written before owners
    generation: int = Field(0, ge=0)
    updated_at: str = Field(default_factory=utc_now)
    aliases: dict[str, AliasRoute] = Field(default_factory=dict)
    canaries: dict[str, CanaryRoute] = Field(default_factory=dict)  # alias -> its canary (schema 2)
    shadows: dict[str, ShadowRoute] = Field(default_factory=dict)  # alias -> its shadow (schema 2)
    history: list[HistoryEntry] = Field(default_factory=list)
    refused: dict[str, Refusal] = Field(default_factory=dict)
    collected: list[Collected] = Field(default_factory=list)

    @model_validator(mode="after")
    def _grammar(self) -> "RoutesManifest":
        """Whatever wrote the file, it may only name this model's own version folders and adapter files:
        a folder is derived from (model, version), so no value can point serving anywhere else."""
        if not is_valid_name(self.model):
            raise ValueError(f"model {self.model!r} is not a valid registered model name")
        for alias in [*self.aliases, *self.refused, *(h.alias for h in self.history)]:
            if not ALIAS_RE.match(alias):
                raise ValueError(f"alias {alias!r} is not a valid alias")
        for alias, canary in self.canaries.items():
            baseline = self.aliases.get(alias)
            if baseline is None or baseline.version == canary.version:
                raise ValueError(f"canary of {alias!r}: needs the alias set to another version")
        for alias, shadow in self.shadows.items():
            baseline = self.aliases.get(alias)
            if baseline is None or baseline.version == shadow.version:
                raise ValueError(f"shadow of {alias!r}: needs the alias set to another version")
        for alias, route in [*self.aliases.items(), *((f"{a}{CANARY_SUFFIX}", c) for a, c in self.canaries.items()),
                             *((f"{a}{SHADOW_SUFFIX}", c) for a, c in self.shadows.items())]:
            if route.folder != version_folder(self.model, route.version):
                raise ValueError(f"alias {alias!r}: folder is not {self.model}'s folder of v{route.version}")
            if not route.files or not all(is_allowed_adapter_file(n) and SHA256_RE.match(d) for n, d in route.files.items()):
                raise ValueError(f"alias {alias!r}: files must be .safetensors/.json names with sha256 hex digests")
            if any(c.version == route.version for c in self.collected):
                raise ValueError(f"alias {alias!r}: v{route.version} is marked garbage-collected")
        return self

    @model_serializer(mode="wrap")
    def _without_empty_shadows(self, handler):
        # readers of the release before know no `shadows` (their schema forbids unknown keys): a manifest
        # without a shadow stays readable by them
        data = handler(self)
        if not self.shadows:
            data.pop("shadows", None)
        return data

    def collected_versions(self) -> set[int]:
        return {c.version for c in self.collected}

    def published_versions(self) -> set[int]:
        """Versions a client may address as `@v<N>`: current targets and recorded history, less collected ones."""
        history = {h.version for h in self.history} - self.collected_versions()
        targets = [*self.aliases.values(), *self.canaries.values(), *self.shadows.values()]
        return {r.version for r in targets} | history


def canary_alias(alias: str) -> str:
    """The registry alias that names `alias`'s canary version."""
    return f"{alias}{CANARY_SUFFIX}"


def shadow_alias(alias: str) -> str:
    """The registry alias that names `alias`'s shadow version."""
    return f"{alias}{SHADOW_SUFFIX}"


def canary_bucket(model: str, alias: str, canary_version: int, client_key: str) -> float:
    """The client's place in [0, 100) for one canary: below the weight, it gets the canary. The canary's version
    is part of the hash (a new canary draws new clients) but the weight is not, so raising the weight only adds
    clients to the canary, and nobody flips back and forth while it grows."""
    digest = hashlib.sha256(f"{model}\0{alias}\0{canary_version}\0{client_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100


# ---------------------------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class Resolution:
    """Where a request goes. `folder` is internal: never put it in a response."""

    ref: ModelRef
    folder: str | None  # None = the base model
    version: int | None
    alias: str | None
    canary: bool = False  # the alias's canary answered (not its baseline)


def resolve_model_name(
    ref: ModelRef,
    base_model_id: str,
    manifests: Mapping[str, RoutesManifest],
    served_aliases: list[str] | tuple[str, ...],
    client_key: str | None = None,
    canary: bool = True,
) -> Resolution:
    """Resolve a parsed name against the published manifests; raise ModelNotFound with a client-safe message.
    An alias with a canary picks by `client_key` (None: a fresh random key, i.e. per request); `canary`
    False keeps the caller on the alias's own target."""
    if ref.base != base_model_id:
        raise ModelNotFound(f"The model {ref.raw!r} does not exist.")
    if ref.model is None:
        return Resolution(ref=ref, folder=None, version=None, alias=None)
    manifest = manifests.get(ref.model)
    if manifest is None:
        raise ModelNotFound(f"The model {ref.raw!r} does not exist.")
    if ref.version is not None:
        if ref.version in manifest.collected_versions():
            raise ModelNotFound(f"The model {ref.raw!r} is not available: version {ref.version} was garbage-collected.")
        if ref.version not in manifest.published_versions():
            raise ModelNotFound(f"The model {ref.raw!r} does not exist: version {ref.version} was never promoted.")
        return Resolution(ref=ref, folder=version_folder(ref.model, ref.version), version=ref.version, alias=None)
    assert ref.alias is not None
    if ref.alias not in served_aliases:
        raise ModelNotFound(f"The model {ref.raw!r} does not exist: alias {ref.alias!r} is not served.")
    route = manifest.aliases.get(ref.alias)
    if route is None:
        raise ModelNotFound(f"The model {ref.raw!r} is not available: alias {ref.alias!r} not set.")
    target = manifest.canaries.get(ref.alias) if canary else None
    if target is not None:
        key = client_key if client_key is not None else os.urandom(16).hex()
        if canary_bucket(ref.model, ref.alias, target.version, key) < target.weight:
            return Resolution(ref=ref, folder=target.folder, version=target.version, alias=ref.alias, canary=True)
    return Resolution(ref=ref, folder=route.folder, version=route.version, alias=ref.alias)
