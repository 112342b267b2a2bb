"""Speculation counters and statistics, named as everywhere in trtspec (records, MLflow, reports).

The four counters describe what verification did; ``discarded_tokens`` is kept apart:

* proposed_tokens       draft tokens sent to verification
* accepted_draft_tokens draft tokens the verifier accepted
* emitted_tokens        tokens committed to the output by verification rounds
* verification_rounds   target verification calls (decode steps; prefill is not one)
* discarded_tokens      tokens verification produced but stop handling dropped (EOS or a stop
                        token inside an accepted run, max_tokens reached)
* rejected_rounds       rounds in which a draft was rejected (fewer accepted than proposed); with
                        accepted_draft_tokens it gives the per-token acceptance probability
                        α̂ = accepted / (accepted + rejected_rounds) (see :attr:`alpha`)
* draft_lens            per round, the draft length D asked of the proposer (fixed, or chosen by
                        the adaptive draft length; clipped to the budget); ``proposed_lens``
                        what it proposed (an n-gram with no match proposes fewer). Per request:
                        :meth:`merge` keeps only ``rounds_per_draft_len``, their histogram

so per round ``emitted + discarded == accepted + 1``. The first output token comes from prefill and
is in no counter. AL is reported two ways and always named: pooled (Σ emitted / Σ rounds, vLLM's)
and per-request mean (mean of each request's AL, SPEED-Bench's Average_AL).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecStats:
    proposed_tokens: int = 0
    accepted_draft_tokens: int = 0
    emitted_tokens: int = 0
    verification_rounds: int = 0
    discarded_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)  # [i]: rounds with a draft at i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds accepting draft i
    request_al: list[float] = field(default_factory=list)  # one AL per request that had rounds
    rejected_rounds: int | None = 0  # None: not recorded (records older than this counter)
    draft_lens: list[int] = field(default_factory=list)  # per round: D asked (per request)
    proposed_lens: list[int] = field(default_factory=list)  # per round: drafts proposed
    rounds_per_draft_len: list[int] = field(default_factory=list)  # [D]: rounds that asked D

    def record_round(self, num_draft: int, num_accepted: int, num_kept: int,
                     draft_len: int | None = None) -> None:
        """Count one verification round: num_accepted + 1 tokens verified, num_kept committed;
        ``draft_len`` is the D asked of the proposer (default: num_draft)."""
        asked = num_draft if draft_len is None else draft_len
        self.draft_lens.append(asked)
        self.proposed_lens.append(num_draft)
        _add_at(self.rounds_per_draft_len, asked)
        self.verification_rounds += 1
        if num_accepted < num_draft and self.rejected_rounds is not None:
            self.rejected_rounds += 1
        self.proposed_tokens += num_draft
        self.accepted_draft_tokens += num_accepted
        self.emitted_tokens += num_kept
        self.discarded_tokens += num_accepted + 1 - num_kept
        _add_prefix(self.proposed_per_position, num_draft)
        _add_prefix(self.accepted_per_position, num_accepted)

    def record_step(self, num_accepted: int, num_kept: int) -> None:
        """Count one verification step of a batch someone else verifies (TensorRT-LLM's),
        known only from the tokens it added: ``num_accepted`` drafts kept (the step's tokens
        less one) and ``num_kept`` committed. What was proposed is not known per request, so
        ``proposed_tokens`` is left alone and ``rejected_rounds`` becomes None (not
        recorded); acceptance *rates* need the proposals and come from elsewhere."""
        self.verification_rounds += 1
        self.rejected_rounds = None
        self.accepted_draft_tokens += num_accepted
        self.emitted_tokens += num_kept
        self.discarded_tokens += num_accepted + 1 - num_kept
        _add_prefix(self.accepted_per_position, num_accepted)

    def close_request(self) -> None:
        """Fix this request's AL (call once, on a per-request SpecStats)."""
        if self.verification_rounds:
            self.request_al.append(self.emitted_tokens / self.verification_rounds)

    @property
    def acceptance_rate(self) -> float:
        """accepted_draft_tokens / proposed_tokens (NaN when nothing was proposed)."""
        return _ratio(self.accepted_draft_tokens, self.proposed_tokens)

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability α, the α of Leviathan's formulas: the maximum-
        likelihood estimate under i.i.d. acceptance, accepted / (accepted + rejected_rounds).
        Each round is a run of accepted drafts ended by one rejection or by running out of
        drafts, so every rejection is one failed trial and every accepted draft one success;
        rounds that accept all their drafts end without a trial. Unlike acceptance_rate
        (accepted / proposed, which counts the drafts after a rejection as failures), it does
        not depend on D. NaN when nothing was tried or the counter was not recorded."""
        if self.rejected_rounds is None:
            return float("nan")
        return _ratio(self.accepted_draft_tokens, self.accepted_draft_tokens + self.rejected_rounds)

    @property
    def al_pooled(self) -> float:
        """Acceptance length, pooled: emitted_tokens / verification_rounds."""
        return _ratio(self.emitted_tokens, self.verification_rounds)

    @property
    def al_request_mean(self) -> float:
        """Acceptance length, mean over requests of each request's AL."""
        return float(np.mean(self.request_al)) if self.request_al else float("nan")

    @classmethod
    def from_record(cls, r: dict) -> SpecStats:
        """One finished request's counters from its eval record (records written before
        rejected_rounds or draft_lens existed lack them)."""
        s = cls(r["proposed_tokens"], r["accepted_draft_tokens"], r["emitted_tokens"],
                r["verification_rounds"], r["discarded_tokens"], list(r["proposed_per_position"]),
                list(r["accepted_per_position"]), rejected_rounds=r.get("rejected_rounds"))
        s.rounds_per_draft_len = histogram(r.get("draft_lens") or ())
        s.close_request()
        return s

    @property
    def draft_len_mean(self) -> float:
        """Mean D asked per round (NaN when no round recorded it)."""
        hist = self.rounds_per_draft_len
        return _ratio(sum(d * n for d, n in enumerate(hist)), sum(hist))

    @property
    def draft_len_share(self) -> dict[int, float]:
        """D → share of the rounds that asked it (the D that occurred, by increasing D)."""
        total = sum(self.rounds_per_draft_len)
        return {d: n / total for d, n in enumerate(self.rounds_per_draft_len) if n}

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft i accepted | draft i proposed), per position."""
        accepted = self.accepted_per_position
        return [_ratio(accepted[i] if i < len(accepted) else 0, p)
                for i, p in enumerate(self.proposed_per_position)]

    @classmethod
    def merge(cls, parts: Iterable[SpecStats]) -> SpecStats:
        total = cls()
        for s in parts:
            total.proposed_tokens += s.proposed_tokens
            total.accepted_draft_tokens += s.accepted_draft_tokens
            total.emitted_tokens += s.emitted_tokens
            total.verification_rounds += s.verification_rounds
            total.discarded_tokens += s.discarded_tokens
            _add_lists(total.proposed_per_position, s.proposed_per_position)
            _add_lists(total.accepted_per_position, s.accepted_per_position)
            _add_lists(total.rounds_per_draft_len, s.rounds_per_draft_len)
            total.request_al.extend(s.request_al)
            total.rejected_rounds = None if None in (total.rejected_rounds, s.rejected_rounds) \
                else total.rejected_rounds + s.rejected_rounds
        return total

    def summary(self) -> dict[str, float | int]:
        """Flat counters and derived rates, with the vocabulary's names."""
        return {
            "proposed_tokens": self.proposed_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "emitted_tokens": self.emitted_tokens,
            "verification_rounds": self.verification_rounds,
            "discarded_tokens": self.discarded_tokens,
            "rejected_rounds": self.rejected_rounds if self.rejected_rounds is not None
            else float("nan"),
            "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha,
            "al_pooled": self.al_pooled,
            "al_request_mean": self.al_request_mean,
            "draft_len_mean": self.draft_len_mean,
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _add_prefix(hist: list[int], n: int) -> None:
    """hist[i] += 1 for i < n, growing hist as needed."""
    if len(hist) < n:
        hist.extend([0] * (n - len(hist)))
    for i in range(n):
        hist[i] += 1


def histogram(values: Iterable[int]) -> list[int]:
    """[v]: how many of ``values`` (non-negative ints) equal v."""
    out: list[int] = []
    for v in values:
        _add_at(out, v)
    return out


def _add_at(hist: list[int], i: int) -> None:
    """hist[i] += 1, growing hist as needed."""
    if len(hist) <= i:
        hist.extend([0] * (i + 1 - len(hist)))
    hist[i] += 1


def _add_lists(into: list[int], other: Sequence[int]) -> None:
    if len(into) < len(other):
        into.extend([0] * (len(other) - len(into)))
    for i, v in enumerate(other):
        into[i] += v
