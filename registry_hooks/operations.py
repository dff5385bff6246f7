"""User-facing operations on top of the sync: promote, rollback, list, status, gc."""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable

from mlflow.exceptions import MlflowException

from registry_hooks import registry, storage
from registry_hooks.adapter import InvalidAdapter
from registry_hooks.plan import drift, parse_time, referenced_folders, rollback_target, served_gate_refusal
from registry_hooks.reconcile import ManifestCache, ModelState, read_states
from registry_hooks.shadow_evidence import Answer, ShadowEvidence, evidence, gate_refusal
from registry_hooks.sync import Forbidden, NotFound, Promoter, PromotionError, Refused, SyncConflict, SyncReport
from rlops.config import Config
from rlops.layout import (CANARY_SUFFIX, TAG_FORCE, TAG_METRIC_KEY, TAG_METRIC_VALUE, TRACE_SCORE, TRACE_TAG_LATENCY_MS,
                          TRACE_TAG_MODEL, TRACE_TAG_SHADOW_PAIR, TRACE_TAG_SHADOW_ROLE, TRACE_TAG_STATUS,
                          TRACE_TAG_VERSION, Collected, MoveNote, ShadowRoute,
                          RoutesManifest, canary_alias, is_valid_alias, is_valid_name, shadow_alias, utc_now,
                          version_folder)

RECONCILER_STATUS = "reconciler"
log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class LiveGate:
    """`--verify`: where the running endpoint is, and how long to wait for it to serve the candidate."""

    endpoint: str
    api_key: str | None = None
    timeout_s: float = 120.0


@dataclass(frozen=True)
class ShadowGate:
    """`--require-shadow`: the candidate must be the alias's shadow, with evidence that it is not worse."""

    min_pairs: int
    max_p: float


SHADOW_GATE_TAG = "rlops.shadow_gate"  # on a version: the shadow gate's last decision and its figures


def _shadow_gate(config: Config, alias: str, gate: ShadowGate | None) -> ShadowGate | None:
    """The gate a move of `alias` must pass: the given one, else the configured one for a required alias."""
    if gate is None and alias in config.registry.shadow.required_aliases:
        return ShadowGate(config.registry.shadow.min_pairs, config.registry.shadow.max_p)
    return gate


def check_shadow(promoter: Promoter, model: str, alias: str, version: int, gate: ShadowGate, *,
                 force: bool, record: bool = True) -> str:
    """Refused unless `version` is `alias`'s shadow and its pairs do not show it worse (`force`: passes, said
    in the decision); with `record`, the decision and its figures go on the version's tags. Returns the
    decision."""
    route, found = read_shadow_evidence(promoter, model, alias)
    if route.version != version:
        raise Refused(f"v{version} is not the shadow of {model}@{alias} (v{route.version} is): the gate needs live "
                      f"evidence of the version it moves")
    refusal = gate_refusal(found, min_pairs=gate.min_pairs, max_p=gate.max_p)
    verdict = "passed" if refusal is None else ("passed by --force" if force else "refused")
    decision = f"shadow gate {verdict}: {refusal or found.describe()}"
    if record:
        registry.set_tags(promoter.mlflow, model, version, {SHADOW_GATE_TAG: f"{utc_now()}: {decision}"})
    if refusal is not None and not force:
        raise Refused(f"{refusal}; {alias} keeps its target (--force moves it anyway)")
    return decision


def _gate_shadow(promoter: Promoter, model: str, alias: str, version: int, gate: ShadowGate | None, *,
                 force: bool, dry_run: bool, reason: str | None) -> str | None:
    """check_shadow where a gate applies; returns the move's reason with the decision added."""
    if gate is None:
        return reason
    decision = check_shadow(promoter, model, alias, version, gate, force=force, record=not dry_run)
    return f"{reason}; {decision}" if reason else decision


def _check_gate(gate: LiveGate | None, dry_run: bool) -> None:
    if gate is not None and dry_run:
        raise UsageProblem("--verify publishes the candidate as @v<N> and evaluates it live; --dry-run changes "
                           "nothing: use one of them")


