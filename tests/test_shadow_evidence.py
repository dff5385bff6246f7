"""Shadow evidence without servers: wins, losses and ties from pairs, the sign test, and the gate."""
from __future__ import annotations

from registry_hooks.shadow_evidence import Answer, evidence, gate_refusal, has_won


def ok(score: float | None, latency: float = 10.0, text: str | None = None) -> Answer:
    return Answer(status=200, latency_ms=latency, score=score, text=text)


def test_pairs_are_decided_by_score_then_by_agreement():
    found = evidence([(ok(0), ok(1)), (ok(1), ok(0)), (ok(1), ok(1)), (ok(None, text="a"), ok(None, text="a")),
                      (ok(None, text="a"), ok(None, text="b")), (ok(0.5), ok(None))])
    assert (found.pairs, found.wins, found.losses, found.ties, found.unscored_differ) == (6, 1, 1, 2, 2)
    assert found.p_worse == 0.75  # 1 of 2 decided pairs to the primary: P(>= 1 of 2) = 3/4


def test_a_clearly_worse_shadow_is_refused_a_better_or_equal_one_passes():
    worse = evidence([(ok(1), ok(0))] * 12 + [(ok(0), ok(1))] * 2 + [(ok(1), ok(1))] * 6)
    assert worse.p_worse < 0.01
    refusal = gate_refusal(worse, min_pairs=20, max_p=0.05)
    assert refusal is not None and "worse on live traffic" in refusal and "2 wins, 12 losses, 6 ties" in refusal
    better = evidence([(ok(0), ok(1))] * 12 + [(ok(1), ok(0))] * 2 + [(ok(1), ok(1))] * 6)
    assert gate_refusal(better, min_pairs=20, max_p=0.05) is None
    assert gate_refusal(better, min_pairs=50, max_p=0.05).startswith("only 20 scored shadow pairs, 50 required")
    slightly_worse = evidence([(ok(1), ok(0))] * 3 + [(ok(0), ok(1))] * 2 + [(ok(1), ok(1))] * 15)
    assert gate_refusal(slightly_worse, min_pairs=20, max_p=0.05) is None  # not evidence of worse


def test_errors_and_latency_of_both_sides():
    failing = evidence([(ok(1, 10), Answer(500, 2.0, None))] * 3 + [(ok(1, 12), ok(1, 30))] * 7)
    assert (failing.primary_error_rate, failing.shadow_error_rate) == (0.0, 0.3)
    assert (failing.primary_p50_ms, failing.shadow_p50_ms) == (12.0, 30.0)  # failed answers carry no latency
    assert "fails more often" in gate_refusal(failing, min_pairs=5, max_p=0.05)
    assert evidence([]).p_worse == 1.0 and gate_refusal(evidence([]), min_pairs=1, max_p=0.05).startswith("only 0")


def test_a_shadow_has_won_only_with_enough_pairs_more_wins_a_small_p_and_no_more_errors():
    better = evidence([(ok(0), ok(1))] * 8 + [(ok(1), ok(1))] * 4)
    assert better.p_better == 1 / 2**8 and has_won(better, min_pairs=12, max_p=0.05)
    assert not has_won(better, min_pairs=13, max_p=0.05)  # one pair short
    assert not has_won(evidence([(ok(0), ok(1))] * 4 + [(ok(1), ok(0))] * 2), min_pairs=6, max_p=0.05)  # p = 0.34
    assert not has_won(evidence([(ok(1), ok(1))] * 30), min_pairs=6, max_p=0.05)  # ties say nothing
    failing = evidence([(ok(0), ok(1))] * 10 + [(ok(1), Answer(500, 2.0, None))])
    assert failing.p_better < 0.01 and not has_won(failing, min_pairs=10, max_p=0.05)
