"""Routes: the published manifests as an immutable table (pure), and a cache that keeps it fresh from S3.

The request path only reads `RoutesCache.table` (a reference swap, no I/O). A background thread checks
the routes stamp every `staleness_s / 2` (one HEAD) and lists `<prefix>/_routes/` only when it moved, when
there is none, or every `relist_s` in any case (a writer that does not stamp); it fetches only manifests
whose ETag changed. A published alias move is visible within `staleness_s`, no S3 call is ever made per
request, and a no-change pass costs one HEAD however many models are published.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping
from urllib.parse import unquote
from xml.etree import ElementTree

import httpx

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlops.layout import (
    ModelRef,
    Resolution,
    RoutesManifest,
    S3Location,
    ShadowRoute,
    model_from_routes_key,
    parse_model_name,
    parse_s3_uri,
    resolve_model_name,
    routes_prefix,
    routes_stamp_key,
    version_folder,
)

log = logging.getLogger(__name__)

FETCH_WORKERS = 8


def internal_model_id(base_model_id: str, folder: str | None) -> str:
    """The id Ray and the engine route on: `<base>:<folder>`, or the bare base. Never shown to clients."""
    return base_model_id if folder is None else f"{base_model_id}:{folder}"


@dataclass(frozen=True)
class RoutesTable:
    """One consistent snapshot of every published manifest. Immutable: the cache swaps whole tables."""

    base_model_id: str
    served_aliases: tuple[str, ...]
    default_alias: str
    manifests: Mapping[str, RoutesManifest] = field(default_factory=dict)

    def parse(self, raw_name: object) -> ModelRef:
        """Client name -> its parts; raises MalformedModelName (400) with a client-safe message."""
        return parse_model_name(raw_name, self.default_alias)

    def resolve(self, raw_name: object, client_key: str | None = None, *, canary: bool = True) -> Resolution:
        """Client name -> route; raises MalformedModelName (400) or ModelNotFound (404), client-safe messages.
        `client_key` picks between an alias's target and its canary (sticky per key; `canary` False: never)."""
        return self.resolve_ref(self.parse(raw_name), client_key, canary=canary)

    def resolve_ref(self, ref: ModelRef, client_key: str | None = None, *, canary: bool = True) -> Resolution:
        return resolve_model_name(ref, self.base_model_id, self.manifests, self.served_aliases, client_key, canary)

    def shadow(self, resolution: Resolution) -> ShadowRoute | None:
        """The shadow that gets a copy of a request answered by its alias's own target (not its canary)."""
        if resolution.alias is None or resolution.canary or resolution.ref.model is None:
            return None
        manifest = self.manifests.get(resolution.ref.model)
        return manifest.shadows.get(resolution.alias) if manifest is not None else None

    def model_cards(self) -> list[dict[str, Any]]:
        """`/v1/models` entries: the base, then `<base>:<model>@<alias>` for every served alias that is set
        (plus `<base>:<model>` for the default alias), with the version each points to. No folders, no URIs."""
        cards = [_card(self.base_model_id, {"kind": "base"})]
        for model in sorted(self.manifests):
            manifest = self.manifests[model]
            for alias in self.served_aliases:
                route = manifest.aliases.get(alias)
                if route is None:
                    continue
                meta = {"kind": "alias", "registered_model": model, "alias": alias, "version": route.version,
                        "promoted_at": route.promoted_at}
                canary = manifest.canaries.get(alias)
                if canary is not None:
                    meta["canary"] = {"version": canary.version, "weight": canary.weight, "since": canary.promoted_at}
                if alias == self.default_alias:
                    cards.append(_card(f"{self.base_model_id}:{model}", meta))
                cards.append(_card(f"{self.base_model_id}:{model}@{alias}", meta))
        return cards

    @cached_property
    def models_json(self) -> bytes:
        """The `/v1/models` body, serialized once per table (10k entries stay fast)."""
        return json.dumps({"object": "list", "data": self.model_cards()}, separators=(",", ":")).encode()


