"""Bandit baselines (BanditSpec): only the chosen drafter's outcome is observed. Pure Python.

Each request (batch row) learns on its own, as HedgeSpec does. The reward of a step is the
fraction of the K+1 possible tokens it emitted, (accepted + 1) / (K + 1), in [0, 1].
"""
from __future__ import annotations

import math
import random

from ..stats import StepRecord
from .base import DrafterSelector, StepContext


class _PerRowBandit(DrafterSelector):
    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def begin(self, ctx: StepContext) -> None:
        self.num_drafters = ctx.num_drafters
        self.state = {row: self._new_state(ctx.num_drafters) for row in ctx.rows}

    def choose(self, ctx: StepContext) -> list[int]:
        return [self._choose(self.state[row]) for row in ctx.rows]

    def observe(self, record: StepRecord) -> None:
        if record.k == 0:
            return
        for row, drafter, accepted in zip(record.rows, record.drafters, record.accepted):
            if drafter >= 0:
                self._update(self.state[row], drafter, (accepted + 1) / (record.k + 1))


class UCBSpec(_PerRowBandit):
    """UCB1: play each drafter once, then argmax mean reward + sqrt(2 ln t / n_i)."""

    def _new_state(self, n):
        return {"t": 0, "plays": [0] * n, "total": [0.0] * n}

    def _choose(self, s) -> int:
        untried = [i for i, c in enumerate(s["plays"]) if c == 0]
        if untried:
            return untried[0]
        bonus = [m / c + math.sqrt(2 * math.log(s["t"]) / c) for m, c in zip(s["total"], s["plays"])]
        return max(range(len(bonus)), key=bonus.__getitem__)

    def _update(self, s, drafter, reward):
        s["t"] += 1
        s["plays"][drafter] += 1
        s["total"][drafter] += reward

    def __repr__(self):
        return "UCBSpec()"


class EXP3Spec(_PerRowBandit):
    """EXP3 on importance-weighted losses: p_i ∝ exp(-eta_t L^_i), L^_i += loss / p_i for the
    played drafter, eta_t = sqrt(2 ln N / (N t))."""

    def _new_state(self, n):
        return {"t": 0, "estimates": [0.0] * n, "probs": [1.0 / n] * n}

    def _choose(self, s) -> int:
        n = len(s["estimates"])
        eta = math.sqrt(2 * math.log(max(n, 2)) / (n * max(s["t"], 1)))
        logs = [-eta * x for x in s["estimates"]]
        top = max(logs)
        weights = [math.exp(x - top) for x in logs]
        total = sum(weights)
        s["probs"] = [w / total for w in weights]
        return self.rng.choices(range(n), s["probs"])[0]

    def _update(self, s, drafter, reward):
        s["t"] += 1
        s["estimates"][drafter] += (1.0 - reward) / s["probs"][drafter]

    def __repr__(self):
        return "EXP3Spec()"
