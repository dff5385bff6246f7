"""`registry.shadow.auto_canary` in `rlops hooks serve`: a shadow that has won on live traffic becomes a canary
by itself. Each pass reads every configured model's published shadows and their pairs; one that has won
(shadow_evidence.has_won) starts as a canary through the same operation as `promote canary --require-shadow`
(the gate is checked and recorded, the shadow ends), with trigger `shadow` in the history. From there the
canary's SLO watcher, where configured, decides as for any canary.
"""
from __future__ import annotations

import logging

from registry_hooks import operations, storage
from registry_hooks.shadow_evidence import has_won
from registry_hooks.sync import Promoter, PromotionError
from registry_hooks.watcher import Periodic
from rlops.config import Config

log = logging.getLogger(__name__)

AUTO_CANARY_ACTOR = "rlops-hooks/auto-canary"
AUTO_CANARY_TRIGGER = "shadow"


class AutoCanary(Periodic):
    name = "rlops-auto-canary"

    def __init__(self, config: Config):
        assert config.registry.shadow.auto_canary is not None
        super().__init__(config.registry.shadow.auto_canary.interval_s)
        self.config, self.policy = config, config.registry.shadow.auto_canary
        self.started: list[dict] = []

    def tick(self) -> list[dict]:
        """One pass over the configured models; returns the canaries it started. A model whose pass fails is
        logged and left for the next pass; the others go on."""
        promoter = Promoter(self.config)
        started = []
        for model in self.config.registry.models:
            try:
                started.extend(self._model(promoter, model))
            except PromotionError as exc:
                log.warning("auto canary: %s: %s", model, exc)
        self.started.extend(started)
        return started

    def _model(self, promoter: Promoter, model: str) -> list[dict]:
        manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
        started = []
        for alias, shadow in sorted(manifest.shadows.items()):
            if alias in manifest.canaries:
                continue  # a canary of the alias is live already: one candidate at a time
            _, found = operations.read_shadow_evidence(promoter, model, alias)
            if not has_won(found, min_pairs=self.policy.min_pairs, max_p=self.policy.max_p):
                continue
            reason = f"the shadow won on live traffic: {found.describe()}, p better={found.p_better:.2g}"
            gate = operations.ShadowGate(self.config.registry.shadow.min_pairs, self.config.registry.shadow.max_p)
            report = operations.canary(self.config, model, alias=alias, version=shadow.version,
                                       weight=self.policy.weight, trigger=AUTO_CANARY_TRIGGER,
                                       actor=AUTO_CANARY_ACTOR, reason=reason, shadow_gate=gate)
            log.warning("auto canary: %s@%s v%d now answers %g%% of clients: %s", model, alias, shadow.version,
                        self.policy.weight, reason)
            started.append({"model": model, "alias": alias, "version": shadow.version, "weight": self.policy.weight,
                            "reason": reason, "generation": report.generation})
        return started
