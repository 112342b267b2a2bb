"""A separate (smaller) model drafts D tokens autoregressively, sampling from its own q."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trtspec.propose import Draft
from trtspec.runtime import Runner
from trtspec.sampling import SamplingParams, rows_to_probs, sample, uniforms


class DraftModelProposer:
    """Drives any Runner as the draft. Its cache holds committed tokens plus the drafts it fed.

    Per round: feed the committed tokens the draft has not seen (at least the last emitted token),
    then D single-token steps; the last draft is never fed (nothing would read its logits).
    ``observe`` rolls the cache back to the committed prefix plus the accepted drafts.

    With ``follows`` (the target's runner, whose cache ``runner`` shares: a layer-skip view) the
    committed tokens are in the cache already, written by the target: the draft feeds only the
    last emitted token, so a round after plain steps costs no catch-up.
    """

    def __init__(self, runner: Runner, target_vocab: int | None = None,
                 fallback_id: int | None = None, follows: Runner | None = None) -> None:
        self.runner, self.follows = runner, follows
        self.target_vocab = target_vocab or runner.vocab_size  # q is over the target's ids
        # Committed tokens come from the target and may hold ids the draft lacks (a prefix
        # vocabulary): they would index past its embedding table, so the draft reads them as
        # ``fallback_id`` (its tokenizer's unk, else 0). Only its input changes: q is still
        # what the draft computes, over the target's ids, so the sampling stays exact.
        self.input_vocab = runner.vocab_size
        self.fallback_id = fallback_id or 0
        self._valid: list[int] = []  # per row: leading cache tokens that are committed
        self._after_propose: list[tuple[int, int]] = []  # per row: (committed len, cache len)

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        if self.follows is not None:  # the target prefills the shared cache
            self._valid, self._after_propose = [0] * len(prompts), []
            return
        self.runner.prefill([self._inputs(p) for p in prompts])
        self._valid = [len(p) for p in prompts]
        self._after_propose = []

    def admit(self, row: int, prompt: Sequence[int]) -> None:
        from trtspec.runtime import admit_row

        if self.follows is not None:  # the target admitted it into the shared cache
            self._valid[row] = 0
            return
        admit_row(self.runner, row, self._inputs(prompt))
        self._valid[row] = len(prompt)

    def release(self, row: int) -> None:
        lengths = self.runner.lengths()
        lengths[row] = 0
        self.runner.rollback(lengths)
        self._valid[row] = 0

    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        batch, steps = len(tokens), max(draft_len, default=0)
        if steps == 0:
            return Draft.empty(batch)
        if self.follows is not None:  # all but each row's last token are in the shared cache
            self.runner.follow()
            self._valid = self.runner.lengths()
        feed = [self._inputs(t[v:]) if n else [] for t, v, n in zip(tokens, self._valid,
                                                                    draft_len, strict=True)]
        ids, probs = [], []
        for step in range(steps):
            logits = _fit(self.runner.score(feed, last_only=True)[:, 0], self.target_vocab)
            q = rows_to_probs(logits, params)  # [B, V_target]
            live = [int(n > step) for n in draft_len]
            x = sample(q, uniforms(live, generators, q.device)[:, 0]).tolist()  # [B], host
            ids.append([t if on else -1 for t, on in zip(x, live, strict=True)])
            probs.append(q)
            feed = [[x[b]] if draft_len[b] > step + 1 else [] for b in range(batch)]
        self._after_propose = [(len(t), len(t) + n - 1) if n else (v, v)
                               for t, n, v in zip(tokens, draft_len, self._valid, strict=True)]
        return Draft(torch.tensor(ids, dtype=torch.long).T.contiguous(),
                     torch.as_tensor(list(draft_len), dtype=torch.long), torch.stack(probs, 1))

    def _inputs(self, ids: Sequence[int]) -> list[int]:
        return [t if t < self.input_vocab else self.fallback_id for t in ids]

    def observe(self, num_accepted: Sequence[int]) -> None:
        if not self._after_propose:
            return
        self._valid = [min(cached, committed + int(a))
                       for (committed, cached), a in
                       zip(self._after_propose, num_accepted, strict=True)]
        self.runner.rollback(self._valid)
        self._after_propose = []


def _fit(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [B, V_draft] → [B, vocab]: ids the draft lacks get −inf, so q(x) = 0."""
    have = logits.shape[-1]
    if have == vocab:
        return logits
    if have > vocab:
        return logits[:, :vocab]
    return torch.nn.functional.pad(logits, (0, vocab - have), value=float("-inf"))


def check_vocab(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Accept an identical vocabulary or a draft vocabulary that is a prefix of the target's
    (same token → same id, the target has extra ids, e.g. 128000 vs 128256); refuse the rest."""
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target == draft:
        return
    moved = sum(1 for token, i in draft.items() if target.get(token) != i)
    if moved == 0 and len(draft) < len(target):
        return
    raise ValueError(
        f"draft tokenizer '{_name(draft_tokenizer)}' (vocab {len(draft)}) does not match target "
        f"tokenizer '{_name(target_tokenizer)}' (vocab {len(target)}): {moved} draft tokens have "
        "another id or are missing in the target; a draft must share the target's vocabulary "
        "(identical, or a prefix of it)")


def _name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
