"""Adaptive draft length: per round, the D that pays for itself, for each request or the batch.

For a request whose estimated acceptance at draft position j (given positions < j accepted)
is a_j, a round that drafts D tokens emits on average

    E[emitted | D] = 1 + Σ_{i=1..D} Π_{j≤i} a_j

tokens and costs time(D) = t(D+1) + D·t_draft, where t(T) is what the target takes to score T
new tokens in a row and t_draft one draft step (0 for model-free proposers), both relative to
t(1), a plain decoding step. The chooser picks the D ∈ {0 … K} with the most tokens per unit
of time; D = 0 (plain decoding, through the same verify()) unless some D > 0 promises at least
``min_gain`` times plain decoding's rate (default 1.05: the curve leaves out the proposer's and
verify's own overheads, so a break-even D would lose, and the rates are estimates: batch-aware,
a round's cost is the ratio of two averages timed seconds apart on a machine whose speed
drifts; at 1.02, on open-ended prompts at 16 clients, the batch-aware chooser drafted in
rounds it rated 1.02–1.16× plain that ran below plain. The per-request chooser, untimed, has
the same default).

Model-free proposers do not always propose what they are asked for: an n-gram or suffix
lookup with no match proposes nothing, one with a short match fewer tokens. So a request also
has a supply s_j = P(the proposer gives position j | it gave position j − 1 and was asked for
j), and a row asked for D drafts emits on average

    E[emitted | D] = 1 + Σ_{i=1..D} Π_{j≤i} s_j · a_j

(a draft model always proposes: s_j = 1, and this is the formula above). Its round costs what
a round of the drafts it got costs: with r_k = Π_{j≤k} s_j = P(it gets ≥ k drafts),

    E[time | D] = Σ_{k=0..D} (r_k − r_{k+1}) · time(k),   r_0 = 1, r_{D+1} = 0,

where time(0), a round that got no draft, is a plain round plus the lookups that found nothing
(1 until the executor timed such rounds, trtspec.spec.round_cost, and never less; the
per-request chooser has no clock: 1). Counting a miss as a rejection alone (as a_j) would
price it as a round of the asked width; leaving it out (as trtspec did before) prices it as a
proposal accepted as often as real ones, and on open-ended prompts, where lookups mostly miss,
the chooser drafted where it lost (0.82–0.96× plain at 4–16 clients, one run a cell, in an
earlier reports/bench-serve-clients.md: git history).

Estimates: a_j and s_j are exponential moving averages per position, updated after each
round from (asked, proposed, accepted): positions 1..proposed were supplied (1) and position
proposed + 1 was not (0) when proposed < asked; positions 1..a were accepted (1) and position
a + 1 was rejected (0) when a < proposed; later positions were not observed. A new request
starts from a process-wide prior, itself a slower EMA of every request's observations (at
first a running mean in which the initial guess, ``initial`` for a_j and 1 for s_j, counts as
``prior_weight`` observations), so an open-ended workload learns fast. An acceptance not
observed yet (by the request, or by anyone for the prior) takes the estimate of the last one
observed before it, as under i.i.d. acceptance, so D can grow past what was tried. A supply
not observed yet takes the last one observed past position 1, else 1: s_1 is whether a lookup
matches at all, s_j (j ≥ 2) whether a match goes on, which it mostly does; probes ask for one
draft, so s_1 taken for every position would, after a few misses, rule out the widths that
would teach otherwise.

Probes: a request at D = 0 observes nothing, so after ``probe_after`` plain rounds (counted
over all requests: the back-off is process-wide) the request whose turn it is drafts once, the
best-looking D > 0. If its estimates then favour speculating, speculation is back (and the wait
is reset); if not, the wait doubles, up to ``max_wait`` rounds. Process-wide, because a probe
with a draft model also pays for the draft catching up on the tokens it skipped: over many
short requests a per-request back-off would keep probing each of them at its shortest wait.

Batch-aware (with a :class:`~trtspec.spec.round_cost.RoundCost`, as every build measures): a
round scores every running row at once, padded to the widest, so one row's D costs all of them.
Each round picks one width W ∈ {0 … K}; row i drafts D_i = min(W, cap_i) (cap_i: its budget),
and W maximises the round's expected tokens per unit of time,

    Σ_i E_i[emitted | D_i] / Σ_{k=0..W} P(the widest row gets k drafts) · time_B(k),

time_B(k) = (t(B, k + 1) + k · t_draft · t(B, 1)) / t(B, 1) for k ≥ 1 and time_B(0) a round in
which no row got a draft, P(widest ≤ k) = Π_i (1 − r^(i)_{k+1}) (rows taken as independent:
where their lookups miss together, a round is cheaper than this says), against plain
decoding's rate (W = 0: plain decoding through the same verify()), with the same
``min_gain`` and probes as above (one probe is a round of all rows drafting one token each,
the cheapest round that observes anything, and it also waits until its expected extra cost
over a plain round is at most ``probe_budget`` of the plain rounds since the last: on the
2-core CPU a 4-row probe costs ~0.8 of a round, so it waits ~40; the wait is judged by the next
round that knows what a probe saw). t(B, W) is the round cost measured at build for B rows × W
tokens, relative to t(1, 1); a draft model's step is assumed to grow with rows as the target's
plain step does. Why one W and not one D per row: rows are padded to the widest anyway, so a
row drafting less saves nothing, and a proposer drafts every row in the same batched steps.

Measured rounds (``timed``, which a chooser from a build's measured costs is): the build's
t(B, W) times the scoring call alone, at build time; in service the executor times every round
it runs into a :class:`~trtspec.spec.round_cost.RoundClock`, and a width's price is what such
rounds took here, never below the table's (trtspec.spec.round_cost says why and how).

Only D varies: verification is unchanged, so the output distribution is the target's whatever
D each round drafts (D depends on past rounds only). Seeded outputs, though, depend on the D
of each round, which depends on the prior, so on what ran before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trtspec.spec.round_cost import RoundClock, RoundCost

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
    supply: list[float] = field(default_factory=list)  # [j-1]: s_j, the EMA of P(position j
    # proposed | position j − 1 was, j asked)
    supplied: int = 0  # leading positions with a supply estimate

    def accept_at(self, position: int, initial: float) -> float:
        """a_j at 1-based ``position``: its own, else the last one's, else ``initial``."""
        accept = self.accept
        return accept[min(position, len(accept)) - 1] if accept else initial

    def supply_at(self, position: int) -> float:
        """s_j at 1-based ``position``: its own, else the last one's past position 1, else 1
        (module docstring: s_1 is a match at all, later ones a match going on)."""
        supply = self.supply
        if position <= len(supply):
            return supply[position - 1]
        return supply[-1] if position > 1 and len(supply) > 1 else 1.0

    def reach(self, drafts: int) -> list[float]:
        """r_k = P(a round asking ``drafts`` gets ≥ k of them) for k = 0 … drafts."""
        out = [1.0]
        for j in range(1, drafts + 1):
            out.append(out[-1] * self.supply_at(j))
        return out