def live_gate(promoter: Promoter, model: str, alias: str, version: int, gate: LiveGate, *, force: bool,
              trigger: str, actor: str | None, reason: str | None) -> dict:
    """The live eval gate of `--verify`, before `alias` moves to `version`: publish the candidate under its own
    name (`@v<N>`, a `preview` history entry; no alias moves), wait until the endpoint resolves it, replay its
    eval set through the endpoint (`verify_served`: the served figure is logged on its LoggedModel), and the
    current target's as `@v<current>` beside it. On a guarded alias, raise Refused when the served pass rate
    is below the tracked one, or the current target's served one, by more than
    `registry.guardrail_served_margin` (`force`: pass, said in the figures). Returns the figures."""
    from registry_hooks.parity import verify_served

    config = promoter.config
    try:
        promoter.publish_preview(model, version, alias=alias, trigger=trigger, actor=actor, reason=reason)
    except InvalidAdapter as exc:
        registry.set_tags(promoter.mlflow, model, version, {registry.REFUSED_TAG: str(exc)})
        raise Refused(f"v{version} of {model!r} cannot be served: {exc}") from None
    name = f"{config.serving.base_model_id}:{model}@v{version}"
    waited = wait_served(gate.endpoint, name, version, timeout_s=gate.timeout_s, api_key=gate.api_key)
    manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
    current = manifest.aliases[alias].version if alias in manifest.aliases else None

    def measure(v: int):
        return verify_served(config, model, alias=None, version=v, endpoint=gate.endpoint, api_key=gate.api_key)

    candidate = measure(version)
    figures = {"served_name": name, "data_source": candidate.data_source, "items": candidate.items,
               "served_pass_rate": candidate.served, "tracked_pass_rate": candidate.tracked,
               "current_version": current, "current_served_pass_rate": None, "seconds_to_serve": waited,
               "margin": config.registry.guardrail_served_margin, "guarded": alias in config.registry.guarded_aliases,
               "refusal": None, "notes": []}
    if current is not None and current != version:
        try:
            figures["current_served_pass_rate"] = measure(current).served
        except NotFound as exc:
            figures["notes"].append(f"the current v{current} was not compared: {exc}")
    refusal = served_gate_refusal(version, candidate.served, candidate.tracked, current_version=current,
                                  current_served=figures["current_served_pass_rate"],
                                  margin=config.registry.guardrail_served_margin, data_source=candidate.data_source)
    figures["refusal"] = refusal
    shown = (f"{utc_now()}: served {candidate.served:.4f} (tracked {candidate.tracked:.4f}) on {candidate.data_source}, "
             f"{candidate.items} items" + (f"; current v{current} served {figures['current_served_pass_rate']:.4f}"
                                           if figures["current_served_pass_rate"] is not None else ""))
    registry.set_tags(promoter.mlflow, model, version, {registry.VERIFIED_TAG: shown})
    if refusal and figures["guarded"]:
        if not force:
            registry.set_tags(promoter.mlflow, model, version, {registry.REFUSED_TAG: f"{alias}: {refusal}"})
            stays = f"stays at v{current}" if current is not None else "stays unset"
            raise Refused(f"{refusal}; {alias} {stays} (--force moves it anyway)")
        figures["notes"].append(f"--force passed the live gate: {refusal}")
    elif refusal:
        figures["notes"].append(f"{alias} is not guarded, so this does not stop the move: {refusal}")
    return figures


def promote(
    config: Config, model: str, *, to_alias: str, version: int | None = None, from_alias: str | None = None,
    force: bool = False, trigger: str = "cli", actor: str | None = None, reason: str | None = None,
    dry_run: bool = False, progress: Callable[[int], None] | None = None, gate: LiveGate | None = None,
    shadow_gate: ShadowGate | None = None,
) -> SyncReport:
    """Copy and verify the version's folder, then move `to_alias` to it, then sync (the alias moves only
    after the copy succeeded). Raises NotFound, Refused (invalid adapter, guardrail, live gate) or UsageProblem.

    The sync applies the guardrail for every trigger; it is checked here first only so that a refused
    promote leaves the registry alias where it was. `force` tags the version rlops.force (who, when).
    `gate` (`--verify`): the live eval gate (see live_gate) runs before the alias moves. `shadow_gate`
    (`--require-shadow`, or configured for the alias): the version must be the alias's shadow with evidence that
    it is not worse (check_shadow); the decision goes into the move's reason, and the shadow ends with the move."""
    return _promote(config, model, to_alias=to_alias, version=version, from_alias=from_alias, force=force,
                    trigger=trigger, actor=actor, reason=reason, dry_run=dry_run, progress=progress, gate=gate,
                    shadow_gate=_shadow_gate(config, to_alias, shadow_gate))


