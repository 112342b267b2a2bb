"""Suffix decoding: the trie (counts, match, walk, eviction), the proposer (request and global
tries, and the scope that keeps requests apart), exactness and greedy identity through the
executor for both scopes, and release() under the scheduler."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
from broken_verifiers import naive_resample_verify
from exactness import ALPHA, PROMPT, continuation_pvalue

import trtspec.spec.executor
from trtspec.build.recipe import Recipe, Suffix
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.serve.scheduler import Scheduler
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose import make_proposer
from trtspec.spec.propose.suffix import SuffixProposer, SuffixTrie
from trtspec.spec.sample.probs import SamplingParams


def substrings(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path of the trie with its count."""
    found: dict[tuple[int, ...], int] = {}
    stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in trie.children(node):
            found[path + (token,)] = trie.count[child]
            stack.append((child, path + (token,)))
    return found


def brute_force(texts: Sequence[Sequence[int]], max_depth: int) -> dict[tuple[int, ...], int]:
    return dict(Counter(tuple(t[i: j]) for t in texts for i in range(len(t))
                        for j in range(i + 1, min(i + max_depth, len(t)) + 1)))


def trie_of(*texts: Sequence[int], max_depth: int = 24) -> SuffixTrie:
    trie = SuffixTrie(max_depth)
    for text in texts:
        trie.add(text)
    return trie


def draft(tokens: Sequence[int], n: int = 8, **knobs) -> list[int]:
    trie = SuffixTrie(knobs.pop("max_depth", 24))
    trie.extend(tokens)
    knobs = {"max_spec_factor": 1.0, "min_token_prob": 0.1} | knobs
    return trie.speculate(tokens, n, suffixes=trie.active, **knobs)[0]


# ---- the trie ----------------------------------------------------------------------------------

