"""EAGLE-3 chain drafting on the torch backend: a one-layer head (:mod:`trtspec.spec.propose.
eagle_model`) drafts from the target's own hidden states, which the target's Runner keeps from
the forwards it runs anyway (``capture_hidden``), and samples from its own q exactly as a draft
model does, so verify() keeps the target's distribution.

Terms (per row b; the executor's round is described in :mod:`trtspec.spec.executor`):

* committed     s_0 … s_{n−1}: prompt + output so far (``tokens[b]`` at propose, n = its length).
                The target has scored s_0 … s_{n−2}; the last emitted token x₀ = s_{n−1} not yet
* H_t           the fused aux states of the target at position t [H] (they predict s_{t+1})
* pair t        (H_t, embed(s_{t+1})) at RoPE position t: EAGLE-3's alignment (a state and the
                token it was followed by predict the next token). Pairs 0 … n−2 are known
                once s_{n−1} is, so a state waits as *pending* until its next token is known
* draft cache   the head's own KV cache
                (:class:`~trtspec.spec.propose.heads.eagle_model.DraftCache`), pair t at slot t; it
                keeps *committed pairs* only (built from target states), ``cache.lengths[b]`` of
                them; the chain's pairs lie past it as scratch
* chain step    after the last pending pair gives (g, logits of d₁), step i feeds
                (g, embed(d_i)) at position n − 2 + i: the head's own output g, not a target
                state, as in training-time test. The last draft is never fed

Order of calls:

* start / admit right after the target scored the prompt (prefill; admit_row): the row's cache
  is emptied and its prompt's complete pairs (H_t with s_{t+1}, t = 0 … len − 2) go into it at
  once (start: all rows in one padded call, as the target's prefill; admit: the row alone);
  H_{len−1} stays pending. So a long prompt never widens another row's call, and a row holds
  at most D + 1 pending states after a round that drafted D
* propose(tokens, draft_len): for rows with D = draft_len[b] > 0, feed every pending pair
  (H_t with s_{t+1}; padded calls, rows of similar counts together) — the last one gives g and
  the logits of d₁ — then D − 1 chain steps, batched across the rows still drafting. q_i =
  rows_to_probs(target_logits(logits), params) over the target vocabulary (0 where the head's
  vocabulary lacks an id), x ~ q_i by ``sample`` with one uniform per drafting row per step
  from the row's generator (as ``sample_drafts``). Returns Draft(ids [B, K], num_draft [B],
  q [B, K, V])
* observe(a) after the target scored [x₀, d₁ … d_D] and rolled back: for each row it scored,
  its states at x₀, d₁ … d_a (H_{n−1} … H_{n−1+a}; the next round's tokens end d₁ … d_a, y)
  join the pending ones (one chunk per round, concatenated once when fed); the cache keeps its
  n − 1 committed pairs, not the chain's. A row that drafted nothing still gets its states:
  pending simply grows until it drafts
* release drops the row's pending states and cache pairs; with ``keep`` (a kept prompt: the
  next request in the row has the same prompt) the prompt's complete pairs stay, and admit
  with ``kept`` then only takes the state of the prompt's last token, the one token the
  target fed

Why committed pairs only: a chain pair holds the head's own g where training (and the next
round) has the target's state, so even an accepted draft's pair is rebuilt from H once the
target has scored it. Pending rows hold the aux states unfused [P, 3H]; ``fc`` runs once per
call over all its rows. Why the states come from the target's verify forward: no second target
pass, and they are exactly the states of the committed tokens (the rejected positions' states
are simply not taken).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from trtspec.runtime import Runner
from trtspec.spec.propose.heads import Captured, captured, llama_decoder
from trtspec.spec.propose.heads.eagle_model import (
    DraftCache,
    Eagle3Config,
    Eagle3Draft,
    default_aux_layers,
    load_eagle3,
    save_eagle3,
)
from trtspec.spec.propose.proposer import Draft
from trtspec.spec.sample.probs import SamplingParams, rows_to_probs, sample, uniforms

__all__ = ["DraftCache", "Eagle3Config", "Eagle3Draft", "EagleProposer", "default_aux_layers",
           "load_eagle3", "save_eagle3"]


class EagleProposer:
    """Drafts with ``draft`` over ``target`` (an HFRunner or CompiledRunner: it needs
    ``capture_hidden`` and the model's input embeddings); see the module docstring."""

    def __init__(self, target: Runner, draft: Eagle3Draft) -> None:
        llama_decoder(getattr(target, "model", target), "eagle3")  # HeadsError otherwise
        self.hidden_layers = list(draft.aux_layers)  # what the executor asks the target to keep
        target.capture_hidden(self.hidden_layers)
        self.target, self.draft = target, draft.eval()
        self.embed = draft.embed_tokens if draft.embed_tokens is not None else \
            target.model.get_input_embeddings()  # type: ignore[attr-defined]
        self.vocab = target.vocab_size
        self.cache = draft.new_cache(0)  # lengths[b]: committed pairs of row b
        self._pending: list[list[torch.Tensor]] = []  # per row: chunks of aux states [P, 3H]

    @property
    def draft_runner(self) -> None:
        return None

    def describe(self) -> str:
        c = self.draft.config
        return (f"eagle3 head: draft vocabulary {c.draft_vocab_size} of {c.vocab_size}, target "
                f"layers {c.aux_layers}")

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.cache = self.draft.new_cache(len(prompts))
        self._pending = [[] for _ in prompts]
        self._prompts(captured(self.target), dict(enumerate(prompts)))

    def admit(self, row: int, prompt: Sequence[int], kept: int = 0) -> None:
        if kept:  # a kept prompt (release with keep): its complete pairs are still in the
            # cache, and the target fed only its last token, whose state is the one pending
            cap = captured(self.target)
            if not cap.counts[row] == 1 == len(prompt) - kept or \
                    self.cache.lengths[row] != kept:
                raise RuntimeError(f"eagle: row {row} kept {self.cache.lengths[row]} pairs and "
                                   f"was fed {cap.counts[row]} tokens for a prompt of "
                                   f"{len(prompt)} with {kept} kept: admit must follow the "
                                   "target's and release(keep=len(prompt))")
            self._pending[row] = [cap.at([row], [0])]
            return
        self._pending[row], self.cache.lengths[row] = [], 0
        self._prompts(captured(self.target), {row: prompt})

    def release(self, row: int, keep: int = 0) -> None:
        self._pending[row] = []
        self.cache.lengths[row] = min(self.cache.lengths[row], max(keep - 1, 0))

    def forget(self) -> None:
        """Nothing outlives a request here."""

    def undo(self) -> None:
        """Not done: proposing catches the head's cache up on the pending states first, and
        a failed round leaves that part way (the batch ends instead)."""
        raise RuntimeError("a round with an EAGLE head failed: its state cannot be put back")

    @torch.inference_mode()
    def observe(self, num_accepted: Sequence[int]) -> None:
        cap = captured(self.target)
        rows = [b for b, n in enumerate(cap.counts) if n]
        if not rows:
            return
        keep = [int(num_accepted[b]) + 1 for b in rows]
        states = cap.at([b for b, k in zip(rows, keep, strict=True) for _ in range(k)],
                        [t for k in keep for t in range(k)])  # [Σ keep, 3H]: one gather
        for b, chunk in zip(rows, states.split(keep), strict=True):
            self._pending[b].append(chunk)

    @torch.inference_mode()
    def _prompts(self, cap: Captured, prompts: dict[int, Sequence[int]]) -> None:
        """Rows whose prompts the target just scored: their complete pairs into the cache (one
        padded call, no logits), their last state H_{len−1} pending."""
        rows = list(prompts)
        for b in rows:
            if cap.counts[b] != len(prompts[b]):
                raise RuntimeError(f"eagle: the target's last call fed row {b} {cap.counts[b]} "
                                   f"tokens, not its prompt's {len(prompts[b])}: start/admit "
                                   "must follow its prefill")
        last = cap.at(rows, [len(prompts[b]) - 1 for b in rows])  # [n, 3H]
        fed = [b for b in rows if len(prompts[b]) > 1]
        if fed:
            self._feed(fed, [cap.row(b)[: len(prompts[b]) - 1] for b in fed],
                       [prompts[b][1:] for b in fed], None)
        for j, b in enumerate(rows):
            self._pending[b] = [last[j: j + 1]]
            self.cache.lengths[b] = len(prompts[b]) - 1

    @torch.inference_mode()
    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        batch, steps = len(tokens), max(draft_len, default=0)
        if steps == 0:
            return Draft.empty(batch)
        act = [b for b in range(batch) if draft_len[b] > 0]  # rows drafting in this step
        for b in act:
            have = sum(len(c) for c in self._pending[b])
            want = len(tokens[b]) - 1 - self.cache.lengths[b]
            if have != want or not have:
                raise RuntimeError(f"eagle: row {b} has {have} target states pending for {want} "
                                   "new pairs: start/admit/observe were not called in order")
        g, logits = self._catch_up(tokens, act, steps)  # [A, H], [A, Vd]
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

    def _catch_up(self, tokens: Sequence[Sequence[int]], rows: list[int], steps: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the rows' pending pairs; returns g and the draft logits at each row's last
        pair. What stays in the cache: the committed pairs (tokens s_1 … s_{n−1})."""
        aux = [c[0] if len(c) == 1 else torch.cat(c) for c in (self._pending[b] for b in rows)]
        ids = [tokens[b][self.cache.lengths[b] + 1:] for b in rows]
        out = self._feed(rows, aux, ids, steps + 1)
        assert out is not None
        for b in rows:
            self.cache.lengths[b] = len(tokens[b]) - 1
            self._pending[b] = []
        return out

    def _feed(self, rows: list[int], aux: list[torch.Tensor], ids: list[Sequence[int]],
              slack: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pairs (aux[j] [P_j, 3H], ids[j] [P_j]) of cache row rows[j] at positions
        cache.lengths[rows[j]] onward, in padded calls (the RowCache rule makes padding
        harmless). ``slack`` None: one call, nothing returned (a prompt's pairs). Otherwise rows
        of similar counts share a call (:func:`groups`) and (g [A, H], draft logits [A, Vd])
        at each row's last pair come back, in the order of ``rows``."""
        device = self.draft.lm_head.weight.device
        counts = [len(a) for a in aux]
        last = None
        for group in [list(range(len(rows)))] if slack is None else groups(counts, slack):
            width = max(counts[j] for j in group)
            tok = torch.zeros((len(group), width), dtype=torch.long)
            for i, j in enumerate(group):
                tok[i, : counts[j]] = torch.as_tensor(list(ids[j]), dtype=torch.long)
            hidden = self.draft.fuse(pad_sequence([aux[j] for j in group], batch_first=True)
                                     .to(device))  # [n, W, H]
            pos = torch.tensor([self.cache.lengths[rows[j]] for j in group], device=device
                               )[:, None] + torch.arange(width, device=device)  # [n, W]
            g = self.draft.layer(self.embed(tok.to(device)), hidden, pos, self.cache,
                                 torch.tensor([rows[j] for j in group], device=device))
            if slack is not None:
                if last is None:
                    last = g.new_empty((len(rows), g.shape[-1]))
                at = torch.tensor([counts[j] - 1 for j in group], device=device)
                last[torch.tensor(group, device=device)] = \
                    g[torch.arange(len(group), device=device), at]
        return None if last is None else (last, self.draft.draft_logits(last))


def groups(counts: Sequence[int], slack: int) -> list[list[int]]:
    """Indices of ``counts`` in padded calls: longest first, a row joins the current call while
    the call's width is ≤ 2 × its count + ``slack``, so padding costs at most about as much as
    the real pairs (plus ``slack`` per row) and rows of ≤ slack pairs share one call."""
    out: list[list[int]] = []
    for j in sorted(range(len(counts)), key=lambda j: -counts[j]):
        if out and counts[out[-1][0]] <= 2 * counts[j] + slack:
            out[-1].append(j)
        else:
            out.append([j])
    return out
