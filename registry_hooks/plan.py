"""Pure decisions over the routes manifest: the next manifest for an intent, rollback targets, drift, GC."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Mapping

from rlops.layout import AliasRoute, HistoryEntry, Refusal, RoutesManifest, version_folder

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
) -> RoutesManifest:
    """The manifest that serves `intent`, or `old` itself when nothing changes (no generation bump).

    `prepared`: verified routes by version; `refusals`: reason by version. An alias whose version is refused
    keeps its previous target (if any) and records the refusal; an alias missing from `intent` is dropped
    (its route answers "alias not set"; history keeps it).
    """
    aliases: dict[str, AliasRoute] = {}
    refused: dict[str, Refusal] = {}
    history = list(old.history)
    for alias, version in sorted(intent.items()):
        current = old.aliases.get(alias)
        if current is not None and current.version == version:
            aliases[alias] = current
            continue
        if version in refusals:
            earlier = old.refused.get(alias)
            keep_time = earlier is not None and earlier.version == version
            refused[alias] = earlier if keep_time else Refusal(version=version, reason=refusals[version], at=now)
            if current is not None:
                aliases[alias] = current
            continue
        route = prepared.get(version)
        if route is None:
            raise KeyError(f"no prepared route for {alias} -> v{version}")
        aliases[alias] = route.model_copy(update={"promoted_at": now, "trigger": trigger})
        history.append(HistoryEntry(alias=alias, version=version, at=now, trigger=trigger))
    if aliases == old.aliases and refused == old.refused:
        return old
    return RoutesManifest(
        model=old.model, generation=old.generation + 1, updated_at=now, aliases=aliases,
        history=history[-history_limit:], refused=refused,
    )


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
    (A refusal stays sticky, as in the sync itself: only moving the alias or a `promote` retries it.)"""
    if any(intent.get(alias) != refusal.version for alias, refusal in manifest.refused.items()):
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
