"""What a round costs: the build's table of t(B, W), and the clock of what rounds took here.

A round scores W tokens in each of B rows in one call (padded to the widest row); the
batch-aware chooser (trtspec.spec.adaptive) prices a width by t(B, W) / t(B, 1), what such a
round costs over a plain one at the same rows. :class:`RoundCost` is the table the build
measured, t(B, W) / t(1, 1); :class:`RoundClock` what rounds took in service.

Measured rounds (a ``timed`` chooser, which one from a build's measured costs is): the build's
t(B, W) times the scoring call alone, on a scratch context, at build time; a round in service
also proposes, verifies and commits, at the context it has, beside whatever else the machine
runs, and on a 2-core CPU a 4-row round of 3 tokens measured 0.96 t(B, 1) at build and 1.3 in
service. So the executor times every round it runs and :class:`RoundClock` keeps an EMA of the
seconds per (B, W); a round's cost relative to plain decoding's at the same B is then what was
observed (t̂(B, W)/t̂(B, 1)), and a width not observed yet takes the table's ratio scaled by
how far the observed widths at those rows (else the nearest rows observed) were off the table.
A ratio from the clock (observed, or the table's scaled) is never taken below the table's. Its
two averages are timed seconds apart (the plain one up to ``refresh`` rounds earlier), and on a
shared machine the speed drifts by more than a round's gain in that time: on the 2-core CPU,
open-ended prompts at 16 clients, rounds of 8 rows × 2 tokens ran at 1.22–1.27× the plain
rounds of the same run (the table: 1.11×) while the clock's ratio fell to 0.9–1.0 in runs where
the machine sped up, and the chooser drafted on it and lost. The floor costs where a runner's
true ratios are below its table (a large fixed cost per round, longer contexts than the
table's): there each width is priced above what it costs, so the chooser may speculate in fewer
rounds (or at another width) than it could; it never makes a width look cheaper than the build
measured it. At rows whose plain rounds were last timed ``refresh`` speculative rounds ago (or
never), the next round is plain: it costs at most one round's gain in ``refresh`` and keeps the
baseline it is judged against current. A round that did one-off work (grew the cache, swapped
rows, compiled a graph) is not timed; one asked to draft that proposed nothing (every row's
lookup missed) is timed as width 0 (the chooser's time_B(0), trtspec.spec.adaptive), apart from
plain rounds (its lookups are no plain round's), and on a GPU the clock waits for the queued
work before and after. What each round costs is then the time it took, not a model of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


class RoundCost:
    """t(B, W) / t(1, 1): a round that scores W tokens in each of B rows, from a table of
    measured times (rows → width → any unit; widths 1 … n for every row). A round with drafts
    (W ≥ 2) is scored as the cheapest measured width W′ ≥ W when that is at least
    ``pad_margin`` cheaper (:meth:`width`): BLAS runs some shapes much faster than smaller ones
    (on a 2-core CPU, 16 tokens cost less than 14), and a padded position changes no earlier
    position's logits. Plain decoding (W = 1) is never padded, so it costs what the baseline
    costs. Rows between two measured are interpolated, rows past the last scaled in
    proportion; widths past the last extended by the row's mean slope."""

    def __init__(self, table: Mapping[int, Mapping[int, float]], pad_margin: float = 0.05
                 ) -> None:
        if not table or 1 not in table or 1 not in table[1]:
            raise ValueError("a round-cost table needs t(1 row, 1 token)")
        for b, widths in table.items():
            if int(b) < 1 or sorted(map(int, widths)) != list(range(1, len(widths) + 1)) or \
                    min(widths.values()) <= 0:
                raise ValueError(f"round cost for {b} rows: give widths 1 … n, each > 0 "
                                 f"(got {dict(widths)})")
        base = float(table[1][1])
        self.table = {int(b): [float(table[b][w]) / base for w in sorted(table[b])]
                      for b in sorted(table)}  # B → [W - 1] → relative time
        self.pad_margin = pad_margin

    @classmethod
    def linear(cls, slope: float, rows: int, widths: int) -> RoundCost:
        """t(B, W) = 1 + slope · (B·W − 1): what models with no honest timing (toy) assume."""
        return cls({b: {w: 1 + slope * (b * w - 1) for w in range(1, widths + 1)}
                    for b in range(1, rows + 1)})

    def _row(self, rows: int) -> list[float]:
        """Relative times of W = 1 … (measured) for ``rows`` rows."""
        known = sorted(self.table)
        if rows in self.table:
            return self.table[rows]
        if rows > known[-1]:
            return [t * rows / known[-1] for t in self.table[known[-1]]]
        low = max(b for b in known if b < rows)
        high = min(b for b in known if b > rows)
        f = (rows - low) / (high - low)
        return [a + f * (b - a) for a, b in zip(self.table[low], self.table[high], strict=False)]

    def _raw(self, rows: int, width: int) -> float:
        ts = self._row(max(1, rows))
        if width <= len(ts):
            return ts[width - 1]
        slope = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.02
        return ts[-1] + max(slope, 0.0) * (width - len(ts))

    def width(self, rows: int, width: int) -> int:
        """The width a round of ``width`` tokens per row is best scored at (≥ width)."""
        ts = self._row(max(1, rows))
        if width <= 1 or width >= len(ts):
            return width
        best = min(range(width, len(ts) + 1), key=lambda w: (ts[w - 1], w))
        return best if ts[best - 1] <= (1 - self.pad_margin) * ts[width - 1] else width

    def time(self, rows: int, width: int) -> float:
        """t(B, W) / t(1, 1), scored at :meth:`width`."""
        return self._raw(rows, self.width(rows, width))


