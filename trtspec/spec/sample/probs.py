"""Sampling parameters, the one place probabilities are made, and the one sampler.

Exactness depends on draft (q) and target (p) being shaped by *the same* transformation, so both
go through :func:`logits_to_probs` with the request's :class:`SamplingParams`. Every random token
in trtspec (plain decoding, draft proposals, recovered and bonus tokens) is drawn by
:func:`sample` from uniforms made by :func:`uniforms`, so a request that owns a
``torch.Generator`` consumes the same random numbers alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

Generators = torch.Generator | Sequence[torch.Generator | None] | None
"""One generator for the whole batch, one per row (batch-independent), or the global RNG."""


class SamplingParams(BaseModel):
    """How one request samples. ``temperature == 0`` means greedy (argmax)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass; 1 = off")
    seed: int | None = Field(None, description="per-request seed; None = drawn at random")
    max_tokens: int = Field(16, ge=1, description="output tokens, the stop token included")
    stop_token_ids: tuple[int, ...] = Field((), description="extra token ids that end a request")
    ignore_eos: bool = Field(False, description="generate past EOS (fixed-length benchmarks)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shape_key(self) -> tuple[float, int, float]:
        """The fields that shape probabilities; requests sharing it share one logits_to_probs."""
        return (self.temperature, self.top_k, self.top_p)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] → fp32 probabilities [..., V] after temperature, top-k and top-p.

    Greedy returns the one-hot of the argmax, so exact rejection sampling on greedy inputs
    degenerates to token matching. Filtered tokens get probability exactly 0.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax(logits)[..., None], 1.0)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def rows_to_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [B, ..., V] with one SamplingParams per row → fp32 probs, one call per distinct
    (temperature, top_k, top_p)."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} SamplingParams for a batch of {logits.shape[0]} rows")
    groups: dict[tuple[float, int, float], list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault(p.shape_key, []).append(row)
    if len(groups) == 1:
        return logits_to_probs(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        out[index] = logits_to_probs(logits[index], params[rows[0]])
    return out


def uniforms(counts: Sequence[int], generator: Generators, device: torch.device | str = "cpu"
             ) -> torch.Tensor:
    """Uniforms in [0, 1), fp64, shape [B, max(counts)]; row b's first counts[b] are its draws.

    With one generator per row, row b draws exactly counts[b] numbers from its own generator, so
    its stream does not depend on its neighbours or on the batch's padding.
    """
    width = max(counts, default=0)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand((len(counts), width), generator=generator, dtype=torch.float64).to(device)
    if len(generator) != len(counts):
        raise ValueError(f"{len(generator)} generators for a batch of {len(counts)} rows")
    out = torch.zeros((len(counts), width), dtype=torch.float64)
    if width:
        draws = [torch.rand(n, generator=g, dtype=torch.float64)
                 for n, g in zip(counts, generator, strict=True) if n]
        out[torch.arange(width) < torch.tensor(counts)[:, None]] = torch.cat(draws)
    return out.to(device)


SAMPLE_BLOCK = 1024  # tokens per block of the two-level inverse CDF


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (≥ 0, any positive total), u [N] in [0, 1) → ids [N].

    Two levels, so no sequential scan runs over the whole vocabulary: vectorised sums of
    SAMPLE_BLOCK-token blocks pick the block holding u·total, then a cumsum inside that one block
    picks the token. A token with probability 0 is never returned: ``searchsorted(right=True)``
    skips flat steps of a CDF, and each target is kept strictly below its CDF's last value.
    """
    n, vocab = probs.shape
    probs = probs.float()
    block = min(SAMPLE_BLOCK, vocab)
    full = vocab // block * block
    sums = probs[:, :full].reshape(n, full // block, block).sum(-1)  # [N, nb]
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], dim=1)  # [N, nb+1]
    block_cdf = sums.cumsum(-1)  # [N, nb']
    target = _below_last(block_cdf, (u.to(probs.device, torch.float64)[:, None]
                                     * block_cdf[:, -1:].double()).float())  # [N, 1]
    k = torch.searchsorted(block_cdf, target, right=True)  # [N, 1] chosen block
    before = torch.where(k > 0, block_cdf.gather(1, (k - 1).clamp(min=0)), 0.0)  # [N, 1]
    cols = k * block + torch.arange(block, device=probs.device)  # [N, block]
    inside = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)
    inside_cdf = inside.cumsum(-1)  # [N, block]
    j = torch.searchsorted(inside_cdf, _below_last(inside_cdf, target - before), right=True)
    return (k * block + j).squeeze(-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] → index of the first maximum [...], like ``x.argmax(-1)``.

    Blocked (amax of SAMPLE_BLOCK-token blocks, then argmax inside the first block holding the
    maximum) because torch's CPU argmax runs several times below memory bandwidth at large V.
    """
    vocab = x.shape[-1]
    block = min(SAMPLE_BLOCK, vocab)
    full = vocab // block * block
    if full == vocab and block == vocab:
        return x.argmax(-1)
    maxima = x[..., :full].reshape(*x.shape[:-1], full // block, block).amax(-1)  # [..., nb]
    if full < vocab:
        maxima = torch.cat([maxima, x[..., full:].amax(-1, keepdim=True)], dim=-1)
    k = maxima.argmax(-1, keepdim=True)  # [..., 1] first block holding the maximum
    cols = k * block + torch.arange(block, device=x.device)  # [..., block]
    inside = x.gather(-1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, float("-inf"))
    return (k * block).squeeze(-1) + inside.argmax(-1)


def _below_last(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Clamp target [N, 1] strictly below each row's total, so rounding never runs off the end."""
    last = cdf[:, -1:]
    return torch.minimum(target, torch.nextafter(last, torch.zeros_like(last)))


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request; a random seed when none is given."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
