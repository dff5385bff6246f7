"""The paired test behind baseline-aware registration (pure): exact sign test over discordant mazes."""
from __future__ import annotations

import math

import pytest

from tracker.baseline import compare, outcomes


def test_discordant_mazes_decide_and_the_p_value_is_exact():
    base = {seed: seed < 20 for seed in range(64)}  # 20/64
    better = {seed: seed < 32 for seed in range(64)}  # +12 gained, 0 lost
    result = compare(base, better)
    assert (result.gained, result.lost) == (12, 0) and result.p_value == pytest.approx(0.5**12)
    assert result.beats(0.05) and result.rate == 0.5 and result.base_rate == 20 / 64
    noisy = {seed: (seed < 20 and seed % 5 != 0) or 20 <= seed < 26 for seed in range(64)}  # +6 gained, -4 lost
    result = compare(base, noisy)
    assert (result.gained, result.lost) == (6, 4)
    assert result.p_value == pytest.approx(sum(math.comb(10, k) for k in range(6, 11)) / 1024)
    assert not result.beats(0.05)
    assert result.refusal() == "no checkpoint beat the base: 0.31 vs best 0.34, p=0.38; nothing registered"
    assert not compare(base, base).beats(0.05) and compare(base, base).p_value == 1.0


def test_rows_of_a_logged_table_become_outcomes_and_other_sets_cannot_be_compared():
    assert outcomes([{"seed": 3, "solved": True, "steps": 4}, {"seed": 5, "solved": 0}]) == {3: True, 5: False}
    with pytest.raises(ValueError, match="share no maze"):
        compare({1: True}, {2: True})
