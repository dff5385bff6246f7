"""Pure decisions over the routes manifest: the next manifest for an intent, rollback targets, drift, GC."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Mapping, Protocol

from rlops.layout import (
    CANARY_SUFFIX,
    SHADOW_SUFFIX,
    AliasRoute,
    CanaryRoute,
    REGISTRY_ACTOR,
    HistoryEntry,
    MoveNote,
    Refusal,
    RefusalKind,
    RoutesManifest,
    ShadowRoute,
    canary_alias,
    shadow_alias,
    version_folder,
)


class Intent(dict):
    """Registry alias -> version for the served aliases, their canaries (keys `<alias>-canary`) and shadows
    (keys `<alias>-shadow`), plus `weights`: alias -> its canary's percent (the rlops.canary_weight.<alias>
    tags) and `percents`: alias -> the share of its requests copied to its shadow (rlops.shadow_percent.<alias>).
    Equal only with the same weights and percents, so a reweighted canary or shadow is a change."""

    def __init__(self, targets: Mapping[str, int] = (), weights: Mapping[str, float] | None = None,
                 notes: Mapping[str, MoveNote] | None = None, percents: Mapping[str, float] | None = None):
        super().__init__(targets)
        self.weights = dict(weights or {})
        self.percents = dict(percents or {})
        self.notes = dict(notes or {})  # key -> who moves it (the rlops.move.<key> tags); not part of equality

    def __eq__(self, other) -> bool:
        return (dict.__eq__(self, other) and self.weights == getattr(other, "weights", {})
                and self.percents == getattr(other, "percents", {}))

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]


def _beside_targets(intent: Mapping[str, int], suffix: str, shares: Mapping[str, float]) -> dict[str, tuple[int, float]]:
    """alias -> (version, share) for the `<alias><suffix>` keys a manifest can serve: share set, the alias
    intended, and a version other than the alias's own."""
    out = {}
    for key, version in intent.items():
        alias = key[: -len(suffix)] if key.endswith(suffix) else None
        if alias and alias in shares and alias in intent and intent[alias] != version:
            out[alias] = (version, shares[alias])
    return out


def canary_targets(intent: Mapping[str, int]) -> dict[str, tuple[int, float]]:
    """alias -> (canary version, weight); a canary that is the alias's target already is simply done."""
    return _beside_targets(intent, CANARY_SUFFIX, getattr(intent, "weights", {}))


def shadow_targets(intent: Mapping[str, int]) -> dict[str, tuple[int, float]]:
    """alias -> (shadow version, percent); shadowing the answering version would compare nothing."""
    return _beside_targets(intent, SHADOW_SUFFIX, getattr(intent, "percents", {}))


def served_targets(manifest: RoutesManifest) -> dict[str, int]:
    """What the manifest serves, keyed as the intent is (canaries under `<alias>-canary`, shadows under
    `<alias>-shadow`)."""
    return {**{a: r.version for a, r in manifest.aliases.items()},
            **{canary_alias(a): c.version for a, c in manifest.canaries.items()},
            **{shadow_alias(a): c.version for a, c in manifest.shadows.items()}}


def effective_intent(intent: Mapping[str, int]) -> dict[str, int]:
    """The intent less canary and shadow aliases no manifest would serve (see canary_targets, shadow_targets)."""
    canaries, shadows = canary_targets(intent), shadow_targets(intent)
    return {k: v for k, v in intent.items()
            if (not k.endswith(CANARY_SUFFIX) or k[: -len(CANARY_SUFFIX)] in canaries)
            and (not k.endswith(SHADOW_SUFFIX) or k[: -len(SHADOW_SUFFIX)] in shadows)}


