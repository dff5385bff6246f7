"""Bulk reads over every configured model, and the reconciler pass built on them.

The registry is read in a few paged `search_registered_models` calls (aliases and legacy stages come with
each model) and the manifests from one `_routes/` listing, fetching only manifests whose ETag changed
since the last read. A pass then syncs only the models whose manifest differs from their intent, a few at
a time, so a pass with nothing to do costs no per-model request.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

from registry_hooks import registry, storage
from registry_hooks.plan import needs_sync
from registry_hooks.sync import Promoter
from rlops.layout import RoutesManifest, utc_now


@dataclass(frozen=True)
class ModelState:
    """One configured model as the bulk reads saw it."""

    model: str
    intent: dict[str, int] | None  # None: no such registered model
    manifest: RoutesManifest  # empty (generation 0) when none is published
    invalid: str | None = None  # why the published manifest could not be read

    @property
    def needs_sync(self) -> bool:
        return self.invalid is not None or needs_sync(self.intent or {}, self.manifest)


class ManifestCache:
    """Manifests last read, by model, with their ETags: `refresh` lists `_routes/` once and GETs only the
    manifests that are new or whose ETag changed (what serving's reader does too)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, RoutesManifest, str | None]] = {}  # model -> (etag, manifest, invalid)

    def refresh(self, promoter: Promoter, models: list[str], pool: ThreadPoolExecutor) -> int:
        """Bring the manifests of `models` up to date; return how many were fetched."""
        wanted = set(models)
        listing = {m: etag for m, etag in storage.list_manifest_models(promoter.dest, promoter.location).items()
                   if m in wanted}
        for model in set(self._held) - set(listing):
            del self._held[model]
        changed = [m for m, etag in listing.items() if m not in self._held or self._held[m][0] != etag]
        for model, entry in zip(changed, pool.map(lambda m: _fetch(promoter, m, listing[m]), changed)):
            self._held[model] = entry
        return len(changed)

    def get(self, model: str) -> tuple[RoutesManifest, str | None]:
        _, manifest, invalid = self._held.get(model, ("", RoutesManifest(model=model), None))
        return manifest, invalid


def _fetch(promoter: Promoter, model: str, listed_etag: str) -> tuple[str, RoutesManifest, str | None]:
    """Held under the listed ETag: what was read is at least that new, and if it changed since the listing,
    the next listing differs and it is read again (GET and listing ETags may be quoted differently)."""
    try:
        manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
    except storage.InvalidManifest as exc:
        return listed_etag, RoutesManifest(model=model), str(exc)
    return listed_etag, manifest, None


def read_states(promoter: Promoter, models: list[str], cache: ManifestCache, pool: ThreadPoolExecutor) -> tuple[list[ModelState], int]:
    """Every model's intent and manifest in bulk; also how many manifests had to be fetched."""
    served = promoter.config.registry.served_aliases
    intents: dict[str, dict[str, int]] = {}
    for found in pool.map(lambda f: registry.search_intents(promoter.mlflow, f, served), registry.name_filters(models)):
        intents.update(found)
    fetched = cache.refresh(promoter, models, pool)
    return [ModelState(m, intents.get(m), *cache.get(m)) for m in models], fetched


@dataclass
class PassReport:
    """What `/healthz` and `_status/reconciler.json` say about the last pass."""

    finished_at: str
    seconds: float
    models_seen: int  # configured models read
    models_registered: int
    manifests_fetched: int  # GETs this pass needed (0 when nothing was republished)
    models_synced: int  # syncs run: models whose manifest differed from their intent
    sync_failures: int
    interval_s: float
    behind_s: float  # how much longer than the interval the pass took (the next one starts late by this)

    def to_dict(self) -> dict:
        return asdict(self)


def run_pass(promoter: Promoter, cache: ManifestCache, sync: Callable[[str], bool], concurrency: int) -> PassReport:
    """Sync, `concurrency` at a time, every configured model whose manifest differs from its intent.
    `sync(model)` runs one sync and says whether it succeeded (it reports its own errors)."""
    started = time.monotonic()
    models = promoter.config.registry.models
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rlops-reconcile") as pool:
        states, fetched = read_states(promoter, models, cache, pool)
        stale = [s.model for s in states if s.needs_sync]
        outcomes = list(pool.map(sync, stale))
    seconds = time.monotonic() - started
    interval = promoter.config.hooks.reconcile_interval_s
    return PassReport(
        finished_at=utc_now(), seconds=round(seconds, 3), models_seen=len(states),
        models_registered=sum(s.intent is not None for s in states), manifests_fetched=fetched,
        models_synced=len(stale), sync_failures=outcomes.count(False), interval_s=interval,
        behind_s=round(max(0.0, seconds - interval), 3) if interval > 0 else 0.0,
    )