def _promote(
    config: Config, model: str, *, to_alias: str, version: int | None, from_alias: str | None, force: bool,
    trigger: str, actor: str | None, reason: str | None, dry_run: bool, progress: Callable[[int], None] | None,
    gate: LiveGate | None, shadow_gate: ShadowGate | None,
) -> SyncReport:
    """promote() with the shadow gate as given: the configured one is not added (a canary's promotion passed
    it when the canary started)."""
    _check_gate(gate, dry_run)
    promoter = Promoter(config, progress=progress)
    promoter.check_model(model)
    _served_alias(config, to_alias)
    if (version is None) == (from_alias is None):
        raise UsageProblem("give exactly one of --version N or --from ALIAS")
    _lookup(registry.require_model, promoter.mlflow, model)
    if from_alias is not None:
        version = _lookup(registry.version_by_alias, promoter.mlflow, model, from_alias)
    assert version is not None
    _lookup(registry.version_source, promoter.mlflow, model, version)  # NotFound (exit 3) for a missing version
    guarded = to_alias in config.registry.guarded_aliases
    if guarded and not force:
        manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
        served = manifest.aliases.get(to_alias)
        losing = promoter.guard_refusal(model, version, served.version if served else None)
        if losing:
            raise Refused(f"{losing}; use --force to promote anyway (it tags the version {TAG_FORCE})")
    reason = _gate_shadow(promoter, model, to_alias, version, shadow_gate, force=force, dry_run=dry_run,
                          reason=reason)
    figures = gate and live_gate(promoter, model, to_alias, version, gate, force=force, trigger=trigger, actor=actor,
                                 reason=reason)
    report = _move_alias(promoter, model, to_alias, version, trigger=trigger, actor=actor, reason=reason,
                         dry_run=dry_run, override=f"promote --force --to {to_alias}" if guarded and force else None)
    report = _end_gated_shadow(promoter, model, to_alias, shadow_gate, dry_run, report, trigger)
    report.verify = figures or None
    return report


def _end_gated_shadow(promoter: Promoter, model: str, alias: str, gate: ShadowGate | None, dry_run: bool,
                      report: SyncReport, trigger: str) -> SyncReport:
    """After a gated move the shadow answers clients: its copies would compare nothing, so it ends."""
    if gate is None or dry_run:
        return report
    registry.clear_shadow(promoter.mlflow, model, alias)
    return promoter.sync(model, trigger=trigger)


def _move_alias(promoter: Promoter, model: str, alias: str, version: int, *, trigger: str, actor: str | None,
                dry_run: bool, override: str | None = None, reason: str | None = None,
                set_intent: Callable[[], None] | None = None, key: str | None = None) -> SyncReport:
    """`override`: why this move passes the guardrail, recorded as the version's rlops.force tag (who, when).
    `set_intent`: how the registry is changed once the folder is ready (default: move `alias` to `version`),
    and `key` the registry alias it moves (`<alias>-canary`, `<alias>-shadow`; default `alias`)."""
    manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
    promoter.check_owner(manifest)
    collecting = promoter.collecting_reason(manifest, version)
    if collecting:
        raise Refused(collecting)
    if dry_run:
        try:
            promoter.inspect(model, version)
        except InvalidAdapter as exc:
            raise Refused(f"v{version} of {model!r} cannot be served: {exc}") from None
        return SyncReport(model=model, trigger=trigger, generation=manifest.generation,
                          served={a: r.version for a, r in manifest.aliases.items()}, promoted={alias: version},
                          copy_mode=promoter.last_mode, warnings=["dry run: nothing was copied or changed"])
    key = key or alias
    # The note needs the MLflow permission the move needs: a user who may not move the alias is refused here,
    # before anything is copied or tagged.
    note = _note_move(promoter, model, key, version, trigger=trigger, actor=actor, reason=reason)
    try:
        try:
            promoter.prepare(model, version, collected=version in manifest.collected_versions())
        except InvalidAdapter as exc:
            registry.set_tags(promoter.mlflow, model, version, {registry.REFUSED_TAG: str(exc)})
            raise Refused(f"v{version} of {model!r} cannot be served: {exc}") from None
        if override:
            registry.set_tags(promoter.mlflow, model, version,
                              {TAG_FORCE: f"{actor or 'unknown'} at {utc_now()}: {override}"})
        if set_intent is None:
            registry.set_alias(promoter.mlflow, model, alias, version)
        else:
            set_intent()
    except BaseException:
        _drop_note(promoter, model, key, note)  # this move did not happen: nobody may be credited with it
        raise
    report = promoter.sync(model, trigger=trigger)
    _forget_move(promoter, model, key, note, report)
    beside = {canary_alias(alias): ("canary", report.canaries), shadow_alias(alias): ("shadow", report.shadows)}
    kind, published = beside.get(key, (None, None))
    served = (published.get(alias) or {}).get("version") if published is not None else report.served.get(alias)
    if served != version:
        report.warnings.append(f"{alias} now serves v{report.served.get(alias)}"
                               + (f" with {kind} v{served}" if kind and served else "")
                               + ": the registry was changed meanwhile")
    return report


