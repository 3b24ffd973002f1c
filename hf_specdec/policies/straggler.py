"""A static batch ends with its slowest row: the time speculation adds at the end of a call. Pure Python.

In generate() a call lasts until its last row is done. Plain decoding moves every row one token
per step, so rows with the same budget finish together. Speculation moves a row 1 + (its accepted
drafts) tokens, a random number, so rows drift apart and the call waits for the unluckiest (tiny
pair, B=16, k=2: 39 steps with all rows, then 9 with 14..1 rows, ~13% of the call). A step's own
goodput does not see this. With X a row's tokens per step (mean mu, variance var) and r tokens
left, a row needs about r/mu steps, with variance r var / mu^3 (renewal central limit), and the
last of B rows about
    r/mu + z_B sqrt(r var / mu^3),    z_B = E[max of B standard normals],
so drafting takes `stretch` = 1 + z_B sqrt(var / (r mu)) times the steps its goodput promises
(its tail steps costed as full ones: on an accelerator they nearly are). Rows also differ for good:
prompt lookup at SmolLM2, B=4, fixed:3, one call: one row passed 2 of 14 first drafts, another 8 of
9 (1.14 vs 3.56 tokens per step), and the call waited for the first. With row b's accepted drafts
per step (mu - 1) f_b, f_b spread by s (`RowSpread`) around 1, the slowest row's tokens per step
are about mu_s = 1 + (mu - 1) max(0, 1 - z_B s), and the stretch mu / mu_s (1 + z_B sqrt(var / (r mu_s)))
(z_B for both: conservative, the slowest row need not also be the unluckiest). Serving replaces rows as
they finish, so nothing waits there (StepContext.static_batch is False). Only rows still running
near the call's end can be last: rows that stop early (EOS, a stopping criterion, outputs of very
different lengths) wait for no one, so B is the share of rows that `FinishingRows` saw reach the
end of earlier calls; and of the rows running, only those about as far from their limit as the
furthest can be last (`contenders`).
"""
from __future__ import annotations

import bisect
import math
from functools import lru_cache


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """z_n = E[max of n independent standard normals] (z_1 = 0, z_2 = 1/sqrt(pi), z_16 = 1.77):
    the integral of x n phi(x) Phi(x)^(n-1), by the midpoint rule on [-10, 10]."""
    if n <= 1:
        return 0.0
    h, total = 0.005, 0.0
    for i in range(4000):
        x = -10.0 + (i + 0.5) * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2)))
        total += x * n * pdf * cdf ** (n - 1) * h
    return total


def emission_moments(ar: list[float]) -> tuple[float, float]:
    """Mean and variance of the tokens a row emits in a step whose drafts pass with cumulative
    probabilities ar[i - 1] = P(first i accepted): X = 1 + sum_i 1[first i accepted], and the
    indicators are nested, so E[(X - 1)^2] = sum_i (2i - 1) ar[i - 1]."""
    mean = sum(ar)
    square = sum((2 * i + 1) * a for i, a in enumerate(ar))
    return 1.0 + mean, max(0.0, square - mean * mean)


def stretch(batch: int, remaining: int, ar: list[float], rooms: list[int] = (), spread: float = 0.0) -> float:
    """How many times the steps a drafting step's rate promises a static batch of `batch` rows
    with `remaining` tokens to go takes to finish its slowest row (1.0: one row, nothing to
    draft, or the rest of the call unknown). rooms: the tokens each row may still emit, sorted
    ascending (`StepContext.rooms`), if known: only rows within reach of the longest can be last
    (`contenders`). At most the mean tokens per step: no row takes more steps than it has tokens
    to go. spread: the relative spread of the rows' acceptance beyond chance (`RowSpread`)."""
    if not ar:
        return 1.0
    return stretch_of_moments(batch, remaining, *emission_moments(ar), rooms, spread)


def stretch_of_moments(batch: int, remaining: int, mean: float, var: float, rooms: list[int] = (),
                       spread: float = 0.0) -> float:
    """`stretch` from a row's tokens per step, mean and variance (`emission_moments`), for callers
    that keep them."""
    if batch <= 1 or remaining <= 0:
        return 1.0
    if rooms:
        batch = min(batch, contenders(rooms, remaining, mean, var))
    z = expected_max_normal(batch)
    slowest = 1.0 + (mean - 1.0) * max(0.0, 1.0 - z * spread)      # tokens per step of the slowest row
    return min(mean, mean / slowest * (1.0 + z * math.sqrt(var / (remaining * slowest))))


