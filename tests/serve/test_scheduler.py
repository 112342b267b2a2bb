"""Continuous batching: a seeded request's output is the one it gets alone, whenever it was
admitted and beside whatever requests; slots free on finish and cancel; the queue is bounded;
the draft length policy."""

from __future__ import annotations

import collections
import threading

import pytest
from conftest import count_fed, tiny_llama

from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.serve.scheduler import Scheduler
from trtspec.serve.slots import DraftPolicy, QueueFull, SchedulerDown, Ticket
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.propose.layer_skip import LayerSkipProposer
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.sample.probs import SamplingParams

TARGET = MarkovLM(vocab_size=24, order=2, seed=5, eos_token_id=23)
DRAFT = TARGET.diverged(0.3, seed=6)


def toy_executor(method: str, draft_len: int = 3) -> SpecExecutor:
    proposer = {"none": None, "draft_model": DraftModelProposer(ToyRunner(DRAFT)),
                "ngram": NgramProposer(1, 3)}[method]
    return SpecExecutor(ToyRunner(TARGET), proposer, draft_len)


def _counters(stats) -> tuple:
    return (stats.proposed_tokens, stats.accepted_draft_tokens, stats.emitted_tokens,
            stats.verification_rounds, stats.discarded_tokens, stats.rejected_rounds,
            stats.accepted_per_position, stats.proposed_per_position)


def requests(n: int) -> list[tuple[list[int], SamplingParams]]:
    return [([1 + i % 7, 2 + i % 5, 3 + i % 3] * (1 + i % 3),
             SamplingParams(temperature=(0.0, 0.8, 1.0)[i % 3], top_p=(1.0, 0.9)[i % 2],
                            seed=100 + i, max_tokens=5 + 3 * (i % 4)))
            for i in range(n)]


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("method", ["draft_model", "ngram", "none"])
def test_staggered_arrivals_give_each_request_its_output_alone(method: str,
                                                               chunk: int | None) -> None:
    """12 requests through 3 slots, arriving while others run: every output equals the
    executor's for that request alone (the exact sampler, proven in test_executor), with
    prompts prefilled whole or 2 tokens a step while the others decode."""
    work = requests(12)
    alone = [toy_executor(method).generate([p], s)[0] for p, s in work]
    scheduler = Scheduler(toy_executor(method), slots=3, prefill_chunk=chunk)
    tickets = []
    for i, (prompt, params) in enumerate(work):
        tickets.append(scheduler.submit(prompt, params))
        for _ in range(i % 3):  # a few rounds between arrivals: admitted mid-flight
            scheduler.step()
    scheduler.run_until_idle()
    assert scheduler.running == 0 and scheduler.waiting == 0
    for ticket, reference in zip(tickets, alone, strict=True):
        assert ticket.done.is_set()
        assert ticket.token_ids == reference.token_ids
        assert ticket.finish_reason == reference.finish_reason
        assert _counters(ticket.stats) == _counters(reference.stats)
    total = sum(t.stats.emitted_tokens for t in tickets)
    assert scheduler.totals.emitted_tokens == total  # what /metrics will export


def test_power_a_slot_that_keeps_its_last_occupant_s_tokens_fails(monkeypatch) -> None:
    """The identity test above can fail: admission that forgets to drop the row's old tokens
    (the new prompt lands after them) changes outputs."""
    monkeypatch.setattr(Scheduler, "_reset_row", lambda self, slot, kept: None)
    work = requests(12)
    alone = [toy_executor("draft_model").generate([p], s)[0].token_ids for p, s in work]
    scheduler = Scheduler(toy_executor("draft_model"), slots=3)
    tickets = [scheduler.submit(p, s) for p, s in work]
    scheduler.run_until_idle()
    assert sum(t.token_ids != a for t, a in zip(tickets, alone, strict=True)) >= 3


def test_on_a_transformers_model_greedy_output_is_the_same_as_alone() -> None:
    from trtspec.runtime.hf import HFRunner, layer_skip_view

    model = tiny_llama(vocab=48, layers=2, seed=3, logit_scale=4.0)

    def executor() -> SpecExecutor:
        return SpecExecutor(HFRunner(model), DraftModelProposer(
            HFRunner(layer_skip_view(model, 1))), 3)

    work = [([5 + i, 9, 11 + i, 9, 5 + i][: 2 + i % 4], SamplingParams(temperature=0.0,
                                                                       max_tokens=6 + i))
            for i in range(6)]
    alone = [executor().generate([p], s)[0].token_ids for p, s in work]
    scheduler = Scheduler(executor(), slots=2)
    tickets = []
    for prompt, params in work:
        tickets.append(scheduler.submit(prompt, params))
        scheduler.step()
    scheduler.run_until_idle()
    assert [t.token_ids for t in tickets] == alone


def test_a_layer_skip_draft_over_the_target_s_cache_under_continuous_batching() -> None:
    """trtspec's decoder with the draft reading the target's KV cache: staggered admissions,
    a cancel, rows at D = 0 beside rows at D = 4 (a schedule): greedy output is plain
    decoding's, request by request."""
    from trtspec.runtime.compiled import CompiledRunner

    model = tiny_llama(vocab=48, layers=3, seed=3, logit_scale=4.0)
    target = CompiledRunner(model, compile=False)
    draft = LayerSkipProposer(target.view(2, share_cache=True))
    work = [([5 + i, 9, 11 + i, 9, 5 + i][: 2 + i % 4], SamplingParams(temperature=0.0,
                                                                       max_tokens=8 + i))
            for i in range(7)]
    plain = [SpecExecutor(CompiledRunner(model, compile=False)).generate([p], s)[0].token_ids
             for p, s in work]
    scheduler = Scheduler(SpecExecutor(target, draft, 4), slots=3,
                          policy=DraftPolicy.parse("1:4,2:2,3:0"))
    tickets = []
    for i, (prompt, params) in enumerate(work):
        tickets.append(scheduler.submit(prompt, params))
        for _ in range(i % 3):
            scheduler.step()
        if i == 2:
            scheduler.cancel(tickets[1])
    scheduler.run_until_idle()
    assert tickets[1].finish_reason == "abort"
    for i, ticket in enumerate(tickets):
        if i != 1:
            assert ticket.token_ids == plain[i], i
    assert scheduler.totals.proposed_tokens > 0


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_a_kept_prompt_is_admitted_from_its_cache_with_the_same_outputs(method: str) -> None:
    """``keep_prompts``: a slot that held a prompt admits it again by scoring its last token
    only, and each seeded request still gets its output alone; another prompt (or a
    cancelled request's row) is prefilled as before."""
    prompt = [3, 5, 7] * 12
    other = [4, 6] * 5
    work = [(prompt if i % 4 else other, SamplingParams(temperature=1.0, seed=300 + i,
                                                        max_tokens=4 + i % 3))
            for i in range(16)]
    alone = [toy_executor(method).generate([p], s)[0].token_ids for p, s in work]
    executor = toy_executor(method)
    scheduler = Scheduler(executor, slots=2, keep_prompts=True)
    fed = count_fed(executor.target)
    tickets = [scheduler.submit(p, s) for p, s in work]
    scheduler.run_until_idle()
    assert [t.token_ids for t in tickets] == alone
    assert fed.count(1) >= 6  # admissions of the kept prompt: one token, not 36
    assert fed.count(len(prompt)) < 6