def _note_move(promoter: Promoter, model: str, key: str, version: int | None, *, trigger: str, actor: str | None,
               reason: str | None) -> MoveNote:
    """Who moves `key`, on the registry before it changes: every publisher of the move records this author."""
    note = MoveNote(move_id=uuid.uuid4().hex, version=version, trigger=trigger, actor=actor, reason=reason)
    try:
        registry.note_move(promoter.mlflow, model, key, note)
    except MlflowException as exc:
        if exc.get_http_status_code() == 403:
            raise Forbidden(f"{actor or 'this user'} may not move {key!r} of {model!r}: MLflow requires EDIT (or "
                            f"MANAGE) on the registered model to change its aliases; nothing was changed "
                            f"({exc.message})") from None
        raise
    return note


def _drop_note(promoter: Promoter, model: str, key: str, note: MoveNote) -> None:
    try:
        registry.forget_move(promoter.mlflow, model, key, note.move_id)
    except MlflowException as exc:
        log.warning("move note rlops.move.%s of %s not removed after a failed move: %s", key, model, exc.message)


def _forget_move(promoter: Promoter, model: str, key: str, note: MoveNote, report: SyncReport) -> None:
    try:
        registry.forget_move(promoter.mlflow, model, key, note.move_id)
    except MlflowException as exc:  # the move is published; a stale note only names this move's version
        report.warnings.append(f"move note rlops.move.{key} not removed: {exc.message}")


def canary(config: Config, model: str, *, alias: str | None = None, version: int | None = None,
           weight: float | None = None, promote_it: bool = False, abort: bool = False, force: bool = False,
           trigger: str = "cli", actor: str | None = None, reason: str | None = None, dry_run: bool = False,
           progress: Callable[[int], None] | None = None, gate: LiveGate | None = None,
           shadow_gate: ShadowGate | None = None) -> SyncReport:
    """Start (or reweight) a canary of `alias`: `weight` percent of its clients get `version` (its folder is
    copied and verified first, then the registry gets the `<alias>-canary` alias and the weight tag, then a
    sync publishes it). `promote_it`: the alias moves to the canary (guardrail as for promote) and the canary
    intent goes; `abort`: the canary intent goes, the alias keeps its target. `gate` (`--verify`, not with
    `abort`): the live eval gate (see live_gate) runs on the candidate before the registry changes.
    `shadow_gate` (`--require-shadow`, or configured for the alias): checked when the canary starts, as for
    promote; the shadow then ends (the canary answers clients from then on), and `--promote` does not ask for it
    again."""
    _check_gate(gate, dry_run)
    if gate is not None and abort:
        raise UsageProblem("--verify gates a move to a version; --abort moves nothing")
    if shadow_gate is not None and version is None:
        raise UsageProblem("--require-shadow gates the start of a canary (--version N): its shadow's pairs are the "
                           "evidence, and the shadow ends when the canary starts")
    if sum([version is not None, promote_it, abort]) != 1:
        raise UsageProblem("give exactly one of --version N (with --weight W), --promote or --abort")
    promoter, alias, intent = _beside_intent(config, model, alias, progress)
    candidate = intent.get(canary_alias(alias))
    if promote_it or abort:
        if candidate is None:
            raise NotFound(f"{model}@{alias} has no canary to {'promote' if promote_it else 'abort'}")
        if abort:
            return _drop_intent(promoter, model, canary_alias(alias), candidate,
                                lambda: registry.clear_canary(promoter.mlflow, model, alias),
                                trigger=trigger, actor=actor, reason=reason, dry_run=dry_run)
        report = _promote(config, model, to_alias=alias, version=candidate, from_alias=None, force=force,
                          trigger=trigger, actor=actor, reason=reason, dry_run=dry_run, progress=progress, gate=gate,
                          shadow_gate=None)
        if not dry_run:
            registry.clear_canary(promoter.mlflow, model, alias)
            figures, report = report.verify, promoter.sync(model, trigger=trigger)
            report.verify = figures
        return report
    if weight is None or not 0 < weight < 100:
        raise UsageProblem("--weight must be a percent strictly between 0 and 100 (100 is --promote)")
    assert version is not None
    _check_beside(promoter, model, alias, version, intent, "a canary splits an alias's traffic")
    shadow_gate = _shadow_gate(config, alias, shadow_gate)
    reason = _gate_shadow(promoter, model, alias, version, shadow_gate, force=force, dry_run=dry_run, reason=reason)
    figures = gate and live_gate(promoter, model, alias, version, gate, force=force, trigger=trigger, actor=actor,
                                 reason=reason)
    report = _move_alias(promoter, model, alias, version, trigger=trigger, actor=actor, reason=reason, dry_run=dry_run,
                         set_intent=lambda: registry.set_canary(promoter.mlflow, model, alias, version, weight),
                         key=canary_alias(alias))
    report = _end_gated_shadow(promoter, model, alias, shadow_gate, dry_run, report, trigger)
    report.verify = figures or None
    return report


