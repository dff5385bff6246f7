"""Thin MLflow registry I/O: the served intent, where a version's adapter files live, audit tags."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from pydantic import ValidationError

from registry_hooks.adapter import InvalidAdapter
from registry_hooks.plan import Intent
from rlops.config import Config
from rlops.layout import (CANARY_WEIGHT_TAG, MOVE_NOTE_TAG, SHADOW_PERCENT_TAG, TAG_BASE_MODEL, TAG_BASE_MODEL_SHA256,
                          TAG_EVAL_SET, TAG_METRIC_KEY, TAG_METRIC_VALUE, TAG_SHA256, MoveNote, S3Location,
                          canary_alias, parse_s3_uri, shadow_alias,
                          version_model_id)

MOVE_REASON_LIMIT = 2000
LEGACY_PRODUCTION_STAGE = "Production"
LEGACY_PRODUCTION_ALIAS = "production"
# Audit tags written on a version when it is published or refused.
FOLDER_TAG = "serving.folder"
PROMOTED_AT_TAG = "serving.promoted_at"
PROMOTED_BY_TAG = "serving.promoted_by"
TRIGGER_TAG = "serving.trigger"
REFUSED_TAG = "serving.refused"
# The routes manifest mirrored on each version whose routes changed: where it is served, its history.
SERVED_AS_TAG = "serving.aliases"
HISTORY_TAG = "serving.history"
VERIFIED_TAG = "serving.verified"  # the live eval gate's figures (`promote --verify`): served vs tracked, when
# Bulk reads: the server's max_results limit for registered models (1000), a version page, a filter's length.
SEARCH_PAGE = 1000
VERSIONS_PAGE = 10_000
FILTER_CHARS = 6000


class RegistryNotFound(LookupError):
    """A registered model, version or alias that does not exist (message names which)."""


@dataclass(frozen=True)
class VersionSource:
    """Where one registered version's adapter files are and what the tracker recorded about them."""

    model: str
    version: int
    artifact_uri: str
    checksums: dict[str, str]
    base_model: str | None
    metric_key: str | None
    metric_value: float | None
    tags: dict[str, str] = field(default_factory=dict)
    eval_set: str | None = None
    base_sha256: str | None = None  # the content digest of the base it was trained on, where the tracker knew it


def mlflow_client(config: Config) -> MlflowClient:
    return MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)


def _not_found(exc: MlflowException) -> bool:
    return exc.error_code == "RESOURCE_DOES_NOT_EXIST"


def read_intent(client: MlflowClient, model: str, served_aliases: list[str]) -> Intent | None:
    """Served alias -> version for `model`; None when the registered model does not exist."""
    try:
        registered = client.get_registered_model(model)
    except MlflowException as exc:
        if _not_found(exc):
            return None
        raise
    return intent_of(registered, served_aliases)


def intent_of(registered, served_aliases: list[str]) -> Intent:
    """Served alias -> version of one RegisteredModel (as `get_` or `search_registered_models` return it),
    with each served alias's canary (`<alias>-canary` alias) and its weight tag, and its shadow
    (`<alias>-shadow` alias) and its percent tag.

    A legacy stage "Production" counts as the `production` alias only when that alias is not set.
    """
    keys = {*served_aliases, *(canary_alias(a) for a in served_aliases), *(shadow_alias(a) for a in served_aliases)}
    intent = {alias: int(v) for alias, v in registered.aliases.items() if alias in keys}
    if LEGACY_PRODUCTION_ALIAS in served_aliases and LEGACY_PRODUCTION_ALIAS not in intent:
        staged = [int(mv.version) for mv in registered.latest_versions or [] if mv.current_stage == LEGACY_PRODUCTION_STAGE]
        if staged:
            intent[LEGACY_PRODUCTION_ALIAS] = max(staged)
    tags = registered.tags or {}
    weights = {a: w for a in served_aliases if (w := canary_weight(tags.get(CANARY_WEIGHT_TAG + a))) is not None}
    percents = {a: p for a in served_aliases if (p := shadow_percent(tags.get(SHADOW_PERCENT_TAG + a))) is not None}
    notes = {key: note for key in keys if (note := move_note(tags.get(MOVE_NOTE_TAG + key))) is not None}
    return Intent(intent, weights, notes, percents)


def move_note(value: str | None) -> MoveNote | None:
    """A rlops.move.<key> tag's note; None when unset or not one (a hand-edited tag names no author)."""
    if value is None:
        return None
    try:
        return MoveNote.model_validate_json(value)
    except ValidationError:
        return None