@dataclass(frozen=True)
class ProbeMark:
    """The chooser's probe bookkeeping at one moment (:meth:`AdaptiveDraft.mark`)."""

    idle: int
    wait: int
    probed: bool
    probe_saw: bool
    would_draft: bool
    probing: tuple[tuple[AdaptiveState, bool], ...]  # each request's state and its flag


class AdaptiveDraft:
    """Chooses D per round (see the module docstring); pure Python.

    ``target_cost[T - 1]`` is t(T) / t(1) for T = 1 … (at least 2 values; longer T are
    extrapolated from the last two, and the curve is made non-decreasing); ``draft_cost`` is
    one draft step / t(1). With ``round_cost`` the choice is batch-aware (:meth:`choose_round`);
    without, each request chooses alone from ``target_cost``.
    """

    def __init__(self, max_draft_len: int, target_cost: Sequence[float], draft_cost: float = 0.0,
                 rate: float = 0.3, prior_rate: float = 0.05, initial: float = 0.6,
                 prior_weight: int = 8, probe_budget: float = 0.02,
                 min_gain: float = 1.05, probe_after: int = 16, max_wait: int = 512,
                 round_cost: RoundCost | None = None, timed: bool = False) -> None:
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be ≥ 1, got {max_draft_len}")
        if not target_cost:
            raise ValueError("target_cost needs t(1) at least")
        self.max_draft_len = max_draft_len
        self.cost = relative_costs(target_cost, max_draft_len + 1)  # [T-1] → t(T)/t(1)
        self.draft_cost = max(0.0, float(draft_cost))
        self.rate, self.prior_rate, self.initial = rate, prior_rate, initial
        self.prior_weight, self.probe_budget = prior_weight, probe_budget
        self.min_gain, self.probe_after, self.max_wait = min_gain, probe_after, max_wait
        self.prior = [initial] * max_draft_len
        self.observed = [0] * max_draft_len  # observations of each position, all requests
        self.supply_prior = [1.0] * max_draft_len  # the same for s_j
        self.supply_observed = [0] * max_draft_len
        self.idle, self.wait = 0, probe_after  # plain rounds since the last probe, and before
        # the next one (all requests)
        self.round_cost = round_cost
        self._table_times: dict[tuple[int, int], list[float]] = {}  # (B, widest) → time_B(k)
        # batch-aware, with costs worth correcting: the executor times its rounds into it
        self.clock = RoundClock() if timed and round_cost is not None else None
        self.probed = False  # batch-aware: a probe whose verdict is pending
        self.probe_saw = False  # … and it (or a round since) observed something
        self.would_draft = True  # batch-aware: the last round chosen would have drafted or
        # probed but for a stale clock (:meth:`wants_timing`; before any round: assume so)

    def mark(self, states: Sequence[AdaptiveState]) -> ProbeMark:
        """What choosing a round may change (the probe bookkeeping: plain rounds waited, a
        probe started), for ``states`` too, so a round that fails before it is observed can
        be put back (:meth:`back_to`): run again, it would otherwise count as two rounds
        waited, or start a probe whose verdict never comes."""
        return ProbeMark(self.idle, self.wait, self.probed, self.probe_saw, self.would_draft,
                         tuple((s, s.probing) for s in states)
                         if self.round_cost is None else ())  # (batch-aware: never set)

    def back_to(self, mark: ProbeMark) -> None:
        """The probe bookkeeping as :meth:`mark` found it."""
        self.idle, self.wait, self.probed, self.probe_saw, self.would_draft = \
            mark.idle, mark.wait, mark.probed, mark.probe_saw, mark.would_draft
        for state, probing in mark.probing:
            state.probing = probing

    def start(self) -> AdaptiveState:
        """A new request's state: the prior (positions nobody observed follow the last one
        observed, or the initial guess)."""
        known = next((j for j, n in enumerate(self.observed) if not n), self.max_draft_len)
        supplied = next((j for j, n in enumerate(self.supply_observed) if not n),
                        self.max_draft_len)
        return AdaptiveState(self.prior[:known] or [self.initial], known,
                             supply=self.supply_prior[:supplied], supplied=supplied)

    def emitted(self, state: AdaptiveState, cap: int) -> list[float]:
        """E[emitted | D] for D = 0 … min(cap, K)."""
        out, run = [1.0], 1.0
        for d in range(1, min(cap, self.max_draft_len) + 1):
            run *= state.accept_at(d, self.initial) * state.supply_at(d)
            out.append(out[-1] + run)
        return out

    def rates(self, state: AdaptiveState, cap: int) -> list[float]:
        """Expected tokens per unit time (plain decoding = 1) for D = 0 … cap, one row: a
        round costs what the drafts it gets cost (one that gets none, a plain round)."""
        return [e / widest_cost([state.reach(d)], lambda k: self.cost[k] + k * self.draft_cost)
                for d, e in enumerate(self.emitted(state, cap))]

    def round_rates(self, states: Sequence[AdaptiveState], caps: Sequence[int], rows: int,
                    clocked: bool = True) -> list[float]:
        """Expected tokens per unit time of a round of these requests (plain decoding = 1) for
        W = 0 … max cap, each request drafting min(W, its cap); ``rows``: rows the round scores
        (B); not ``clocked``: at the round cost's prices alone (:meth:`round_time`)."""
        emitted = [self.emitted(s, max(c, 0)) for s, c in zip(states, caps, strict=True)]
        # once a round, not once a width: each row's r_k and time_B(k) for every k
        reaches = [s.reach(len(e) - 1) for s, e in zip(states, emitted, strict=True)]
        widest = max((len(e) for e in emitted), default=1) - 1
        times = self._round_times(rows, widest, clocked) if widest else []  # none: nothing
        # to draft
        out = []
        for w in range(widest + 1):
            ds = [min(w, len(e) - 1) for e in emitted]
            tokens = sum(e[d] for e, d in zip(emitted, ds, strict=True))
            time = widest_cost([r[: d + 1] for r, d in zip(reaches, ds, strict=True)],
                               times.__getitem__) if any(ds) else 1.0
            out.append(tokens / len(emitted) / time)
        return out

    def expected_time(self, states: Sequence[AdaptiveState], drafts: Sequence[int], rows: int,
                      clocked: bool = True) -> float:
        """E[a round's time] over a plain round's at ``rows`` rows, row i asked for
        ``drafts[i]``: Σ_k P(the widest row gets k drafts) · time_B(k) (module docstring)."""
        if not any(drafts):
            return 1.0
        return widest_cost([s.reach(d) for s, d in zip(states, drafts, strict=True)],
                           self._round_times(rows, max(0, max(drafts)), clocked).__getitem__)

    def _round_times(self, rows: int, widest: int, clocked: bool = True) -> list[float]:
        """time_B(k) for k = 0 … ``widest`` drafts: a round whose widest row got k drafts
        (k + 1 tokens; 0: none got one) over a plain round, at ``rows`` rows. The round
        cost's alone (not ``clocked``, or no clock) never change: worked out once."""
        if clocked and self.clock is not None:
            return [self.round_time(rows, k + 1 if k else 0) for k in range(widest + 1)]
        key = (rows, widest)
        if key not in self._table_times:
            self._table_times[key] = [self.round_time(rows, k + 1 if k else 0, False)
                                      for k in range(widest + 1)]
        return self._table_times[key]

    def round_time(self, rows: int, width: int, clocked: bool = True) -> float:
        """A round of ``width`` tokens in each of ``rows`` rows over a plain round (W = 1) at
        the same rows: (t(B, W) + (W − 1)·t_draft·t(B, 1)) / t(B, 1) from the round cost, or
        what such rounds took here (:class:`~trtspec.spec.round_cost.RoundClock`; not
        ``clocked``: the round cost's ratio alone), never below the round cost's ratio
        (trtspec.spec.round_cost says why). Width 0: a round asked for drafts that got none
        (1, a plain round, until such rounds were timed; never below 1)."""
        assert self.round_cost is not None
        cost = self.round_cost
        clock = self.clock if clocked else None
        if width == 0:  # plain plus lookups: never cheaper than plain (the clock's floor)
            return 1.0 if clock is None else clock.relative(rows, 0, lambda b, w: 1.0)

        def model(b: int, w: int) -> float:
            step = cost.time(b, 1)
            return (cost.time(b, w) + (w - 1) * self.draft_cost * step) / step

        return model(rows, width) if clock is None else clock.relative(rows, width, model)

    def observe_round(self, rows: int, width: int, seconds: float) -> None:
        """The executor's word that a round of ``width`` tokens a row (the widest row's
        drafts + 1; 0: asked for drafts, got none) at ``rows`` rows took ``seconds``; ignored
        unless ``timed``."""
        if self.clock is not None:
            self.clock.observe(rows, width, seconds)

    def choose_round(self, states: Sequence[AdaptiveState], caps: Sequence[int], rows: int
                     ) -> list[int]:
        """Every request's D for one round (``caps``: each one's most, its budget; ``rows``:
        the rows the round scores). Batch-aware with a round cost, else each request alone."""
        if self.round_cost is None:
            return [self.choose(s, c) if c > 0 else 0 for s, c in zip(states, caps, strict=True)]
        if self.clock is not None and self.clock.stale(rows):  # the baseline is due a timing:
            # plain. Could the timing change that? Only where the round cost's prices, which
            # the clock never goes below, say draft, or say a probe is due (wants_timing)
            table = self.round_rates(states, caps, rows, clocked=False) if states else [1.0]
            self.would_draft = len(table) > 1 and (
                max(table[1:]) >= self.min_gain or self._probe_due(states, caps, rows, False))
            if len(table) > 1 and not self.would_draft:
                self.idle += 1  # a plain round waited all the same: a probe comes due (then
                # a timing is wanted), however long chunks keep the clock stale
            return [0] * len(caps)
        self.would_draft = False
        # the round cost's prices first: the clock never prices a width below them, so its
        # rates are at most these, and where these draft nothing (most rounds under load)
        # the clock's, dearer to compute, would not either (the verdict and the probe below
        # ask only whether the best is under min_gain)
        rates = self.round_rates(states, caps, rows, clocked=False) if states else [1.0]
        if len(rates) == 1:
            return [0] * len(caps)  # nothing to draft
        if self.clock is not None and max(rates[1:]) >= self.min_gain:
            rates = self.round_rates(states, caps, rows)
        best = max(range(1, len(rates)), key=rates.__getitem__)  # the best-looking W > 0
        if self.probed and self.probe_saw:  # the probe's observations are in (a miss is
            self.probed = False  # one: it lowered s_1): did speculating come back?
            self.wait = self.probe_after if rates[best] >= self.min_gain else min(
                2 * self.wait, self.max_wait)
        if rates[best] < self.min_gain:
            if not self._probe_due(states, caps, rows):
                self.idle += 1
                return [0] * len(caps)
            self.idle, self.probed, self.probe_saw = 0, True, False
            best = 1  # a probe asks the least that tells: one draft a row
        self.would_draft = True
        return [max(0, min(best, c)) for c in caps]

    def _probe_due(self, states: Sequence[AdaptiveState], caps: Sequence[int], rows: int,
                   clocked: bool = True) -> bool:
        """Whether a probe's turn has come (batch-aware): ``wait`` plain rounds, and as many
        as make its expected extra cost over a plain round ≤ ``probe_budget`` of them (a
        probe of many rows costs more)."""
        if self.idle < self.wait:  # not yet whatever a probe costs (most plain rounds)
            return False
        extra = self.expected_time(states, [min(1, c) for c in caps], rows, clocked) - 1
        return self.idle >= max(self.wait, extra / self.probe_budget)

    def wants_timing(self, rows: int) -> bool:
        """Whether a plain round at ``rows`` rows is due a timing that could change a choice:
        the clock's baseline there is stale (:meth:`~trtspec.spec.round_cost.RoundClock.stale`)
        and the last round chosen drafted or probed, or, where that round was stale, would have
        at the round cost's prices (the last round's rows and states stand for the next's,
        which may differ by a request). The scheduler then gives the next round a call of its
        own (a round with a prompt's chunk in its call is not timed). Where the round cost says
        plain and no probe is due, no timing can change that: the clock never prices a width
        below the round cost's ratio. Stale rounds that want no timing count toward the next
        probe, whose turn then wants one."""
        return self.clock is not None and self.would_draft and self.clock.stale(rows)

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

    def update(self, state: AdaptiveState, proposed: int, accepted: int,
               asked: int | None = None) -> None:
        """Learn from a round that was asked for ``asked`` drafts [default: ``proposed``],
        proposed ``proposed`` and accepted ``accepted``."""
        k = self.max_draft_len
        asked = proposed if asked is None else max(asked, proposed)
        given = min(proposed, k)
        supplied = [1.0] * given + [0.0] * (proposed < asked and proposed < k)
        hits = min(accepted, proposed, k)
        accepted_ = [1.0] * hits + [0.0] * (accepted < proposed and accepted < k)
        state.supplied = self._learn(state.supply, state.supplied, supplied,
                                     self.supply_prior, self.supply_observed, state.supply_at)
        state.known = self._learn(state.accept, state.known, accepted_, self.prior,
                                  self.observed, lambda j: state.accept_at(j, self.initial))
        seen = bool(supplied or accepted_)  # a miss tells too: the lookups come up empty
        self.probe_saw |= seen
        if state.probing and seen:  # did the probe pay (bring speculation back)? else wait
            state.probing = False  # longer
            rates = self.rates(state, self.max_draft_len)
            self.wait = self.probe_after if max(rates[1:]) >= self.min_gain else min(
                2 * self.wait, self.max_wait)


    def _learn(self, values: list[float], known: int, outcomes: Sequence[float],
               prior: list[float], observed: list[int], assumed: Callable[[int], float]
               ) -> int:
        """One request's EMA ``values`` (its first ``known`` positions estimated) and the
        process-wide ``prior`` learn ``outcomes`` (0/1 at positions 1, 2, …); ``assumed(j)``:
        what the request took position j for until now. Returns the positions now known."""
        if len(outcomes) > known:  # new positions start from what the request assumed of them
            start = [assumed(j) for j in range(known + 1, len(outcomes) + 1)]
            del values[known:]
            values += start
            known = len(outcomes)
        for j, x in enumerate(outcomes):
            values[j] += self.rate * (x - values[j])
            # the prior: a running mean (the initial guess counts as prior_weight
            # observations, so a few lucky rounds do not make every new request bold) until it
            # is as slow as its EMA
            observed[j] += 1
            prior[j] += max(self.prior_rate, 1 / (observed[j] + self.prior_weight)) \
                * (x - prior[j])
        return known


def widest_cost(reaches: Sequence[Sequence[float]], time: Callable[[int], float]) -> float:
    """Σ_k P(the widest row gets k drafts) · time(k), where row i gets ≥ k drafts with
    probability ``reaches[i][k]`` (k up to what it asked; never more), rows independent."""
    width = max((len(r) - 1 for r in reaches), default=0)
    total, below = 0.0, 0.0  # below: P(widest ≤ k − 1)
    for k in range(width + 1):
        at_most = 1.0  # P(widest ≤ k) = Π_i P(row i gets ≤ k) = Π_i (1 − r_{k+1})
        for r in reaches:
            at_most *= 1 - r[k + 1] if k + 1 < len(r) else 1.0
        total += (at_most - below) * time(k)
        below = at_most
    return total


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
