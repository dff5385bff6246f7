"""Did the best checkpoint beat the model it started from? An exact one-sided sign test (McNemar's exact
test) over the per-maze outcomes of two evals of one eval set: the step-0 eval (the base) and the
best checkpoint's. Only the mazes where the two disagree carry information. Pure logic: the tracker
reads the per-maze tables it logged and applies `compare` to them.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Iterable, Mapping


@dataclass(frozen=True)
class BaselineComparison:
    base_rate: float
    rate: float
    gained: int  # mazes the checkpoint solves that the base failed
    lost: int  # mazes the base solved that the checkpoint fails
    p_value: float  # P(at least `gained` of the gained + lost discordant mazes favour the checkpoint | no effect)

    def beats(self, max_p: float) -> bool:
        return self.gained > self.lost and self.p_value < max_p

    def describe(self) -> str:
        return (f"base {self.base_rate:.3g} vs best {self.rate:.3g} ({self.gained} mazes gained, {self.lost} lost, "
                f"p={self.p_value:.2g})")

    def refusal(self) -> str:
        return (f"no checkpoint beat the base: {self.base_rate:.2f} vs best {self.rate:.2f}, p={self.p_value:.2g}; "
                f"nothing registered")


def outcomes(rows: Iterable[Mapping]) -> dict[int, bool]:
    """Per-maze outcomes (seed -> solved) from the rows of a logged eval table."""
    return {int(row["seed"]): bool(row["solved"]) for row in rows}


def compare(base: Mapping[int, bool], candidate: Mapping[int, bool]) -> BaselineComparison:
    """Compare the outcomes of the mazes both evals scored (keyed by maze seed)."""
    seeds = sorted(base.keys() & candidate.keys())
    if not seeds:
        raise ValueError("the two evals share no maze: they were not run on the same eval set")
    gained = sum(1 for s in seeds if candidate[s] and not base[s])
    lost = sum(1 for s in seeds if base[s] and not candidate[s])
    n = gained + lost
    p_value = sum(comb(n, k) for k in range(gained, n + 1)) / 2**n if n else 1.0
    return BaselineComparison(base_rate=sum(base[s] for s in seeds) / len(seeds),
                              rate=sum(candidate[s] for s in seeds) / len(seeds), gained=gained, lost=lost,
                              p_value=p_value)