def hot_adapter_ids(table: RoutesTable, cap: int) -> list[str]:
    """Internal ids of the adapters every LLM replica should hold before traffic asks for them, newest first,
    at most `cap` (the replica's adapter slots: preloading more would evict what is served). Hot: each served
    alias's target, canary and shadow, and each pending `preview` (`promote --verify` publishes it, then evaluates it,
    then moves the alias: a preview newer than its alias's target is the next target). Newest by the time each
    became hot (`promoted_at`, a preview's `at`)."""
    became_hot: dict[str, str] = {}
    for model, manifest in table.manifests.items():
        served = [route for alias, route in [*manifest.aliases.items(), *manifest.canaries.items(),
                                             *manifest.shadows.items()] if alias in table.served_aliases]
        hot = [(route.folder, route.promoted_at) for route in served]
        collected = manifest.collected_versions()
        for entry in manifest.history:
            target = manifest.aliases.get(entry.alias)
            if entry.event == "preview" and entry.version not in collected and (
                    target is None or (target.version != entry.version and entry.at > target.promoted_at)):
                hot.append((version_folder(model, entry.version), entry.at))
        for folder, at in hot:
            key = internal_model_id(table.base_model_id, folder)
            became_hot[key] = max(at, became_hot.get(key, ""))
    return sorted(became_hot, key=lambda key: (became_hot[key], key), reverse=True)[:cap]


def _card(model_id: str, metadata: dict[str, Any]) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "owned_by": "rlops", "permission": [], "metadata": metadata}


S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def parse_list_page(body: bytes) -> tuple[dict[str, str], str | None]:
    """One ListObjectsV2 XML page -> ({key: etag}, continuation token or None). Keys may be URL-encoded."""
    root = ElementTree.fromstring(body)
    page = {unquote(c.findtext(f"{S3_NS}Key", "")): c.findtext(f"{S3_NS}ETag", "") for c in root.iter(f"{S3_NS}Contents")}
    truncated = root.findtext(f"{S3_NS}IsTruncated") == "true"
    return page, (root.findtext(f"{S3_NS}NextContinuationToken") or None) if truncated else None


