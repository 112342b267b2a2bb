"""A separate (smaller) model drafts D tokens autoregressively, sampling from its own q."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trtspec.runtime import Runner
from trtspec.spec.propose.proposer import Draft
from trtspec.spec.sample.probs import SamplingParams, rows_to_probs, sample, uniforms


class DraftModelProposer:
    """Drives any Runner with a KV cache of its own as the draft. Its cache holds committed
    tokens plus the drafts it fed.

    Per round: feed the committed tokens the draft has not seen (at least the last emitted token),
    then D single-token steps; the last draft is never fed (nothing would read its logits).
    ``observe`` rolls the cache back to the committed prefix plus the accepted drafts.
    (A draft that reads the target's own cache is :class:`~trtspec.spec.propose.layer_skip.
    LayerSkipProposer`.)
    """

    def __init__(self, runner: Runner, target_vocab: int | None = None,
                 fallback_id: int | None = None) -> None:
        self.runner = runner
        self.target_vocab = target_vocab or runner.vocab_size  # q is over the target's ids
        # Committed tokens come from the target and may hold ids the draft lacks (a prefix
        # vocabulary): they would index past its embedding table, so the draft reads them as
        # ``fallback_id`` (its tokenizer's unk, else 0). Only its input changes: q is still
        # what the draft computes, over the target's ids, so the sampling stays exact.
        self.input_vocab = runner.vocab_size
        self.fallback_id = fallback_id or 0
        self._valid: list[int] = []  # per row: leading cache tokens that are committed
        self._after_propose: list[tuple[int, int]] = []  # per row: (committed len, cache len)
        self._chunked: set[int] = set()  # rows whose prompt came in whole by admit_chunk

    @property
    def draft_runner(self) -> Runner:
        return self.runner

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.runner.prefill([self._inputs(p) for p in prompts])
        self._valid = [len(p) for p in prompts]
        self._after_propose = []
        self._chunked.clear()

    def admit(self, row: int, prompt: Sequence[int], kept: int = 0) -> None:
        from trtspec.runtime import admit_row

        if row in self._chunked:  # its chunks are in (admit_chunk)
            self._chunked.discard(row)
            return
        if kept and self._valid[row] >= kept:  # the row holds the prompt's first kept tokens
            lengths = self.runner.lengths()  # (release with keep): the next proposal
            lengths[row] = self._valid[row] = kept  # catches up from there, as after a
            self.runner.rollback(lengths)  # plain step
            return
        admit_row(self.runner, row, self._inputs(prompt))
        self._valid[row] = len(prompt)

    def admit_chunk(self, row: int, prompt: Sequence[int], start: int, end: int) -> None:
        """The target just scored ``prompt[start:end]`` in ``row``, one chunk of a chunked
        admission: the draft takes the same chunk in, so its prefill is chunked as the
        target's is (a whole one would stall every stream for it) and :meth:`admit` finds
        the prompt in. The first chunk empties the row and, on a runner that can say so (the
        compiled one's ``reserve``), checks that the draft's cache can hold the prompt before
        the draft's own work (the target's first chunk is done by then); elsewhere a prompt
        too big for the draft fails at the chunk that does not fit, and its request ends
        alone. A chunk that does not follow what the row holds (a kept prompt's last token)
        is left to :meth:`admit`."""
        lengths = self.runner.lengths()
        if start == 0:
            self._chunked.discard(row)
            lengths[row] = self._valid[row] = 0
            self.runner.rollback(lengths)
            reserve = getattr(self.runner, "reserve", None)  # the compiled runner
            if reserve is not None:
                reserve(len(prompt) + 1, gradual=True)
        elif self._valid[row] != start or lengths[row] != start:
            return
        feed: list[list[int]] = [[] for _ in lengths]
        feed[row] = self._inputs(prompt[start:end])
        self.runner.score(feed, last_only=True)
        self._valid[row] = end
        if end == len(prompt):
            self._chunked.add(row)

    def release(self, row: int, keep: int = 0) -> None:
        self._chunked.discard(row)
        lengths = self.runner.lengths()
        lengths[row] = self._valid[row] = min(keep, self._valid[row], lengths[row])
        self.runner.rollback(lengths)

    def forget(self) -> None:
        """Nothing outlives a request here."""

    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        if max(draft_len, default=0) == 0:
            return Draft.empty(len(tokens))
        feed = [self._inputs(t[v:]) if n else [] for t, v, n in zip(tokens, self._valid,
                                                                    draft_len, strict=True)]
        draft = sample_drafts(self.runner, feed, draft_len, params, generators,
                              self.target_vocab)
        self._after_propose = [(len(t), len(t) + n - 1) if n else (v, v)
                               for t, n, v in zip(tokens, draft_len, self._valid, strict=True)]
        return draft

    def _inputs(self, ids: Sequence[int]) -> list[int]:
        return [t if t < self.input_vocab else self.fallback_id for t in ids]

    def undo(self) -> None:
        """Back to what the draft held before the failed round's propose (``_valid`` moves
        only in observe): its drafts, or the part of them sampled before a failure, go."""
        self._after_propose = []
        self.runner.rollback(self._valid)

    def observe(self, num_accepted: Sequence[int]) -> None:
        if not self._after_propose:
            return
        self._valid = [min(cached, committed + int(a))
                       for (committed, cached), a in
                       zip(self._after_propose, num_accepted, strict=True)]
        self.runner.rollback(self._valid)
        self._after_propose = []


def sample_drafts(runner: Runner, feed: list[list[int]], draft_len: Sequence[int],
                  params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                  target_vocab: int) -> Draft:
    """D = draft_len[b] autoregressive steps of ``runner`` for each row: score ``feed[b]``
    (what the draft has not seen yet), sample x ~ q from the last position's logits through
    ``logits_to_probs`` with the row's params and generator, feed x back; the last draft is
    never fed. Returns the drafts with q [B, K, V_target]."""
    batch, steps = len(feed), max(draft_len, default=0)
    ids, probs = [], []
    for step in range(steps):
        logits = fit_vocab(runner.score(feed, last_only=True)[:, 0], target_vocab)
        q = rows_to_probs(logits, params)  # [B, V_target]
        live = [int(n > step) for n in draft_len]
        x = sample(q, uniforms(live, generators, q.device)[:, 0]).tolist()  # [B], host
        ids.append([t if on else -1 for t, on in zip(x, live, strict=True)])
        probs.append(q)
        feed = [[x[b]] if draft_len[b] > step + 1 else [] for b in range(batch)]
    return Draft(torch.tensor(ids, dtype=torch.long).T.contiguous(),
                 torch.as_tensor(list(draft_len), dtype=torch.long), torch.stack(probs, 1))


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
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
