"""Deliberately wrong speculative samplers, for power checks: each must FAIL the exactness tests.

They share verify()'s signature so the same harness (and the executor) can run them.
"""

from __future__ import annotations

import torch

from trtspec.spec.sample.probs import sample, uniforms
from trtspec.spec.sample.verify import VerifyOutput


def _broken(target_probs, draft_token_ids, draft_probs, num_draft, generator, mode: str):
    B, K1, _ = target_probs.shape
    K = K1 - 1
    rows = torch.arange(B)
    num_draft = torch.as_tensor(num_draft, dtype=torch.long)
    ids = draft_token_ids.long().clamp(min=0)
    valid = torch.arange(K) < num_draft[:, None]
    p_x = target_probs[:, :K].gather(-1, ids[..., None]).squeeze(-1)
    q_x = (torch.ones_like(p_x) if draft_probs is None
           else draft_probs.gather(-1, ids[..., None]).squeeze(-1))
    u = uniforms((num_draft + 1).tolist(), generator)
    u = torch.nn.functional.pad(u, (0, K1 - u.shape[1]))
    accept = (p_x >= q_x) if mode == "accept_if_p_ge_q" else (u[:, :K] * q_x < p_x)
    a = (accept & valid).long().cumprod(-1).sum(-1)
    p_j = target_probs[rows, a]
    rejected = a < num_draft
    dist = p_j
    if mode == "accept_if_p_ge_q" and K > 0:  # correct residual, wrong acceptance
        j = a.clamp(max=K - 1)
        q_j = (torch.zeros_like(p_j).scatter_(-1, ids[rows, j][:, None], 1.0)
               if draft_probs is None else draft_probs[rows, j])
        residual = (p_j - q_j).clamp(min=0)
        ok = rejected & (residual.sum(-1) > 0)
        dist = torch.where(ok[:, None], residual, p_j)
    # mode "naive_resample": a rejection retries with the big model, sampling from p (wrong)
    final = sample(dist, u[rows, num_draft])
    token_ids = torch.full((B, K1), -1, dtype=torch.long)
    token_ids[:, :K] = torch.where(torch.arange(K) < a[:, None], ids, -1)
    token_ids[rows, a] = final
    return VerifyOutput(token_ids, a, a + 1, ~rejected)


def naive_resample_verify(target_probs, draft_token_ids, draft_probs, num_draft,
                          generator=None, greedy=False):
    return _broken(target_probs, draft_token_ids, draft_probs, num_draft, generator,
                   "naive_resample")


def accept_if_p_ge_q_verify(target_probs, draft_token_ids, draft_probs, num_draft,
                            generator=None, greedy=False):
    return _broken(target_probs, draft_token_ids, draft_probs, num_draft, generator,
                   "accept_if_p_ge_q")


def exact_match_verify(target_probs, draft_token_ids, draft_probs, num_draft,
                       generator=None, greedy=False):
    """Accept a draft token when it equals the target's most likely token (argmax), as greedy
    speculation does, even at temperature > 0; the first other token (or the bonus) is
    sampled from the target's distribution. Wrong: the argmax is emitted with probability
    q(argmax) + (1 − q(argmax))·p(argmax) > p(argmax)."""
    B, K1, _ = target_probs.shape
    K = K1 - 1
    rows = torch.arange(B)
    num_draft = torch.as_tensor(num_draft, dtype=torch.long)
    ids = draft_token_ids.long().clamp(min=0)
    valid = torch.arange(K) < num_draft[:, None]
    accept = ids == target_probs[:, :K].argmax(-1)
    a = (accept & valid).long().cumprod(-1).sum(-1)
    u = uniforms((num_draft + 1).tolist(), generator)
    final = sample(target_probs[rows, a], u[rows, num_draft])
    token_ids = torch.full((B, K1), -1, dtype=torch.long)
    token_ids[:, :K] = torch.where(torch.arange(K) < a[:, None], ids, -1)
    token_ids[rows, a] = final
    return VerifyOutput(token_ids, a, a + 1, a >= num_draft)


def wrong_past(position: int, broken):
    """A verify() that is ``broken`` only in rounds whose target rows hold more than
    ``position`` tokens (read from the target the executor verifies for, via the stack: verify
    has no positions of its own), and right below: what an audit of short prompts alone never
    sees."""
    import inspect

    from trtspec.spec.sample.verify import verify as right

    def verify(*args, **kwargs):
        caller = inspect.currentframe().f_back
        executor = caller.f_locals.get("self")
        lengths = executor.target.lengths() if executor is not None else [0]
        return (broken if max(lengths) > position else right)(*args, **kwargs)

    return verify
