"""The record schema's latency definitions (TTFT, ITL, TPOT, E2E on the eval clock) and
throughput, on hand-built timings and records."""

from __future__ import annotations

import pytest


def test_latency_definitions_on_hand_built_timings() -> None:
    from trtspec.analysis.records import RequestTiming, latency_summary

    # request A: starts at 0, first token at 0.2, then a burst of 3 at 0.5 and one at 0.9
    a = RequestTiming(start=0.0, token_times=[0.2, 0.5, 0.5, 0.5, 0.9], end=1.0)
    assert a.ttft == pytest.approx(0.2) and a.e2e == pytest.approx(1.0)
    assert a.tpot == pytest.approx((1.0 - 0.2) / 4)
    assert a.itl == pytest.approx([0.3, 0.0, 0.0, 0.4])
    b = RequestTiming(start=0.5, token_times=[0.6], end=0.6)  # one token: no TPOT
    assert b.tpot is None and b.itl == []
    s = latency_summary([a, b])
    assert s["ttft_ms_p50"] == pytest.approx(150.0)  # median of 200 and 100 ms
    assert s["tpot_ms_mean"] == pytest.approx(200.0)
    assert s["e2e_ms_p99"] == pytest.approx(100 + 0.99 * (1000 - 100))  # linear interpolation
    assert s["output_tokens_per_s"] == pytest.approx(6 / 1.0)
    assert s["request_output_tokens_per_s_mean"] == pytest.approx((5 / 1.0 + 1 / 0.1) / 2)
    assert s["itl_ms_p50"] == pytest.approx(150.0)  # ITLs 300, 0, 0, 400 → median 150
    assert latency_summary([]) == {}


def test_throughput_is_tokens_over_the_union_of_request_intervals() -> None:
    from trtspec.analysis.records import RequestTiming, busy_seconds, latency_summary

    # [0, 1] and [0.5, 2] overlap (2 s together), [3, 4] runs alone: 3 s busy, not 4 or 1
    timings = [RequestTiming(0.0, [0.5, 1.0], 1.0), RequestTiming(0.5, [1.0, 2.0], 2.0),
               RequestTiming(3.0, [3.5, 3.6, 4.0], 4.0)]
    assert busy_seconds(timings) == pytest.approx(3.0)
    assert latency_summary(timings)["output_tokens_per_s"] == pytest.approx(7 / 3.0)
    # a record on the eval clock: start_s shifts its times; token times stay relative
    r = RequestTiming.from_record({"start_s": 10.0, "token_times_s": [0.2, 0.4], "e2e_s": 0.5,
                                   "output_tokens": 2})
    assert (r.start, r.end, r.ttft, r.e2e) == pytest.approx((10.0, 10.5, 0.2, 0.5))


def test_report_throughput_is_tokens_over_wall_time() -> None:
    from fake_records import record

    from trtspec.analysis.records import arm_throughput

    rows = [record("ngram/D4/c1", "spec", "a", 0.01, n=11) | {"start_s": 100.0},  # e2e 0.15
            record("ngram/D4/c1", "spec", "b", 0.01, n=21) | {"start_s": 200.0},  # e2e 0.25
            record("ngram/D4/c1", "spec", "c", 0.01, n=5) | {"start_s": 300.0, "error": "x"}]
    t = arm_throughput(rows)["ngram/D4/c1"]["spec"]
    assert t["requests"] == 2 and t["output_tokens"] == 32
    assert t["wall_s"] == pytest.approx(0.40) and t["tokens_per_s"] == pytest.approx(80.0)
