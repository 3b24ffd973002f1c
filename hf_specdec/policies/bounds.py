"""Confidence bounds on a rate measured as passes over trials (Chernoff-KL, as in KL-UCB). Pure Python."""
from __future__ import annotations

import math


def kl_bernoulli(p: float, q: float) -> float:
    """KL divergence of Bernoulli(q) from Bernoulli(p), 0 <= p <= 1, 0 < q < 1."""
    return (p * math.log(p / q) if p > 0 else 0.0) + (
        (1 - p) * math.log((1 - p) / (1 - q)) if p < 1 else 0.0)


def rate_bound(p: float, n: int, side: int, log_inv_delta: float) -> float:
    """The upper (side +1) or lower (-1) end of {q: n KL(p || q) <= ln(1/delta)}: a bound on a
    rate measured as p over n trials. Never wider than Hoeffding's p +- sqrt(ln(1/delta) / 2n), and
    far narrower towards 1/2 from a p near 0 or 1 (0 of 40 passed, delta = e^-4: at most 0.10, not
    0.22): deep depths, rarely passed, are what kept a useless drafter's long arms in Nightjar's running."""
    if p > 0.5:                    # the starts below are tight for rates under 1/2: mirror
        return 1.0 - rate_bound(1.0 - p, n, -side, log_inv_delta)
    budget = log_inv_delta / n
    hoeffding = math.sqrt(budget / 2)
    # starts at or beyond the bound: KL(p || q) >= (q - p)^2 / 2 max(p, q), >= 2 (q - p)^2 (Pinsker),
    # and (q < p) >= p ln(p / q) - p
    if side > 0:
        q = min(p + budget + math.sqrt(2 * p * budget + budget * budget), p + hoeffding)
        if q >= 1:
            return 1.0
    else:
        if p == 0:
            return 0.0
        q = max(p - math.sqrt(2 * p * budget), p - hoeffding, p * math.exp(-1 - budget / p))
    # one Newton step on the convex n KL - ln(1/delta): towards the bound, never past it
    return q - (kl_bernoulli(p, q) - budget) * q * (1 - q) / (q - p)
