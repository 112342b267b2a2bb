"""Adaptive draft length: per request and per round, the D that pays for itself.

For a request whose estimated acceptance at draft position j (given positions < j accepted)
is a_j, a round that drafts D tokens emits on average

    E[emitted | D] = 1 + Σ_{i=1..D} Π_{j≤i} a_j

tokens and costs time(D) = t(D+1) + D·t_draft, where t(T) is what the target takes to score T
new tokens in a row and t_draft one draft step (0 for model-free proposers), both relative to
t(1), a plain decoding step. The chooser picks the D ∈ {0 … K} with the most tokens per unit
of time; D = 0 (plain decoding, through the same verify()) unless some D > 0 promises at least
``min_gain`` times plain decoding's rate (the curve leaves out the proposer's and verify's own
overheads, so a break-even D would lose).

Estimates: a_j is an exponential moving average per position, updated after each round from
(proposed, accepted): positions 1..a were accepted (1), position a + 1 was rejected (0) when
a < proposed; later positions were not observed. What was asked but not proposed (an n-gram
with no match) is not observed either. A new request starts from a process-wide prior, itself
a slower EMA of every request's observations, so an open-ended workload learns fast. A
position not observed yet (by the request, or by anyone for the prior) takes the estimate of
the last one observed before it, as under i.i.d. acceptance, so D can grow past what was tried.

Probes: a request at D = 0 observes nothing, so after ``probe_after`` plain rounds (counted
over all requests: the back-off is process-wide) the request whose turn it is drafts once, the
best-looking D > 0. If its estimates then favour speculating, speculation is back (and the wait
is reset); if not, the wait doubles, up to ``max_wait`` rounds. Process-wide, because a probe
with a draft model also pays for the draft catching up on the tokens it skipped: over many
short requests a per-request back-off would keep probing each of them at its shortest wait.

Only D varies: verification is unchanged, so the output distribution is the target's whatever
D each round drafts (D depends on past rounds only). Seeded outputs, though, depend on the D
of each round, which depends on the prior, so on what ran before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ADAPTIVE = "adaptive"
DEFAULT_MAX_DRAFT_LEN = 8


def is_adaptive(draft_len: object) -> bool:
    return draft_len == ADAPTIVE


@dataclass
class AdaptiveState:
    """One request's estimates and probe bookkeeping."""

    accept: list[float]  # [j-1]: a_j, the EMA of P(position j accepted | positions < j were)
    known: int = 0  # leading positions with an estimate; later ones take a_known's
    probing: bool = False  # its last round was a probe


class AdaptiveDraft:
    """Chooses D per request per round (see the module docstring); pure Python.

    ``target_cost[T - 1]`` is t(T) / t(1) for T = 1 … (at least 2 values; longer T are
    extrapolated from the last two, and the curve is made non-decreasing); ``draft_cost`` is
    one draft step / t(1).
    """

    def __init__(self, max_draft_len: int, target_cost: Sequence[float], draft_cost: float = 0.0,
                 rate: float = 0.3, prior_rate: float = 0.05, initial: float = 0.6,
                 min_gain: float = 1.02, probe_after: int = 16, max_wait: int = 512) -> None:
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be ≥ 1, got {max_draft_len}")
        if not target_cost:
            raise ValueError("target_cost needs t(1) at least")
        self.max_draft_len = max_draft_len
        self.cost = relative_costs(target_cost, max_draft_len + 1)  # [T-1] → t(T)/t(1)
        self.draft_cost = max(0.0, float(draft_cost))
        self.rate, self.prior_rate, self.initial = rate, prior_rate, initial
        self.min_gain, self.probe_after, self.max_wait = min_gain, probe_after, max_wait
        self.prior = [initial] * max_draft_len
        self.observed = [0] * max_draft_len  # observations of each position, all requests
        self.idle, self.wait = 0, probe_after  # plain rounds since the last probe, and before
        # the next one (all requests)

    def start(self) -> AdaptiveState:
        """A new request's state: the prior (positions nobody observed follow the last one
        observed, or the initial guess)."""
        known = next((j for j, n in enumerate(self.observed) if not n), self.max_draft_len)
        return AdaptiveState(self.prior[:known] or [self.initial], known)

    def rates(self, state: AdaptiveState, cap: int) -> list[float]:
        """Expected tokens per unit time (plain decoding = 1) for D = 0 … cap."""
        accept = state.accept
        out, emitted, run = [1.0], 1.0, 1.0
        for d in range(1, min(cap, self.max_draft_len) + 1):
            run *= accept[d - 1] if d <= len(accept) else accept[-1]
            emitted += run
            out.append(emitted / (self.cost[d] + d * self.draft_cost))
        return out

    def choose(self, state: AdaptiveState, cap: int) -> int:
        """D for this request's next round, at most ``cap`` (and max_draft_len)."""
        rates = self.rates(state, cap)
        if len(rates) == 1:
            return 0
        best = max(range(1, len(rates)), key=rates.__getitem__)  # the best-looking D > 0
        if rates[best] >= self.min_gain:
            return best
        if self.idle >= self.wait:
            self.idle, state.probing = 0, True
            return best
        self.idle += 1
        return 0

    def update(self, state: AdaptiveState, proposed: int, accepted: int) -> None:
        """Learn from a round that proposed ``proposed`` drafts and accepted ``accepted``."""
        hits = min(accepted, proposed, self.max_draft_len)
        miss = accepted < proposed and accepted < self.max_draft_len
        seen = hits + miss  # positions this round observed
        accept = state.accept
        if seen > state.known:  # new positions start from what the request assumed of them
            del accept[state.known:]
            accept += [accept[-1] if accept else self.initial] * (seen - len(accept))
            state.known = seen
        for j in range(seen):
            x = 1.0 if j < hits else 0.0
            accept[j] += self.rate * (x - accept[j])
            # the prior: a running mean (the initial guess counts once) until it is as slow
            # as its EMA
            self.observed[j] += 1
            self.prior[j] += max(self.prior_rate, 1 / (self.observed[j] + 1)) * (x - self.prior[j])
        if state.probing and seen:  # did the probe pay (bring speculation back)? else wait
            state.probing = False  # longer. One that proposed nothing (no match) tells nothing
            rates = self.rates(state, self.max_draft_len)
            self.wait = self.probe_after if max(rates[1:]) >= self.min_gain else min(
                2 * self.wait, self.max_wait)


def relative_costs(target_cost: Sequence[float], n: int) -> list[float]:
    """t(T)/t(1) for T = 1 … n from measured values (any unit): normalised, made
    non-decreasing (scoring more tokens never costs less: what looks cheaper is noise), and
    extended linearly from the last two values (or +2 % per token from one)."""
    base = float(target_cost[0])
    if base <= 0:
        raise ValueError(f"t(1) must be > 0, got {base}")
    out: list[float] = []
    for value in list(target_cost)[:n]:
        out.append(max(float(value) / base, out[-1] if out else 1.0))
    slope = out[-1] - out[-2] if len(out) > 1 else 0.02
    while len(out) < n:
        out.append(out[-1] + max(slope, 0.0))
    return out