def test_kept_prompts_on_transformers() -> None:
    """The transformers runner's cache rolled back to a kept prompt: greedy outputs are the
    ones alone (heads keep theirs too: tests/spec/propose/heads/test_eagle.py, test_medusa.py)."""
    from trtspec.runtime.hf import HFRunner

    model = tiny_llama(vocab=48, layers=2, seed=3, logit_scale=4.0)
    prompt = [5, 9, 11, 9, 5, 7, 30, 2]
    work = [(prompt, SamplingParams(temperature=0.0, max_tokens=5 + i % 3)) for i in range(5)]
    alone = [SpecExecutor(HFRunner(model)).generate([p], s)[0].token_ids for p, s in work]
    executor = SpecExecutor(HFRunner(model))
    scheduler = Scheduler(executor, slots=2, keep_prompts=True)
    fed = count_fed(executor.target)
    tickets = [scheduler.submit(p, s) for p, s in work]
    scheduler.run_until_idle()
    assert [t.token_ids for t in tickets] == alone and fed.count(1) > 3


def test_cancel_frees_the_slot_and_the_others_go_on() -> None:
    work = requests(4)
    alone = [toy_executor("draft_model").generate([p], s)[0] for p, s in work]
    seen: list = []
    scheduler = Scheduler(toy_executor("draft_model"), slots=2)
    tickets = [scheduler.submit(p, s.model_copy(update={"max_tokens": 14}) if i == 0 else s,
                                on_delta=seen.append if i == 0 else None)
               for i, (p, s) in enumerate(work)]
    scheduler.step()
    scheduler.cancel(tickets[0])  # running
    scheduler.cancel(tickets[3])  # still waiting
    scheduler.run_until_idle()
    assert tickets[0].finish_reason == "abort" and seen[-1].finish_reason == "abort"
    assert tickets[3].finish_reason == "abort" and tickets[3].token_ids == []
    for ticket, reference in zip(tickets[1:3], alone[1:3], strict=True):
        assert ticket.token_ids == reference.token_ids
    assert scheduler.running == 0 and all(t.done.is_set() for t in tickets)


def test_a_round_callback_that_raises_ends_nothing() -> None:
    """The per-round metrics callback fails: logged, and every request still finishes."""
    work = requests(3)
    scheduler = Scheduler(toy_executor("draft_model"), slots=2)

    def broken(deltas):
        raise RuntimeError("a metrics bug")

    scheduler.on_round = broken
    tickets = [scheduler.submit(p, s) for p, s in work]
    scheduler.run_until_idle()
    assert all(t.finish_reason in ("stop", "length") for t in tickets)
    assert scheduler.error is None


def test_a_stop_found_off_the_step_thread_ends_the_request_at_the_next_step() -> None:
    """Slots.stop (the server's text side, on its event loop): at the next step the request
    keeps its first ``keep`` tokens and ends with "stop", tokens after them are counted as
    discarded, not emitted, and the slot serves the next request."""
    scheduler = Scheduler(toy_executor("ngram"), slots=1)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=100, ignore_eos=True)
    ticket = scheduler.submit([1, 2, 3], params)
    ends: list = []
    scheduler.on_end = ends.append
    while len(ticket.token_ids) < 6:
        scheduler.step()
    emitted = len(ticket.token_ids)
    scheduler.stop(ticket, 3)
    nxt = scheduler.submit([4, 5], params.model_copy(update={"max_tokens": 4}))
    scheduler.run_until_idle()
    assert ticket.finish_reason == "stop" and len(ticket.token_ids) == 3
    assert ticket.stats.emitted_tokens == 2 and ticket.stats.discarded_tokens == emitted - 3
    assert ends[0] is ticket and nxt.finish_reason == "length"


def test_the_waiting_queue_is_bounded_and_bad_prompts_take_no_slot() -> None:
    scheduler = Scheduler(toy_executor("none"), slots=1, max_waiting=2)
    prompt, params = requests(1)[0]
    for _ in range(3):  # one for the free slot, two waiting
        scheduler.submit(prompt, params)
    with pytest.raises(QueueFull, match="3 requests are waiting for a slot"):
        scheduler.submit(prompt, params)
    scheduler.step()  # one admitted: the slot is taken, two wait
    with pytest.raises(QueueFull, match="2 requests are waiting for a slot"):
        scheduler.submit(prompt, params)
    with pytest.raises(ValueError, match=r"outside 0\.\.23"):
        scheduler.submit([99], params)
    scheduler.run_until_idle()
    scheduler.submit(prompt, params)  # room again


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    scheduler = Scheduler(toy_executor("draft_model"), slots=2)
    work = requests(7)
    tickets = [scheduler.submit(p, s) for p, s in work]
    scheduler.run_until_idle()
    admitted = [t.admitted_at for t in tickets]
    assert None not in admitted and admitted == sorted(admitted)
    assert len(set(admitted)) == len(admitted)


def test_a_schedule_that_turns_speculation_off_keeps_greedy_output() -> None:
    """D changes with the running count (4 alone, 0 with company): greedy output is still
    the plain one, and the rounds at D = 0 propose nothing."""
    work = [(p, s.model_copy(update={"temperature": 0.0})) for p, s in requests(6)]
    work[-1] = (work[-1][0], work[-1][1].model_copy(update={"max_tokens": 40,
                                                             "ignore_eos": True}))
    plain = [toy_executor("none").generate([p], s)[0].token_ids for p, s in work]
    executor = toy_executor("draft_model")
    scheduler = Scheduler(executor, slots=3, policy=DraftPolicy.parse("1:4,2:0"))
    rounds: list[tuple[int, int]] = []  # (running, D asked) per round
    real_round = executor.round

    def round_(rows, live, draft_len, *budget):
        rounds.append((len(live), draft_len))
        return real_round(rows, live, draft_len, *budget)

    executor.round = round_
    tickets = [scheduler.submit(p, s) for p, s in work]
    scheduler.run_until_idle()
    assert [t.token_ids for t in tickets] == plain
    assert {d for n, d in rounds if n >= 2} == {0} and {d for n, d in rounds if n == 1} == {4}
    alone = sum(1 for n, _ in rounds if n == 1)
    assert scheduler.totals.verification_rounds >= alone > 0
    assert scheduler.totals.proposed_tokens > 0  # the last request ran alone, at D = 4


def test_the_step_loop_serves_submissions_from_other_threads() -> None:
    scheduler = Scheduler(toy_executor("draft_model"), slots=2)
    stop = threading.Event()
    loop = threading.Thread(target=scheduler.serve_forever, args=(stop,), daemon=True)
    loop.start()
    try:
        work = requests(6)
        tickets = [scheduler.submit(p, s) for p, s in work]
        assert all(t.done.wait(timeout=30) for t in tickets)
    finally:
        stop.set()
        loop.join(timeout=10)
    alone = [toy_executor("draft_model").generate([p], s)[0].token_ids for p, s in work]
    assert [t.token_ids for t in tickets] == alone


