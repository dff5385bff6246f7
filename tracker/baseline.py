"""Did the best checkpoint beat the model it started from? An exact one-sided sign test (McNemar's exact
test) over the per-item outcomes of two evals of one eval set: the step-0 eval (the base) and the
best checkpoint's. Only the items where the two disagree carry information. Pure logic: the tracker
reads the eval tables it logged (rlops.eval_table) and applies `compare` to them.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Mapping


@dataclass(frozen=True)
class BaselineComparison:
    base_rate: float
    rate: float
    gained: int  # items the checkpoint passes that the base failed
    lost: int  # items the base passed that the checkpoint fails
    p_value: float  # P(at least `gained` of the gained + lost discordant items favour the checkpoint | no effect)

    def beats(self, max_p: float) -> bool:
        return self.gained > self.lost and self.p_value < max_p

    def describe(self) -> str:
        return (f"base {self.base_rate:.3g} vs best {self.rate:.3g} ({self.gained} items gained, {self.lost} lost, "
                f"p={self.p_value:.2g})")

    def refusal(self) -> str:
        return (f"no checkpoint beat the base: {self.base_rate:.2f} vs best {self.rate:.2f}, p={self.p_value:.2g}; "
                f"nothing registered")


def compare(base: Mapping[str, bool], candidate: Mapping[str, bool]) -> BaselineComparison:
    """Compare the outcomes of the items both evals scored (keyed by item id)."""
    ids = sorted(base.keys() & candidate.keys())
    if not ids:
        raise ValueError("the two evals share no item: they were not run on the same eval set")
    gained = sum(1 for i in ids if candidate[i] and not base[i])
    lost = sum(1 for i in ids if base[i] and not candidate[i])
    return BaselineComparison(base_rate=sum(base[i] for i in ids) / len(ids),
                              rate=sum(candidate[i] for i in ids) / len(ids), gained=gained, lost=lost,
                              p_value=sign_test_p(gained, lost))


def sign_test_p(gained: int, lost: int) -> float:
    """P(at least `gained` of the gained + lost discordant pairs favour the candidate | no effect)."""
    n = gained + lost
    return sum(comb(n, k) for k in range(gained, n + 1)) / 2**n if n else 1.0