def note_move(client: MlflowClient, model: str, key: str, note: MoveNote) -> None:
    """Say who moves `key` before the registry changes (a tag holds at most 5000 characters: the reason is cut)."""
    if note.reason is not None and len(note.reason) > MOVE_REASON_LIMIT:
        note = note.model_copy(update={"reason": note.reason[:MOVE_REASON_LIMIT]})
    client.set_registered_model_tag(model, MOVE_NOTE_TAG + key, note.model_dump_json())


def forget_move(client: MlflowClient, model: str, key: str, move_id: str) -> None:
    """Drop the note once its move is published, unless another mover's note replaced it meanwhile (a later
    move of the same key without a note must not be credited to this one)."""
    current = move_note((client.get_registered_model(model).tags or {}).get(MOVE_NOTE_TAG + key))
    if current is not None and current.move_id == move_id:
        client.delete_registered_model_tag(model, MOVE_NOTE_TAG + key)


def canary_weight(value: str | None) -> float | None:
    """A weight tag's percent, or None when unset or not a number strictly between 0 and 100 (not served)."""
    weight = _percent(value)
    return weight if weight is not None and weight < 100 else None


def shadow_percent(value: str | None) -> float | None:
    """A shadow percent tag's value, or None when unset or not a number in (0, 100] (not served)."""
    return _percent(value)


def _percent(value: str | None) -> float | None:
    try:
        percent = float(value) if value is not None else None
    except ValueError:
        return None
    return percent if percent is not None and 0 < percent <= 100 else None


def name_filters(models: list[str]) -> list[str]:
    """`name IN (...)` filters covering `models`, each short enough for one GET: the search filter rides in
    the URL, and the server answers "Invalid HTTP request" to a request line of ~58 kB (28 kB passed)."""
    filters, chunk, size = [], [], 0
    for name in models:
        quoted = "'" + name + "'"  # registered names cannot contain quotes (RegistryName)
        if chunk and size + len(quoted) + 1 > FILTER_CHARS:
            filters.append(f"name IN ({','.join(chunk)})")
            chunk, size = [], 0
        chunk.append(quoted)
        size += len(quoted) + 1
    if chunk:
        filters.append(f"name IN ({','.join(chunk)})")
    return filters


def search_intents(client: MlflowClient, name_filter: str, served_aliases: list[str]) -> dict[str, dict[str, int]]:
    """Intent of every registered model matching `name_filter`, read in pages of SEARCH_PAGE (aliases and
    per-stage latest versions come with each model, so this costs no per-model request)."""
    found, token = {}, None
    while True:
        page = client.search_registered_models(filter_string=name_filter, max_results=SEARCH_PAGE, page_token=token)
        found.update({rm.name: intent_of(rm, served_aliases) for rm in page})
        token = page.token
        if not token:
            return found