def next_manifest(
    old: RoutesManifest,
    intent: Intent,
    prepared: Mapping[int, AliasRoute],
    refusals: Mapping[int, str],
    *,
    trigger: str,
    now: str,
    history_limit: int,
    held: Mapping[str, tuple[RefusalKind, str]] | None = None,
    owner: str | None = None,
) -> RoutesManifest:
    """The manifest that serves `intent`, or `old` itself when nothing changes (no generation bump).

    `prepared`: verified routes by version; `refusals`: why a version cannot be served; `held`: alias ->
    (kind, reason) for a move refused for that alias only (guardrail, folder being collected). A refused
    alias keeps its previous target (if any) and records the refusal; an alias missing from `intent` is
    dropped (its route answers "alias not set"; history keeps it). A version published again leaves
    `collected`. `owner` (None: keep old's) is recorded. A canary (see canary_targets) is published beside
    its alias's target, refused like an alias (keeping the canary it had). Each history entry names the
    move's author from the intent's MoveNote for that key when the note names this change, else the
    registry (a move in the MLflow UI or by a plain client), with `trigger` (the publisher) as its trigger.
    (Entries keep their schema-2 fields: serving replicas of the release before read the same manifest.)
    """
    held = held or {}
    aliases: dict[str, AliasRoute] = {}
    refused: dict[str, Refusal] = {}
    history = list(old.history)
    notes: Mapping[str, MoveNote] = getattr(intent, "notes", {})

    def said(key: str, version: int | None) -> dict:
        note = notes.get(key)
        if note is not None and note.version == version:
            return {"trigger": note.trigger, "actor": note.actor, "reason": note.reason, "at": now}
        return {"trigger": trigger, "actor": REGISTRY_ACTOR, "at": now}

    def target(key: str, version: int, current: AliasRoute | None) -> AliasRoute | None:
        """The route `key` publishes: current if unchanged or refused (recorded), else the prepared one."""
        if current is not None and current.version == version:
            return current
        kind, why = held.get(key) or ("adapter", refusals.get(version))
        if why is not None:
            earlier = old.refused.get(key)
            keep_time = earlier is not None and (earlier.version, earlier.reason, earlier.kind) == (version, why, kind)
            refused[key] = earlier if keep_time else Refusal(version=version, reason=why, at=now, kind=kind)
            return current
        route = prepared.get(version)
        if route is None:
            raise KeyError(f"no prepared route for {key} -> v{version}")
        return route.model_copy(update={"promoted_at": now, "trigger": trigger})

    for alias, version in sorted(intent.items()):
        if alias.endswith((CANARY_SUFFIX, SHADOW_SUFFIX)):
            continue
        current = old.aliases.get(alias)
        route = target(alias, version, current)
        if route is None:
            continue
        aliases[alias] = route
        if route is not current:
            was_canary = old.canaries.get(alias)
            event = "canary_promoted" if was_canary is not None and was_canary.version == version else "move"
            history.append(HistoryEntry(alias=alias, version=version, event=event,
                                        from_version=current.version if current else None, **said(alias, version)))
    def beside(targets: Mapping[str, tuple[int, float]], before: Mapping, key_of, share: str, route_type: type,
               started: str, ended: str, promoted_is_ended: bool) -> dict:
        """The canaries or shadows published beside `aliases` (their `share` field set from the intent) with
        their history: `started` on a new version or share, `ended` for one gone (a canary that became its
        alias's target was promoted, not aborted: `promoted_is_ended` False)."""
        routes = {}
        for alias, (version, value) in sorted(targets.items()):
            current, baseline = before.get(alias), aliases.get(alias)
            route = target(key_of(alias), version, current)
            if route is None or baseline is None or baseline.version == route.version:
                continue
            if route is not current:
                route = route_type(**{**route.model_dump(), share: value})
            elif getattr(current, share) != value:
                route = current.model_copy(update={share: value})
            routes[alias] = route
            if route is not current:
                history.append(HistoryEntry(alias=alias, version=version, event=started, weight=value,
                                            from_version=baseline.version, **said(key_of(alias), version)))
        for alias, gone in sorted(before.items()):
            promoted = alias in aliases and aliases[alias].version == gone.version
            if alias not in routes and (promoted_is_ended or not promoted):
                history.append(HistoryEntry(alias=alias, version=gone.version, event=ended, weight=0,
                                            from_version=gone.version, **said(key_of(alias), None)))
        return routes

    canaries = beside(canary_targets(intent), old.canaries, canary_alias, "weight", CanaryRoute, "canary",
                      "canary_aborted", promoted_is_ended=False)
    shadows = beside(shadow_targets(intent), old.shadows, shadow_alias, "percent", ShadowRoute, "shadow",
                     "shadow_stopped", promoted_is_ended=True)
    owner = owner or old.owner
    if (aliases == old.aliases and canaries == old.canaries and shadows == old.shadows and refused == old.refused
            and owner == old.owner):
        return old
    served = {r.version for r in [*aliases.values(), *canaries.values(), *shadows.values()]}
    return RoutesManifest(
        model=old.model, owner=owner, generation=old.generation + 1, updated_at=now, aliases=aliases,
        canaries=canaries, shadows=shadows, history=history[-history_limit:], refused=refused,
        collected=[c for c in old.collected if c.version not in served],
    )


