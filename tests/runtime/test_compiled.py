"""CompiledRunner: the same logits as transformers (eager and compiled), greedy identity on the
demo model, exact rollback and admission, one warning and no crash when compiling fails."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from trtspec.runtime import admit_row
from trtspec.runtime.compiled import CompiledRunner
from trtspec.runtime.hf import HFRunner, layer_skip_view
from trtspec.runtime.kinds import make_runner
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.propose.layer_skip import LayerSkipProposer
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.sample.probs import SamplingParams

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("inductor")


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_ragged_rows_score_like_full_forwards(kind: str, cache_dir) -> None:
    model = tiny_llama(vocab=64)
    runner = make_runner(model, kind, cache_dir=cache_dir)
    assert isinstance(runner, CompiledRunner) and runner.compiled == (kind == "compiled")
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    first = runner.prefill(prompts)
    for b, p in enumerate(prompts):
        assert close(first[b], full_logits(model, p)[-1])
    new = [[10, 11, 12], [], [13]]
    logits = runner.score(new)
    assert logits.shape == (3, 3, 64) and runner.lengths() == [8, 1, 4]
    assert close(logits[0], full_logits(model, prompts[0] + new[0])[-3:])
    assert close(logits[2, 0], full_logits(model, prompts[2] + new[2])[-1])
    runner.rollback([6, 1, 4])  # keep one of row 0's three
    again = runner.score([[20, 21], [22], []])
    assert close(again[0, :2], full_logits(model, [1, 2, 3, 4, 5, 10, 20, 21])[-2:])
    assert close(again[1, 0], full_logits(model, [6, 22])[-1])
    fresh = admit_row(runner, 2, [30, 31, 32])  # a new request in row 2, the others untouched
    assert close(fresh, full_logits(model, [30, 31, 32])[-1])
    assert runner.lengths() == [8, 2, 3]
    if kind == "compiled":
        assert runner.shapes  # widths ≤ 16 went through the compiled graph
    with pytest.raises(ValueError, match="cannot roll forward"):
        runner.rollback([100, 0, 0])


def test_qwen2_biases_and_a_growing_cache(cache_dir) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        use_sliding_window=False)).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    runner = CompiledRunner(model, compile=False, capacity=8)
    seq = [1, 2, 3]
    runner.prefill([seq])
    for i in range(600):  # past the first capacity (512)
        runner.score([[i % 48]])
        seq.append(i % 48)
    assert close(runner.score([[5]])[0, 0], full_logits(model, [*seq, 5])[-1])


def test_greedy_speculation_is_identical_to_the_transformers_runner(cache_dir) -> None:
    """ngram and a layer-skip draft (a view sharing the compiled graph) on a tiny model."""
    model = tiny_llama(vocab=64, layers=3, seed=3, logit_scale=4.0)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8], [9, 9, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = SpecExecutor(HFRunner(model)).generate(prompts, params)
    compiled = make_runner(model, "compiled", cache_dir=cache_dir)
    shared = LayerSkipProposer(compiled.view(2, share_cache=True))
    for proposer in (NgramProposer(1, 3), DraftModelProposer(compiled.view(2)), shared):
        got = SpecExecutor(compiled, proposer, draft_len=3).generate(prompts, params)
        assert [c.token_ids for c in got] == [c.token_ids for c in reference]
    hf_draft = HFRunner(layer_skip_view(model, 2))
    assert close(compiled.view(2).prefill([[1, 2]]), hf_draft.prefill([[1, 2]]))


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_a_round_scored_wider_keeps_its_logits_and_greedy_output(kind: str, cache_dir
                                                                 ) -> None:
    """What the executor does when the round cost says a wider call is cheaper: a row's feed
    lengthened by repeats changes no earlier logit, and greedy speculation (ngram, a draft
    model view, a layer-skip view on the target's own cache) stays plain decoding's."""
    from trtspec.spec.round_cost import RoundCost

    model = tiny_llama(vocab=64, layers=3, seed=3, logit_scale=4.0)
    runner = make_runner(model, kind, cache_dir=cache_dir)
    runner.prefill([[1, 2, 3], [4, 5], [6]])
    narrow = runner.score([[10, 11], [12], [13, 14]])
    runner.rollback([3, 2, 1])
    wide = runner.score([[10, 11, 11, 11, 11, 11], [12], [13, 14]])
    assert close(narrow, wide[:, :2])
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8], [9, 9, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = SpecExecutor(HFRunner(model)).generate(prompts, params)
    pads = RoundCost({b: {1: 1.0, 2: 2.0, 3: 2.0, 4: 2.0, 5: 2.0, 6: 1.2} for b in (1, 2, 3)})
    widths: list[int] = []
    target = make_runner(model, kind, cache_dir=cache_dir)
    proposers = (NgramProposer(1, 3), DraftModelProposer(target.view(2)),
                 LayerSkipProposer(target.view(2, share_cache=True)))  # before the spy: a view
    score = target.score  # copies its owner's attributes
    target.score = lambda tokens, last_only=False: (
        widths.append(max(map(len, tokens))), score(tokens, last_only))[1]
    for proposer in proposers:
        got = SpecExecutor(target, proposer, draft_len=3, round_cost=pads).generate(prompts,
                                                                                    params)
        assert [c.token_ids for c in got] == [c.token_ids for c in reference]
    assert 6 in widths and not {2, 3, 4} & set(widths[1:])  # rounds with drafts: 6 wide


def test_a_shared_cache_view_reads_what_the_target_wrote() -> None:
    """The layer-skip view with share_cache scores from the target's keys and values, writes
    only past the target's committed length, and grows the target's cache."""
    model = tiny_llama(vocab=64, layers=3, seed=5)
    target = CompiledRunner(model, compile=False, capacity=8)
    target.prefill([[1, 2, 3], [4, 5]])
    target.score([[6, 7], [8]])  # lengths [5, 3]
    view = target.view(2, share_cache=True)
    view.follow()
    assert view.lengths() == [5, 3]
    got = view.score([[9, 10], [11]])
    skip = layer_skip_view(model, 2)
    assert close(got[0], full_logits(skip, [1, 2, 3, 6, 7, 9, 10])[-2:])
    assert close(got[1, 0], full_logits(skip, [4, 5, 8, 11])[-1])
    after = target.score([[12], [13]])  # over the slots the view wrote
    assert close(after[0, 0], full_logits(model, [1, 2, 3, 6, 7, 12])[-1])
    assert close(after[1, 0], full_logits(model, [4, 5, 8, 13])[-1])
    view.follow()
    long = list(range(20, 60)) * 15  # 600 tokens: past the target's first capacity (512)
    view.score([long, []])
    assert target.keys[0].shape[0] >= 1024
    with pytest.raises(RuntimeError, match="owner does"):
        view.prefill([[1]])
    with pytest.raises(RuntimeError, match="share_cache"):
        target.view(2).follow()


def test_a_layer_skip_draft_on_the_shared_cache_never_catches_up() -> None:
    """After plain steps, a probe feeds the draft one token per row (the last emitted one), and
    its q equals that of a draft with a cache of its own, which must first feed the backlog."""
    model = tiny_llama(vocab=64, layers=3, seed=5)
    target = CompiledRunner(model, compile=False)
    target.prefill([[1, 2, 3]])
    shared = LayerSkipProposer(target.view(2, share_cache=True))
    own = DraftModelProposer(target.view(2))
    widths: dict[int, list[int]] = {id(shared): [], id(own): []}
    for proposer in (shared, own):
        proposer.start([[1, 2, 3]])
        score, log = proposer.runner.score, widths[id(proposer)]
        proposer.runner.score = lambda t, last_only=False, s=score, log=log: (
            log.append(max(map(len, t))) or s(t, last_only))
    tokens = [1, 2, 3, 7]
    for t in (7, 8, 9):  # three plain steps on the target alone
        target.score([[t]])
        tokens.append(t + 1)
    params, drafts = [SamplingParams(temperature=0.0)], []
    for proposer in (shared, own):
        drafts.append(proposer.propose([tokens], [2], params, [torch.Generator()]))
    assert widths[id(shared)] == [1, 1] and widths[id(own)] == [4, 1]
    assert close(drafts[0].probs, drafts[1].probs)
    assert drafts[0].token_ids.tolist() == drafts[1].token_ids.tolist()


def test_compiled_greedy_equals_transformers_on_smollm2(smollm2, cache_dir) -> None:
    prompt = smollm2.tokenizer("The three primary colours are")["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = SpecExecutor(HFRunner(smollm2.model)).generate([prompt], params)[0].token_ids
    runner = make_runner(smollm2.model, "compiled", cache_dir=cache_dir)
    got = SpecExecutor(runner).generate([prompt], params)[0].token_ids
    assert got == want and (1, 1) in runner.shapes
    spec = SpecExecutor(runner, NgramProposer(1, 3), draft_len=4).generate([prompt], params)
    assert spec[0].token_ids == want


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_prepacked_weights_are_the_default_and_score_as_the_model_s_own(kind: str, cache_dir
                                                                        ) -> None:
    """On a CPU every GEMM's weight, the head's included, is prepacked for oneDNN by default;
    the logits are those of the weights as the model has them (prepacked=False) up to float
    rounding, prefill, a verify round and a chunk beside it alike, and the compiled graph is
    used, not an eager fallback. A layer-skip view shares the prepacked weights."""
    model = tiny_llama(vocab=64)
    runs = {}
    for prepacked in (True, False):
        runner = CompiledRunner(model, compile=kind == "compiled", cache_dir=cache_dir,
                                prepacked=prepacked)
        assert runner.prepacked == prepacked and runner._head_w.is_mkldnn == prepacked
        assert all(w.is_mkldnn == prepacked for w in runner._weights[0] if w is not None
                   and w.dim() == 2)
        first = runner.prefill([[1, 2, 3], [4, 5], [6]])
        round_ = runner.score([[7, 8, 9], [10], []])
        pair, last = runner.score_pair([[11], [12], []], 2, [13, 14, 15])
        draft = runner.layer_skip(1)
        draft.follow()
        assert draft._weights[0][1] is runner._weights[0][1]
        drafted = draft.score([[16, 17], [18], []])
        runs[prepacked] = (first, round_, pair, last, drafted)
        assert runner.compiled == (kind == "compiled")
    for a, b in zip(runs[True], runs[False], strict=True):
        assert close(a, b)


def test_prepacking_is_the_default_all_or_none_and_can_be_turned_off(monkeypatch) -> None:
    """Prepacked by default (TRTSPEC_PREPACK unset). One graph serves every layer, so one
    weight that cannot be prepacked (here the head, in float16) leaves all of them as they are,
    with one warning; TRTSPEC_PREPACK=0 turns it off without one."""
    monkeypatch.delenv("TRTSPEC_PREPACK", raising=False)
    assert CompiledRunner(tiny_llama(vocab=64), compile=False).prepacked
    model = tiny_llama(vocab=64)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, 64, bias=False,
                                    dtype=torch.float16)
    said: list[str] = []
    mixed = CompiledRunner(model, compile=False, warn=said.append)
    assert not mixed.prepacked and not mixed._weights[0][1].is_mkldnn
    assert len(said) == 1 and "not prepacked" in said[0] and "float16" in said[0]
    monkeypatch.setenv("TRTSPEC_PREPACK", "0")
    said.clear()
    assert not CompiledRunner(tiny_llama(vocab=64), compile=False, warn=said.append).prepacked
    assert not said


def test_the_runner_says_whether_a_wide_call_attends_packed(monkeypatch) -> None:
    """What a build records beside its cost curve: tiny_llama's 4 query heads over 2 key/value
    heads, on this CPU, attend packed in calls of 2+ tokens a row; with PACK_GQA off, not."""
    from trtspec.runtime import decoder_layer

    assert CompiledRunner(tiny_llama(vocab=64), compile=False).packed_attention
    monkeypatch.setattr(decoder_layer, "PACK_GQA", False)
    assert not CompiledRunner(tiny_llama(vocab=64), compile=False).packed_attention


def test_a_compiler_failure_warns_once_and_runs_eagerly(monkeypatch) -> None:
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("no C++ compiler\nmore detail")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    lines: list[str] = []
    model = tiny_llama(vocab=64)
    runner = CompiledRunner(model, warn=lines.append)
    first = runner.prefill([[1, 2, 3]])
    runner.score([[4]])
    runner.score([[5, 6]])
    assert len(lines) == 1 and "torch.compile failed (RuntimeError: no C++ compiler)" in lines[0]
    assert not runner.compiled and close(first[0], full_logits(model, [1, 2, 3])[-1])
    assert runner.lengths() == [6]


@pytest.mark.parametrize("error", [MemoryError, torch.OutOfMemoryError])
def test_running_out_of_memory_in_a_compiled_call_is_not_a_compiler_failure(
        monkeypatch, error: type[Exception]) -> None:
    """Memory that runs out inside a compiled call is raised to the caller (its request's or
    round's failure, handled there), the call's lengths unchanged; compiling stays on."""
    def short_of_memory(fn, **kw):
        def call(*a, **k):
            raise error("out of memory")
        return call

    monkeypatch.setattr(torch, "compile", short_of_memory)
    lines: list[str] = []
    runner = CompiledRunner(tiny_llama(vocab=64), warn=lines.append)
    with pytest.raises(error):
        runner.prefill([[1, 2, 3]])
    assert runner.compiled and runner.lengths() == [0] and not lines


def test_make_runner_falls_back_for_other_architectures_and_obeys_trtspec_compile(
        monkeypatch) -> None:
    model = tiny_llama(vocab=64)
    monkeypatch.setattr(model.config, "model_type", "gpt_neox")
    lines: list[str] = []
    runner = make_runner(model, "compiled", warn=lines.append)
    assert isinstance(runner, HFRunner)
    assert lines == ["warning: the compiled runner does not support model type 'gpt_neox' "
                     "(compiled: llama, mistral, qwen2); running the transformers runner"]
    monkeypatch.setattr(model.config, "model_type", "llama")
    monkeypatch.setenv("TRTSPEC_COMPILE", "0")
    eager = make_runner(model, "compiled")
    assert isinstance(eager, CompiledRunner) and not eager.compiled
    assert isinstance(make_runner(model, "transformers"), HFRunner)


def test_warm_up_compiles_every_graph_a_batch_can_need(cache_dir) -> None:
    """After warm_up(8), any rows × width of a batch of 8 (ragged, whole or part), any
    round with a prompt's chunk beside it in one call (score_pair), also after the cache grew
    inside a call, and rounds whose longest row attends in a group of its own, runs on graphs
    already compiled: no request waits for the compiler."""
    from torch._dynamo.utils import counters

    model = tiny_llama(vocab=64, layers=2, seed=9)
    runner = make_runner(model, "compiled", cache_dir=cache_dir)
    runner.warm_up(8)
    compiled = counters["stats"]["unique_graphs"]
    runner.prefill([[1, 2, 3]] * 8)
    for feed in ([[4]] * 8, [[5, 6, 7]] + [[]] * 7, [[1] * 9, [2] * 4] + [[3]] * 6,
                 [[]] * 3 + [[4, 5]] * 5, [[6] * 17] + [[]] * 7, [[7]] * 3 + [[]] * 5):
        runner.score(feed)
    for feed, row, chunk in (([[4]] * 3 + [[]] * 5, 3, [1] * 7), ([[4, 5]] * 2 + [[]] * 6, 2,
                                                                   [1] * 12),
                             ([[4]] * 7 + [[]], 7, [1] * 5), ([[4]] + [[]] * 7, 1, [2] * 3),
                             ([[]] * 4 + [[4], [5, 6, 7], [8]] + [[]], 3, [1] * 30)):
        runner.score_pair(feed, row, chunk)  # a round and a prompt's chunk in one call
    runner.score([[1] * 600] + [[]] * 7)  # grows the cache inside the call: its tensors
    runner.score([[4]] * 8)  # stay what the graphs were compiled for
    runner.score_pair([[4]] * 3 + [[]] * 5, 3, [1] * 6)
    runner.split_keys = 64  # row 0 holds 600 tokens more: rounds beside it split
    calls = groups_of(runner)
    for feed in ([[4]] * 8, [[4, 5]] * 8, [[4]] * 2 + [[]] * 6, [[4, 5, 6]] * 3 + [[]] * 5,
                 [[4]] * 3 + [[]] * 5, [[4]] + [[5, 6]] * 7):
        runner.score(feed)  # the set fed once (swapped next time where it must be)
        runner.score(feed)
    assert sum(len(c) == 2 for c in calls) >= 6
    runner.prefill([[1] * 40, [2] * 7] * 4)
    assert counters["stats"]["unique_graphs"] == compiled
    assert runner.compiled
    assert runner.warm_up(1) > 0  # one row: no round beside a chunk to warm up


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_a_chunk_beside_a_round_scores_in_one_call_as_in_two(kind: str, cache_dir) -> None:
    """score_pair: a round over rows 0-2 (widths 1 and 3) and a 9-token chunk of a prompt
    being admitted in row 3 (20 of its tokens in) run as one call over 3 + 1 rows and give
    the logits of the chunk's call and then the round's, the chunk's as one prefill of the
    whole prompt; the cache is left as the two calls leave it (the next call scores alike).
    A chunk whose row is apart from the round's is swapped next to it first; a one-token
    chunk is scored in two calls; a chunk in a row the round feeds is refused; a chunk
    before its prompt's last (``last=False``) gives no logits after it, the round's alike."""
    model = tiny_llama(vocab=64, seed=4)
    prompt = [(7 * i) % 60 + 1 for i in range(29)]

    def fresh(row: int) -> CompiledRunner:
        runner = make_runner(model, kind, cache_dir=cache_dir)
        starts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1], [2], [3]]
        starts[row] = prompt[:20]
        runner.prefill(starts)
        return runner

    for row in (3, 5):
        rnd = [[10], [11, 12, 13], [14], [], [], []]
        two, one = fresh(row), fresh(row)
        feed: list[list[int]] = [[] for _ in rnd]
        feed[row] = prompt[20:]
        last, logits = two.score(feed, last_only=True)[row, 0], two.score(rnd)
        calls = count_rows(one)
        got, got_last = one.score_pair(rnd, row, prompt[20:])
        assert calls == [4] and one.lengths() == two.lengths()
        assert (one.swaps > 0) == (row == 5)
        assert got.shape == logits.shape
        assert all(close(got[b, : len(t)], logits[b, : len(t)]) for b, t in enumerate(rnd) if t)
        assert close(got_last, last) and close(got_last, full_logits(model, prompt)[-1])
        assert close(one.score([[5]] * 6), two.score([[5]] * 6))
    one, two = fresh(3), fresh(3)  # a chunk before its prompt's last: no logits after it
    feed = [[10], [11, 12, 13], [14], [], [], []]
    got, none = one.score_pair(feed, 3, prompt[20:25], last=False)
    assert none is None and close(got, two.score_pair(feed, 3, prompt[20:25])[0])
    assert close(one.score_pair(feed, 3, prompt[25:])[1], full_logits(model, prompt)[-1])
    one = fresh(3)
    calls = count_rows(one)
    one.score_pair([[10], [], [], [], [], []], 3, [7])
    assert calls == [1, 1]  # the chunk's call, then the round's
    with pytest.raises(ValueError, match="fed nothing else"):
        one.score_pair([[10], [], [], [4], [], []], 3, [7, 8])


def test_warm_up_keeps_a_live_cache_and_a_late_compile_is_said(cache_dir) -> None:
    """Warming up another batch size (serve --slots) while rows are live leaves their KV cache
    as it was; a graph compiled after warm-up is counted and said (a request waited)."""
    model = tiny_llama(vocab=64, layers=2, seed=9)
    said: list[str] = []
    runner = make_runner(model, "compiled", cache_dir=cache_dir, warn=said.append)
    runner.warm_up(2, watch=True)  # as a server does
    runner.prefill([[1, 2, 3], [4, 5]])
    runner.score([[6], [7]])
    before = runner.lengths()
    runner.warm_up(3)  # scratch rows, then the live ones back
    assert runner.lengths() == before
    got = runner.score([[8], [9]])[:, 0]
    assert close(got[0], full_logits(model, [1, 2, 3, 6, 8])[-1])
    assert close(got[1], full_logits(model, [4, 5, 7, 9])[-1])
    assert runner.late_compiles == 0 and not said
    torch._dynamo.reset()  # as if warm-up had missed a graph: the next step compiles it
    runner.score([[1], [2]])
    assert runner.late_compiles > 0
    assert any("compiled a graph after warm-up (rows 2, width 1)" in line for line in said)


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_a_prompt_prefilled_in_chunks_gets_the_logits_of_one_prefill(kind: str,
                                                                     cache_dir) -> None:
    """Chunked prefill (the scheduler's admission): a 40-token prompt fed 7 tokens a call in
    row 1, while rows 0 and 2 hold other sequences, ends with the logits one call gives, and
    the next tokens score alike."""
    model = tiny_llama(vocab=64)
    prompt = [(7 * i + 3) % 64 for i in range(40)]
    whole = make_runner(model, kind, cache_dir=cache_dir)
    whole.prefill([[1, 2], [0], [3, 4, 5]])
    one = admit_row(whole, 1, prompt)
    chunked = make_runner(model, kind, cache_dir=cache_dir)
    chunked.prefill([[1, 2], [0], [3, 4, 5]])
    lengths = chunked.lengths()
    lengths[1] = 0
    chunked.rollback(lengths)
    for start in range(0, len(prompt), 7):
        feed = [[], prompt[start: start + 7], []]
        last = chunked.score(feed, last_only=True)[1, 0]
    assert chunked.lengths() == whole.lengths() == [2, 40, 3]
    assert (last - one).abs().max().item() <= 1e-5 and last.argmax() == one.argmax()
    assert close(last, full_logits(model, prompt)[-1])
    after = [[9], [10, 11], [12]]
    assert (chunked.score(after) - whole.score(after)).abs().max().item() <= 1e-5


def test_a_cache_that_cannot_grow_raises_before_it_changes_anything(monkeypatch) -> None:
    """The KV cache is checked before it grows: CacheFull, nothing allocated or written, and
    the runner goes on at the size it had; a long row's memory goes back once it leaves."""
    import trtspec.runtime.compiled as compiled_module
    from trtspec.runtime import CacheFull

    model = tiny_llama(vocab=64, positions=4096)
    runner = CompiledRunner(model, compile=False)
    runner.prefill([[1, 2, 3], [4]])
    monkeypatch.setattr(compiled_module, "free_bytes", lambda device: 10_000)
    before = [k.data_ptr() for k in runner.keys]
    with pytest.raises(CacheFull, match=r"would grow to 1024 tokens a row \(2 rows"):
        runner.score([[5] * 600, []])
    assert runner.lengths() == [3, 1] and [k.data_ptr() for k in runner.keys] == before
    with pytest.raises(CacheFull):  # what admission asks for a long prompt, before any work
        runner.reserve(600)
    assert close(runner.score([[7], [8]])[0, 0], full_logits(model, [1, 2, 3, 7])[-1])
    monkeypatch.undo()
    runner.reserve(1500)  # memory is free again: one growth, to 2048 slots a row
    assert runner.keys[0].shape[0] == 2048
    runner.score([[5] * 1500, []])
    assert runner.keys[0].shape[0] == 2048
    runner.fit_cache()  # the long row is still there: kept
    assert runner.keys[0].shape[0] == 2048
    runner.rollback([4, 2])
    runner.fit_cache(reserved=1500)  # it left, but a prompt that size is coming in: kept
    assert runner.keys[0].shape[0] == 2048
    runner.fit_cache()  # it left: back to the smallest cache
    assert runner.keys[0].shape[0] == 512
    assert close(runner.score([[6], [9]])[1, 0], full_logits(model, [4, 8, 9])[-1])


def count_rows(runner: CompiledRunner) -> list[int]:
    """The rows each of ``runner``'s calls scores from now on (what its layers are run over)."""
    rows: list[int] = []
    layers = runner._layers

    def spy(compiled, first, second):
        rows.append(len(first.rows) + (0 if second is None else len(second.rows)))
        return layers(compiled, first, second)

    runner._layers = spy
    return rows


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_live_rows_are_packed_and_score_like_full_forwards(kind: str, cache_dir) -> None:
    """Rows 0 and 5 of 6 fed twice: the first call scores the range (6 rows: a set fed once
    is not worth a swap), the second swaps row 5's cache next to row 0's and scores 2; every
    row keeps its sequence (logits as one forward of it, by batch row), and a runner that does
    not pack gives the same logits."""
    model = tiny_llama(vocab=64)
    prompts = [[1 + b, 2, 3 + b][: 1 + b % 3] for b in range(6)]
    packed = make_runner(model, kind, cache_dir=cache_dir)
    spread = make_runner(model, kind, cache_dir=cache_dir)
    spread.pack_rows = False
    seqs = [list(p) for p in prompts]
    for runner in (packed, spread):
        runner.prefill(prompts)
    scored = count_rows(packed)
    assert packed.scored_rows([0, 5]) == 2 and spread.scored_rows([0, 5]) == 6
    calls = [[[10, 11]] + [[]] * 4 + [[12]],  # rows 0 and 5: once, scored spread
             [[13]] + [[]] * 4 + [[14, 15]],  # the same rows again: one swap, 2 rows
             [[16]] + [[]] * 4 + [[17]],  # and again: no swap
             [[18]] * 6,  # every row, in whatever order the cache now holds them
             [[]] + [[19]] + [[]] * 2 + [[20]] + [[]]]  # rows 1 and 4: contiguous now
    for feed in calls:
        got, want = packed.score(feed), spread.score(feed)
        for b, tokens in enumerate(feed):
            if tokens:  # (the rows between, scored when not packed, are padding)
                n = len(tokens)
                assert (got[b, :n] - want[b, :n]).abs().max().item() <= 1e-5
                seqs[b] += tokens
                assert close(got[b, :n], full_logits(model, seqs[b])[-n:])
    assert scored == [6, 2, 2, 6, 2]
    assert packed.lengths() == spread.lengths() == [len(s) for s in seqs]
    assert packed.swaps == 1 and spread.swaps == 0  # row 5 went to physical row 1, row 1 to
    assert packed._phys[5] == 1 and packed._phys[1] == 5  # 5, next to row 4's: no more
    packed.rollback([2, 1, 1, 1, 1, 1])
    assert close(packed.score([[]] * 5 + [[21]])[5, 0], full_logits(model, [6, 21])[-1])


def test_packing_keeps_what_a_shared_cache_view_wrote_and_hidden_states_in_row_order() -> None:
    """A layer-skip view on the target's cache packs the target's rows too. A swap keeps what
    the view wrote past the target's length (row 1's draft token, moved while the view still
    reads it); a call that keeps hidden states puts every row back where its batch row is."""
    model = tiny_llama(vocab=64, layers=3, seed=5)
    skip = layer_skip_view(model, 2)
    target = CompiledRunner(model, compile=False)
    target.prefill([[1, 2], [3], [4, 5, 6], [7]])
    view = target.view(2, share_cache=True)
    view.follow()
    view.score([[], [8], [], []])  # row 1 writes past the target's length (a draft step)
    view.score([[9], [], [10], []])  # rows 0 and 2: once, spread
    assert target.swaps == 0
    got = view.score([[11], [], [12], []])  # again: row 2 swaps with row 1, whose draft
    assert target.swaps == 1 and target._phys[1] == 2  # slot moves with it
    assert close(got[0, 0], full_logits(skip, [1, 2, 9, 11])[-1])
    assert close(got[2, 0], full_logits(skip, [4, 5, 6, 10, 12])[-1])
    got = view.score([[], [13], [], []])  # row 1 reads its draft slot where it went
    assert close(got[1, 0], full_logits(skip, [3, 8, 13])[-1])
    view.follow()  # the target decides; the view drops its drafts
    after = target.score([[20], [21], [22], [23]])  # over the slots the view wrote
    for b, seq in enumerate([[1, 2, 20], [3, 21], [4, 5, 6, 22], [7, 23]]):
        assert close(after[b, 0], full_logits(model, seq)[-1])
    target.capture_hidden([0])
    kept = target.score([[24], [], [25], []])
    assert target._phys == [0, 1, 2, 3] and target.hidden_first == 0
    assert target.hidden.shape[0] == 3  # rows 0 … 2, in batch order
    assert close(kept[2, 0], full_logits(model, [4, 5, 6, 22, 25])[-1])


def test_requests_ending_between_others_give_their_greedy_output_alone() -> None:
    """Through the scheduler on 4 slots, requests of different lengths end between running
    ones and new ones take their slots: the runner packs (swaps > 0), a round whose rows the
    call before it fed too scores only them, and every request gets what it gets alone
    (plain and n-gram drafts)."""
    from trtspec.serve.scheduler import Scheduler

    model = tiny_llama(vocab=64, seed=3)
    prompts = [[(5 * i + j) % 60 + 1 for j in range(3 + i % 4)] for i in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 5 * (i % 3), ignore_eos=True)
              for i in range(10)]
    for proposer in (None, NgramProposer(1, 2)):
        alone = [SpecExecutor(CompiledRunner(model, compile=False), proposer and NgramProposer(
            1, 2), 3).generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
        runner = CompiledRunner(model, compile=False)
        fed: list[tuple[int, ...]] = []
        score = runner.score

        def spy(tokens, last_only=False, score=score, fed=fed):
            fed.append(tuple(b for b, t in enumerate(tokens) if t))
            return score(tokens, last_only)

        scheduler = Scheduler(SpecExecutor(runner, proposer, 3), 4, prefill_chunk=2)
        runner.score, scored = spy, count_rows(runner)  # from after the scheduler's prefill
        runner.score_pair = None  # every call through score (chunks beside rounds: below)
        tickets = [scheduler.submit(p, q) for p, q in zip(prompts, params, strict=True)]
        scheduler.run_until_idle()
        assert [t.token_ids for t in tickets] == alone
        fed = [f for f in fed if f]
        assert runner.swaps > 0 and len(fed) == len(scored)
        repeated = [(now, n) for i, (now, n) in enumerate(zip(fed, scored, strict=True))
                    if i and fed[i - 1] == now]  # a round fed the rows the call before fed
        assert repeated and all(n == len(now) for now, n in repeated)


def test_a_gradual_reservation_grows_a_few_layers_a_call(monkeypatch) -> None:
    """reserve(gradual=True) checks memory at once (CacheFull) but copies nothing; each later
    call grows the short tensors spread over the calls as wide as it that still fit the
    capacity (at least one), and the capacity is the smallest layer's until all have grown;
    a call that needs the room at once grows the rest."""
    import trtspec.runtime.compiled as compiled_module
    from trtspec.runtime import CacheFull

    model = tiny_llama(vocab=64, layers=3, positions=4096)  # 6 tensors: keys and values
    runner = CompiledRunner(model, compile=False)
    runner.prefill([[1, 2, 3], [4]])
    monkeypatch.setattr(compiled_module, "free_bytes", lambda device: 10_000)
    with pytest.raises(CacheFull, match="would grow to 2048 tokens a row"):
        runner.reserve(1500, gradual=True)
    monkeypatch.undo()
    runner.reserve(1500, gradual=True)
    sizes = lambda: [t.shape[0] for t in (*runner.keys, *runner.values)]  # noqa: E731
    assert sizes() == [512] * 6
    runner.fit_cache(reserved=1500)  # a growth under way for a prompt coming in: kept
    runner.score([[5], [6]])  # 508 more one-token calls fit in 512: one tensor a call
    assert sizes() == [2048] + [512] * 5
    assert runner.keys[0].shape[0] == 2048 and runner._capacity == 512
    assert close(runner.score([[7], [8]])[0, 0], full_logits(model, [1, 2, 3, 5, 7])[-1])
    assert sizes() == [2048] * 2 + [512] * 4
    chunk = [(5 * i) % 64 for i in range(150)]  # (512 - 5 - 150) // 150 = 2 such calls
    runner.score([chunk, []])  # still fit: the 4 short tensors over 2 calls
    assert sizes() == [2048] * 4 + [512] * 2 and runner._capacity == 512
    got = runner.score([chunk, []])  # one more would fit (455 ≤ 512): kept as a margin
    assert sizes() == [2048] * 6 and runner._capacity == 2048
    assert close(got[0, -1], full_logits(model, [1, 2, 3, 5, 7, *chunk, *chunk])[-1])
    again = CompiledRunner(model, compile=False)
    again.prefill([[1, 2, 3], [4]])
    again.reserve(1500, gradual=True)
    long = [(5 * i) % 64 for i in range(600)]  # needs 640 slots now: everything grows
    got = again.score([long, []])
    assert [t.shape[0] for t in again.keys] == [2048] * 3
    assert close(got[0, -1], full_logits(model, [1, 2, 3, *long])[-1])


def test_a_reservation_that_cannot_be_grown_is_dropped_and_a_half_swap_undone(monkeypatch
                                                                              ) -> None:
    """Memory taken after a gradual reservation: the copy fails, the reservation is dropped
    and the call goes on; a call that needs room it cannot have with the reservation grows
    what it needs; a prompt that left (cancelled) drops its reservation at fit_cache; a swap
    that fails part way leaves every row as it was."""
    import trtspec.runtime.compiled as compiled_module

    model = tiny_llama(vocab=64, layers=3, positions=4096)
    runner = CompiledRunner(model, compile=False)
    runner.prefill([[1, 2, 3], [4]])
    runner.reserve(1500, gradual=True)
    grown = compiled_module._grown
    monkeypatch.setattr(compiled_module, "_grown", lambda t, capacity: (_ for _ in ()).throw(
        torch.OutOfMemoryError("no memory")))
    got = runner.score([[5], [6]])  # the copy fails: dropped, and the call is served
    assert runner._pending == 0 and runner._capacity == 512
    assert close(got[0, 0], full_logits(model, [1, 2, 3, 5])[-1])
    monkeypatch.setattr(compiled_module, "_grown", grown)
    runner.reserve(4000, gradual=True)  # 4096 a row: then a call needs 640 of them now,
    monkeypatch.setattr(compiled_module, "free_bytes",  # and only that fits
                        lambda device: 2 * 6 * 1024 * runner.keys[0][0].numel() * 4)
    long = [(5 * i) % 64 for i in range(600)]
    runner.score([long, []])
    assert runner._pending == 0 and runner._capacity == 1024
    monkeypatch.undo()
    runner.rollback([4, 2])
    runner.fit_cache()  # back to the smallest
    runner.reserve(1500, gradual=True)
    runner.score([[7], [8]])  # part grown, then its prompt is cancelled: fit_cache drops it
    runner.fit_cache(reserved=0)
    assert runner._pending == 0
    assert [t.shape[0] for t in (*runner.keys, *runner.values)] == [512] * 6  # and the
    before = [t.clone() for t in (*runner.keys, *runner.values)]
    phys = list(runner._phys)
    calls = []  # a copy that fails on the third tensor
    real = torch.Tensor.__setitem__

    def setitem(self, index, value):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("copy failed")
        return real(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)
    with pytest.raises(RuntimeError, match="copy failed"):
        runner._swap(0, 1)
    monkeypatch.undo()
    assert runner._phys == phys
    assert all(torch.equal(a, b) for a, b in zip(before, (*runner.keys, *runner.values),
                                                 strict=True))


def test_attention_context_is_where_a_token_s_attention_costs_its_projections(monkeypatch
                                                                            ) -> None:
    """tiny_llama's layer: q|k|v 32·64 + o 32·32 + gate|up 32·128 + down 64·32 = 9,216
    weights, 2 FLOPs each a token (18,432); a key attended costs 4·Hq·d = 4·4·8 = 128, so
    FLOP parity is at 144 keys, scaled by the device's ATTENTION_RATE; a device with none,
    or weights not prepacked (the rate was measured prepacked), is not priced (None)."""
    from trtspec.runtime import compiled

    runner = CompiledRunner(tiny_llama(), compile=False)
    monkeypatch.setattr(compiled, "ATTENTION_RATE", {"cpu": 0.5})
    assert runner.prepacked and runner.attention_context == pytest.approx(72.0)
    assert CompiledRunner(tiny_llama(), compile=False, prepacked=False).attention_context \
        is None
    monkeypatch.setattr(compiled, "ATTENTION_RATE", {"cuda": 1.0})
    assert runner.attention_context is None


def groups_of(runner: CompiledRunner) -> list[tuple[int, ...]]:
    """The rows of each group of each of ``runner``'s calls from now on (one group, or two)."""
    calls: list[tuple[int, ...]] = []
    layers = runner._layers

    def spy(compiled, first, second):
        calls.append((len(first.rows),) + (() if second is None else (len(second.rows),)))
        return layers(compiled, first, second)

    runner._layers = spy
    return calls


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_the_longest_row_attends_in_a_group_of_its_own(kind: str, cache_dir) -> None:
    """Three short rows beside a 150-token one: a round over the four scores the longest row
    in a group of its own (one call), where that spares split_keys keys or more, and every
    row keeps the logits of one forward of its sequence (as a runner that never splits gives
    them). A longest row that is not on top of the rows is swapped there once the same rows
    recur (a set fed once is scored as one group); rows of even length are not split, nor
    rows whose hidden states are kept. A layer-skip draft on the target's cache splits alike
    (its logits those of one group), and so does a call for the last positions only."""
    model = tiny_llama(vocab=64, seed=5, positions=256)
    long = [(5 * i) % 60 + 1 for i in range(150)]
    for row in (3, 1):  # the long prompt on top of the rows, or not
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11]]  # row 4: not in the rounds
        prompts[row] = long
        split, whole = (make_runner(model, kind, cache_dir=cache_dir) for _ in range(2))
        split.split_keys, whole.split_keys = 64, 10**9
        seqs = [list(p) for p in prompts]
        for runner in (split, whole):
            runner.prefill(prompts)
        calls = groups_of(split)
        for step in range(3):
            feed = [[20 + step], [21, 22], [23], [24, 25, 26], []]
            got, want = split.score(feed), whole.score(feed)
            for b, tokens in enumerate(feed[:4]):
                n = len(tokens)
                seqs[b] += tokens
                assert (got[b, :n] - want[b, :n]).abs().max().item() <= 1e-5
                assert close(got[b, :n], full_logits(model, seqs[b])[-n:])
        # on top: split from the first call; else the rows recur at the second call: a swap
        assert calls == ([(3, 1)] * 3 if row == 3 else [(4,), (3, 1), (3, 1)])
        assert split.swaps == (row != 3) and split._phys[row] == 3
        assert split.lengths() == whole.lengths() == [len(s) for s in seqs]
        assert close(split.score([[]] * 4 + [[12]])[4, 0], full_logits(model, [11, 12])[-1])
        feed = [[30], [31], [32], [33], []]  # last position only: split alike
        got, want = split.score(feed, last_only=True), whole.score(feed, last_only=True)
        assert split.last_split and close(got[:4], want[:4])
        views = [r.layer_skip(1) for r in (split, whole)]  # a draft on the target's cache
        for view in views:  # (its split_keys its target's; not the target's spy)
            view.__dict__.pop("_layers", None)
            view.follow()
        got, want = (v.score([[34, 35]] * 4 + [[]]) for v in views)
        assert views[0].last_split and not views[1].last_split and close(got[:4], want[:4])
        split.capture_hidden([0])  # hidden states kept (heads): one group, rows in order
        split.rollback(whole.lengths())
        split.score([[36]] * 4 + [[]])
        assert not split.last_split
    even = make_runner(model, kind, cache_dir=cache_dir)
    even.split_keys = 64
    even.prefill([long[:100], long[:90], long[:110]])
    calls = groups_of(even)
    even.score([[1], [2], [3]])  # spans 128 and 128: nothing spared
    assert calls == [(3,)]
