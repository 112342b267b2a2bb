"""Exact speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023), batched.

Glossary — the names used everywhere in trtspec:

* **target** p — the model whose output distribution is kept. ``target_probs[b, i]`` is p at the
  position of draft token i (i < K) and, at i = K, the position after the last draft.
* **draft** q — the proposer's distribution. ``draft_probs=None`` means *point-mass* drafts
  (n-gram, argmax drafts): q is the one-hot of the proposed token.
* **D / num_draft** — draft tokens proposed for a request this round (ragged, ≤ K, padded to K).
* **accepted** — draft token x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), scanning
  left to right; the first rejection ends the scan. ``num_accepted`` counts the kept prefix.
* **recovered token** — at the first rejection (position j), a token sampled from the residual
  norm(max(0, p_j − q_j)). If that residual has no mass (p_j ≤ q_j everywhere, which only numerics
  can reach), it is sampled from p_j instead — never a NaN.
* **bonus token** — when all D drafts are accepted, a token sampled from p_D, for free.
* **emitted** — accepted drafts followed by the one recovered-or-bonus token:
  ``num_emitted = num_accepted + 1``. Their distribution is exactly the target's.
* **greedy** — temperature 0: accept while x_i == argmax p_i, then emit argmax p_j. This is token
  matching, and spec output equals plain greedy decoding.

Randomness: each row draws num_draft[b] + 1 uniforms (one per acceptance test, one for the
recovered/bonus token) from its own generator when a list of generators is given, so a request's
output does not depend on its batch neighbours.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from trtspec.spec.sample.probs import Generators, argmax, sample, uniforms


@dataclass
class VerifyOutput:
    token_ids: torch.Tensor  # [B, K+1] int64: accepted drafts, then recovered/bonus, then -1
    num_accepted: torch.Tensor  # [B] int64, 0..num_draft[b]
    num_emitted: torch.Tensor  # [B] int64, num_accepted + 1
    bonus: torch.Tensor  # [B] bool: the last emitted token is a bonus (every draft accepted)


def verify(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft: torch.Tensor,
    generator: Generators = None,
    greedy: bool | torch.Tensor = False,
) -> VerifyOutput:
    """Accept or reject each request's drafts and emit num_accepted + 1 tokens per request.

    target_probs [B, K+1, V] fp32 p; draft_token_ids [B, K] int (padding anything, e.g. -1);
    draft_probs [B, K, V] q or None (point-mass); num_draft [B] ≤ K; generator: one, one per row,
    or None (global RNG); greedy: one flag, or [B] bool for mixed batches.
    """
    B, K1, _ = target_probs.shape
    K = K1 - 1
    device = target_probs.device
    _check_shapes(target_probs, draft_token_ids, draft_probs, num_draft)
    num_draft = torch.as_tensor(num_draft, dtype=torch.long, device=device)  # [B]
    greedy_rows = torch.as_tensor(greedy, dtype=torch.bool, device=device).expand(B)  # [B]
    rows = torch.arange(B, device=device)  # [B]

    draft_ids = draft_token_ids.to(device=device, dtype=torch.long).clamp(min=0)  # [B, K]
    valid = torch.arange(K, device=device) < num_draft[:, None]  # [B, K]
    p_x = target_probs[:, :K].gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, K] p_i(x_i)
    q_x = (torch.ones_like(p_x) if draft_probs is None
           else draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1))  # [B, K] q_i(x_i)

    any_greedy, all_greedy = bool(greedy_rows.any()), bool(greedy_rows.all())
    if all_greedy:  # no randomness needed
        u = torch.zeros((B, K1), dtype=torch.float64, device=device)
    else:
        u = uniforms((num_draft + 1).tolist(), generator, device)  # [B, ≤K+1]
        u = torch.nn.functional.pad(u, (0, K1 - u.shape[1]))  # [B, K+1]

    # u < p/q written as u·q < p: no division, q(x) = 0 accepts iff p(x) > 0.
    accept = (u[:, :K] * q_x < p_x) & valid  # [B, K]
    top = argmax(target_probs) if any_greedy else None  # [B, K+1] argmax p, one pass
    if top is not None:
        accept = torch.where(greedy_rows[:, None], (draft_ids == top[:, :K]) & valid, accept)
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B]
    rejected = num_accepted < num_draft  # [B]

    if all_greedy:
        final = top[rows, num_accepted]  # [B]
    else:
        flat_p = target_probs.reshape(B * K1, -1)  # [B·(K+1), V]; row gathers are memcpys
        dist = torch.index_select(flat_p, 0, rows * K1 + num_accepted,
                                  out=_scratch("dist", (B, flat_p.shape[1]), flat_p))  # [B, V]
        redo = (rejected & ~greedy_rows).nonzero().squeeze(-1)  # [R] rows needing a residual
        if len(redo):
            j = num_accepted[redo]  # [R]
            residual = torch.index_select(dist, 0, redo, out=_scratch(
                "residual", (len(redo), dist.shape[1]), dist))  # [R, V]
            if draft_probs is None:  # point mass: residual = p with the rejected token removed
                residual.scatter_(-1, draft_ids[redo, j][:, None], 0.0)
            else:
                q_j = draft_probs.reshape(B * K, -1).index_select(0, redo * K + j)  # [R, V]
                residual.sub_(q_j).clamp_(min=0.0)
            has_mass = residual.sum(-1) > 0  # [R]; no mass → keep p (never NaN)
            if bool(has_mass.all()):
                dist.index_copy_(0, redo, residual)
            else:
                dist.index_copy_(0, redo[has_mass], residual[has_mass])
        final = sample(dist, u[rows, num_draft])  # [B] u: the row's last draw
        if top is not None:
            final = torch.where(greedy_rows, top[rows, num_accepted], final)

    positions = torch.arange(K1, device=device)  # [K+1]
    token_ids = torch.full((B, K1), -1, dtype=torch.long, device=device)
    token_ids[:, :K] = torch.where(positions[:K] < num_accepted[:, None], draft_ids, -1)
    token_ids[rows, num_accepted] = final
    return VerifyOutput(token_ids, num_accepted, num_accepted + 1, ~rejected)


_local = threading.local()


def _scratch(name: str, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """A reused per-thread work buffer: a fresh [B, V] allocation per call costs more than the
    work itself on CPU (large blocks are mmapped and page-faulted anew)."""
    key = (name, like.device, like.dtype)
    buffers = _local.__dict__.setdefault("buffers", {})
    numel = shape[0] * shape[1]
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, device=like.device, dtype=like.dtype)
    return buf[:numel].view(shape)


def _check_shapes(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                  draft_probs: torch.Tensor | None, num_draft: torch.Tensor) -> None:
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got {tuple(target_probs.shape)}")
    B, K1, V = target_probs.shape
    if tuple(draft_token_ids.shape) != (B, K1 - 1):
        raise ValueError(f"draft_token_ids must be [B, K] = {(B, K1 - 1)}, "
                         f"got {tuple(draft_token_ids.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (B, K1 - 1, V):
        raise ValueError(f"draft_probs must be [B, K, V] = {(B, K1 - 1, V)}, "
                         f"got {tuple(draft_probs.shape)}")
    n = torch.as_tensor(num_draft)
    if tuple(n.shape) != (B,) or (B and (int(n.min()) < 0 or int(n.max()) > K1 - 1)):
        raise ValueError(f"num_draft must be [B] with values in 0..{K1 - 1}")