def with_preview(old: RoutesManifest, version: int, *, alias: str, trigger: str, now: str, history_limit: int,
                 owner: str | None = None, actor: str | None = None, reason: str | None = None) -> RoutesManifest:
    """`old` plus a `preview` history entry that makes `@v<version>` servable (its folder verified by the
    caller) without moving any alias: the live eval of `promote --verify` addresses the candidate under its
    own name. `old` itself when the version is servable already (a target, a canary, in the history)."""
    if version in old.published_versions():
        return old
    current = old.aliases.get(alias)
    entry = HistoryEntry(alias=alias, version=version, event="preview", trigger=trigger, at=now, actor=actor,
                         reason=reason, from_version=current.version if current else None)
    return old.model_copy(update={
        "owner": owner or old.owner, "generation": old.generation + 1, "updated_at": now,
        "history": [*old.history, entry][-history_limit:],
        "collected": [c for c in old.collected if c.version != version]})


def served_gate_refusal(version: int, served: float, tracked: float, *, current_version: int | None,
                        current_served: float | None, margin: float, data_source: str) -> str | None:
    """Why the live eval gate refuses `version` (None: it passes): its pass rate served through the endpoint
    is below its tracked one, or below the current target's served one, by more than `margin`."""
    problems = []
    if served < tracked - margin:
        problems.append(f"below its tracked {tracked:.4f}")
    if current_served is not None and served < current_served - margin:
        problems.append(f"below the current v{current_version}'s served {current_served:.4f}")
    if not problems:
        return None
    return (f"live eval: v{version} served a pass rate of {served:.4f} on {data_source}, "
            f"{' and '.join(problems)} by more than the margin {margin:g} (registry.guardrail_served_margin)")


class EvalFacts(Protocol):
    """What the guardrail compares (registry.VersionSource has these)."""

    version: int
    metric_key: str | None
    metric_value: float | None
    eval_set: str | None


def guardrail_refusal(candidate: EvalFacts, current: EvalFacts | None, *, direction: str, min_delta: float) -> str | None:
    """Why a guarded alias must not move from `current` to `candidate`, or None. The candidate must have a
    metric comparable to the current one (same key, same eval set when both record it) and beat it by at
    least `min_delta` in `direction` (`higher`/`lower` is better; a negative min_delta tolerates a loss)."""
    if current is None or current.version == candidate.version or current.metric_value is None:
        return None
    shown = f"{current.metric_key}={current.metric_value:g}"
    if candidate.metric_value is None or candidate.metric_key != current.metric_key:
        return f"v{candidate.version} has no eval metric comparable to v{current.version}'s {shown}"
    if candidate.eval_set and current.eval_set and candidate.eval_set != current.eval_set:
        return (f"v{candidate.version} and v{current.version} were scored on different eval sets (layout "
                f"sha256 {candidate.eval_set} vs {current.eval_set}): not comparable")
    gain = candidate.metric_value - current.metric_value
    if direction == "lower":
        gain = -gain
    if gain < min_delta:
        return (f"v{candidate.version} scores {candidate.metric_key}={candidate.metric_value:g}, which does not beat "
                f"the current v{current.version} ({current.metric_value:g}) by {min_delta:g} ({direction} is better)")
    return None


def served_aliases(manifest: RoutesManifest, version: int) -> list[str]:
    """Where `version` is served: its aliases, and `<alias> (canary W%)` where it is an alias's canary."""
    return sorted([a for a, r in manifest.aliases.items() if r.version == version]
                  + [f"{a} (canary {c.weight:g}%)" for a, c in manifest.canaries.items() if c.version == version])


