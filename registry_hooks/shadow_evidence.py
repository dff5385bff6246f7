"""What a shadow's pairs say (issue 31): pure logic over the two answers of each copied request.

A pair is the primary's answer (the one the client got) and the shadow's answer to the same request. Where
the task scored both, the higher score wins (equal: a tie); where it could not score them, equal answers tie
and others only count as different. The shadow is worse when it loses more pairs than it wins and an exact
one-sided sign test over the decided pairs says so (the test registration uses against the base).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from tracker.baseline import sign_test_p


@dataclass(frozen=True)
class Answer:
    """One side of a pair as its trace recorded it."""

    status: int
    latency_ms: float
    score: float | None  # the task's score; None: not scored
    text: str | None = None


@dataclass(frozen=True)
class ShadowEvidence:
    pairs: int
    wins: int  # the shadow scored higher
    losses: int
    ties: int
    unscored_differ: int  # pairs without scores whose answers differ
    p_worse: float  # P(at least `losses` of the decided pairs go to the primary | no difference)
    p_better: float  # P(at least `wins` of the decided pairs go to the shadow | no difference)
    primary_p50_ms: float | None
    shadow_p50_ms: float | None
    primary_error_rate: float
    shadow_error_rate: float

    def describe(self) -> str:
        latency = (f"; p50 {self.primary_p50_ms:.0f} vs {self.shadow_p50_ms:.0f} ms"
                   if self.primary_p50_ms is not None and self.shadow_p50_ms is not None else "")
        return (f"{self.pairs} pairs: shadow {self.wins} wins, {self.losses} losses, {self.ties} ties"
                + (f", {self.unscored_differ} unscored and different" if self.unscored_differ else "")
                + f" (p worse={self.p_worse:.2g}); errors {self.primary_error_rate:.1%} vs "
                f"{self.shadow_error_rate:.1%}{latency}")


def evidence(pairs: list[tuple[Answer, Answer]]) -> ShadowEvidence:
    """The figures of (primary, shadow) pairs."""
    wins = losses = ties = differ = 0
    for primary, shadow in pairs:
        if primary.score is not None and shadow.score is not None:
            wins += shadow.score > primary.score
            losses += shadow.score < primary.score
            ties += shadow.score == primary.score
        elif primary.text is not None and primary.text == shadow.text:
            ties += 1
        else:
            differ += 1

    def p50(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    def error_rate(answers: list[Answer]) -> float:
        return sum(a.status >= 500 for a in answers) / len(answers) if answers else 0.0

    primaries, shadows = [p for p, _ in pairs], [s for _, s in pairs]
    return ShadowEvidence(pairs=len(pairs), wins=wins, losses=losses, ties=ties, unscored_differ=differ,
                          p_worse=sign_test_p(losses, wins), p_better=sign_test_p(wins, losses),
                          primary_p50_ms=p50([a.latency_ms for a in primaries if a.status < 400]),
                          shadow_p50_ms=p50([a.latency_ms for a in shadows if a.status < 400]),
                          primary_error_rate=error_rate(primaries), shadow_error_rate=error_rate(shadows))


def gate_refusal(found: ShadowEvidence, *, min_pairs: int, max_p: float) -> str | None:
    """Why a promotion that requires shadow evidence is refused, or None: too few scored pairs, or the shadow
    loses with p below `max_p`, or it fails more often than the primary."""
    scored = found.wins + found.losses + found.ties
    if scored < min_pairs:
        return f"only {scored} scored shadow pairs, {min_pairs} required ({found.describe()})"
    if found.losses > found.wins and found.p_worse < max_p:
        return f"the shadow is worse on live traffic: {found.describe()}, p below {max_p:g}"
    if found.shadow_error_rate > found.primary_error_rate:
        return f"the shadow fails more often than the primary: {found.describe()}"
    return None


def has_won(found: ShadowEvidence, *, min_pairs: int, max_p: float) -> bool:
    """Whether the shadow has earned a canary: `min_pairs` scored pairs, more wins than losses with a one-sided
    sign-test p below `max_p`, and no more errors than the primary."""
    scored = found.wins + found.losses + found.ties
    return (scored >= min_pairs and found.wins > found.losses and found.p_better < max_p
            and found.shadow_error_rate <= found.primary_error_rate)