class RoundClock:
    """Seconds that rounds took in service: an EMA per (rows B, tokens per row W; W = 0 a
    round asked for drafts that got none), and how many speculative rounds ran at each B
    since its last plain one (see the module docstring). A cell counts from its third round
    on, starting from the median of the three (one cold round, a late compile, must not rule
    a width out); after that ``rate`` weighs the newest round, and one that took more than
    ``spike`` times the EMA counts as ``spike`` times it (a pause of the machine).
    ``refresh`` speculative rounds without a plain one at some B make the next round there
    plain, and so does a B whose plain rounds have not counted yet. A cell not timed in the
    last ``forget`` rounds at its B is forgotten (a width judged dear is never chosen, so
    never timed again: it goes back to the table's ratio, scaled)."""

    FIRST = 3  # rounds a cell takes before it counts

    def __init__(self, rate: float = 0.2, refresh: int = 32, spike: float = 2.0,
                 forget: int = 512) -> None:
        self.rate, self.refresh, self.spike, self.forget = rate, refresh, spike, forget
        self.seconds: dict[tuple[int, int], float] = {}  # (B, W) → EMA of a round's seconds
        self.first: dict[tuple[int, int], list[float]] = {}  # (B, W) → its first rounds
        self.since_plain: dict[int, int] = {}  # B → speculative rounds since its plain one
        self.rounds: dict[int, int] = {}  # B → rounds timed there
        self.timed_at: dict[tuple[int, int], int] = {}  # (B, W) → rounds[B] when last timed

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A round of ``width`` tokens in each of ``rows`` rows took ``seconds``."""
        key = (rows, width)
        old = self.get(rows, width)
        self.rounds[rows] = self.rounds.get(rows, 0) + 1
        if old is None:  # new, or forgotten: counts from its FIRST-th round on
            first = self.first.setdefault(key, [])
            stale = key in self.timed_at and \
                self.rounds[rows] - 1 - self.timed_at[key] >= self.forget
            if key in self.seconds or stale:  # forgotten (or its first rounds are): starts
                self.seconds.pop(key, None)  # again
                first.clear()
            first.append(seconds)
            if len(first) == self.FIRST:
                self.seconds[key] = sorted(first)[len(first) // 2]
                del self.first[key]
        else:
            self.seconds[key] = old + self.rate * (min(seconds, self.spike * old) - old)
        self.timed_at[key] = self.rounds[rows]
        self.since_plain[rows] = 0 if width == 1 else \
            self.since_plain.get(rows, self.refresh) + 1

    def get(self, rows: int, width: int) -> float | None:
        """The EMA of (rows, width), unless it does not count yet or was last timed
        ``forget`` rounds ago."""
        if (rows, width) not in self.seconds or \
                self.rounds[rows] - self.timed_at[rows, width] >= self.forget:
            return None
        return self.seconds[rows, width]

    def stale(self, rows: int) -> bool:
        """Whether the next round at ``rows`` rows should be plain, to time the baseline."""
        return bool(self.rounds) and (self.get(rows, 1) is None or self.since_plain.get(
            rows, self.refresh) >= self.refresh)

    def relative(self, rows: int, width: int, model: Callable[[int, int], float]) -> float:
        """A round of ``width`` tokens a row over a plain round, at ``rows`` rows: observed
        where both were timed at these rows; else ``model(rows, width)`` (the table's ratio)
        scaled by the mean of observed ÷ model over the widths timed at these rows, or else at
        the nearest rows with such widths; else ``model(rows, width)``. Never below
        ``model(rows, width)``: a cheaper reading is the machine's drift between two averages
        timed apart, not the round (see the module docstring)."""
        if width == 1:
            return 1.0
        table = model(rows, width)
        plain, seen = self.get(rows, 1), self.get(rows, width)
        if plain is not None and seen is not None:
            return max(seen / plain, table)
        if width == 0:  # a round whose lookups all missed, not timed here yet: plain
            return table
        return table * max(1.0, self._scale(rows, model))

    def _scale(self, rows: int, model: Callable[[int, int], float]) -> float:
        def scale(b: int) -> float | None:
            plain = self.get(b, 1)
            timed = [(w, self.get(r, w)) for r, w in self.seconds if r == b and w > 1]
            ratios = [t / plain / model(b, w) for w, t in timed
                      if t is not None and plain is not None]
            return sum(ratios) / len(ratios) if ratios else None

        for b in sorted({r for r, _ in self.seconds}, key=lambda r: (abs(r - rows), r)):
            found = scale(b)  # the model of B rows is not ratio-for-ratio another B's, but
            if found is not None:  # how far off it is carries over better than nothing
                return found
        return 1.0
