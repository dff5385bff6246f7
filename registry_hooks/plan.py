"""Pure decisions over the routes manifest: the next manifest for an intent, rollback targets, drift, GC."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Mapping, Protocol

from rlops.layout import AliasRoute, HistoryEntry, Refusal, RefusalKind, RoutesManifest, version_folder

Intent = Mapping[str, int]  # served alias -> registry version


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
    `collected`. `owner` (None: keep old's) is recorded.
    """
    held = held or {}
    aliases: dict[str, AliasRoute] = {}
    refused: dict[str, Refusal] = {}
    history = list(old.history)
    for alias, version in sorted(intent.items()):
        current = old.aliases.get(alias)
        if current is not None and current.version == version:
            aliases[alias] = current
            continue
        kind, reason = held.get(alias) or ("adapter", refusals.get(version))
        if reason is not None:
            earlier = old.refused.get(alias)
            keep_time = earlier is not None and (earlier.version, earlier.reason, earlier.kind) == (version, reason, kind)
            refused[alias] = earlier if keep_time else Refusal(version=version, reason=reason, at=now, kind=kind)
            if current is not None:
                aliases[alias] = current
            continue
        route = prepared.get(version)
        if route is None:
            raise KeyError(f"no prepared route for {alias} -> v{version}")
        aliases[alias] = route.model_copy(update={"promoted_at": now, "trigger": trigger})
        history.append(HistoryEntry(alias=alias, version=version, at=now, trigger=trigger))
    owner = owner or old.owner
    if aliases == old.aliases and refused == old.refused and owner == old.owner:
        return old
    served = {r.version for r in aliases.values()}
    return RoutesManifest(
        model=old.model, owner=owner, generation=old.generation + 1, updated_at=now, aliases=aliases,
        history=history[-history_limit:], refused=refused, collected=[c for c in old.collected if c.version not in served],
    )


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
    return sorted(a for a, r in manifest.aliases.items() if r.version == version)


def promotion_record(manifest: RoutesManifest, version: int, limit: int) -> tuple[str, str]:
    """(aliases serving `version` now, its promotion history newest first) as version-tag values of at
    most `limit` characters: the Models page shows where each version is served and since when."""
    entries = [f"{e.alias} {e.at} ({e.trigger})" for e in reversed(manifest.history) if e.version == version]
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
        if entry.alias == alias and entry.version != current:
            return entry.version
    return None


@dataclass(frozen=True)
class Drift:
    alias: str
    intended: int | None
    served: int | None
    refused_reason: str | None = None

    def describe(self) -> str:
        want = f"v{self.intended}" if self.intended is not None else "unset"
        have = f"v{self.served}" if self.served is not None else "nothing"
        text = f"{self.alias}: registry {want}, served {have}"
        return text + (f" (refused: {self.refused_reason})" if self.refused_reason else "")


def drift(intent: Intent, manifest: RoutesManifest) -> list[Drift]:
    """Aliases where the registry's intent differs from what the manifest serves."""
    out = []
    for alias in sorted(set(intent) | set(manifest.aliases)):
        want = intent.get(alias)
        route = manifest.aliases.get(alias)
        have = route.version if route else None
        if want != have:
            refusal = manifest.refused.get(alias)
            reason = refusal.reason if refusal is not None and refusal.version == want else None
            out.append(Drift(alias, want, have, reason))
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