def shadow(config: Config, model: str, *, alias: str | None = None, version: int | None = None,
           percent: float | None = None, stop: bool = False, trigger: str = "cli", actor: str | None = None,
           reason: str | None = None, dry_run: bool = False,
           progress: Callable[[int], None] | None = None) -> SyncReport:
    """Start (or change the share of) a shadow of `alias`: a copy of `percent` percent of its requests goes to
    `version`, whose answers are never returned (its folder is copied and verified first, then the registry
    gets the `<alias>-shadow` alias and the percent tag, then a sync publishes it). `stop`: the shadow intent
    goes. A shadow answers no client, so the eval guardrail does not apply to it."""
    if (version is not None) == stop:
        raise UsageProblem("give exactly one of --version N (with --percent P) or --stop")
    promoter, alias, intent = _beside_intent(config, model, alias, progress)
    key = shadow_alias(alias)
    if stop:
        if intent.get(key) is None:
            raise NotFound(f"{model}@{alias} has no shadow to stop")
        return _drop_intent(promoter, model, key, intent[key],
                            lambda: registry.clear_shadow(promoter.mlflow, model, alias),
                            trigger=trigger, actor=actor, reason=reason, dry_run=dry_run)
    if percent is None or not 0 < percent <= 100:
        raise UsageProblem("--percent must be a share of the alias's requests above 0 and at most 100")
    assert version is not None
    _check_beside(promoter, model, alias, version, intent, "a shadow copies an alias's requests")
    return _move_alias(promoter, model, alias, version, trigger=trigger, actor=actor, reason=reason, dry_run=dry_run,
                       set_intent=lambda: registry.set_shadow(promoter.mlflow, model, alias, version, percent), key=key)


def _beside_intent(config: Config, model: str, alias: str | None,
                   progress: Callable[[int], None] | None) -> tuple[Promoter, str, dict[str, int]]:
    """(promoter, alias, registry intent) for a canary or shadow command on `model`, its alias checked as served."""
    promoter = Promoter(config, progress=progress)
    promoter.check_model(model)
    alias = alias or config.registry.default_alias
    _served_alias(config, alias)
    _lookup(registry.require_model, promoter.mlflow, model)
    return promoter, alias, registry.read_intent(promoter.mlflow, model, config.registry.served_aliases) or {}


def _check_beside(promoter: Promoter, model: str, alias: str, version: int, intent: dict[str, int], what: str) -> None:
    """A canary or shadow (`what` it does) needs an existing version, a set alias, and another version than its."""
    _lookup(registry.version_source, promoter.mlflow, model, version)
    if intent.get(alias) is None:
        raise NotFound(f"{model}@{alias} is not set: {what}, so the alias needs a target")
    if intent[alias] == version:
        raise UsageProblem(f"{model}@{alias} already serves v{version}: {what} to another version")


def _drop_intent(promoter: Promoter, model: str, key: str, candidate: int, clear: Callable[[], None], *,
                 trigger: str, actor: str | None, reason: str | None, dry_run: bool) -> SyncReport:
    """End the canary or shadow that registry alias `key` names (`clear` drops its intent), credited to
    `actor`, then sync."""
    if dry_run:
        what = "canary" if key.endswith(CANARY_SUFFIX) else "shadow"
        return SyncReport(model=model, trigger=trigger, warnings=[f"dry run: would drop {what} v{candidate}"])
    note = _note_move(promoter, model, key, None, trigger=trigger, actor=actor, reason=reason)
    clear()
    report = promoter.sync(model, trigger=trigger)
    _forget_move(promoter, model, key, note, report)
    return report


