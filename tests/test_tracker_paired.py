"""The paired test behind baseline-aware registration (pure): exact sign test over discordant mazes."""
from __future__ import annotations

import math

import pytest

from tracker.paired import sign_test


def test_discordant_mazes_decide_and_the_p_value_is_exact():
    base = {seed: seed < 20 for seed in range(64)}  # 20/64
    better = {seed: seed < 32 for seed in range(64)}  # +12 gained, 0 lost
    result = sign_test(base, better)
    assert (result.gained, result.lost) == (12, 0) and result.p_value == pytest.approx(0.5**12)
    assert result.beats(0.05) and result.rate == 0.5 and result.base_rate == 20 / 64
    noisy = {seed: (seed < 20 and seed % 5 != 0) or 20 <= seed < 26 for seed in range(64)}  # +6 gained, -4 lost
    result = sign_test(base, noisy)
    assert (result.gained, result.lost) == (6, 4)
    assert result.p_value == pytest.approx(sum(math.comb(10, k) for k in range(6, 11)) / 1024)
    assert not result.beats(0.05) and "p=0.38" in result.describe()
    assert not sign_test(base, base).beats(0.05) and sign_test(base, base).p_value == 1.0


def test_evals_of_different_sets_cannot_be_compared():
    with pytest.raises(ValueError, match="share no maze"):
        sign_test({1: True}, {2: True})
