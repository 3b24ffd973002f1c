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
(its tail steps costed as full ones: on an accelerator they nearly are). Serving replaces rows as
they finish, so nothing waits there (StepContext.static_batch is False).
"""
from __future__ import annotations

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


def stretch(batch: int, remaining: int, ar: list[float]) -> float:
    """How many times the steps a drafting step's rate promises a static batch of `batch` rows
    with `remaining` tokens to go takes to finish its slowest row (1.0: one row, nothing to
    draft, or the rest of the call unknown)."""
    if batch <= 1 or remaining <= 0 or not ar:
        return 1.0
    mean, var = emission_moments(ar)
    return 1.0 + expected_max_normal(batch) * math.sqrt(var / (remaining * mean))