@pytest.mark.parametrize("max_depth", [2, 3, 5, 24])
def test_every_substring_up_to_max_depth_is_counted(max_depth: int) -> None:
    rng = random.Random(max_depth)
    texts = [[rng.randrange(4) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    streamed = SuffixTrie(max_depth)
    for token in texts[0]:  # one token at a time, as propose syncs a request
        streamed.extend([token])
    assert substrings(streamed) == brute_force(texts[:1], max_depth)
    whole = trie_of(*texts, max_depth=max_depth)
    assert substrings(whole) == brute_force(texts, max_depth)
    assert whole.count[0] == sum(map(len, texts)) and whole.nodes == len(substrings(whole)) + 1


def test_counts_on_a_small_text() -> None:
    trie = trie_of([1, 2, 3, 1, 2], max_depth=4)
    assert trie.count[trie.find([1, 2])] == 2 and trie.count[trie.find([1, 2, 3])] == 1
    assert trie.find([1, 2, 3, 1, 2]) is None  # longer than max_depth
    assert trie.find([2, 1]) is None


def test_the_longest_suffix_with_a_continuation_is_matched() -> None:
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    trie = SuffixTrie()
    trie.extend(tokens)
    node, length = trie.match(tokens, trie.active)
    assert length == 3 and node == trie.find([1, 2, 3])  # not "2 3", which also occurred
    assert trie.match(tokens) == (node, length)  # looked up instead of the active nodes
    assert draft(tokens, 1) == [9]
    assert trie.match([4, 4]) == (0, 0) and draft([5, 6, 7]) == []


def test_the_walk_takes_the_most_frequent_child_smaller_id_on_a_tie() -> None:
    assert draft([1, 5, 1, 6, 1, 6, 1], 1) == [6]  # "1 6" twice, "1 5" once
    assert draft([1, 6, 1, 5, 1], 1) == [5]  # a tie: the smaller id


def test_min_token_prob_stops_the_walk() -> None:
    # "4" occurs 4 times (the last with nothing after it), "4 1" twice: 1 has probability 2/4;
    # then "4 1 2" and "4 1 3" once each: 2 (the smaller id) has 0.5 × 1/2, and so on at 0.25
    tokens = [4, 1, 2, 4, 1, 3, 4, 9, 4]
    trie = SuffixTrie()
    trie.extend(tokens)
    assert trie.speculate(tokens, 8, 4.0, 0.6, trie.active) == ([], 0.0)
    assert trie.speculate(tokens, 8, 4.0, 0.5, trie.active) == ([1], 0.5)
    assert trie.speculate(tokens, 8, 4.0, 0.3, trie.active) == ([1], 0.5)
    assert trie.speculate(tokens, 8, 4.0, 0.2, trie.active) == ([1, 2, 4, 1], 1.25)


def test_the_draft_follows_the_match_length_and_draft_len_caps_it() -> None:
    story = list(range(10, 30))
    assert draft(story + [0, 10], 8) == [11]  # a match of 1: ⌈1.0 × 1⌉ = 1 token
    assert draft(story + [0, 10, 11, 12], 8) == [13, 14, 15]  # a match of 3: 3 tokens
    assert draft(story + [0, 10, 11], 8, max_spec_factor=2.0) == [12, 13, 14, 15]
    assert draft(story + [0, 10], 8, max_spec_factor=0.1) == [11]  # at least one
    assert draft(story + [0, *range(10, 18)], 2) == [18, 19]  # draft_len caps it


def test_the_walk_goes_on_past_max_depth() -> None:
    story = list(range(10, 30))
    assert draft(story + [0, *range(10, 14)], 12, max_depth=5, max_spec_factor=4.0) == \
        list(range(14, 26))


# ---- the global trie and its eviction ----------------------------------------------------------

def ctx(*tokens: int) -> list[list[int]]:
    return [list(tokens)]


def propose(proposer: SuffixProposer, *tokens: int, n: int = 4) -> list[int]:
    """Row 0's draft after ``tokens``."""
    out = proposer.propose([list(tokens)], [n], [SamplingParams()], [None])
    assert out.probs is None  # point masses
    return out.token_ids[0, : int(out.num_draft[0])].tolist()


@pytest.mark.parametrize("global_tokens", [65536, 0])
def test_the_global_trie_proposes_what_an_earlier_request_wrote(global_tokens: int) -> None:
    proposer = SuffixProposer(global_tokens=global_tokens)
    proposer.start([[5]])
    assert propose(proposer, 5, 7, 8, 9, 10, 11) == []  # syncs row 0: nothing repeats
    proposer.start([[1, 7, 8]])  # a new batch: the old one's output goes to the global trie
    if global_tokens:
        assert list(proposer.finished) == [[7, 8, 9, 10, 11]]
        assert propose(proposer, 1, 7, 8) == [9, 10]  # match "7 8": 2 tokens
    else:
        assert proposer.global_trie.nodes == 1 and propose(proposer, 1, 7, 8) == []


@pytest.mark.parametrize("scope", ["request", "server"])
def test_scope_request_keeps_one_requests_text_from_anothers_drafts(scope: str) -> None:
    proposer = SuffixProposer(scope=scope)
    proposer.start([[5]])
    assert propose(proposer, 5, 7, 8, 9, 10, 11) == []  # the first request's text
    proposer.start([[1, 7, 8]])  # a second request, which the first one's output would predict
    if scope == "server":
        assert propose(proposer, 1, 7, 8) == [9, 10]
        return
    assert proposer.global_trie is None and not proposer.finished and proposer.global_size == 0
    assert propose(proposer, 1, 7, 8) == []
    assert propose(proposer, 1, 7, 8, 3, 1, 7) == [8, 3]  # its own text still drafts
    proposer.remember([1, 2, 3])
    proposer.forget()
    assert proposer.global_trie is None and not proposer.finished


def test_describe_says_whether_text_is_shared_across_clients() -> None:
    assert SuffixProposer(scope="request").describe() == \
        "suffix tree: per request (no text is shared across requests)"
    assert SuffixProposer(global_tokens=4096).describe() == \
        "suffix tree: server-wide, ≤ 4096 tokens of finished outputs, shared across clients"
    assert SuffixProposer(global_tokens=0).describe().startswith("suffix tree: per request")
    with pytest.raises(ValueError, match="scope request or server"):
        SuffixProposer(scope="tenant")  # type: ignore[arg-type]


def test_eviction_is_fifo_and_leaves_the_trie_of_the_remaining_outputs() -> None:
    rng = random.Random(0)
    budget, depth = 100, 6
    proposer = SuffixProposer(max_depth=depth, global_tokens=budget)
    outputs = [[rng.randrange(5) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    peak = 0
    for i, output in enumerate(outputs):
        proposer.remember(output)
        kept = list(proposer.finished)
        assert kept == outputs[i - len(kept) + 1: i + 1]  # the newest ones, oldest first
        assert proposer.global_size == sum(map(len, kept)) <= budget
        assert i == len(kept) - 1 or proposer.global_size + len(outputs[i - len(kept)]) > budget
        rebuilt = trie_of(*kept, max_depth=depth)
        assert substrings(proposer.global_trie) == substrings(rebuilt)
        assert proposer.global_trie.nodes == rebuilt.nodes <= 1 + budget * depth
        peak = max(peak, len(proposer.global_trie.count))
    assert peak <= 1 + 2 * budget * depth  # deleted nodes are reused: memory stays bounded
    long = SuffixProposer(global_tokens=10)
    long.remember(list(range(25)))
    assert list(long.finished) == [list(range(15, 25))]  # its last global_tokens tokens
    with pytest.raises(ValueError, match="not inserted"):
        trie_of([1, 2]).add([3], -1)


# ---- through the executor ----------------------------------------------------------------------

def suffix_executor(target: MarkovLM, d: int, clip: bool = True, warm: int = 0,
                    scope: str = "server", **sampling) -> SpecExecutor:
    """A suffix executor whose global trie (scope server) holds ``warm`` earlier outputs of
    PROMPT."""
    executor = SpecExecutor(ToyRunner(target), SuffixProposer(max_depth=8, scope=scope), d,
                            clip_draft=clip)
    executor.generate([PROMPT] * warm, [SamplingParams(max_tokens=12, seed=10**6 + i,
                                                       **sampling) for i in range(warm)])
    return executor


@pytest.mark.parametrize("scope", ["server", "request"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_p": 0.9}])
def test_four_token_continuations_match_target_exactly(sampling: dict, scope: str) -> None:
    """V = 4: 256 sequences. With 300 earlier outputs in the global trie nearly every round
    drafts (up to D = 3), and about 6 in 10 drafts are rejected; with scope request (the 300
    leave nothing) a request's own repeats still draft about 2 tokens per request."""
    target = MarkovLM(vocab_size=4, order=2, seed=3)
    executor = suffix_executor(target, 3, clip=False, warm=300, scope=scope, **sampling)
    check = executor.generate([PROMPT] * 200, [SamplingParams(max_tokens=4, seed=i, **sampling)
                                               for i in range(200)])
    proposed = sum(c.stats.proposed_tokens for c in check)
    accepted = sum(c.stats.accepted_draft_tokens for c in check)
    assert proposed > 400 and 0.2 * proposed < accepted < 0.8 * proposed
    pval = continuation_pvalue(executor, target, 4, 10_000, **sampling)
    assert pval > ALPHA, f"{sampling}: p-value {pval:.2e}"


def test_power_suffix_drafts_with_a_broken_verifier_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    target = MarkovLM(vocab_size=4, order=2, seed=3)
    executor = suffix_executor(target, 3, clip=False, warm=300)
    assert continuation_pvalue(executor, target, 4, 8_000) < ALPHA


@pytest.mark.parametrize("scope", ["server", "request"])
def test_greedy_spec_equals_plain_greedy(scope: str) -> None:
    target = MarkovLM(vocab_size=16, order=2, seed=5, eos_token_id=15)
    prompts = [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10], [11, 12], [1, 2, 1, 2, 1, 2]]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = [c.token_ids for c in SpecExecutor(ToyRunner(target)).generate(prompts, params)]
    for d in (1, 3, 6):
        executor = suffix_executor(target, d, scope=scope)
        accepted = 0
        for _ in range(2):  # the second time, a global trie holds the first time's outputs
            for prompt, reference in zip(prompts, plain, strict=True):
                out = executor.generate([prompt], params)[0]
                assert out.token_ids == reference, (d, prompt)
                accepted += out.stats.accepted_draft_tokens
        assert accepted > (50 if scope == "server" else 20)  # request: its own repeats only


def test_release_feeds_the_global_trie_under_the_scheduler() -> None:
    target = MarkovLM(vocab_size=24, order=2, seed=5)
    proposer = SuffixProposer()
    scheduler = Scheduler(SpecExecutor(ToyRunner(target), proposer, 3), slots=2)
    tickets = [scheduler.submit([1 + i, 2 + i], SamplingParams(seed=i, max_tokens=6 + i))
               for i in range(5)]
    scheduler.run_until_idle()
    assert proposer.rows == [None, None]  # every slot released
    assert len(proposer.finished) == len(tickets)
    for stored in proposer.finished:  # what propose saw of an output: all but its last round
        assert any(t.token_ids[: len(stored)] == stored for t in tickets)
    assert proposer.global_size == sum(map(len, proposer.finished))
    longest = max(proposer.finished, key=len)
    assert len(longest) >= 3
    proposer.admit(0, [0])
    assert len(propose(proposer, 0, *longest[:2], n=1)) == 1  # an earlier output's "a b"


@pytest.mark.parametrize("scope", ["request", "server"])
def test_with_scope_request_earlier_clients_leave_no_trace_in_a_request(scope: str) -> None:
    """A seeded sampled request after other clients' requests: with scope request its tokens
    and its speculation counters (hence its rounds, hence its latency) are those it has on a
    fresh server; with scope server the others' outputs change its drafts."""
    target = MarkovLM(vocab_size=8, order=2, seed=3)
    probe = SamplingParams(temperature=0.8, seed=7, max_tokens=40)

    def run(others: int) -> tuple[list[int], int, int]:
        executor = suffix_executor(target, 4, warm=others, scope=scope, temperature=0.8)
        out = executor.generate([PROMPT], probe)[0]
        return out.token_ids, out.stats.proposed_tokens, out.stats.accepted_draft_tokens

    alone, after = run(0), run(40)
    if scope == "request":
        assert after == alone
    else:
        assert after[1:] != alone[1:]


# ---- recipe and factory ------------------------------------------------------------------------

def recipe(backend: dict, **method) -> Recipe:
    return Recipe.model_validate({
        "name": "r", "target": {"model": "m"}, "methods": [{"method": "suffix", **method}],
        "backend": backend})


def test_recipe_method_and_factory() -> None:
    r = recipe({"kind": "torch"}, max_depth=12, global_tokens=0)
    m = r.methods[0]
    assert isinstance(m, Suffix) and m.max_spec_factor == 1.0 and m.min_token_prob == 0.1
    assert m.scope == "server"  # the default: one tenant's acceptance, as evals measure it
    assert set(r.method_digests()) == {"suffix"}
    proposer = make_proposer(m)
    assert isinstance(proposer, SuffixProposer)
    assert (proposer.max_depth, proposer.global_tokens, proposer.scope) == (12, 0, "server")
    isolated = make_proposer(recipe({"kind": "torch"}, scope="request").methods[0])
    assert isinstance(isolated, SuffixProposer) and isolated.scope == "request"
    assert isolated.global_trie is None
    with pytest.raises(ValueError, match=r"set backend\.mode: drafter"):
        recipe({"kind": "trtllm"})  # TensorRT-LLM has no suffix drafting of its own
    assert recipe({"kind": "trtllm", "workflow": "pytorch", "mode": "drafter"}).methods[0].method \
        == "suffix"
    with pytest.raises(ValueError, match="min_token_prob"):
        recipe({"kind": "torch"}, min_token_prob=1.5)
    with pytest.raises(ValueError, match="scope"):
        recipe({"kind": "torch"}, scope="tenant")
