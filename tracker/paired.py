"""Did a checkpoint beat the base on the same mazes? An exact one-sided sign test (McNemar's exact test) over
the per-maze outcomes of two evals of one eval set: only the mazes where they disagree carry information.
Pure logic; the tracker logs the per-maze rows it is applied to.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Mapping


@dataclass(frozen=True)
class PairedResult:
    base_rate: float
    rate: float
    gained: int  # mazes solved now that the base failed
    lost: int  # mazes the base solved that are failed now
    p_value: float  # P(at least `gained` of the gained+lost discordant mazes favour the checkpoint | no effect)

    def beats(self, alpha: float) -> bool:
        return self.gained > self.lost and self.p_value < alpha

    def describe(self) -> str:
        return (f"{self.rate:.4g} vs base {self.base_rate:.4g} ({self.gained} mazes gained, {self.lost} lost, "
                f"p={self.p_value:.2g})")


def sign_test(base: Mapping[int, bool], candidate: Mapping[int, bool]) -> PairedResult:
    """Compare the outcomes of the mazes both evals scored (keyed by maze seed)."""
    seeds = sorted(base.keys() & candidate.keys())
    if not seeds:
        raise ValueError("the two evals share no maze: they were not run on the same eval set")
    gained = sum(1 for s in seeds if candidate[s] and not base[s])
    lost = sum(1 for s in seeds if base[s] and not candidate[s])
    n = gained + lost
    p_value = sum(comb(n, k) for k in range(gained, n + 1)) / 2**n if n else 1.0
    return PairedResult(base_rate=sum(base[s] for s in seeds) / len(seeds),
                        rate=sum(candidate[s] for s in seeds) / len(seeds), gained=gained, lost=lost, p_value=p_value)