def search_versions(client: MlflowClient, name_filter: str) -> list:
    """Every version of the models matching `name_filter`, in pages of VERSIONS_PAGE."""
    found, token = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while True:
            page = client.search_model_versions(name_filter, max_results=VERSIONS_PAGE, page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                return found


def version_by_alias(client: MlflowClient, model: str, alias: str) -> int:
    try:
        return int(client.get_model_version_by_alias(model, alias).version)
    except MlflowException as exc:
        # MLflow answers an unset alias with INVALID_PARAMETER_VALUE "... alias X not found".
        if _not_found(exc) or "not found" in exc.message:
            raise RegistryNotFound(f"alias {alias!r} is not set on registered model {model!r}") from None
        raise


def version_experiment_id(client: MlflowClient, model: str, version: int, fallback_experiment: str) -> str | None:
    """Where the traces of a version's answers are: its LoggedModel's experiment, else (a version without one)
    the experiment named `fallback_experiment`; None when that does not exist (no trace written yet)."""
    mv = client.get_model_version(model, str(version))
    model_id = version_model_id(mv.model_id, mv.source)
    if model_id:
        return client.get_logged_model(model_id).experiment_id
    experiment = client.get_experiment_by_name(fallback_experiment)
    return experiment.experiment_id if experiment is not None else None


def require_model(client: MlflowClient, model: str) -> None:
    try:
        client.get_registered_model(model)
    except MlflowException as exc:
        if _not_found(exc):
            raise RegistryNotFound(f"registered model {model!r} does not exist in {client.tracking_uri}") from None
        raise


def _metric(tags: dict[str, str]) -> tuple[str | None, float | None]:
    try:
        value = float(tags[TAG_METRIC_VALUE]) if TAG_METRIC_VALUE in tags else None
    except ValueError:
        value = None
    return tags.get(TAG_METRIC_KEY), value


def version_source(client: MlflowClient, model: str, version: int) -> VersionSource:
    """The version's artifact URI and recorded checksums (LoggedModel tags, else the version's own tags)."""
    try:
        mv = client.get_model_version(model, str(version))
    except MlflowException as exc:
        if _not_found(exc):
            raise RegistryNotFound(f"version {version} of registered model {model!r} does not exist") from None
        raise
    version_tags = dict(mv.tags or {})
    source_tags: dict[str, str] = {}
    artifact_uri = mv.source
    model_id = version_model_id(mv.model_id, mv.source)
    if model_id:
        try:
            logged = client.get_logged_model(model_id)
        except MlflowException as exc:
            if _not_found(exc):
                raise InvalidAdapter(f"the version's logged model {model_id} no longer exists") from None
            raise
        artifact_uri = logged.artifact_location
        source_tags = dict(logged.tags or {})
    recorded = {**version_tags, **source_tags}
    checksums = {k[len(TAG_SHA256):]: v.lower() for k, v in recorded.items() if k.startswith(TAG_SHA256)}
    metric_key, metric_value = _metric(version_tags)
    return VersionSource(model, int(mv.version), artifact_uri, checksums, recorded.get(TAG_BASE_MODEL),
                         metric_key, metric_value, version_tags, eval_set=version_tags.get(TAG_EVAL_SET),
                         base_sha256=recorded.get(TAG_BASE_MODEL_SHA256))


def artifact_s3_location(config: Config, artifact_uri: str) -> S3Location | None:
    """`s3://...` as is; `mlflow-artifacts:/<path>` mapped under the server's S3 artifacts destination."""
    if artifact_uri.startswith("s3://"):
        return parse_s3_uri(artifact_uri)
    if artifact_uri.startswith("mlflow-artifacts:"):
        path = artifact_uri[len("mlflow-artifacts:"):]
        if path.startswith("//"):  # mlflow-artifacts://host:port/path
            path = "/" + path[2:].partition("/")[2]
        destination = config.artifacts_destination
        if destination.startswith("s3://"):
            return parse_s3_uri(destination.rstrip("/") + "/" + path.lstrip("/"))
    return None


def set_tags(client: MlflowClient, model: str, version: int, tags: dict[str, str]) -> None:
    for key, value in tags.items():
        client.set_model_version_tag(model, str(version), key, value)


def delete_tag(client: MlflowClient, model: str, version: int, key: str) -> None:
    """Drop a version tag; an absent one is fine."""
    try:
        client.delete_model_version_tag(model, str(version), key)
    except MlflowException as exc:
        if not (_not_found(exc) or "not found" in exc.message):
            raise


def set_alias(client: MlflowClient, model: str, alias: str, version: int) -> None:
    client.set_registered_model_alias(model, alias, str(version))


def set_canary(client: MlflowClient, model: str, alias: str, version: int, weight: float) -> None:
    """The canary intent: weight tag first, so the alias never names a canary without its weight."""
    client.set_registered_model_tag(model, CANARY_WEIGHT_TAG + alias, f"{weight:g}")
    client.set_registered_model_alias(model, canary_alias(alias), str(version))


def set_shadow(client: MlflowClient, model: str, alias: str, version: int, percent: float) -> None:
    """The shadow intent: percent tag first, so the alias never names a shadow without its share."""
    client.set_registered_model_tag(model, SHADOW_PERCENT_TAG + alias, f"{percent:g}")
    client.set_registered_model_alias(model, shadow_alias(alias), str(version))


def clear_shadow(client: MlflowClient, model: str, alias: str) -> None:
    """Drop the shadow intent of `alias` (alias first: a percent alone names nothing); absent parts are fine."""
    _drop_all(model, ((client.delete_registered_model_alias, shadow_alias(alias)),
                              (client.delete_registered_model_tag, SHADOW_PERCENT_TAG + alias)))


def clear_canary(client: MlflowClient, model: str, alias: str) -> None:
    """Drop the canary intent of `alias` (alias first: a weight alone names nothing); absent parts are fine."""
    _drop_all(model, ((client.delete_registered_model_alias, canary_alias(alias)),
                              (client.delete_registered_model_tag, CANARY_WEIGHT_TAG + alias)))


def _drop_all(model: str, drops) -> None:
    for drop, name in drops:
        try:
            drop(model, name)
        except MlflowException as exc:
            if not (_not_found(exc) or "not found" in exc.message):
                raise