def test_a_model_error_ends_every_request_and_the_scheduler_says_it_is_down() -> None:
    """A runner that fails on every call: the round is tried row by row, no row runs alone,
    so the runner cannot go on: every request ends with "error", the scheduler is down."""
    executor = toy_executor("draft_model")
    scheduler = Scheduler(executor, slots=2)
    work = requests(4)
    ended: list = []
    scheduler.on_end = ended.append
    tickets = [scheduler.submit(p, s) for p, s in work]
    score = executor.target.score

    def broken(tokens, last_only=False):
        if executor.target.score_calls > 3:
            raise RuntimeError("device lost")
        return score(tokens, last_only)

    executor.target.score = broken
    scheduler.serve_forever(threading.Event())  # returns: the step failed
    assert scheduler.error == "RuntimeError: device lost"
    assert [t.finish_reason for t in tickets].count("error") >= 2
    assert all(t.done.is_set() for t in tickets) and len(ended) == 4
    assert scheduler.running == 0 and scheduler.waiting == 0  # the gauges /metrics exports
    with pytest.raises(SchedulerDown, match="the model failed: RuntimeError: device lost"):
        scheduler.submit(*work[0])


@pytest.mark.parametrize("where", ["observe", "release", "on_end"])
def test_a_failure_after_tokens_were_committed_still_tells_every_client(where: str) -> None:
    """Failures after a round committed its tokens (the proposer's observe, a slot's release
    while the round's deltas are handed out) end every request that was not told with an
    error; a metrics callback that raises ends nothing. No client is left without a final
    delta."""
    executor = toy_executor("draft_model")
    scheduler = Scheduler(executor, slots=2)
    finals: dict[int, list[str]] = {}

    def client(i: int):
        return lambda d: finals.setdefault(i, []).append(d.finish_reason) \
            if d.finish_reason else None

    tickets = [scheduler.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=n,
                                                          ignore_eos=True), client(i))
               for i, n in enumerate((6, 6, 40))]  # the first two end in the same round
    proposer = executor.proposer
    original = getattr(proposer, where) if where != "on_end" else None

    def boom(*args, **kwargs):
        raise RuntimeError(f"{where} failed")

    def armed(*args, **kwargs):
        if any(t.request.finish_reason for t in tickets[:2]):
            boom()
        return original(*args, **kwargs)

    if where == "on_end":
        scheduler.on_end = boom
    else:
        setattr(proposer, where, armed)
    stop = threading.Event()
    scheduler.serve_forever(stop) if where != "on_end" else scheduler.run_until_idle()
    assert all(t.done.is_set() for t in tickets)
    for i in range(len(tickets)):
        assert len(finals.get(i, [])) == 1, (i, finals)  # exactly one final delta each
    if where == "on_end":
        assert scheduler.error is None and [f[0] for f in finals.values()] == ["length"] * 3
    else:
        assert scheduler.error == f"RuntimeError: {where} failed"
        assert "error" in [f[0] for f in finals.values()]


def continuation_pvalue(tickets, exact: dict[tuple, float]) -> float:
    """Chi-square p of the tickets' outputs against the exact continuation probabilities."""
    from trtspec.analysis.gof import chi_square_gof

    counts: dict[tuple, int] = {}
    for t in tickets:
        counts[tuple(t.token_ids)] = counts.get(tuple(t.token_ids), 0) + 1
    seqs = sorted(set(exact) | set(counts))
    return chi_square_gof([counts.get(q, 0) for q in seqs],
                          [exact.get(q, 0.0) for q in seqs])[2]


