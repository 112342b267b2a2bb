"""TorchSampler's draft verification as TensorRT-LLM 1.2.1 documents and implements it
(_torch/pyexecutor/sampler.py ``process_draft_tokens``, sampling_utils.py
``get_rejected_indices`` / ``sample_rejected``), written here from that description, not from
trtspec's verifier, so a test through it is an independent check:

* greedy requests, and sampled requests without ``py_draft_logits``: each draft is kept while
  it equals the token the target samples (argmax when greedy) at its position;
* sampled requests with ``py_draft_logits``: p = the target's probabilities after the request's
  temperature, top-k and top-p; q = softmax(draft logits) when
  ``py_draft_use_greedy_sampling`` is set, else the request's strategy applied to the draft
  logits; draft x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first
  rejection a token is drawn from relu(p_j − q_j); when all are kept, one from p_D (bonus).
"""

from __future__ import annotations

from typing import Any

import torch


def strategy(request: Any) -> tuple[bool, float, int, float]:
    """(greedy, temperature, top_k, top_p) from the request's sampling_config lists."""
    config = request.sampling_config

    def first(name: str) -> Any:
        value = getattr(config, name)
        return None if value is None else value[0]

    t, k, p = first("temperature"), first("top_k"), first("top_p")
    greedy = (t is None and k is None and p is None) or k == 1 or p == 0 or t == 0
    return greedy, 1.0 if t is None else t, k or 0, 1.0 if p is None else p


def strategy_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                   ) -> torch.Tensor:
    """[N, V] logits → probabilities: divide by temperature, keep the top k, then the
    smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    logits = logits.float() / max(temperature, 1e-5)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def process_draft_tokens(request: Any, target_logits: torch.Tensor,
                         generator: torch.Generator) -> list[int]:
    """The tokens one step emits for ``request``: its kept drafts, then one more token.
    ``target_logits`` [D + 1, V] holds the target's logits at the last token and each draft."""
    drafts = list(request.py_draft_tokens)
    greedy, t, k, top_p = strategy(request)
    if greedy:
        target = target_logits.argmax(-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == target[kept]:
            kept += 1
        return drafts[:kept] + [target[kept]]
    p = strategy_probs(target_logits, t, k, top_p)  # [D + 1, V]
    if request.py_draft_logits is None:  # match drafts against the target's own samples
        out = []
        for i in range(len(drafts) + 1):
            token = int(torch.multinomial(p[i], 1, generator=generator))
            out.append(token)
            if i == len(drafts) or drafts[i] != token:
                return out
    logits = request.py_draft_logits.float()  # [D, V]
    q = logits.softmax(-1) if request.py_draft_use_greedy_sampling \
        else strategy_probs(logits, t, k, top_p)
    for i, x in enumerate(drafts):
        accept = torch.clamp(p[i, x] / q[i, x], max=1.0)
        if torch.rand((), generator=generator) > accept:
            residual = torch.relu(p[i] - q[i])
            return drafts[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
    return drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]