def promotion_record(manifest: RoutesManifest, version: int, limit: int) -> tuple[str, str]:
    """(aliases serving `version` now, its promotion history newest first) as version-tag values of at
    most `limit` characters: the Models page shows where each version is served and since when."""
    entries = [f"{e.alias}{' preview' if e.event == 'preview' else ''} {e.at} ({e.trigger})"
               for e in reversed(manifest.history) if e.version == version]
    history = ""
    for entry in entries:
        if len(history) + len(entry) + 2 > limit:
            break
        history = f"{history}; {entry}" if history else entry
    return ",".join(served_aliases(manifest, version)) or "none", history or "none"


def newly_promoted(old: RoutesManifest, new: RoutesManifest) -> dict[str, AliasRoute]:
    return {a: r for a, r in new.aliases.items() if a not in old.aliases or old.aliases[a].version != r.version}


def rollback_target(manifest: RoutesManifest, alias: str) -> int | None:
    """The version `alias` served before its current target, from the manifest history."""
    route = manifest.aliases.get(alias)
    current = route.version if route else None
    for entry in reversed(manifest.history):
        if entry.alias == alias and entry.event in ("move", "canary_promoted") and entry.version != current:
            return entry.version
    return None


@dataclass(frozen=True)
class Drift:
    alias: str
    intended: int | None
    served: int | None
    refused_reason: str | None = None
    intended_weight: float | None = None  # canaries and shadows: the registry's and the manifest's share
    served_weight: float | None = None

    def describe(self) -> str:
        want = f"v{self.intended}" if self.intended is not None else "unset"
        have = f"v{self.served}" if self.served is not None else "nothing"
        if self.intended_weight != self.served_weight:
            want += f" at {self.intended_weight or 0:g}%"
            have += f" at {self.served_weight or 0:g}%"
        text = f"{self.alias}: registry {want}, served {have}"
        return text + (f" (refused: {self.refused_reason})" if self.refused_reason else "")


def drift(intent: Intent, manifest: RoutesManifest) -> list[Drift]:
    """Aliases (and canaries and shadows, as `<alias>-canary` / `<alias>-shadow`) where the registry's intent
    differs from what is served."""
    out = []
    wanted, served = effective_intent(intent), served_targets(manifest)
    weights = {**{canary_alias(a): w for a, (_, w) in canary_targets(intent).items()},
               **{shadow_alias(a): p for a, (_, p) in shadow_targets(intent).items()}}
    served_weights = {**{canary_alias(a): c.weight for a, c in manifest.canaries.items()},
                      **{shadow_alias(a): s.percent for a, s in manifest.shadows.items()}}
    for alias in sorted(set(wanted) | set(served)):
        want, have = wanted.get(alias), served.get(alias)
        if want != have or weights.get(alias) != served_weights.get(alias):
            refusal = manifest.refused.get(alias)
            reason = refusal.reason if refusal is not None and refusal.version == want else None
            out.append(Drift(alias, want, have, reason, weights.get(alias), served_weights.get(alias)))
    return out


def needs_sync(intent: Intent, manifest: RoutesManifest) -> bool:
    """Whether a sync could change `manifest`: an alias differs from the intent without a refusal of that
    very version on record, or a refusal is recorded for a version the alias no longer points at.
    (An adapter refusal stays sticky, as in the sync itself: only moving the alias or a `promote` retries
    it. A guardrail or collecting one is re-checked each pass: a rlops.force tag or an expired gc lease
    changes the outcome without moving the alias.)"""
    if any(intent.get(alias) != refusal.version or refusal.kind != "adapter"
           for alias, refusal in manifest.refused.items()):
        return True
    return any(d.refused_reason is None for d in drift(intent, manifest))


def parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def referenced_folders(
    manifests: Iterable[RoutesManifest], intents: Mapping[str, Intent], now: datetime, retention: timedelta
) -> set[str]:
    """Folders GC must keep: every alias target (served or intended) and history entries within retention."""
    keep: set[str] = set()
    for manifest in manifests:
        keep.update(r.folder for r in manifest.aliases.values())
        keep.update(version_folder(manifest.model, r.version) for r in manifest.refused.values())
        for entry in manifest.history:
            if now - parse_time(entry.at) <= retention:
                keep.add(version_folder(manifest.model, entry.version))
    for model, intent in intents.items():
        keep.update(version_folder(model, v) for v in intent.values())
    return keep
