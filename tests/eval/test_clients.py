"""Load on the serving scheduler: closed-loop clients keep c requests in flight; open-loop
arrivals are seeded Poisson; TTFT counts from sending, so queueing for a slot shows."""

from __future__ import annotations

import itertools

import pytest

from trtspec.eval.clients import arrival_offsets, run_clients
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.sample.probs import SamplingParams

TARGET = MarkovLM(vocab_size=20, order=2, seed=2, eos_token_id=19)


def executor() -> SpecExecutor:
    return SpecExecutor(ToyRunner(TARGET), DraftModelProposer(ToyRunner(TARGET.diverged(
        0.3, seed=3))), 3)


def work(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[1 + i % 5, 2 + i % 3] for i in range(n)]
    return prompts, [SamplingParams(temperature=0.8, seed=i, max_tokens=6 + i % 5)
                     for i in range(n)]


def test_arrivals_are_seeded_poisson_or_all_at_once() -> None:
    offsets = arrival_offsets(4000, 5.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets == arrival_offsets(4000, 5.0, seed=1) and offsets[0] == 0.0
    assert sum(gaps) / len(gaps) == pytest.approx(0.2, rel=0.05)  # mean gap 1/R
    assert arrival_offsets(3, float("inf"), seed=1) == [0.0] * 3
    assert arrival_offsets(3, None, seed=1) is None


def test_closed_loop_clients_keep_c_in_flight_and_outputs_are_exact() -> None:
    prompts, params = work(10)
    sent, _ = run_clients(executor(), prompts, params, concurrency=2, slots=4)
    spans = [(s.sent, s.sent + s.token_times[-1]) for s in sent]
    for t, _ in spans:  # at every send, at most c requests are in flight (itself included)
        assert sum(a <= t < b for a, b in spans) <= 2
    assert all(s.ticket.done.is_set() for s in sent)
    alone = [executor().generate([p], q)[0].token_ids for p, q in zip(prompts, params,
                                                                      strict=True)]
    assert [s.ticket.token_ids for s in sent] == alone


def test_everything_at_once_on_fewer_slots_queues_and_ttft_shows_it() -> None:
    prompts, params = work(6)
    sent, _ = run_clients(executor(), prompts, params, concurrency=1, slots=2,
                          offsets=arrival_offsets(6, float("inf"), 0))
    waits = [s.admitted - s.sent for s in sent]
    assert sum(w > 0.0 for w in waits) >= 4 and max(waits) > min(waits)
    assert all(s.token_times[0] >= w for s, w in zip(sent, waits, strict=True))
