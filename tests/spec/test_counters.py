"""SpecStats arithmetic: the counters, derived rates and pooling."""

from __future__ import annotations

import math

import pytest

from trtspec.spec.counters import SpecStats


def test_record_round_and_derived_rates() -> None:
    s = SpecStats()
    s.record_round(num_draft=4, num_accepted=4, num_kept=5)  # all accepted + bonus
    s.record_round(num_draft=4, num_accepted=1, num_kept=2)  # one accepted + recovered
    s.record_round(num_draft=4, num_accepted=3, num_kept=2)  # EOS after 2 kept: 2 discarded
    s.close_request()
    assert (s.proposed_tokens, s.accepted_draft_tokens, s.emitted_tokens,
            s.verification_rounds, s.discarded_tokens) == (12, 8, 9, 3, 2)
    assert s.acceptance_rate == pytest.approx(8 / 12) and s.al_pooled == 3.0
    assert s.proposed_per_position == [3, 3, 3, 3]
    assert s.accepted_per_position == [3, 2, 2, 1]
    assert s.acceptance_per_position == [1.0, 2 / 3, 2 / 3, 1 / 3]
    assert s.request_al == [3.0]


def test_merge_pools_counts_and_keeps_per_request_al() -> None:
    a, b = SpecStats(), SpecStats()
    a.record_round(2, 2, 3)
    a.close_request()
    for _ in range(3):
        b.record_round(5, 0, 1)
    b.close_request()
    total = SpecStats.merge([a, b])
    assert total.al_pooled == pytest.approx(6 / 4)
    assert total.al_request_mean == pytest.approx((3 + 1) / 2)
    assert total.proposed_per_position == [4, 4, 3, 3, 3]
    assert total.summary()["proposed_tokens"] == 17
    assert total.acceptance_per_position == [0.25, 0.25, 0.0, 0.0, 0.0]  # never-accepted tail


def test_empty_stats_are_nan_not_errors() -> None:
    s = SpecStats()
    s.close_request()
    assert math.isnan(s.acceptance_rate) and math.isnan(s.al_pooled)
    assert math.isnan(s.al_request_mean) and s.request_al == []