def rollback(config: Config, model: str, *, alias: str | None = None, actor: str | None = None,
             reason: str | None = None, dry_run: bool = False,
             progress: Callable[[int], None] | None = None) -> SyncReport:
    """Move `alias` back to the version it served before (manifest history), then sync."""
    promoter = Promoter(config, progress=progress)
    promoter.check_model(model)
    alias = alias or config.registry.default_alias
    _served_alias(config, alias)
    manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
    target = rollback_target(manifest, alias)
    if target is None:
        raise NotFound(f"{model}@{alias} has no earlier target in the served history to roll back to")
    # Going back is deliberate even to a lower score: say so where the guardrail (and everyone) looks.
    override = f"rollback of {alias}" if alias in config.registry.guarded_aliases else None
    return _move_alias(promoter, model, alias, target, trigger="rollback", actor=actor, reason=reason,
                       dry_run=dry_run, override=override)


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
                "metric_key": tags.get(TAG_METRIC_KEY), "metric_value": tags.get(TAG_METRIC_VALUE),
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


def retire(config: Config, model: str, *, actor: str | None = None, dry_run: bool = False) -> dict:
    """Unpublish `model`'s routes manifest, so its names answer "does not exist"; its folders stay (gc only
    collects configured models). The one way a model leaves serving: explicit, owned, and logged (an audit
    record under `_status/` and a warning), never a side effect of a config edit."""
    if not is_valid_name(model):
        raise UsageProblem(f"{model!r} is not a valid registered model name")
    if model in config.registry.models:
        raise UsageProblem(f"{model!r} is still in registry.models, so the reconciler would publish it again; "
                           "remove it from the config first")
    promoter = Promoter(config)
    manifest, etag = storage.read_manifest(promoter.dest, promoter.location, model)
    if etag is None:
        raise NotFound(f"{model!r} has no published routes manifest under {config.lora_path}")
    promoter.check_owner(manifest)
    record = {"model": model, "owner": manifest.owner, "generation": manifest.generation,
              "served": {a: r.version for a, r in manifest.aliases.items()}, "retired_at": utc_now(),
              "retired_by": actor or "unknown", "dry_run": dry_run}
    if not dry_run:
        storage.write_status(promoter.dest, promoter.location, f"retired-{model}", record)  # the record first
        storage.delete_manifest(promoter.dest, promoter.location, model)
        log.warning("retired %s: routes manifest (generation %d, served %s) unpublished by %s", model,
                    manifest.generation, record["served"], record["retired_by"])
    return record


@dataclass
class GcReport:
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    too_young: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # marked collected, left for the next gc (lease ran short)
    restored: list[str] = field(default_factory=list)  # named again while deleted (must not happen): copied back
    not_owned: list[str] = field(default_factory=list)  # models whose manifest another deployment writes
    dry_run: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


GC_ROUNDS = 8


def _version_folders(promoter: Promoter, models: list[str]) -> dict[str, list[int]]:
    """Existing version folders of `models`, as versions by model (anything else under the prefix is not ours)."""
    found: dict[str, list[int]] = {m: [] for m in models}
    for folder in storage.list_subfolders(promoter.dest, promoter.location):
        head, _, number = folder.rpartition("-v")
        if head in found and number.isdigit() and folder == version_folder(head, int(number)):
            found[head].append(int(number))
    return found


def gc(config: Config, *, dry_run: bool = False, now: datetime | None = None) -> GcReport:
    """Delete version folders of configured, owned models that nothing can reach any more: no alias target
    (registry or manifest), no refusal, no history entry within `registry.gc_retention_s`, and older than
    `registry.gc_grace_s`. `@v<N>` of a deleted version then answers 404 "garbage-collected".

    The manifest is the lock against a racing promotion. Versions are first marked `collected` with a
    conditional PUT: a sync that published before wins (the version is re-read as referenced and kept); one
    after sees the mark and does not touch the folder for `registry.gc_lease_s`. Deletes happen only in the
    first half of the lease, the manifest is re-read after each folder, and a version found named again is
    copied back at once (a clock far off is the only way there)."""
    promoter = Promoter(config)
    now = now or datetime.now(timezone.utc)
    report = GcReport(dry_run=dry_run)
    for model, versions in _version_folders(promoter, config.registry.models).items():
        _collect_model(promoter, model, sorted(versions), now, report)
    return report


