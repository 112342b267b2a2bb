"""A proposer driven by request ids, for a batch someone else schedules (TensorRT-LLM's
``Drafter`` hook, mode ``drafter``).

trtspec's proposers keep one row per request for the life of a batch (``start`` / ``admit`` /
``release``, then ``propose`` and ``observe`` each round). TensorRT-LLM instead hands its
drafter the requests it scheduled this step, by id, and verifies the drafts itself. This
adapter keeps the two in step:

* **row**       a request id's place in the proposer's batch: taken when the id first
                appears (``admit`` with its tokens but the last, so the proposer sees that one
                as new), given back when the id is gone from a step (``release``).
* **accepted**  learnt one step late, from how far the request's tokens grew past the drafts'
                start: a kept prefix of the drafts and one more token, so
                accepted = min(growth − 1, the drafts' matching prefix); ``observe`` gets it
                before the next ``propose``.
* **q**         what the proposer returns: the distribution each draft token was sampled from,
                after trtspec's ``logits_to_probs`` with the request's sampling (None: point
                masses), drawn with a generator of the adapter's own, seeded from a hash of
                (the request's seed, its id, the admission's number): never the verifier's
                stream, and never one a re-admitted request already drew from.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trtspec.runtime.trtllm import Scheduled
from trtspec.spec.propose.proposer import Proposer
from trtspec.spec.sample.probs import SamplingParams


def draft_seed(seed: int | None, key: int, admission: int) -> int:
    """A generator seed for a request's drafts, apart from every seed its verifier uses."""
    text = f"trtspec-draft:{seed}:{key}:{admission}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") % 2**63


@dataclass
class _Row:
    key: int
    generator: torch.Generator
    start: int = 0  # tokens the request held when it was last drafted for
    drafts: tuple[int, ...] = ()


class RequestDrafts:
    """``__call__(requests, d)`` → per request (draft tokens, q [n, V] or None)."""

    def __init__(self, proposer: Proposer, slots: int) -> None:
        self.proposer, self.slots = proposer, slots
        proposer.start([[0]] * slots)
        self._rows: dict[int, int] = {}  # request id → row
        self._state: list[_Row | None] = [None] * slots
        self._pending = False  # a propose() whose acceptance observe() has not heard yet
        self._admitted = 0  # rows taken so far, by any request: a re-admission draws anew

    def __call__(self, requests: Sequence[Scheduled], d: int
                 ) -> list[tuple[list[int], torch.Tensor | None]]:
        if len(requests) > self.slots:
            raise ValueError(f"{len(requests)} requests for a drafter of {self.slots} rows "
                             "(limits.max_batch_size)")
        self._observe(requests)
        keep = {r.key for r in requests}
        for key in [k for k in self._rows if k not in keep]:  # finished, or not running now
            row = self._rows.pop(key)
            self._state[row] = None
            self.proposer.release(row)
        for r in requests:
            if r.key not in self._rows:
                row = self._state.index(None)
                self._admitted += 1
                self._rows[r.key] = row
                self._state[row] = _Row(r.key, torch.Generator().manual_seed(
                    draft_seed(r.seed, r.key, self._admitted)))
                self.proposer.admit(row, r.tokens[:-1])
        tokens: list[list[int]] = [[0]] * self.slots
        draft_len = [0] * self.slots
        params = [SamplingParams()] * self.slots
        for r in requests:
            row = self._rows[r.key]
            tokens[row], draft_len[row] = r.tokens, d
            params[row] = SamplingParams(temperature=r.temperature, top_k=r.top_k,
                                         top_p=r.top_p)
        generators = [s.generator if s is not None else torch.Generator() for s in self._state]
        draft = self.proposer.propose(tokens, draft_len, params, generators)
        self._pending = True
        out = []
        n_draft = draft.num_draft.tolist()
        for r in requests:
            row = self._rows[r.key]
            ids = draft.token_ids[row, : n_draft[row]].tolist()
            state = self._state[row]
            state.start, state.drafts = len(r.tokens), tuple(ids)
            out.append((ids, None if draft.probs is None or not ids
                        else draft.probs[row, : len(ids)]))
        return out

    def _observe(self, requests: Sequence[Scheduled]) -> None:
        """Tell the proposer how many of each row's last drafts were kept."""
        if not self._pending:
            return
        accepted = [0] * self.slots
        now = {r.key: r.tokens for r in requests}
        for key, row in self._rows.items():
            state = self._state[row]
            if key not in now or state is None:
                continue
            grown = now[key][state.start:]
            match = 0
            while match < min(len(state.drafts), len(grown)) and \
                    grown[match] == state.drafts[match]:
                match += 1
            accepted[row] = max(0, min(match, len(grown) - 1))
        self.proposer.observe(accepted)
        self._pending = False