class Poisoned(ToyRunner):
    """A target that fails on one request's row: a prompt holding POISON (its own chunk's
    call), and row 0 once it holds ``long`` tokens in a round (its row alone, say a NaN)."""

    POISON = 21

    def __init__(self, model, long: int = 10**9) -> None:
        super().__init__(model)
        self.long = long

    def score(self, tokens, last_only=False):
        if last_only and any(self.POISON in row for row in tokens):
            raise ValueError("this prompt breaks the model")
        if not last_only and tokens[0] and self.lengths()[0] >= self.long:
            raise FloatingPointError("row 0 went NaN")
        return super().score(tokens, last_only)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_a_failure_on_one_row_ends_that_request_alone(method: str) -> None:
    """A row that fails in a round and a prompt that fails its prefill end their own
    requests with "error" (and say why); the others get the outputs they get alone, and the
    scheduler is up for the next request."""
    proposer = {"draft_model": DraftModelProposer(ToyRunner(DRAFT)),
                "ngram": NgramProposer(1, 3)}[method]
    executor = SpecExecutor(Poisoned(TARGET, long=20), proposer, 3)
    scheduler = Scheduler(executor, slots=3, prefill_chunk=2)
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=40, ignore_eos=True)
              for s in range(4)]
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9, Poisoned.POISON, 10], [2, 4]]
    tickets = [scheduler.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    while not tickets[0].done.is_set():
        scheduler.step()
    if method == "draft_model":  # the failed round's drafts were undone in the draft's cache
        assert proposer.runner.lengths() == proposer._valid
    scheduler.run_until_idle()
    assert scheduler.error is None
    assert [t.finish_reason for t in tickets] == ["error", "length", "error", "length"]
    assert tickets[0].error == "FloatingPointError: row 0 went NaN"
    assert tickets[2].error == "ValueError: this prompt breaks the model"
    assert len(tickets[0].token_ids) < 40 and tickets[2].token_ids == []
    for i in (1, 3):  # a failed round's drafts drew from every row's generator: after it,
        # the others' samples are still the target's, but not the ones their seeds give alone
        reference = toy_executor(method).generate([prompts[i]], params[i])[0].token_ids
        assert len(tickets[i].token_ids) == 40
        assert method == "draft_model" or tickets[i].token_ids == reference  # ngram drew none
    after = scheduler.submit([3, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    scheduler.run_until_idle()
    assert after.finish_reason == "length" and scheduler.running == 0


def test_requests_failing_in_a_row_mean_the_runner_is_broken() -> None:
    """Three requests that fail one after another with nothing succeeding between them: the
    runner, not the requests, so the scheduler goes down."""
    scheduler = Scheduler(SpecExecutor(Poisoned(TARGET), None, 0), slots=1)
    bad = [scheduler.submit([1, Poisoned.POISON], SamplingParams()) for _ in range(3)]
    scheduler.serve_forever(threading.Event())
    assert [t.finish_reason for t in bad] == ["error"] * 3
    assert scheduler.error and scheduler.error.startswith("RuntimeError: 3 requests in a row")


def test_rounds_that_fail_batched_but_not_row_by_row_take_the_scheduler_down() -> None:
    """A runner that fails whenever two rows verify together: each round is rescued row by
    row (every request still gets its tokens) until the third in a row, when the runner is
    not to be trusted: the scheduler goes down and says why."""

    class Pairs(ToyRunner):
        def score(self, tokens, last_only=False):
            if not last_only and sum(bool(t) for t in tokens) >= 2:
                raise RuntimeError("two rows at once")
            return super().score(tokens, last_only)

    scheduler = Scheduler(SpecExecutor(Pairs(TARGET), NgramProposer(1, 3), 3), slots=2)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    tickets = [scheduler.submit([1, 2], params), scheduler.submit([3, 4], params)]
    scheduler.serve_forever(threading.Event())
    assert scheduler.error and "3 rounds in a row failed batched" in scheduler.error
    assert all(t.finish_reason == "error" and len(t.token_ids) >= 3 for t in tickets)


def test_a_prompt_the_kv_cache_cannot_hold_is_refused_before_any_work(monkeypatch) -> None:
    """Admission reserves the prompt's room in the compiled runner's cache: with (pretend)
    little memory, a 700-token prompt ends at once with "error" saying why, no call scores
    it, and a short request beside it is served."""
    import trtspec.runtime.compiled as compiled_module
    from trtspec.runtime.compiled import CompiledRunner

    runner = CompiledRunner(tiny_llama(vocab=64, positions=4096), compile=False)
    scheduler = Scheduler(SpecExecutor(runner, None, 0), slots=2)
    monkeypatch.setattr(compiled_module, "free_bytes", lambda device: 1000)
    fed = count_fed(runner)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    long = scheduler.submit([7] * 700, params)
    short = scheduler.submit([1, 2, 3], params)
    scheduler.run_until_idle()
    assert long.finish_reason == "error" and long.token_ids == []
    assert long.error.startswith("the KV cache would grow to 1024 tokens a row")
    assert max(fed) < 700 and short.finish_reason == "length" and scheduler.error is None


def test_sampling_stays_exact_when_rounds_fail_and_are_run_row_by_row() -> None:
    """Chi-square, as below: every 4th round of two or more rows fails after the target
    scored it (independently of the tokens drawn), is undone and run row by row. Power: a
    recovery that leaves the failed round's tokens in the target's cache fails the test."""
    from conftest import continuation_probs

    target = MarkovLM(vocab_size=6, order=3, seed=11)
    prompt = [1, 4, 2, 5, 3, 1, 2]
    params = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True)
    exact = continuation_probs(target, prompt, 3, params)

    class Flaky(ToyRunner):
        def __init__(self, model, broken: bool) -> None:
            super().__init__(model)
            self.broken, self.batched, self.failed, self.stale = broken, 0, 0, False

        def score(self, tokens, last_only=False):
            out = super().score(tokens, last_only)
            if not last_only and sum(bool(t) for t in tokens) >= 2:
                self.batched += 1
                if self.batched % 4 == 0:
                    self.failed, self.stale = self.failed + 1, True
                    raise RuntimeError("a flaky device")
            return out

        def rollback(self, lengths):
            if self.stale:
                self.stale = False
                if self.broken:  # the failed round's tokens stay
                    return
            super().rollback(lengths)

    def pvalue(runner: Flaky) -> float:
        draft = DraftModelProposer(ToyRunner(target.diverged(0.5, seed=12)))
        scheduler = Scheduler(SpecExecutor(runner, draft, 3), slots=4, max_waiting=2000)
        tickets = [scheduler.submit(prompt, params.model_copy(update={"seed": i}))
                   for i in range(2000)]
        scheduler.run_until_idle()
        assert scheduler.error is None and runner.failed > 100
        return continuation_pvalue(tickets, exact)

    assert pvalue(Flaky(target, broken=False)) > 1e-3
    assert pvalue(Flaky(target, broken=True)) < 1e-3


def test_a_long_prompt_is_admitted_in_chunks_while_the_others_decode() -> None:
    """The token budget: a 30-token prompt at 4 tokens a step takes 8 steps, every running
    stream gets tokens in each of them, and no step feeds the target more than
    max_num_tokens (10): the two streams' rounds (D = 3: 8 tokens) have D cut to 2 so the
    prompt gets its 4."""
    executor = toy_executor("ngram", draft_len=3)
    fed: list[int] = []
    score = executor.target.score

    def counted(tokens, last_only=False):
        fed.append(sum(len(t) for t in tokens))
        return score(tokens, last_only)

    executor.target.score = counted
    scheduler = Scheduler(executor, slots=3, max_num_tokens=10, prefill_chunk=4)
    asked: list[int] = []
    round_ = executor.round

    def counted_round(rows, live, draft_len, budget, beside=None):
        asked.append(budget)
        return round_(rows, live, draft_len, budget, beside)

    executor.round = counted_round
    params = SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True)
    running = [scheduler.submit([1, 2, 3], params), scheduler.submit([4, 5], params)]
    while any(not t.token_ids for t in running):
        scheduler.step()
    long = scheduler.submit([(5 * i) % 20 for i in range(30)], params)
    steps = 0
    while not long.token_ids:
        before = [len(t.token_ids) for t in running]
        fed.clear()
        scheduler.step()
        steps += 1
        assert all(len(t.token_ids) > n for t, n in zip(running, before, strict=True))
        assert sum(fed) <= 10  # the budget: a round's D is cut to fit what the chunk left
    assert steps == 30 // 4 + 1 and 6 in asked  # 2 rows × (D 2 + 1)
    for t in [*running, long]:
        scheduler.cancel(t)
    scheduler.run_until_idle()


@pytest.mark.parametrize(("method", "failing", "memory"), [
    ("none", None, False), ("ngram", None, False), ("ngram", 2, False), ("ngram", 1, False),
    ("ngram", 1, True)])
def test_a_prompt_s_chunks_ride_in_the_rounds_own_calls(method: str, failing: int | None,
                                                        memory: bool, caplog) -> None:
    """On the compiled runner's decoder (eager here: the same functions), a 30-token prompt
    admitted 4 tokens a step beside two sampled streams has its chunks scored in the rounds'
    own calls (score_pair: one call a step, both groups in it), and every request's seeded
    output is the one it gets when each chunk has a call of its own, as on a runner that
    cannot pair (the same logits up to float rounding, so the same draws). ``failing`` n:
    every n-th paired call raises after writing the cache; the round and the chunk are put
    back and the step runs them in calls of their own, so the outputs are still the same, the
    prompt's row holds just its tokens and no request ends (a failed pairing is no request's
    fault); each failure is logged, and three in a row stop the riding, unless they ran
    short of memory (``memory``: as the cache's growth for the prompt may, riding or not)."""
    from trtspec.runtime.compiled import CompiledRunner

    model = tiny_llama(vocab=64, seed=6)

    def run(pair: bool) -> tuple[list[list[int]], list[int], int, int]:
        runner = CompiledRunner(model, compile=False)
        paired, failed = [0], [0]
        if pair:
            layers = runner._layers

            def spy(compiled, first, second):
                paired[0] += second is not None
                return layers(compiled, first, second)

            runner._layers = spy
            if failing:
                score_pair = runner.score_pair

                def flaky(tokens, row, chunk, last=True):
                    out = score_pair(tokens, row, chunk, last)  # the cache written, then
                    if paired[0] % failing == 0:  # a failure: both groups rolled back
                        failed[0] += 1
                        raise (MemoryError if memory else RuntimeError)("paired call failed")
                    return out

                runner.score_pair = flaky
        else:
            runner.score_pair = None
        proposer = NgramProposer(1, 3) if method == "ngram" else None
        scheduler = Scheduler(SpecExecutor(runner, proposer, 3), 4, prefill_chunk=4)
        scheduler.prefill_context = None  # chunks of 4 wherever they are (the counts below)
        params = SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True)
        streams = [scheduler.submit([1, 2, 3, 1, 2], params.model_copy(update={"seed": 1})),
                   scheduler.submit([4, 5], params.model_copy(update={"seed": 2}))]
        while any(not t.token_ids for t in streams):
            scheduler.step()
        long = scheduler.submit([(5 * i) % 60 + 1 for i in range(30)],
                                params.model_copy(update={"seed": 3, "max_tokens": 8}))
        chunk_in, held = scheduler._chunk_in, []

        def counted(slot, n, logits):  # the prompt's row in the cache after each chunk
            held.append(runner.lengths()[slot])
            return chunk_in(slot, n, logits)

        scheduler._chunk_in = counted
        scheduler.run_until_idle()
        assert scheduler.error is None
        return [t.token_ids for t in (*streams, long)], held, paired[0], failed[0]

    (riding, held, paired, failed), (alone, held_alone, _, _) = run(True), run(False)
    assert riding == alone
    assert held == held_alone and held[-1] == 30  # (a failed pairing rolled its chunk back)
    warned = [r.getMessage() for r in caplog.records if "chunk riding" in r.getMessage()]
    if failing is None:  # 30 tokens, 4 a step: 7 chunks of 4 and one of 2
        assert (paired, failed, warned) == (8, 0, [])
    elif failing == 2:  # every other call fails: the chunk rides again after each
        assert (paired, failed) == (8, 4) and len(warned) == 4
    elif memory:  # memory: not the pairing's fault, never counted against it
        assert (paired, failed) == (8, 8) and len(warned) == 8
        assert all("not counted" in w for w in warned)
    else:  # all fail: three tries, then the chunks take calls of their own
        assert (paired, failed) == (3, 3) and len(warned) == 3
        assert not any("own" in w for w in warned[:2]) and "own from now on" in warned[-1]


