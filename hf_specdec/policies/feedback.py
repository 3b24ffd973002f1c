"""Losses from full-information feedback (HedgeSpec, "Not-a-Bandit"). Pure Python.

Notation of the paper, stated once: gamma_t[i] is the probability that drafter i's token at
verified position t would have been accepted (1 - TV(target, draft) when sampling, agreement with
the target's argmax when greedy, target probability of its token for a deterministic drafter).
The expected acceptance length of a K-token draft starting at t is estimated without bias by
    EAL = sum_{k=1}^{K+1} k (1 - gamma_k) prod_{j<k} gamma_j,   gamma_{K+1} = 0,
with gamma_k = gamma_{t+k-1}; its loss is 1 - EAL / (K+1). The acceptance-probability loss
1 - gamma_t is available at once; the length loss only after K more positions are verified
(delayed feedback), so losses go through a FIFO queue in position order.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence


def expected_accept_length(gammas: Sequence[float]) -> float:
    """EAL for one drafter from gamma_1..gamma_K (tokens per step, bonus included: in [1, K+1])."""
    total, survive = 0.0, 1.0
    for k, gamma in enumerate(gammas, start=1):
        total += k * (1.0 - gamma) * survive
        survive *= gamma
    return total + (len(gammas) + 1) * survive


class DelayedFeedback:
    """Per-position gamma vectors in, feedback out in position order as it becomes computable.

    Positions before `warmup` yield ("prob", gamma) at once ("hybrid loss" warm-up); later
    positions yield ("length", EAL per drafter) once `depth` positions from them are known.
    """

    def __init__(self, depth: int, warmup: int = 0):
        self.depth, self.warmup = depth, warmup
        self.seen = 0                 # positions added so far
        self.window: deque = deque()  # gamma vectors waiting for their K-position window
        self.ready: deque = deque()   # (kind, values) not yet given to the learner

    def add(self, gammas: Sequence[Sequence[float]]) -> None:
        """Gamma vectors [position][drafter] of newly verified positions, in order."""
        for gamma in gammas:
            if self.seen < self.warmup:
                self.ready.append(("prob", list(gamma)))
            else:
                self.window.append(list(gamma))
            self.seen += 1
            while len(self.window) >= self.depth:
                columns = zip(*list(self.window)[: self.depth])
                self.ready.append(("length", [expected_accept_length(c) for c in columns]))
                self.window.popleft()

    def pop_all(self) -> list[tuple[str, list[float]]]:
        out = list(self.ready)
        self.ready.clear()
        return out
