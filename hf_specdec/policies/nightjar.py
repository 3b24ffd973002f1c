"""Nightjar: a bandit per batch size over draft lengths k = 0..max_len (0 = no speculation). Pure Python.

Time per batch size B is cut into blocks j of H = 2^(j-1) steps and bins of sqrt(H) steps. At a
bin's start the bin explores (k uniform) with probability 1/b (b = the bin's index in its block,
so every block starts exploring), else exploits
    argmin_k  latency_per_token(B, k) + 1[previous k = 0 and k > 0] * C_switch(L_max, B) / k,
and k stays locked for the bin. latency_per_token is the running mean of step time / emitted
tokens; C_switch is the time the draft model needs to catch up the L_max tokens it missed while
speculation was off. Each batch size (by default, each power-of-two bucket of them) keeps its own
statistics, so when load drops back to a small batch its (positive) k is found again: no
decision deadlock.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from ..costmodel import CostProfile, SwitchCostTable
from ..stats import StepRecord
from .base import LengthPolicy, StepContext, non_negative_int


@dataclass
class _BatchState:
    block: int = 1                 # j
    horizon: int = 1               # H = 2^(j-1)
    bin: int = 1                   # b, within the block
    round: int = 1                 # tau, within the bin
    locked: int = 0                # k of the current bin
    means: list[float] = field(default_factory=list)   # latency per token, by k
    counts: list[int] = field(default_factory=list)


class Nightjar(LengthPolicy):
    """switch_cost: a `SwitchCostTable`, a `CostProfile` (its table), a callable
    (lag, batch_size) -> seconds, a constant number of seconds, or None (0).
    buckets: "pow2" (default) shares one bandit among batch sizes up to the same power of two
    (ours: batches that shrink row by row reuse what was learned); "exact": one per size, as in
    the paper."""

    def __init__(self, max_len: int = 6, switch_cost=None, buckets: str = "pow2", seed: int = 0):
        if non_negative_int(max_len, "Nightjar(max_len)") < 1:
            raise ValueError(f"Nightjar(max_len) must be >= 1, got {max_len}")
        if buckets not in ("pow2", "exact"):
            raise ValueError(f"Nightjar(buckets) must be 'pow2' or 'exact', got {buckets!r}")
        self.max_len, self.buckets = max_len, buckets
        self.switch_cost = _as_switch_cost(switch_cost)
        self.rng = random.Random(seed)
        self.states: dict[int, _BatchState] = {}   # learned per batch size, kept across calls
        self.previous_k = None

    def _key(self, batch_size: int) -> int:
        """The bandit a batch size uses: its own, or (pow2) that of the next power of two, so a
        batch shrinking row by row does not meet a fresh, unexplored bandit at every size."""
        return batch_size if self.buckets == "exact" else 1 << max(batch_size - 1, 0).bit_length()

    def choose(self, ctx: StepContext) -> int:
        key = self._key(ctx.batch_size)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = _BatchState(means=[0.0] * (self.max_len + 1), counts=[0] * (self.max_len + 1))
        if state.round == 1:                                      # a bin starts: lock its k
            if self.rng.random() < 1.0 / state.bin:
                state.locked = self.rng.randint(0, self.max_len)
            else:
                state.locked = self._exploit(state, ctx)
        k = state.locked
        state.round += 1
        if state.round > math.sqrt(state.horizon):               # bin completed
            state.bin, state.round = state.bin + 1, 1
            if state.bin > math.sqrt(state.horizon):             # block completed
                state.block += 1
                state.horizon, state.bin = 2 ** (state.block - 1), 1
        self.previous_k = k
        return k

    def _exploit(self, state: _BatchState, ctx: StepContext) -> int:
        switching = self.previous_k == 0
        cost = self.switch_cost(ctx.max_lag, ctx.batch_size) if switching else 0.0
        best, best_value = 0, math.inf
        for k in range(self.max_len + 1):
            if state.counts[k] == 0:
                return k                                          # untried: try it first
            value = state.means[k] + (cost / k if switching and k > 0 else 0.0)
            if value < best_value:
                best, best_value = k, value
        return best

    def observe(self, record: StepRecord) -> None:
        state = self.states.get(self._key(record.batch_size))
        tokens = sum(record.emitted)
        if state is None or tokens == 0 or record.k > self.max_len:
            return
        latency = (record.draft_s + record.verify_s) / tokens
        state.counts[record.k] += 1
        state.means[record.k] += (latency - state.means[record.k]) / state.counts[record.k]

    def __repr__(self):
        return f"Nightjar(max_len={self.max_len})"


def _as_switch_cost(value) -> Callable[[float, float], float]:
    if value is None:
        return lambda lag, batch: 0.0
    if isinstance(value, CostProfile):
        return value.switch
    if isinstance(value, SwitchCostTable) or callable(value):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return lambda lag, batch: float(value) if lag > 0 else 0.0
    raise ValueError(f"Nightjar(switch_cost) must be a SwitchCostTable, CostProfile, callable, number >= 0 "
                     f"or None, got {value!r}")