def _collect_model(promoter: Promoter, model: str, versions: list[int], now: datetime, report: GcReport) -> None:
    policy = promoter.config.registry
    for _ in range(GC_ROUNDS):
        manifest, etag = storage.read_manifest(promoter.dest, promoter.location, model)
        if manifest.owner not in (None, promoter.config.registry_owner):
            report.not_owned.append(model)
            return
        intent = registry.read_intent(promoter.mlflow, model, policy.served_aliases) or {}
        keep = referenced_folders([manifest], {model: intent}, now, timedelta(seconds=policy.gc_retention_s))
        kept, young, doomed = [], [], {}
        for version in versions:
            folder = version_folder(model, version)
            if folder in keep:
                kept.append(folder)
                continue
            objects = storage.list_folder(promoter.dest, promoter.location.bucket, promoter.location.key(folder))
            youngest = max((o.last_modified for o in objects.values()), default=now)
            if now - youngest < timedelta(seconds=policy.gc_grace_s):
                young.append(folder)
            elif objects:
                doomed[version] = list(objects)
        if doomed and not report.dry_run:
            marks = {c.version: c for c in manifest.collected}
            marks.update({v: Collected(version=v, at=utc_now()) for v in doomed})  # a renewed mark renews the lease
            marked = RoutesManifest.model_validate({
                **manifest.model_dump(), "generation": manifest.generation + 1, "updated_at": utc_now(),
                "collected": [m.model_dump() for m in sorted(marks.values(), key=lambda m: m.version)]})
            try:
                etag = storage.write_manifest(promoter.dest, promoter.location, marked, etag)
            except storage.ManifestConflict:
                continue  # a sync published meanwhile: decide again on what it wrote
            _delete_marked(promoter, model, doomed, etag, report)
        else:
            report.deleted.extend(version_folder(model, v) for v in doomed)
        report.kept.extend(kept)
        report.too_young.extend(young)
        return
    raise SyncConflict(f"gc of {model!r} did not converge after {GC_ROUNDS} rounds: other writers kept publishing")


def _delete_marked(promoter: Promoter, model: str, doomed: dict[int, list[str]], etag: str, report: GcReport) -> None:
    deadline = time.monotonic() + promoter.config.registry.gc_lease_s / 2
    deleted: list[int] = []
    for version, names in sorted(doomed.items()):
        folder = version_folder(model, version)
        if time.monotonic() > deadline:
            report.unfinished.append(folder)
            continue
        storage.delete_folder(promoter.dest, promoter.location.bucket, promoter.location.key(folder), names)
        log.info("gc: deleted %s (marked collected in the routes manifest of %s)", folder, model)
        report.deleted.append(folder)
        deleted.append(version)
        manifest, now_etag = storage.read_manifest(promoter.dest, promoter.location, model)
        if now_etag != etag:
            for route in manifest.aliases.values():
                if route.version in deleted and version_folder(model, route.version) not in report.restored:
                    log.warning("gc: %s was published again while being deleted; copying it back", route.folder)
                    promoter.prepare(model, route.version, collected=True)
                    report.restored.append(route.folder)
            etag = now_etag


def history(config: Config, model: str, *, alias: str | None = None) -> list[dict]:
    """Every published move of `model` (optionally one alias), oldest first, from its routes manifest: when,
    from -> to, canary weight, trigger, actor, reason, and the version's tracked eval figure (and its live
    eval's, when `--verify` measured it)."""
    promoter = Promoter(config)
    promoter.check_model(model)
    if alias is not None:
        _served_alias(config, alias)
    manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
    metrics = {}
    for mv in registry.search_versions(promoter.mlflow, f"name = '{model}'"):
        tags = mv.tags or {}
        figures = [f"{tags[TAG_METRIC_KEY]}={tags.get(TAG_METRIC_VALUE)}" if TAG_METRIC_KEY in tags else None,
                   tags.get(registry.VERIFIED_TAG) and f"verified {tags[registry.VERIFIED_TAG]}"]
        if any(figures):
            metrics[int(mv.version)] = "; ".join(filter(None, figures))
    return [{**entry.model_dump(), "eval": metrics.get(entry.version)}
            for entry in manifest.history if alias is None or entry.alias == alias]


TRACES_PAGE = 500


def shadow_status(config: Config, model: str, *, alias: str | None = None) -> dict:
    """The evidence of `alias`'s shadow so far: its pairs since it started (each copied request's primary and
    shadow traces, joined by the pair's id), as shadow_evidence.evidence figures, with both versions."""
    promoter = Promoter(config)
    promoter.check_model(model)
    alias = alias or config.registry.default_alias
    _served_alias(config, alias)
    manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
    shadow, found = read_shadow_evidence(promoter, model, alias)
    return {"model": model, "alias": alias, "primary_version": manifest.aliases[alias].version,
            "shadow_version": shadow.version, "percent": shadow.percent, "since": shadow.promoted_at,
            "summary": found.describe(), **asdict(found)}