def beside_a_stream(slots: int, chunk: int, executor: SpecExecutor | None = None, **kw
                    ) -> tuple[Scheduler, Ticket, list[list[int]]]:
    """A toy-target scheduler admitting prompts ``chunk`` tokens a step, one stream decoding,
    and the prefill calls' token counts: a list per step, the caller starting each one
    (``executor``: toy_executor("none")'s; ``kw``: the Scheduler's)."""
    executor = executor or toy_executor("none")
    score, steps = executor.target.score, [[]]

    def counted(tokens, last_only=False):
        if last_only:
            steps[-1].append(sum(len(t) for t in tokens))
        return score(tokens, last_only)

    executor.target.score = counted
    scheduler = Scheduler(executor, slots=slots, prefill_chunk=chunk, **kw)
    running = scheduler.submit([1, 2], SamplingParams(temperature=0.8, seed=3, max_tokens=50,
                                                      ignore_eos=True))
    while not running.token_ids:
        scheduler.step()
    steps.clear()
    return scheduler, running, steps


@pytest.mark.parametrize(("length", "calls"), [(5, 1), (6, 2), (9, 2), (10, 3)])
def test_a_prompt_s_short_tail_joins_the_chunk_before_it(length: int, calls: int) -> None:
    """Chunks of 4 beside a decoding stream: a tail under half a chunk (1 of a 5- or
    9-token prompt) comes in with the chunk before it, a tail of 2 gets a call of its own;
    the request's output is the one it gets alone (its prompt's logits are one prefill's)."""
    scheduler, running, steps = beside_a_stream(2, 4)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    prompt = [(3 * i) % 20 + 1 for i in range(length)]
    ticket = scheduler.submit(prompt, params)
    while not ticket.done.is_set():
        steps.append([])
        scheduler.step()
    prefills = [n for step in steps for n in step]
    assert len(prefills) == calls and sum(prefills) == length and max(prefills) < 6
    assert ticket.token_ids == toy_executor("none").generate([prompt], params)[0].token_ids
    scheduler.cancel(running)
    scheduler.run_until_idle()


def test_a_tail_waits_when_the_chunk_before_it_went_to_another_prompt() -> None:
    """Chunks of 4: a 4-token prompt takes this step's chunk; a 1-token prompt admitted
    beside it (a tail of nothing but itself) waits for the next step, not an extra call."""
    scheduler, running, steps = beside_a_stream(3, 4)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    first, second = scheduler.submit([3, 4, 5, 6], params), scheduler.submit([7], params)
    while not second.token_ids:
        steps.append([])
        scheduler.step()
    assert steps == [[4], [1]] and first.token_ids
    for t in (running, first, second):
        scheduler.cancel(t)
    scheduler.run_until_idle()


def test_a_chunk_s_tokens_are_priced_by_the_context_they_attend() -> None:
    """Chunks of 8 beside a decoding stream, on a target whose attention_context is 20: a
    token at position p counts 1 + p/20 of the chunk, so a step feeds int(8 / (1 + p/20))
    (8 at 0, 5 at 8, 4 at 13 and 17, 3 from 21 to 33), never under a quarter of the chunk
    (2, from 36 on); the output is the one the request gets alone."""
    scheduler, running, steps = beside_a_stream(2, 8)
    scheduler.prefill_context = 20.0  # read from the target's attention_context
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    prompt = [(3 * i) % 20 + 1 for i in range(60)]
    ticket = scheduler.submit(prompt, params)
    while not ticket.done.is_set():
        steps.append([])
        scheduler.step()
    assert [n for step in steps for n in step] == [8, 5, 4, 4, 3, 3, 3, 3, 3] + [2] * 12
    assert ticket.token_ids == toy_executor("none").generate([prompt], params)[0].token_ids
    scheduler.cancel(running)
    scheduler.run_until_idle()


@pytest.mark.parametrize(("budget", "lengths", "steps_fed"), [
    (None, (24, 12), [[16], [8], [12]]), (12, (23, 10), [[11], [10], [2, 9], [1]])])
def test_two_prompts_share_a_step_s_priced_chunk(budget: int | None, lengths: tuple[int, int],
                                                 steps_fed: list[list[int]]) -> None:
    """Chunks of 16 at a context of 20, two prompts waiting beside one stream.

    With the default budget: the 24-token prompt takes the first step's 16; at position 16
    (a price of 1.8) its last 8 cost 14.4 of the chunk, so the 12-token one gets 1.6 → 1
    token, a sliver it does not start on (its tail of 11 is not under half a chunk, which
    would join); it comes in whole at the next step. (Charged 1 a token, the 8 would have
    left it 8, and its tail of 4 would have joined them.)

    With max_num_tokens 12 and a plain stream (D = 0), a step leaves prompts 11 tokens (the
    round takes 1). The 23-token prompt: 11 (the budget binds), then 10 at position 11
    (16 / 1.55), then its last 2 at 21 (4.1 of the chunk); the 10-token one then gets
    min(the 9 tokens left of the budget, the 11.9 left of the chunk): 9, and its last 1 at
    the next step. (Seeded with the budget, 11, the chunk would have left it 6.9: a sliver
    it does not start on.)"""
    scheduler, running, steps = beside_a_stream(
        3, 16, *([] if budget is None else [SpecExecutor(ToyRunner(TARGET), None, 0)]),
        **({} if budget is None else {"max_num_tokens": budget}))
    scheduler.prefill_context = 20.0
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    first = scheduler.submit([(3 * i) % 20 + 1 for i in range(lengths[0])], params)
    second = scheduler.submit([(5 * i) % 20 + 1 for i in range(lengths[1])], params)
    while not second.token_ids:
        steps.append([])
        scheduler.step()
    assert steps == steps_fed and first.token_ids
    for t in (running, first, second):
        scheduler.cancel(t)
    scheduler.run_until_idle()


