"""TensorRT-LLM's own batch behind trtspec's scheduler interface (modes native and drafter),
against the test-only stand-in of TensorRT-LLM 1.2.1 (tests/standin/: its engine thread
batches and streams as the PyTorch executor does, over toy Markov models; nothing measured
here is TensorRT-LLM's)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from conftest import continuation_probs, unflag
from exactness import ALPHA, PROMPT

import trtspec.runtime.trtllm_stream as stream
from trtspec.analysis.gof import chi_square_gof
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.runtime.trtllm import make_drafter, user_provided
from trtspec.runtime.trtllm_stream import LlmArm
from trtspec.serve.llmapi import LlmApiScheduler, make_scheduler
from trtspec.serve.scheduler import Scheduler
from trtspec.spec.propose.by_request import RequestDrafts
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.sample.probs import SamplingParams

TARGET = MarkovLM(vocab_size=6, order=2, seed=43)
EOS = 5
TRIALS = 4_000
SAMPLING = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)
D = 3


def arm(standin, mode: str | None, d: int = D, slots: int = 8, proposer=None) -> LlmArm:
    """An LlmArm on the stand-in over TARGET: plain, native NGram, or trtspec's drafter (its
    n-gram proposer, or ``proposer``)."""
    from tensorrt_llm.llmapi import MODELS, NGramDecodingConfig

    MODELS["toy"] = TARGET
    spec = None
    if mode == "native":
        spec = NGramDecodingConfig(max_draft_len=d, max_matching_ngram_size=2)
    elif mode == "drafter":
        drafts = RequestDrafts(proposer or NgramProposer(1, 2), slots)
        spec = user_provided(make_drafter(drafts, lambda batch: d, d, TARGET.vocab_size), d)
    llm = standin.LLM("toy", max_batch_size=slots, max_input_len=64, speculative_config=spec)
    return LlmArm(llm, "ngram" if mode else "none", d if mode else 0, frozenset({EOS}),
                  TARGET.vocab_size, mode, "NGram" if mode == "native" else None)


def sample(scheduler: LlmApiScheduler, n: int, params: SamplingParams = SAMPLING) -> Counter:
    """n seeded requests of PROMPT through the scheduler, all queued at once."""
    tickets = [scheduler.submit(PROMPT, params.model_copy(update={"seed": i}))
               for i in range(n)]
    scheduler.run_until_idle()
    assert all(t.done.is_set() and t.finish_reason == "length" for t in tickets)
    return Counter(tuple(t.token_ids) for t in tickets)


def pvalue(counts: Counter) -> float:
    exact = continuation_probs(TARGET, PROMPT, 3, SAMPLING)
    seqs = sorted(set(exact) | set(counts))
    return chi_square_gof([counts.get(s, 0) for s in seqs], [exact.get(s, 0.0) for s in seqs])[2]


def draft_model() -> DraftModelProposer:
    """A draft that samples its drafts (q a real distribution, not point masses)."""
    return DraftModelProposer(ToyRunner(TARGET.diverged(0.5, seed=44)))


@pytest.mark.parametrize("mode", ["native", "drafter", "drafter-model"])
def test_streamed_through_the_scheduler_the_output_is_the_targets(trtllm_standin, mode) -> None:
    """8 slots of TensorRT-LLM's batch, requests streamed step by step (the first token, then
    each iteration's kept drafts and one more) and reassembled by the scheduler: chi-square
    against the exact continuation probabilities. Drafts: TensorRT-LLM's n-gram (native),
    trtspec's n-gram and trtspec's draft model, whose q is a distribution (drafter)."""
    proposer = draft_model() if mode == "drafter-model" else None
    scheduler = LlmApiScheduler(arm(trtllm_standin, mode.split("-")[0], proposer=proposer),
                                slots=8, max_waiting=TRIALS)
    counts = sample(scheduler, TRIALS)
    assert pvalue(counts) > ALPHA
    # batched, not one at a time: how full the batch gets in one iteration is the two
    # threads' race (the engine iterates while the scheduler refills; 7 of 8 once beside a
    # loaded suite)
    assert scheduler.arm.llm.max_in_flight > 1
    assert scheduler.arm.llm.accepted_drafts > 0  # drafts were kept: speculation ran
    totals = scheduler.totals
    # the counters are the streamed increments: a step's tokens less one were accepted (a
    # lower bound where max_tokens cut the step: TensorRT-LLM may have accepted more)
    assert 0 < totals.accepted_draft_tokens <= scheduler.arm.llm.accepted_drafts
    assert totals.emitted_tokens == 2 * TRIALS  # the first token is prefill's
    assert totals.emitted_tokens + totals.discarded_tokens == \
        totals.accepted_draft_tokens + totals.verification_rounds
    # what TensorRT-LLM verified is not reported per request: unknown, never made up
    assert totals.proposed_tokens == 0 and totals.rejected_rounds is None


@pytest.mark.parametrize("broken", ["temperature", "flag"])
def test_power_a_broken_boundary_fails_the_same_test(trtllm_standin, monkeypatch, broken
                                                     ) -> None:
    """The power checks of the test above, one per boundary trtspec owns: sampling passed to
    TensorRT-LLM without its temperature (native; it then samples at T = 1), and a drafter
    whose draft logits TensorRT-LLM reshapes with the request's temperature again (the
    greedy-sampling flag left off: q is then not the proposal the drafts came from)."""
    if broken == "temperature":
        right = stream.llm_sampling
        monkeypatch.setattr(stream, "llm_sampling", lambda params, stops: right(
            params.model_copy(update={"temperature": 1.0}), stops))
        made = arm(trtllm_standin, "native")
    else:
        made = arm(trtllm_standin, "drafter", proposer=draft_model())
        drafter = made.llm.args.speculative_config.drafter
        unflag(drafter)
    scheduler = LlmApiScheduler(made, slots=8, max_waiting=TRIALS)
    assert pvalue(sample(scheduler, TRIALS)) < ALPHA


def test_greedy_native_and_drafter_give_plain_decodings_tokens(trtllm_standin) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 1, 2], [4, 4, 1], [2, 3, 2, 3, 2, 3]]

    def outputs(mode):
        scheduler = make_scheduler(arm(trtllm_standin, mode), slots=2)
        tickets = [scheduler.submit(p, greedy) for p in prompts]
        scheduler.run_until_idle()
        return [t.token_ids for t in tickets]

    plain = outputs(None)
    assert all(len(o) == 12 for o in plain)
    assert outputs("native") == plain and outputs("drafter") == plain


def test_a_stop_string_ends_the_request_and_tensorrt_llm_stops_it(trtllm_standin) -> None:
    """The server's text side finds a stop string after the 2nd token: the request ends with
    "stop", keeps 2 tokens, and TensorRT-LLM is asked to end it (the slot is free again)."""
    scheduler = make_scheduler(arm(trtllm_standin, "native", slots=1), slots=1)
    # the stand-in's engine runs ahead of the step thread as TensorRT-LLM's does: a budget it
    # cannot finish before the abort arrives, however loaded the machine (200 raced it)
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    seen: list[int] = []

    def text_side(delta):  # a stop string once two tokens are in
        seen.extend(delta.token_ids)
        return 2 if len(seen) >= 2 else None

    ticket = scheduler.submit([1, 2, 3], params, text_side)
    nxt = scheduler.submit([1, 2], params.model_copy(update={"max_tokens": 3}))
    scheduler.run_until_idle()
    assert ticket.finish_reason == "stop" and ticket.token_ids == seen[:2]
    assert nxt.finish_reason == "length" and len(nxt.token_ids) == 3
    assert scheduler.arm.llm.aborted == [0]  # TensorRT-LLM was told, long before the end


def test_a_stop_found_off_the_step_thread_ends_the_request_at_the_next_step(
        trtllm_standin) -> None:
    """The server's text side runs on the event loop: Slots.stop(ticket, 2) from there ends
    the request at the next step with "stop" and its first 2 tokens, what came after them
    counted as discarded, and TensorRT-LLM is asked to end it."""
    scheduler = make_scheduler(arm(trtllm_standin, "native", slots=1), slots=1)
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)  # as above
    ticket = scheduler.submit([1, 2, 3], params)
    while len(ticket.token_ids) < 4:
        scheduler.step()
    emitted = len(ticket.token_ids)
    scheduler.stop(ticket, 2)
    scheduler.run_until_idle()
    assert ticket.finish_reason == "stop" and len(ticket.token_ids) == 2
    assert ticket.stats.discarded_tokens >= emitted - 2
    assert scheduler.arm.llm.aborted == [0] and scheduler.running == 0


def test_cancel_aborts_in_tensorrt_llm_and_frees_the_slot(trtllm_standin) -> None:
    scheduler = make_scheduler(arm(trtllm_standin, None, slots=1), slots=1)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    long = scheduler.submit([1, 2, 3], params)
    while len(long.token_ids) < 5:
        scheduler.step()
    scheduler.cancel(long)
    short = scheduler.submit([1, 2], params.model_copy(update={"max_tokens": 4}))
    scheduler.run_until_idle()
    assert long.finish_reason == "abort" and long.done.is_set()
    assert short.finish_reason == "length" and short.token_ids
    assert scheduler.running == 0 and scheduler.waiting == 0
    # aborted, not run to its 10,000 tokens (the stand-in's engine thread runs on between
    # steps: under a full suite on 2 cores it once ran 1,746 iterations before the cancel)
    assert scheduler.arm.llm.aborted == [0] and scheduler.arm.llm.iterations < 10_000


def test_a_request_tensorrt_llm_refuses_ends_alone(trtllm_standin) -> None:
    """A prompt past the LLM's max_input_len: TensorRT-LLM refuses it; that request ends with
    an error, the one beside it finishes, and the scheduler keeps taking requests."""
    scheduler = make_scheduler(arm(trtllm_standin, "drafter", slots=2), slots=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    bad = scheduler.submit([1] * 100, params)
    good = scheduler.submit([1, 2, 3], params)
    scheduler.run_until_idle()
    assert bad.finish_reason == "error" and good.finish_reason == "length"
    again = scheduler.submit([3, 2, 1], params)
    scheduler.run_until_idle()
    assert again.finish_reason == "length" and scheduler.error is None


def test_a_request_failing_mid_stream_ends_alone_and_frees_its_slot(trtllm_standin) -> None:
    """A request whose stream fails in TensorRT-LLM after its first token: it ends with an
    error, and its one slot serves the next request (never held for an abort)."""
    made = arm(trtllm_standin, "native", slots=1)
    made.llm.failing.add((4, 4, 4))
    scheduler = make_scheduler(made, slots=1)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    bad = scheduler.submit([4, 4, 4], params)
    good = scheduler.submit([1, 2, 3], params)
    scheduler.run_until_idle()
    assert bad.finish_reason == "error" and len(bad.token_ids) == 1
    assert good.finish_reason == "length" and len(good.token_ids) == 5
    assert scheduler.held() == 0 and scheduler.error is None


def test_eos_ends_with_stop_and_the_stop_token_comes_back(trtllm_standin) -> None:
    scheduler = make_scheduler(arm(trtllm_standin, "native"), slots=4)
    params = SamplingParams(temperature=1.0, max_tokens=64)
    tickets = [scheduler.submit([1, 2, 3], params.model_copy(update={"seed": i}))
               for i in range(16)]
    scheduler.run_until_idle()
    stopped = [t for t in tickets if t.finish_reason == "stop"]
    assert stopped and all(t.token_ids[-1] == EOS and EOS not in t.token_ids[:-1]
                           for t in stopped)
    assert all(t.finish_reason == "length" and len(t.token_ids) == 64 for t in tickets
               if t not in stopped)


def test_what_tensorrt_llm_would_fail_on_is_refused_at_submit(trtllm_standin) -> None:
    """Errors a client made are ValueError at submit (the server's 400), never a failure
    inside TensorRT-LLM: an empty prompt, an id outside the vocabulary, a seed past uint64."""
    scheduler = make_scheduler(arm(trtllm_standin, "native"), slots=2)
    ok = SamplingParams(temperature=0.5, max_tokens=2)
    for prompt, params, why in (([], ok, "empty"), ([1, 99], ok, "outside the vocabulary"),
                                ([1], ok.model_copy(update={"seed": 2**64}), "out of range"),
                                ([1], ok.model_copy(update={"seed": -1}), "out of range")):
        with pytest.raises(ValueError, match=why):
            scheduler.submit(prompt, params)
    assert scheduler.waiting == 0


def test_serve_forever_runs_until_stopped_and_make_scheduler_picks_by_arm(
        trtllm_standin) -> None:
    from trtspec.runtime.toy import ToyRunner
    from trtspec.spec.executor import SpecExecutor

    assert isinstance(make_scheduler(SpecExecutor(ToyRunner(TARGET)), 2), Scheduler)
    scheduler = make_scheduler(arm(trtllm_standin, "drafter"), slots=4)
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.serve_forever, args=(stop,), daemon=True)
    thread.start()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tickets = [scheduler.submit([1, 2, 3], params) for _ in range(6)]
    assert all(t.done.wait(30) for t in tickets)
    stop.set()
    thread.join(10)
    assert not thread.is_alive() and all(len(t.token_ids) == 6 for t in tickets)


@pytest.mark.parametrize("value", ["native", "drafter"])
def test_trtspec_serve_runs_tensorrt_llms_batch_behind_the_openai_api(
        trtllm_build, trtllm_standin, monkeypatch, value: str) -> None:
    """`trtspec serve` on a TensorRT-LLM recipe in mode native / drafter, as the CLI makes it
    (recipe_engine, the default settings): the real openai client, streamed and not, a stop
    sequence, and /metrics counting what ended."""
    from conftest import mode, toy_checkpoint
    from openai import OpenAI
    from tensorrt_llm.llmapi import MODELS
    from test_server import metric, serving

    from trtspec.cli.serve import describe_policy, recipe_engine

    recipe, engines = trtllm_build()
    MODELS["toy/standin-target"] = MarkovLM(vocab_size=32, order=2, seed=5)
    toy_checkpoint(monkeypatch)
    engine = recipe_engine(str(mode(recipe, value)), (), engines, None, None, None, 16, None)
    assert isinstance(engine.scheduler, LlmApiScheduler) and engine.scheduler.slots == 4
    assert "TensorRT-LLM" in describe_policy(engine) or "trtspec drafts" in describe_policy(engine)
    with serving(engine) as url:
        client = OpenAI(base_url=url, api_key="x", max_retries=0)
        done = client.completions.create(model=engine.model, prompt="abcabcabc", max_tokens=6,
                                         temperature=0)
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
        pieces = [c.choices[0].text for c in client.completions.create(
            model=engine.model, prompt="abcabcabc", max_tokens=6, temperature=0, stream=True)]
        assert "".join(pieces) == done.choices[0].text
        one = client.completions.create(model=engine.model, prompt="xyz", max_tokens=1,
                                        temperature=0.7, seed=3)
        assert one.usage.completion_tokens == 1
        text = done.choices[0].text
        cut = client.completions.create(  # long: the stop, found on the event loop, ends it
            model=engine.model, prompt="abcabcabc", max_tokens=1000, temperature=0,
            stop=[text[2:4]], extra_body={"ignore_eos": True})  # (docs/serve.md: a request
        # that ends by itself in the round its stop string was found in counts its own end)
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:2]
        length = metric(url, 'trtspec:request_success_total{finish_reason="length"}')
        stopped = metric(url, 'trtspec:request_success_total{finish_reason="stop"}')
        # the stand-in's engine runs ahead of the server as TensorRT-LLM's does, and under a
        # full suite on 2 cores it once finished the 1,000 tokens (the most this recipe's
        # max_seq_len allows) before the abort arrived: that request then counts its own end
        assert (length, stopped) in ((3, 1), (4, 0))
        assert metric(url, "trtspec:num_requests_running") == 0
