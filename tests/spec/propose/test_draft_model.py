"""DraftModelProposer: returns the q it sampled from, and keeps its cache in step."""

from __future__ import annotations

import torch

from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.sample.probs import SamplingParams, logits_to_probs, make_generator


def test_returned_probs_are_the_distributions_sampled_from() -> None:
    draft = MarkovLM(vocab_size=9, order=2, seed=4)
    runner = ToyRunner(draft)
    proposer = DraftModelProposer(runner)
    prompts = [[1, 2], [3, 4, 5], [6]]
    params = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=0),
              SamplingParams(top_p=0.9)]
    proposer.start(prompts)
    tokens = [[*p, 7] for p in prompts]  # one committed output token each
    out = proposer.propose(tokens, [3, 2, 0], params, [make_generator(i) for i in range(3)])
    assert out.token_ids.shape == (3, 3) and out.num_draft.tolist() == [3, 2, 0]
    assert out.token_ids[1, 2] == -1 and out.token_ids[2].eq(-1).all()
    for b in range(2):
        ctx = list(tokens[b])
        for i in range(int(out.num_draft[b])):
            q = logits_to_probs(draft.next_logits(ctx), params[b])
            assert torch.allclose(out.probs[b, i], q)
            tok = int(out.token_ids[b, i])
            assert q[tok] > 0
            ctx.append(tok)
    # greedy row follows the draft's argmax chain
    assert out.token_ids[1, 0] == int(draft.next_logits(tokens[1]).argmax())
    # cache: committed + all drafts but the last
    assert runner.lengths()[:2] == [len(tokens[0]) + 2, len(tokens[1]) + 1]


def test_observe_rolls_back_to_committed_plus_accepted() -> None:
    runner = ToyRunner(MarkovLM(vocab_size=9, order=2, seed=5))
    proposer = DraftModelProposer(runner)
    proposer.start([[1, 2], [3]])
    tokens = [[1, 2, 8], [3, 8]]
    gens = [make_generator(0), make_generator(1)]
    params = [SamplingParams()] * 2
    out = proposer.propose(tokens, [4, 4], params, gens)
    proposer.observe([1, 4])  # row 0: 1 accepted (+ recovered); row 1: all accepted (+ bonus)
    assert runner.lengths() == [3 + 1, 2 + 3]
    # next round feeds only what the draft has not seen: row 0 the recovered token, row 1 d4+bonus
    nxt = [tokens[0] + [int(out.token_ids[0, 0]), 0],
           tokens[1] + out.token_ids[1].tolist() + [0]]
    proposer.propose(nxt, [2, 2], params, gens)
    assert runner.lengths() == [len(nxt[0]) + 1, len(nxt[1]) + 1]
    assert runner._seqs[0][: len(nxt[0])] == nxt[0]  # the cache holds exactly the committed tokens