def test_a_paced_chunk_is_not_priced() -> None:
    """With a stall the chunk is learnt from time (module docstring, "stall"), so a target's
    attention_context changes nothing: the same chunks with and without it (a clock that
    ticks 1 a reading: each step's chunk call takes as long as its round, so a stall of 2
    doubles the chunk each step, 4, 8, 8, …)."""
    def chunks(context: float | None) -> list[int]:
        scheduler, running, steps = beside_a_stream(2, 8)
        scheduler.prefill_stall, scheduler.prefill_context = 2.0, context
        ticks = iter(range(10 ** 6))
        scheduler.clock = lambda: float(next(ticks))
        ticket = scheduler.submit([(3 * i) % 20 + 1 for i in range(40)],
                                  SamplingParams(temperature=0.8, seed=3, max_tokens=3,
                                                 ignore_eos=True))
        while not ticket.done.is_set():
            steps.append([])
            scheduler.step()
        scheduler.cancel(running)
        scheduler.run_until_idle()
        return [n for step in steps for n in step]

    assert chunks(20.0) == chunks(None) == [4, 8, 8, 8, 8, 4]


def test_a_riding_chunk_is_priced_too(monkeypatch) -> None:
    """The compiled runner's own attention_context (tiny_llama at a rate of 0.5: 72, see
    tests/runtime/test_compiled.py): a 30-token prompt rides beside a stream in chunks of
    8, 7 (at 8: 8 / 1.11), 6 (at 15), 6 (at 21) and its last 3, only the last asking for
    the logits after it."""
    from trtspec.runtime import compiled
    from trtspec.runtime.compiled import CompiledRunner

    monkeypatch.setattr(compiled, "ATTENTION_RATE", {"cpu": 0.5})
    runner = CompiledRunner(tiny_llama(vocab=64, seed=6), compile=False)
    rode, lasts, pair = [], [], runner.score_pair

    def counted(tokens, row, chunk, last=True):
        rode.append(len(chunk))
        lasts.append(last)
        return pair(tokens, row, chunk, last)

    runner.score_pair = counted
    scheduler = Scheduler(SpecExecutor(runner, None, 0), 2, prefill_chunk=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    running = scheduler.submit([1, 2], params)
    scheduler.step()
    ticket = scheduler.submit([(5 * i) % 60 + 1 for i in range(30)],
                              params.model_copy(update={"max_tokens": 1}))
    while not ticket.done.is_set():
        scheduler.step()
    assert rode == [8, 7, 6, 6, 3]
    assert lasts == [False] * 4 + [True]  # the head runs for the prompt's last chunk only
    scheduler.cancel(running)
    scheduler.run_until_idle()


@pytest.mark.parametrize(("second", "steps"), [(10, [[6], [10]]), (2, [[6, 2]])])
def test_a_step_s_leftover_under_half_a_chunk_starts_no_other_prompt_s_sliver(
        second: int, steps: list[list[int]]) -> None:
    """Chunks of 8: a 6-token prompt leaves 2 of the step's chunk; a 10-token prompt beside
    it waits for the next step (one call of 10, not 2 and then 8: a call's fixed cost for 2
    tokens), a 2-token one (its whole rest) comes in at once."""
    scheduler, running, calls = beside_a_stream(3, 8)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    first = scheduler.submit([3, 4, 5, 6, 7, 8], params)
    other = scheduler.submit([(3 * i) % 20 + 1 for i in range(second)], params)
    while not other.token_ids:
        calls.append([])
        scheduler.step()
    assert calls == steps and first.token_ids
    for t in (running, first, other):
        scheduler.cancel(t)
    scheduler.run_until_idle()


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model"])
@pytest.mark.parametrize(("length", "joins_at_once"), [(5, True), (10, False)])
def test_a_prompt_that_came_in_over_several_calls_joins_the_rounds_at_the_next_step(
        length: int, joins_at_once: bool, method: str) -> None:
    """Chunks of 4 beside a decoding stream: a prompt prefilled in one call (5 tokens) gets
    its first token and its first round in that step; one that came in over several (10
    tokens: 4, 4, 2) gets only its first token in the step of its last chunk (its first
    round, at its whole context, would have made that step the slowest of the admission)
    and joins the stream's round at the next. Its output is the one it gets alone."""
    executor = toy_executor(method)
    scheduler = Scheduler(executor, slots=2, prefill_chunk=4)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=50, ignore_eos=True)
    running = scheduler.submit([1, 2], params)
    while not running.token_ids:
        scheduler.step()
    prompt = [(3 * i) % 20 + 1 for i in range(length)]
    ticket = scheduler.submit(prompt, params.model_copy(update={"max_tokens": 6}))
    while not ticket.token_ids:
        before = len(running.token_ids)
        scheduler.step()
        assert len(running.token_ids) > before  # the stream gets tokens every step
    assert (len(ticket.token_ids) > 1) == joins_at_once
    scheduler.step()
    assert len(ticket.token_ids) > 1
    while not ticket.done.is_set():
        scheduler.step()
    alone = toy_executor(method).generate([prompt], [ticket.request.params])[0]
    assert ticket.token_ids == alone.token_ids
    scheduler.cancel(running)
    scheduler.run_until_idle()


def test_a_prompt_completed_with_no_stream_left_runs_its_round_at_once() -> None:
    """The streams it came in beside all ended while a prompt's chunks came in: its last
    part takes the step's whole budget and its first round runs in the same step (no stream
    to spare a slow step)."""
    executor = toy_executor("none")
    scheduler = Scheduler(executor, slots=2, prefill_chunk=4)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    running = scheduler.submit([1, 2], params)
    while not running.token_ids:
        scheduler.step()
    ticket = scheduler.submit([(3 * i) % 20 + 1 for i in range(40)], params)
    while not running.done.is_set():
        scheduler.step()
    assert 0 < ticket.prefilled < 40 and not ticket.token_ids  # came in part way
    scheduler.step()  # the rest, whole, then a round
    assert len(ticket.token_ids) == 2
    scheduler.run_until_idle()


