"""Nightjar (Li et al., 2025; Algorithm 1 of the full paper): a bandit per batch size over draft
lengths k = 0..max_len, 0 being no speculation. Pure Python.

Each batch size B cuts its own steps into blocks j of H = 2^(j-1) steps, and blocks into bins of
sqrt(H) steps. At a bin's start the bin explores (k drawn uniformly) with probability 1/b, b the
bin's index in its block, else exploits (Eq. 4)
    argmin_k  l(B, k) + 1[previous k = 0 and k > 0] * C_switch(L_max, B) / k,
and k stays locked for the bin. l(B, k) is arm k's seconds per emitted token; an arm never played
counts 0, so exploitation tries each arm once. C_switch is the time the draft needs to catch up the
L_max tokens it missed while k was 0 (a profiled `SwitchCostTable`).
Because every bandit keeps exploring, k = 0 is never a dead end: acceptance keeps being measured.

In generate() rather than a serving engine:
  - a call's first step also prefills the prompt in the target: its time is nobody's latency, and
    it is not counted;
  - a call starts from k = 0 (its drafter has not seen the prompt, so its first drafts pay a switch);
  - an arm's step is counted for the arm chosen, also when the call's end left room for fewer drafts:
    those short last steps are part of what choosing the arm costs.
Deviation: l(B, k) is the arm's seconds summed over its tokens summed (the throughput it delivered),
where the paper averages each step's seconds per token. The tokens of a step vary far more than its
time, and the mean of per-step ratios rewards short arms (Jensen): with drafts accepted at 0.7, it
ranks k = 1 first where k = 2 gives more tokens per second (tests/test_length_policies.py).
Extension (explore=0.25, the default; 1.0 is the paper's Alg. 1): a bin explores with probability
explore / b. The paper's regret analysis takes the exploration probability proportional to 1/b;
its Alg. 1 sets the constant to 1, which in a bandit's first 128 steps explores about 63 of them
(15 with 0.25), each a uniformly drawn k. Exploitation already plays every untried arm once, so the constant
buys re-measurement only, and where no k beats plain decoding by much (the real pair on a CPU, or
any target at a large batch) each exploring step at k > 0 also pays the draft's catch-up after
plain steps. Measured on the real pair against the paper's constant: docs/benchmarks.md.
Extension (buckets="pow2", the default): the batch sizes up to one power of two share a bandit. A
static batch shrinks row by row as rows finish and a serving batch moves with the load; with one
bandit per exact size every size met starts with a full bin of a uniformly drawn k.
"""
from __future__ import annotations

import math
import random
from typing import Callable

from ..costmodel import CostProfile, SwitchCostTable
from ..stats import StepRecord
from .base import LengthPolicy, StepContext, non_negative_int, pow2_bucket


class _Bandit:
    """Algorithm 1's state for one batch size: block j, bin b, round tau, the locked arm, and each
    arm's seconds and tokens."""

    def __init__(self, arms: int):
        self.block, self.bin, self.round, self.locked = 1, 1, 1, 0
        self.seconds = [0.0] * arms
        self.tokens = [0] * arms

    def latency(self, k: int) -> float:
        return self.seconds[k] / self.tokens[k] if self.tokens[k] else 0.0

    def advance(self) -> None:
        """One round played: bins end after sqrt(H) rounds, blocks after sqrt(H) bins."""
        width = math.sqrt(2 ** (self.block - 1))
        self.round += 1
        if self.round > width:
            self.bin, self.round = self.bin + 1, 1
            if self.bin > width:
                self.block, self.bin = self.block + 1, 1

    def record(self, k: int, seconds: float, tokens: int) -> None:
        self.seconds[k] += seconds
        self.tokens[k] += tokens


class Nightjar(LengthPolicy):
    """max_len: the longest draft (Gamma_max); switch_cost: a `SwitchCostTable`, a `CostProfile`
    (its table), a callable (lag, batch_size) -> seconds, a number of seconds, or None (0);
    buckets: "pow2" (one bandit per power of two of batch sizes) or "exact" (one per size, as in the
    paper); explore: the exploration constant (above; 1.0 in the paper); seed: of the exploration draws."""

    def __init__(self, max_len: int = 6, switch_cost=None, buckets: str = "pow2", explore: float = 0.25,
                 seed: int = 0):
        if non_negative_int(max_len, "Nightjar(max_len)") < 1:
            raise ValueError(f"Nightjar(max_len) must be >= 1, got {max_len}")
        if buckets not in ("pow2", "exact"):
            raise ValueError(f"Nightjar(buckets) must be 'pow2' or 'exact', got {buckets!r}")
        if isinstance(explore, bool) or not isinstance(explore, (int, float)) or not 0 < explore <= 1:
            raise ValueError(f"Nightjar(explore) must be a number in (0, 1], got {explore!r}")
        self.max_len, self.buckets, self.explore = max_len, buckets, explore
        self.switch_cost = _as_switch_cost(switch_cost)
        self.rng = random.Random(seed)
        self.bandits: dict[int, _Bandit] = {}   # by batch size (or its bucket), kept across calls
        self.previous_k = 0

    def _bandit(self, batch_size: int) -> _Bandit:
        key = pow2_bucket(batch_size) if self.buckets == "pow2" else batch_size
        if key not in self.bandits:
            self.bandits[key] = _Bandit(self.max_len + 1)
        return self.bandits[key]

    def choose(self, ctx: StepContext) -> int:
        if ctx.step == 0:                 # a call starts: its drafter has not seen the prompt
            self.previous_k = 0
        bandit = self._bandit(ctx.batch_size)
        if bandit.round == 1:
            if self.rng.random() < self.explore / bandit.bin:
                bandit.locked = self.rng.randrange(self.max_len + 1)
            else:
                switch = self.switch_cost(ctx.max_lag, ctx.batch_size) if self.previous_k == 0 else 0.0
                bandit.locked = min(range(self.max_len + 1),
                                    key=lambda k: bandit.latency(k) + (switch / k if k else 0.0))
        k = bandit.locked
        bandit.advance()
        self.previous_k = k
        return k

    def observe(self, record: StepRecord) -> None:
        tokens = sum(record.emitted)
        arm = record.decided_k if record.k and record.decided_k >= 0 else record.k
        if record.step == 0 or not record.steady or not tokens or arm > self.max_len:
            return
        self._bandit(record.batch_size).record(arm, record.seconds, tokens)

    def __repr__(self):
        return f"Nightjar(max_len={self.max_len}, buckets={self.buckets!r}, explore={self.explore})"


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
