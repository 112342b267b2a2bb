"""EAGLE-3 chain drafting on the torch backend: a one-layer head (:mod:`trtspec.propose.
eagle_model`) drafts from the target's own hidden states, which the target's Runner keeps from
the forwards it runs anyway (``capture_hidden``), and samples from its own q exactly as a draft
model does, so verify() keeps the target's distribution.

Terms (per row b; the executor's round is described in :mod:`trtspec.executor`):

* committed     s_0 … s_{n−1}: prompt + output so far (``tokens[b]`` at propose, n = its length).
                The target has scored s_0 … s_{n−2}; the last emitted token x₀ = s_{n−1} not yet
* H_t           the fused aux states of the target at position t [H] (they predict s_{t+1})
* pair t        (H_t, embed(s_{t+1})) at RoPE position t: EAGLE-3's alignment (a state and the
                token it was followed by predict the next token). Pairs 0 … n−2 are known
                once s_{n−1} is, so a state waits as *pending* until its next token is known
* draft cache   the head's own KV cache (:class:`~trtspec.propose.eagle_model.DraftCache`),
                pair t at slot t; it keeps *committed pairs* only (built from target states),
                ``cache.lengths[b]`` of them; the chain's pairs lie past it as scratch
* chain step    after the last pending pair gives (g, logits of d₁), step i feeds
                (g, embed(d_i)) at position n − 2 + i: the head's own output g, not a target
                state, as in training-time test. The last draft is never fed

Order of calls:

* start / admit right after the target scored the prompt (prefill; admit_row): the row's
  captured states H_0 … H_{len−1} become pending, its cache row is emptied
* propose(tokens, draft_len): for rows with D = draft_len[b] > 0, feed every pending pair
  (H_t with s_{t+1}; all rows in one padded call) — the last one gives g and the logits of d₁ —
  then D − 1 chain steps, batched across the rows still drafting. q_i = rows_to_probs(
  target_logits(logits), params) over the target vocabulary (0 where the head's vocabulary
  lacks an id), x ~ q_i by ``sample`` with one uniform per drafting row per step from the row's
  generator (as ``sample_drafts``). Returns Draft(ids [B, K], num_draft [B], q [B, K, V])
* observe(a) after the target scored [x₀, d₁ … d_D] and rolled back: for each row it scored,
  its states at x₀, d₁ … d_a (H_{n−1} … H_{n−1+a}; the next round's tokens end d₁ … d_a, y)
  become pending; the cache keeps its n − 1 committed pairs, not the chain's. A row
  that drafted nothing still gets its state: pending simply grows until it drafts
* release drops the row's pending states and cache pairs

Why committed pairs only: a chain pair holds the head's own g where training (and the next
round) has the target's state, so even an accepted draft's pair is rebuilt from H once the
target has scored it. Pending rows hold the aux states unfused [P, 3H]; ``fc`` runs once per
round over all rows. Why the states come from the target's verify forward: no second target
pass, and they are exactly the states of the committed tokens (the rejected positions' states
are simply not taken).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from trtspec.propose import Draft
from trtspec.propose.eagle_model import (
    DraftCache,
    Eagle3Config,
    Eagle3Draft,
    default_aux_layers,
    load_eagle3,
    save_eagle3,
)
from trtspec.propose.heads import captured
from trtspec.runtime import Runner
from trtspec.sampling import SamplingParams, rows_to_probs, sample, uniforms

__all__ = ["DraftCache", "Eagle3Config", "Eagle3Draft", "EagleProposer", "default_aux_layers",
           "load_eagle3", "save_eagle3"]


class EagleProposer:
    """Drafts with ``draft`` over ``target`` (an HFRunner or CompiledRunner: it needs
    ``capture_hidden`` and the model's input embeddings); see the module docstring."""

    def __init__(self, target: Runner, draft: Eagle3Draft) -> None:
        target.capture_hidden(draft.aux_layers)
        self.target, self.draft = target, draft.eval()
        self.embed = draft.embed_tokens if draft.embed_tokens is not None else \
            target.model.get_input_embeddings()  # type: ignore[attr-defined]
        self.vocab = target.vocab_size
        self.cache = draft.new_cache(0)  # lengths[b]: committed pairs of row b
        self._pending: list[torch.Tensor] = []  # per row: aux states [P, 3H] awaiting pairs

    @property
    def draft_runner(self) -> None:
        return None

    def describe(self) -> str:
        c = self.draft.config
        return (f"eagle3 head: draft vocabulary {c.draft_vocab_size} of {c.vocab_size}, target "
                f"layers {c.aux_layers}")

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        hidden, counts = captured(self.target)
        self.cache = self.draft.new_cache(len(prompts))
        self._pending = [self._states(hidden, b, counts[b], len(p))
                         for b, p in enumerate(prompts)]

    def admit(self, row: int, prompt: Sequence[int]) -> None:
        hidden, counts = captured(self.target)
        self._pending[row] = self._states(hidden, row, counts[row], len(prompt))
        self.cache.lengths[row] = 0

    def release(self, row: int) -> None:
        self._pending[row] = self._pending[row].new_empty((0, self._pending[row].shape[-1]))
        self.cache.lengths[row] = 0

    def forget(self) -> None:
        """Nothing outlives a request here."""

    def observe(self, num_accepted: Sequence[int]) -> None:
        hidden, counts = captured(self.target)
        for b, (n, a) in enumerate(zip(counts, num_accepted, strict=True)):
            if n:
                self._pending[b] = torch.cat([self._pending[b], hidden[b, : int(a) + 1]])

    def _states(self, hidden: torch.Tensor, row: int, count: int, length: int) -> torch.Tensor:
        if count != length:
            raise RuntimeError(f"eagle: the target's last call fed row {row} {count} tokens, not "
                               f"its prompt's {length}: start/admit must follow its prefill")
        return hidden[row, :count].clone()

    @torch.inference_mode()
    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        batch, steps = len(tokens), max(draft_len, default=0)
        if steps == 0:
            return Draft.empty(batch)
        act = [b for b in range(batch) if draft_len[b] > 0]  # rows drafting in this step
        for b in act:
            have, want = len(self._pending[b]), len(tokens[b]) - 1 - self.cache.lengths[b]
            if have != want or not have:
                raise RuntimeError(f"eagle: row {b} has {have} target states pending for {want} "
                                   "new pairs: start/admit/observe were not called in order")
        g, logits = self._catch_up(tokens, act)  # [A, H], [A, Vd]
        device = logits.device
        ids = torch.full((batch, steps), -1, dtype=torch.long)
        probs = torch.zeros((batch, steps, self.vocab), dtype=torch.float32, device=device)
        first = [len(tokens[b]) - 1 for b in range(batch)]  # position of the first chain pair
        for i in range(steps):
            rows = torch.tensor(act, device=device)
            q = rows_to_probs(self.draft.target_logits(logits), [params[b] for b in act])
            live = [int(draft_len[b] > i) for b in range(batch)]  # exactly the rows in act
            x = sample(q, uniforms(live, generators, device)[rows, 0])  # [A]
            probs[rows, i] = q
            ids[torch.tensor(act), i] = x.cpu()
            keep = [j for j, b in enumerate(act) if draft_len[b] > i + 1]
            if not keep:
                break
            sel = torch.tensor(keep, device=device)
            act = [act[j] for j in keep]
            pos = torch.tensor([[first[b] + i] for b in act], device=device)  # [A, 1]
            g, logits = self.draft(self.embed(x[sel])[:, None], g[sel][:, None], pos,
                                   self.cache, torch.tensor(act, device=device))
            g, logits = g[:, 0], logits[:, 0]
        return Draft(ids, torch.as_tensor(list(draft_len), dtype=torch.long), probs)

    def _catch_up(self, tokens: Sequence[Sequence[int]], rows: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the rows' pending pairs in one padded call (the RowCache rule makes padding
        harmless); returns g and the draft logits at each row's last pair."""
        device = self.draft.lm_head.weight.device
        counts = [len(self._pending[b]) for b in rows]
        aux = pad_sequence([self._pending[b] for b in rows], batch_first=True)  # [A, W, 3H]
        width = aux.shape[1]
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for j, b in enumerate(rows):
            start = self.cache.lengths[b]
            ids[j, : counts[j]] = torch.as_tensor(list(tokens[b][start + 1:]), dtype=torch.long)
        pos = torch.tensor([self.cache.lengths[b] for b in rows], device=device)[:, None] \
            + torch.arange(width, device=device)  # [A, W]
        index = torch.tensor(rows, device=device)
        g, logits = self.draft(self.embed(ids.to(device)), self.draft.fuse(aux.to(device)),
                               pos, self.cache, index)  # [A, W, H], [A, W, Vd]
        last = torch.tensor(counts, device=device) - 1
        for b in rows:  # what stays: the committed pairs (tokens s_1 … s_{n−1})
            self.cache.lengths[b] = len(tokens[b]) - 1
            self._pending[b] = self._pending[b].new_empty((0, aux.shape[-1]))  # frees it
        arange = torch.arange(len(rows), device=device)
        return g[arange, last], logits[arange, last]