@pytest.mark.parametrize("stall", [None, 2.0])
def test_a_stall_paces_the_chunks_to_what_a_step_s_round_allows(stall: float | None) -> None:
    """On a clock where a prompt call of n tokens takes 10 ms + 2 ms·n and a round 20 ms:
    with prefill_stall 2 the chunk starts at 4 and is learnt up (at most ×2 a step) to the
    15 tokens whose call fits in 2 rounds (40 ms), so no step that admits takes more than
    about 3 rounds; without it every chunk is prefill_chunk's 64. The stream decodes in
    every step and the prompt's output is the one it gets alone."""
    executor = toy_executor("none")
    now = [0.0]
    score = executor.target.score
    calls: list[int] = []  # tokens of each prompt call

    def timed(tokens, last_only=False):
        n = sum(len(t) for t in tokens)
        if last_only:  # a prompt's chunk
            calls.append(n)
            now[0] += 0.010 + 0.002 * n
        else:  # a round
            now[0] += 0.020
        return score(tokens, last_only)

    executor.target.score = timed
    scheduler = Scheduler(executor, slots=2, prefill_chunk=64, prefill_stall=stall)
    scheduler.clock = lambda: now[0]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=400, ignore_eos=True)
    running = scheduler.submit([1, 2], params)
    while not running.token_ids:
        scheduler.step()
    prompt = [(3 * i) % 20 + 1 for i in range(600)]
    ticket = scheduler.submit(prompt, params.model_copy(update={"max_tokens": 3}))
    calls.clear()
    while not ticket.token_ids:
        before = len(running.token_ids)
        scheduler.step()
        assert len(running.token_ids) > before
    if stall is None:
        assert set(calls[:-1]) == {64}
    else:
        assert calls[:5] == [4, 8, 12, 14, 15] and set(calls[5:-1]) == {15}
        assert calls[-1] <= 15  # a short tail is a call of its own: no call passes the stall
        assert all(0.010 + 0.002 * n <= 2.0 * 0.020 + 1e-9 for n in calls)
    while not ticket.done.is_set():
        scheduler.step()
    alone = toy_executor("none").generate([prompt], [ticket.request.params])[0]
    assert ticket.token_ids == alone.token_ids
    scheduler.cancel(running)
    scheduler.run_until_idle()


def test_a_stall_keeps_the_chunk_s_own_call_and_no_stall_rides() -> None:
    """The compiled runner's decoder (eager): paced (prefill_stall 2), a long prompt's chunks
    keep calls of their own (their time teaches the chunk), none rides in a round's call;
    unpaced they ride; the prompt's output is the same either way."""
    from trtspec.runtime.compiled import CompiledRunner

    model = tiny_llama(vocab=64, seed=6)

    def run(stall: float | None) -> tuple[int, list[int]]:
        runner = CompiledRunner(model, compile=False)
        rides = [0]
        pair = runner.score_pair

        def counted(tokens, row, chunk, last=True):
            rides[0] += 1
            return pair(tokens, row, chunk, last)

        runner.score_pair = counted
        scheduler = Scheduler(SpecExecutor(runner, None, 0), 2, prefill_chunk=8,
                              prefill_stall=stall)
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=300, ignore_eos=True)
        running = scheduler.submit([1, 2], params)
        for _ in range(3):
            scheduler.step()
        ticket = scheduler.submit([(3 * i) % 60 + 1 for i in range(100)],
                                  params.model_copy(update={"max_tokens": 3}))
        while not ticket.done.is_set():
            scheduler.step()
        scheduler.cancel(running)
        scheduler.run_until_idle()
        return rides[0], ticket.token_ids

    (paced, tokens), (unpaced, same) = run(2.0), run(None)
    assert paced == 0 and unpaced >= 8 and tokens == same


def test_a_stale_clock_lets_chunks_ride_two_steps_in_a_row_then_times_a_round_alone() -> None:
    """With the batch-aware chooser's plain round always due a timing (its clock stale), a
    prompt of two chunks rides whole (a call of its own each time cost the batch-aware arm
    what plain decoding saved), while longer prompts, or short ones arriving back to back,
    ride two steps in a row and then wait a step, whose round runs alone and gets timed (one
    that did one-off work is not), every chunk riding: while prompts keep coming, a timing
    is tried at least every third step. A step with nothing riding starts the count again,
    as does a ride that failed (its round then runs in a call of its own and is timed). A
    chooser that would draft nothing whatever the clock said wants no timing: its chunks
    ride every step, as plain decoding's do."""
    from trtspec.runtime.compiled import CompiledRunner
    from trtspec.spec.adaptive import AdaptiveDraft
    from trtspec.spec.round_cost import RoundCost

    model = tiny_llama(vocab=64, seed=6)

    def admit(lengths: list[int], gap: int = 0, policy: DraftPolicy | None = None,
              fail: bool = False, keen: bool = True) -> tuple[int, int, int]:
        """Rides, rounds timed and steps while prompts of ``lengths`` are admitted beside a
        running stream, one after the other, ``gap`` steps with no prompt between two;
        ``fail``: every paired call raises (after scoring); not ``keen``: a chooser that
        would draft nothing (no width gains enough, no probe due)."""
        runner = CompiledRunner(model, compile=False)
        count, pair = [0, 0], runner.score_pair

        def counted(tokens, row, chunk, last=True):
            count[0] += 1
            out = pair(tokens, row, chunk, last)
            if fail:
                raise RuntimeError("paired call failed")
            return out

        runner.score_pair = counted
        chooser = AdaptiveDraft(3, [1.0] * 5, round_cost=RoundCost.linear(0.1, 4, 4),
                                timed=True, **({} if keen else {"min_gain": 1e9,
                                                                "probe_after": 10 ** 9}))
        assert chooser.clock is not None
        chooser.clock.stale = lambda rows: True  # every round's plain timing is due
        observe = chooser.observe_round

        def timed(rows, width, seconds):
            count[1] += 1
            observe(rows, width, seconds)

        chooser.observe_round = timed
        scheduler = Scheduler(SpecExecutor(runner, NgramProposer(1, 3), 3, adaptive=chooser),
                              2, policy, prefill_chunk=8)
        scheduler.prefill_context = None  # chunks of 8 wherever they are (the counts below)
        params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        running = scheduler.submit([1, 2], params)
        for _ in range(3):
            scheduler.step()
        count[1], steps = 0, 0
        for n in lengths:
            ticket = scheduler.submit([(3 * i) % 60 + 1 for i in range(n)],
                                      params.model_copy(update={"max_tokens": 1}))
            while not ticket.done.is_set():
                scheduler.step()
                steps += 1
            for _ in range(gap):
                scheduler.step()
                steps += 1
        scheduler.cancel(running)
        scheduler.run_until_idle()
        return count[0], count[1], steps

    assert admit([14])[:2] == (2, 0)  # 8 + 6 tokens: both chunks ride, no round timed
    rides, timed, steps = admit([80])  # ten chunks of 8: ride, ride, wait a step (its
    assert (rides, timed, steps) == (10, 4, 14)  # round timed alone), …
    rides, timed, steps = admit([14] * 6)  # back to back, a chunk waiting at every step
    assert (rides, timed, steps) == (12, 5, 17)
    rides, timed, steps = admit([14, 14], gap=2)  # a step without a chunk between them:
    assert (rides, timed, steps) == (4, 4, 8)  # each rides whole (two steps in a row)
    rides, timed, steps = admit([80], policy=DraftPolicy(draft_len=2))  # a fixed D: no
    assert (rides, timed, steps) == (10, 0, 10)  # round is the chooser's, none is timed
    rides, timed, steps = admit([80], fail=True)  # a failed ride's step runs its round in a
    assert (rides, timed, steps) == (3, 10, 10)  # call of its own, timed; three stop riding
    rides, timed, steps = admit([80], keen=False)  # a chooser that would draft nothing
    assert (rides, timed, steps) == (10, 0, 10)  # wants no timing: every chunk rides


