"""User-facing operations on top of the sync: promote, rollback, list, status, gc."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable

from registry_hooks import registry, storage
from registry_hooks.adapter import InvalidAdapter
from registry_hooks.plan import drift, parse_time, referenced_folders, rollback_target
from registry_hooks.reconcile import ManifestCache, ModelState, read_states
from registry_hooks.sync import NotFound, Promoter, PromotionError, Refused, SyncReport
from rlops.config import Config
from rlops.layout import is_valid_alias, version_folder

RECONCILER_STATUS = "reconciler"


class UsageProblem(PromotionError):
    exit_code = 2


def _served_alias(config: Config, alias: str) -> None:
    if not is_valid_alias(alias):
        raise UsageProblem(f"alias {alias!r} is not a valid alias ([A-Za-z0-9_-]+, not 'latest' or 'v<N>')")
    if alias not in config.registry.served_aliases:
        raise NotFound(f"alias {alias!r} is not served (registry.served_aliases: "
                       f"{', '.join(config.registry.served_aliases)})")


def _lookup(fn, *args):
    try:
        return fn(*args)
    except registry.RegistryNotFound as exc:
        raise NotFound(str(exc)) from None


def check_guardrail(candidate: registry.VersionSource, current: registry.VersionSource | None) -> None:
    """A guarded alias never gets a version whose eval metric is worse than (or not comparable to) its current one."""
    if current is None or current.version == candidate.version or current.metric_value is None:
        return
    if candidate.metric_value is None or candidate.metric_key != current.metric_key:
        raise Refused(
            f"v{candidate.version} has no eval metric comparable to v{current.version}'s "
            f"{current.metric_key}={current.metric_value:g}; use --force to promote anyway")
    if candidate.metric_value < current.metric_value:
        raise Refused(
            f"v{candidate.version} scores {candidate.metric_key}={candidate.metric_value:g}, worse than the current "
            f"v{current.version} ({current.metric_value:g}); use --force to promote anyway")


def promote(
    config: Config, model: str, *, to_alias: str, version: int | None = None, from_alias: str | None = None,
    force: bool = False, trigger: str = "cli", actor: str | None = None, dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
) -> SyncReport:
    """Copy and verify the version's folder, then move `to_alias` to it, then sync (the alias moves only
    after the copy succeeded). Raises NotFound, Refused (invalid adapter, guardrail) or UsageProblem."""
    promoter = Promoter(config, progress=progress)
    promoter.check_model(model)
    _served_alias(config, to_alias)
    if (version is None) == (from_alias is None):
        raise UsageProblem("give exactly one of --version N or --from ALIAS")
    _lookup(registry.require_model, promoter.mlflow, model)
    if from_alias is not None:
        version = _lookup(registry.version_by_alias, promoter.mlflow, model, from_alias)
    assert version is not None
    candidate = _lookup(registry.version_source, promoter.mlflow, model, version)
    if to_alias in config.registry.guarded_aliases and not force:
        intent = registry.read_intent(promoter.mlflow, model, config.registry.served_aliases) or {}
        current = intent.get(to_alias)
        check_guardrail(candidate, _lookup(registry.version_source, promoter.mlflow, model, current) if current else None)
    return _move_alias(promoter, model, to_alias, version, trigger=trigger, actor=actor, dry_run=dry_run)


def _move_alias(promoter: Promoter, model: str, alias: str, version: int, *, trigger: str, actor: str | None,
                dry_run: bool) -> SyncReport:
    try:
        if dry_run:
            promoter.inspect(model, version)
        else:
            promoter.prepare(model, version)
    except InvalidAdapter as exc:
        if not dry_run:
            registry.set_tags(promoter.mlflow, model, version, {registry.REFUSED_TAG: str(exc)})
        raise Refused(f"v{version} of {model!r} cannot be served: {exc}") from None
    if dry_run:
        manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
        return SyncReport(model=model, trigger=trigger, generation=manifest.generation,
                          served={a: r.version for a, r in manifest.aliases.items()}, promoted={alias: version},
                          copy_mode=promoter.last_mode, warnings=["dry run: nothing was copied or changed"])
    registry.set_alias(promoter.mlflow, model, alias, version)
    report = promoter.sync(model, trigger=trigger, actor=actor)
    if report.served.get(alias) != version:
        report.warnings.append(f"{alias} now serves v{report.served.get(alias)}: the alias was moved again meanwhile")
    return report


def rollback(config: Config, model: str, *, alias: str | None = None, actor: str | None = None,
             dry_run: bool = False, progress: Callable[[int], None] | None = None) -> SyncReport:
    """Move `alias` back to the version it served before (manifest history), then sync."""
    promoter = Promoter(config, progress=progress)
    promoter.check_model(model)
    alias = alias or config.registry.default_alias
    _served_alias(config, alias)
    manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
    target = rollback_target(manifest, alias)
    if target is None:
        raise NotFound(f"{model}@{alias} has no earlier target in the served history to roll back to")
    return _move_alias(promoter, model, alias, target, trigger="rollback", actor=actor, dry_run=dry_run)


def _bulk_states(config: Config, promoter: Promoter, models: list[str]) -> list[ModelState]:
    with ThreadPoolExecutor(max_workers=config.hooks.reconcile_concurrency) as pool:
        return read_states(promoter, models, ManifestCache(), pool)[0]


def list_models(config: Config, model: str | None = None) -> list[dict]:
    """Per configured model: served aliases (registry vs manifest) and versions with metric and folder."""
    promoter = Promoter(config)
    models = [model] if model else config.registry.models
    for name in models:
        promoter.check_model(name)
    states = _bulk_states(config, promoter, models)
    missing = [s.model for s in states if s.intent is None]
    if missing:
        raise NotFound(f"registered model {missing[0]!r} does not exist in {config.tracking_uri}"
                       + (f" (nor {len(missing) - 1} more configured models)" if len(missing) > 1 else ""))
    versions_of: dict[str, list] = {name: [] for name in models}
    for name_filter in registry.name_filters(models):
        for mv in registry.search_versions(promoter.mlflow, name_filter):
            versions_of[mv.name].append(mv)
    out = []
    for state in states:
        intent, manifest = state.intent or {}, state.manifest
        versions = []
        for mv in sorted(versions_of[state.model], key=lambda v: int(v.version)):
            tags = mv.tags or {}
            versions.append({
                "version": int(mv.version), "aliases": sorted(a for a, v in intent.items() if v == int(mv.version)),
                "metric_key": tags.get(registry.METRIC_KEY_TAG), "metric_value": tags.get(registry.METRIC_VALUE_TAG),
                "folder": tags.get(registry.FOLDER_TAG), "refused": tags.get(registry.REFUSED_TAG),
            })
        aliases = {
            alias: {"registry": intent.get(alias),
                    "served": manifest.aliases[alias].version if alias in manifest.aliases else None,
                    "folder": manifest.aliases[alias].folder if alias in manifest.aliases else None}
            for alias in config.registry.served_aliases
        }
        out.append({"model": state.model, "generation": manifest.generation, "aliases": aliases, "versions": versions})
    return out


def status(config: Config, now: datetime | None = None) -> dict:
    """Drift (registry intent vs served manifest, refusals) per model and the reconciler's last heartbeat."""
    promoter = Promoter(config)
    now = now or datetime.now(timezone.utc)
    models = []
    for state in _bulk_states(config, promoter, config.registry.models):
        manifest = state.manifest
        drifts = [d.describe() for d in drift(state.intent or {}, manifest)]
        models.append({
            "model": state.model, "registered": state.intent is not None, "generation": manifest.generation,
            "updated_at": manifest.updated_at if manifest.generation else None,
            "intent": state.intent or {}, "served": {a: r.version for a, r in manifest.aliases.items()},
            "drift": drifts + ([state.invalid] if state.invalid else []),
            "refused": {a: {"version": r.version, "reason": r.reason} for a, r in manifest.refused.items()},
        })
    reconciler = storage.read_status(promoter.dest, promoter.location, RECONCILER_STATUS)
    if reconciler is not None and config.hooks.reconcile_interval_s > 0:
        # A pass with nothing to do runs no sync: its end, not the last sync, is the heartbeat.
        last = (reconciler.get("last_pass") or {}).get("finished_at") or reconciler.get("last_run_at")
        reconciler["stale"] = last is None or (now - parse_time(last)).total_seconds() > 3 * config.hooks.reconcile_interval_s + 60
    return {"in_sync": all(not m["drift"] for m in models), "models": models, "reconciler": reconciler}