def read_shadow_evidence(promoter: Promoter, model: str, alias: str) -> tuple[ShadowRoute, ShadowEvidence]:
    """`alias`'s published shadow and the evidence of its pairs traced since it started."""
    manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
    shadow, primary = manifest.shadows.get(alias), manifest.aliases.get(alias)
    if shadow is None or primary is None:
        raise NotFound(f"{model}@{alias} has no shadow (promote shadow {model} --version N --percent P starts one)")
    since_ms = int(parse_time(shadow.promoted_at).timestamp() * 1000)
    sides = {}
    for role, version in (("primary", primary.version), ("shadow", shadow.version)):
        experiment = registry.version_experiment_id(promoter.mlflow, model, version,
                                                    promoter.config.serving.traces.experiment)
        sides[role] = _pair_traces(promoter.mlflow, experiment, model, version, role, since_ms) if experiment else {}
    pairs = [(sides["primary"][pair], sides["shadow"][pair]) for pair in sides["shadow"] if pair in sides["primary"]]
    return shadow, evidence(pairs)


def _pair_traces(client, experiment_id: str, model: str, version: int, role: str, since_ms: int) -> dict[str, Answer]:
    """Pair id -> the answer of `version` in its role, from the traces written since the shadow started."""
    query = (f"tags.`{TRACE_TAG_MODEL}` = '{model}' AND tags.`{TRACE_TAG_VERSION}` = '{version}' AND "
             f"tags.`{TRACE_TAG_SHADOW_ROLE}` = '{role}' AND timestamp_ms >= {since_ms}")
    answers, token = {}, None
    while True:
        page = client.search_traces(locations=[experiment_id], filter_string=query, max_results=TRACES_PAGE,
                                    page_token=token, include_spans=False)
        for trace in page:
            tags = trace.info.tags
            scores = [a.value for a in trace.info.assessments or [] if a.name == TRACE_SCORE]
            answers[tags[TRACE_TAG_SHADOW_PAIR]] = Answer(
                status=int(tags.get(TRACE_TAG_STATUS, "0")), latency_ms=float(tags.get(TRACE_TAG_LATENCY_MS, "nan")),
                score=float(scores[-1]) if scores else None, text=trace.info.response_preview)
        token = page.token
        if not token:
            return answers


def endpoint_serves(models_body: dict, name: str, version: int, canary: bool) -> bool:
    """Whether a `/v1/models` body (or one `/v1/models/<name>` card) lists `name` at `version` (as its canary
    when `canary`)."""
    for card in models_body.get("data", [models_body]):
        if card.get("id") == name:
            meta = card.get("metadata") or {}
            return ((meta.get("canary") or {}).get("version") if canary else meta.get("version")) == version
    return False


def wait_served(endpoint: str, name: str, version: int, *, canary: bool = False, timeout_s: float,
                api_key: str | None = None, poll_s: float = 0.5) -> float:
    """Poll `endpoint`/v1/models until it lists `name` at `version`; return the seconds it took. Raises
    PromotionError naming what it saw last after `timeout_s` (the move itself is done: only not seen yet).
    A pinned `@v<N>` name is not listed: its own card (`/v1/models/<name>`) answers once it resolves."""
    from urllib.parse import quote

    import httpx

    started = time.monotonic()
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    pinned = not canary and name.endswith(f"@v{version}")
    url = f"{endpoint.rstrip('/')}/v1/models" + (f"/{quote(name, safe='')}" if pinned else "")
    seen = "no answer"
    while True:
        try:
            response = httpx.get(url, headers=headers, timeout=5)
            if response.status_code == 200 and endpoint_serves(response.json(), name, version, canary):
                return round(time.monotonic() - started, 3)
            seen = f"HTTP {response.status_code}"
            if response.status_code == 200:
                body = response.json()
                card = next((c for c in body.get("data", [body]) if c.get("id") == name), None)
                seen = f"metadata {card['metadata']}" if card else f"{name} not listed"
        except httpx.HTTPError as exc:
            seen = type(exc).__name__
        if time.monotonic() - started > timeout_s:
            raise PromotionError(f"the move is published, but {endpoint} did not list {name} at v{version}"
                                 f"{' as canary' if canary else ''} within {timeout_s:g} s (last: {seen})")
        time.sleep(poll_s)