def plan_refresh(known_etags: Mapping[str, str], listing: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Given the ETags we hold and a fresh listing (key -> ETag): (keys to fetch, keys that disappeared)."""
    changed = [key for key, etag in listing.items() if known_etags.get(key) != etag]
    removed = [key for key in known_etags if key not in listing]
    return sorted(changed), sorted(removed)


class RoutesCache:
    """Keeps a `RoutesTable` fresh from `<prefix>/_routes/*.json` (ETag listing, changed files only).

    A manifest that cannot be read keeps its last good version and is retried; one that fails the schema or
    the name/folder grammar keeps its last good version too, is logged and listed in `refused` (key ->
    reason), and is not fetched again until its ETag changes. An S3 outage keeps the whole last table.
    Failures are logged, never raised to clients.
    """

    def __init__(self, s3_client, location: S3Location, *, base_model_id: str, served_aliases: Iterable[str],
                 default_alias: str, staleness_s: float, relist_s: float):
        self._s3 = s3_client  # must sign with SigV4 (presigned listing URLs)
        self._http = httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0))
        self._location = location
        self._staleness_s = staleness_s
        self._relist_s = relist_s
        self._stamp: str | None = None  # the stamp's ETag at the last complete listing
        self._listed_at = float("-inf")
        self._etags: dict[str, str] = {}
        self._manifests: dict[str, RoutesManifest] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.table = RoutesTable(base_model_id, tuple(served_aliases), default_alias)
        self.last_error: str | None = None
        self.refused: dict[str, str] = {}

    def refresh(self) -> bool:
        """One pass; True if the table changed. Called from one thread at a time."""
        try:
            stamp = self._read_stamp()
            if stamp is not None and stamp == self._stamp and time.monotonic() - self._listed_at < self._relist_s:
                return False
            listing = self._list()
        except Exception as exc:  # noqa: BLE001 - an outage must not take routing down
            self._note_error(f"listing {self._location.uri}/_routes failed: {type(exc).__name__}")
            return False
        self._listed_at = time.monotonic()
        to_fetch, removed = plan_refresh(self._etags, listing)
        changed = bool(removed)
        for key in removed:
            del self._etags[key]
            self.refused.pop(key, None)
            model = model_from_routes_key(self._location, key)
            if model is not None:
                self._manifests.pop(model, None)
        failed = False
        models = {key: model_from_routes_key(self._location, key) for key in to_fetch}
        wanted = [key for key, model in models.items() if model is not None]
        # Concurrent GETs: a cold start with thousands of manifests takes seconds, not minutes.
        fetched = {}
        if wanted:
            with ThreadPoolExecutor(max_workers=min(FETCH_WORKERS, len(wanted))) as pool:
                fetched = dict(zip(wanted, pool.map(lambda key: self._fetch(key, models[key]), wanted)))
        for key in to_fetch:
            model = models[key]
            manifest, etag = fetched.get(key, (None, listing[key]))
            if manifest is None and not etag:
                failed = True  # unreadable or invalid: keep the last good version, retry next pass
                continue
            self._etags[key] = etag  # also remembers names we skip, so they are not re-fetched
            if manifest is not None:
                self._manifests[model] = manifest
                self.refused.pop(key, None)
                changed = True
        if changed:
            table = self.table
            self.table = RoutesTable(table.base_model_id, table.served_aliases, table.default_alias, dict(self._manifests))
        if not failed:
            self._stamp = stamp  # read before the listing: a later stamp means a later change, seen next pass
            if not self.refused:  # a refused manifest stays reported until it is fixed or removed
                self.last_error = None
        return changed

    def _read_stamp(self) -> str | None:
        """The routes stamp's ETag; None when no writer has stamped this prefix yet."""
        url = self._s3.generate_presigned_url("head_object", Params={
            "Bucket": self._location.bucket, "Key": routes_stamp_key(self._location)}, ExpiresIn=300)
        response = self._http.head(url)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.headers.get("etag")

    def _list(self) -> dict[str, str]:
        # A presigned GET parsed with ElementTree costs ~1/5 of the CPU of boto3's own parsing, which matters:
        # this runs every staleness_s / 2 inside the ingress process, and grows with the number of models.
        listing: dict[str, str] = {}
        token = None
        while True:
            params = {"Bucket": self._location.bucket, "Prefix": routes_prefix(self._location)}
            if token:
                params["ContinuationToken"] = token
            url = self._s3.generate_presigned_url("list_objects_v2", Params=params, ExpiresIn=300)
            response = self._http.get(url)
            response.raise_for_status()
            page, token = parse_list_page(response.content)
            listing.update(page)
            if token is None:
                return listing

    def _fetch(self, key: str, model: str) -> tuple[RoutesManifest | None, str]:
        """(manifest, etag); (None, etag) for a manifest to skip for good; (None, "") to retry later."""
        try:
            obj = self._s3.get_object(Bucket=self._location.bucket, Key=key)
            body = obj["Body"].read()
        except Exception as exc:  # noqa: BLE001 - deleted between list and get, or an outage: retry next pass
            self._note_error(f"reading {key} failed: {type(exc).__name__}")
            return None, ""
        try:
            manifest = RoutesManifest.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors()[0]["msg"][:200]
            return self._refuse(key, obj, f"invalid ({exc.error_count()} errors, first: {first}); keeping the last good one")
        if manifest.model != model:
            return self._refuse(key, obj, f"names model {manifest.model!r}; ignored")
        return manifest, obj.get("ETag", "")

    def _refuse(self, key: str, obj: dict, reason: str) -> tuple[None, str]:
        self.refused[key] = reason
        self._note_error(f"manifest {key} {reason}")
        return None, obj.get("ETag", "") or "-"

    def _note_error(self, message: str) -> None:
        if message != self.last_error:
            log.warning("routes: %s", message)
        self.last_error = message

    # ------------------------------------------------------------------------------- background refresh

    def start(self) -> None:
        """First refresh now (so the app starts with its routes), then every staleness_s / 2 in a thread."""
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="rlops-routes-refresh", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = self._staleness_s / 2
        while not self._stop.wait(interval):
            self.refresh()

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=5)


PRELOAD_KEY = "rlops_preload"  # LLMConfig.experimental_configs key: the LLM replicas' RoutesSettings (absent: off)


class RoutesSettings(BaseModel):
    """What a replica needs to follow the manifests (plain, serializable, no secrets)."""

    model_config = ConfigDict(extra="forbid")

    base_model_id: str
    lora_path: str
    served_aliases: list[str]
    default_alias: str
    staleness_s: float = Field(gt=0)
    relist_s: float = Field(gt=0)


def replica_routes_cache(settings: RoutesSettings) -> RoutesCache:
    """A RoutesCache on the replica's S3: boto3 reads AWS_ENDPOINT_URL / AWS_REGION / credentials from the
    replica's environment, as Ray's own LoRA downloader does; short timeouts keep a dead S3 from stalling
    the refresh."""
    import boto3
    from botocore.config import Config as BotoConfig

    s3_client = boto3.client("s3", config=BotoConfig(connect_timeout=2, read_timeout=5, signature_version="s3v4",
                                                     retries={"max_attempts": 2}))
    return RoutesCache(s3_client, parse_s3_uri(settings.lora_path), base_model_id=settings.base_model_id,
                       served_aliases=settings.served_aliases, default_alias=settings.default_alias,
                       staleness_s=settings.staleness_s, relist_s=settings.relist_s)