def test_a_stall_learns_nothing_from_one_off_work_and_keeps_under_a_small_chunk() -> None:
    """A step whose calls grew the cache (the runner's one_offs moved) teaches the pacing
    nothing: its time is no chunk's; and a prefill_chunk under PACED_MIN stays the most a
    step feeds."""
    executor = toy_executor("none")
    executor.target.one_offs = 0
    score, now, calls = executor.target.score, [0.0], []

    def timed(tokens, last_only=False):
        n = sum(len(t) for t in tokens)
        if last_only:
            calls.append(n)
            executor.target.one_offs += 1  # every prompt call grows the cache here
        now[0] += 0.010 + 0.002 * n if last_only else 0.020
        return score(tokens, last_only)

    executor.target.score = timed
    for chunk, want in ((64, {4}), (2, {2})):
        scheduler = Scheduler(executor, slots=2, prefill_chunk=chunk, prefill_stall=2.0)
        scheduler.clock = lambda: now[0]
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=60, ignore_eos=True)
        running = scheduler.submit([1, 2], params)
        while not running.token_ids:
            scheduler.step()
        ticket = scheduler.submit([(3 * i) % 20 + 1 for i in range(40)], params)
        calls.clear()
        while not ticket.token_ids:
            scheduler.step()
        assert set(calls) == want and scheduler._paced is None, (chunk, calls)
        scheduler.cancel(running)
        scheduler.cancel(ticket)
        scheduler.run_until_idle()


def test_a_stall_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_stall"):
        Scheduler(toy_executor("none"), slots=2, prefill_stall=0.0)


def test_a_draft_model_takes_the_prompt_in_chunks_as_the_target_does() -> None:
    """Chunks of 2 beside a decoding stream: the draft model's cache takes each chunk the
    target took, never the whole prompt in one call, and the request's output is the one it
    gets alone (a seeded sample through the draft's q: its cache must hold the prompt)."""
    executor = toy_executor("draft_model")
    draft = executor.proposer.runner
    score, fed, admitting = draft.score, [], []

    def counted(tokens, last_only=False):
        if admitting and not admitting[0].token_ids and tokens[1]:  # slot 1, until its
            fed.append(len(tokens[1]))  # first token
        return score(tokens, last_only)

    draft.score = counted
    scheduler = Scheduler(executor, slots=2, prefill_chunk=2)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    running = scheduler.submit([1, 2], params.model_copy(update={"max_tokens": 60}))
    while not running.token_ids:
        scheduler.step()
    prompt = [(3 * i) % 20 + 1 for i in range(9)]
    ticket = scheduler.submit(prompt, params)
    admitting.append(ticket)
    while not ticket.token_ids:
        scheduler.step()
    assert fed == [2, 2, 2, 2, 1]  # 9 tokens, as the target took them (no whole prompt)
    scheduler.run_until_idle()
    assert ticket.token_ids == toy_executor("draft_model").generate([prompt], params
                                                                     )[0].token_ids
    scheduler.cancel(running)
    scheduler.run_until_idle()


def test_a_draft_chunk_that_fails_ends_its_request_alone() -> None:
    """The draft model's own chunk raises (a prompt that breaks the draft): that request ends
    with "error" and the draft's row is emptied; a stream decoding beside it goes on, and the
    next request in the slot gets the output it gets alone."""
    class Breaks(ToyRunner):  # the draft fails on one chunk of one prompt: [21, 5]
        def score(self, tokens, last_only=False):
            if any(list(row) == [Poisoned.POISON, 5] for row in tokens):
                raise ValueError("this prompt breaks the model")
            return super().score(tokens, last_only)

    proposer = DraftModelProposer(Breaks(DRAFT))
    executor = SpecExecutor(ToyRunner(TARGET), proposer, 3)
    scheduler = Scheduler(executor, slots=2, prefill_chunk=2)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)
    running = scheduler.submit([1, 2], params.model_copy(update={"max_tokens": 40}))
    while not running.token_ids:
        scheduler.step()
    bad = scheduler.submit([3, 4, Poisoned.POISON, 5, 6], params)
    while not bad.done.is_set():
        scheduler.step()
    assert bad.finish_reason == "error" and bad.error == "ValueError: this prompt breaks the model"
    assert proposer.runner.lengths()[1] == 0 and proposer._valid[1] == 0
    after = scheduler.submit([5, 6, 7, 8, 9], params)
    scheduler.run_until_idle()
    assert running.finish_reason == "length" and len(running.token_ids) == 40
    reference = SpecExecutor(ToyRunner(TARGET), DraftModelProposer(ToyRunner(DRAFT)), 3)
    assert after.token_ids == reference.generate([[5, 6, 7, 8, 9]], params)[0].token_ids
    assert scheduler.error is None


def test_sampling_stays_exact_with_chunked_admissions_in_flight() -> None:
    """Chi-square against the exact continuation probabilities: 2,000 seeded requests of a
    7-token prompt (order-3 target, a sampling draft model, D = 3, T = 0.9), one a step,
    through 4 slots that admit prompts in chunks priced by their position while the other
    slots verify (4 tokens a step at a context of 4: chunks of 4, 2 and 1; a 60-token
    request, not counted, keeps a stream decoding). Power: a prefill whose
    chunks forget the ones before (zeros in their place) fails the same test."""
    from conftest import continuation_probs

    target = MarkovLM(vocab_size=6, order=3, seed=11)
    prompt = [1, 4, 2, 5, 3, 1, 2]
    params = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True)
    exact = continuation_probs(target, prompt, 3, params)

    class Amnesia(ToyRunner):
        def score(self, tokens, last_only=False):
            if last_only and len(self._seqs) == len(tokens):  # a prompt chunk: the row
                for b, t in enumerate(tokens):  # forgets its earlier chunks (zeros where
                    if t:  # they were)
                        self._seqs[b] = [0] * len(self._seqs[b])
            return super().score(tokens, last_only)

    chunked_beside_rounds = [0]

    def pvalue(runner: ToyRunner) -> float:
        fed, score = collections.Counter(), runner.score

        def sized(tokens, last_only=False):  # the prompt calls' sizes
            if last_only:
                fed.update(len(t) for t in tokens if t)
            return score(tokens, last_only)

        runner.score = sized
        draft = DraftModelProposer(ToyRunner(target.diverged(0.5, seed=12)))
        scheduler = Scheduler(SpecExecutor(runner, draft, 3), slots=4, prefill_chunk=4,
                              max_waiting=2000)
        scheduler.prefill_context = 4.0  # (a target's attention_context)
        chunked_beside_rounds[0] = 0
        prefill = scheduler._prefill

        def counted(budget, chunk, *rest):  # steps whose chunks ran while others decoded
            chunked_beside_rounds[0] += chunk is not None and bool(scheduler._prefilling())
            return prefill(budget, chunk, *rest)

        scheduler._prefill = counted
        tickets, long = [], params.model_copy(update={"max_tokens": 60})
        for i in range(2000):  # one arrival a step, and a long request always decoding
            if i % 40 == 0:  # (its output is not counted): prompts come in chunks
                scheduler.submit([5, 5], long.model_copy(update={"seed": -i}))
            tickets.append(scheduler.submit(prompt, params.model_copy(update={"seed": i})))
            scheduler.step()
        scheduler.run_until_idle()
        assert chunked_beside_rounds[0] > 1500
        assert fed[1] > 300  # priced tails: unpriced, a 7-token prompt is 4 + 3, never 1
        return continuation_pvalue(tickets, exact)

    assert pvalue(ToyRunner(target)) > 1e-3
    assert pvalue(Amnesia(target)) < 1e-3