def contenders(rooms: list[int], remaining: int, mean: float, var: float) -> int:
    """Rows that can still be a call's last: those whose room (`rooms`, sorted ascending) is within
    two standard deviations of the longest room's (`remaining`), in tokens over the steps it takes.
    Rows that drifted apart under speculation mostly cannot (tiny pair, B=16: 14 rows left with
    2-15 tokens to go)."""
    reach = 2.0 * math.sqrt(2.0 * remaining * var / mean)   # the difference of two rows' progress
    return len(rooms) - bisect.bisect_left(rooms, remaining - reach)


class FinishingRows:
    """The rows of a static batch that can be its last to finish, learned over calls: the share of
    a call's rows still running when its longest row had an eighth of its budget left (a moving
    average; 1 before any call, the worst case). Feed it every step's context (`update`)."""

    def __init__(self):
        self.share = 1.0
        self.start = 0          # this call's rows and budget at its first step (0: none yet)
        self.budget = 0
        self.counted = True

    def update(self, ctx) -> None:
        if ctx.step == 0:
            if not self.counted:         # the last call ended before its end phase: one row was last
                self._learn(1 / self.start)
            self.start, self.budget, self.counted = ctx.batch_size, ctx.remaining, not ctx.remaining
        if not self.counted and ctx.remaining <= max(1, self.budget // 8):
            self._learn(ctx.batch_size / self.start)
            self.counted = True

    def _learn(self, share: float) -> None:
        self.share += 0.3 * (share - self.share)

    def __call__(self, batch: int) -> int:
        """Of `batch` active rows, how many may be the last to finish."""
        return min(batch, max(1, round(self.share * self.start))) if self.start else batch


class RowSpread:
    """How much the rows' acceptance differs beyond chance: the standard deviation s of f_b = row
    b's accepted drafts / those the pooled pass rates predict, less the spread that sampling alone
    gives (a method of moments, per call), averaged over the last ~10 calls and taken at a lower
    confidence bound (the mean less two standard errors): rows that are alike read 0, not the noise
    of a few calls (simulated rows alike: up to 0.065 without the bound). Feed it every drafting
    step (`update`) with the accepted drafts predicted for each of its rows (mean and variance:
    `emission_moments`); read `spread`."""

    def __init__(self):
        self.rows: dict[int, list[float]] = {}   # this call, by batch index: [accepted, mean, variance]
        self.excess = 0.0                        # between-row variance, averaged over calls
        self.square = 0.0                        # ... and its square, for a standard error
        self.calls = 0

    def new_call(self) -> None:
        """Close the last call's estimate and start afresh (a new generate() call: new rows)."""
        seen = [(a / m, v / (m * m)) for a, m, v in self.rows.values() if m >= 1.0]
        self.rows = {}
        mean = sum(f for f, _ in seen) / len(seen) if seen else 0.0
        if len(seen) < 2 or mean <= 0:
            return
        spread = sum((f - mean) ** 2 for f, _ in seen) / (len(seen) - 1)
        chance = sum(v for _, v in seen) / len(seen)
        between = (spread - chance) / (mean * mean)   # relative to the rows' mean: the rates are pooled
        self.calls += 1
        weight = 1.0 / min(self.calls, 10)             # the last ~10 calls
        self.excess += weight * (between - self.excess)
        self.square += weight * (between * between - self.square)

    def update(self, rows: list[int], accepted: list[int], mean: float, variance: float) -> None:
        for b, a in zip(rows, accepted):
            row = self.rows.setdefault(b, [0.0, 0.0, 0.0])
            row[0] += a
            row[1] += mean
            row[2] += variance

    @property
    def spread(self) -> float:
        if self.calls < 2:
            return 0.0
        error = math.sqrt(max(0.0, self.square - self.excess ** 2) / min(self.calls, 10))
        return math.sqrt(max(self.excess - 2.0 * error, 0.0))