def retire_unlisted(config: Config) -> list[str]:
    """Unpublish manifests of models no longer in registry.models (the intent is the listed models only):
    their routes answer "model does not exist"; their folders are left for an operator (gc skips them)."""
    promoter = Promoter(config)
    retired = []
    for name in storage.list_manifest_models(promoter.dest, promoter.location):
        if name not in config.registry.models:
            storage.delete_manifest(promoter.dest, promoter.location, name)
            retired.append(name)
    return retired


@dataclass
class GcReport:
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    too_young: list[str] = field(default_factory=list)
    dry_run: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def gc(config: Config, *, dry_run: bool = False, now: datetime | None = None) -> GcReport:
    """Delete version folders of configured models that no alias (registry or manifest) and no history entry
    within `registry.gc_retention_s` names, and that are older than `registry.gc_grace_s`."""
    promoter = Promoter(config)
    now = now or datetime.now(timezone.utc)
    manifests, intents = [], {}
    for name in config.registry.models:
        manifests.append(storage.read_manifest(promoter.dest, promoter.location, name)[0])
        intents[name] = registry.read_intent(promoter.mlflow, name, config.registry.served_aliases) or {}
    keep = referenced_folders(manifests, intents, now, timedelta(seconds=config.registry.gc_retention_s))
    ours = {f"{name}-v" for name in config.registry.models}
    report = GcReport(dry_run=dry_run)
    for folder in sorted(storage.list_subfolders(promoter.dest, promoter.location)):
        head, _, number = folder.rpartition("-v")
        if f"{head}-v" not in ours or not number.isdigit() or folder != version_folder(head, int(number)):
            continue  # not a version folder of a configured model: never ours to delete
        if folder in keep:
            report.kept.append(folder)
            continue
        objects = storage.list_folder(promoter.dest, promoter.location.bucket, promoter.location.key(folder))
        youngest = max((o.last_modified for o in objects.values()), default=now)
        if now - youngest < timedelta(seconds=config.registry.gc_grace_s):
            report.too_young.append(folder)
            continue
        if not dry_run:
            storage.delete_folder(promoter.dest, promoter.location.bucket, promoter.location.key(folder), list(objects))
        report.deleted.append(folder)
    return report
