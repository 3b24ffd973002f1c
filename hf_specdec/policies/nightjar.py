"""Nightjar: a bandit per batch size over draft lengths k = 0..max_len (0 = no speculation). Pure Python.

Time per batch size B is cut into blocks j of H = 2^(j-1) steps and bins of sqrt(H) steps. At a
bin's start the bin explores (k uniform) with probability 1/b (b = the bin's index in its block,
so every block starts exploring), else exploits
    argmin_k  latency_per_token(B, k) + 1[previous k = 0 and k > 0] * C_switch(L_max, B) / (B n),
and k stays locked for the bin. latency_per_token is step time / tokens emitted over all steps
with that k (a ratio of sums: the throughput the arm delivered), the tokens in expectation (below);
C_switch is the time the draft
model needs to catch up the L_max tokens it missed while speculation was off. The paper's
C_switch / k spreads it over one row's k tokens; our latency is per token of the whole batch, so
the switching step's B rows share it (else a batch of 48 would almost never switch back on), and
n is what a switch buys: the tokens a row may still emit in the call (StepContext.remaining, which
generate() knows from max_new_tokens), else (the paper) the step's k. Charged to one step's k
tokens a switch hardly ever pays, so k = 0, where every call starts (its first drafts prefill its
prompt), would be left only by exploring bins.
Each batch size (by default, each power-of-two bucket of them) keeps its own statistics, so when
load drops back to a small batch its (positive) k is found again: no decision deadlock.

Ours, beyond the paper. An arm's tokens are counted in expectation: a row that verified d drafts
emits 1 + sum_{j<=d} p_j, p_j = P(a row's first j drafts are accepted). Every arm k >= j measures
p_j (drafts do not depend on how many follow them), so the p_j pool all arms and batch sizes.
The tokens a step emits vary far more than its time (tiny pair, B=2: 2 to 10 tokens per ~20 ms
step), and with the same prompts (a benchmark) they depend on where in the text an arm was
played; an arm's own count then takes hundreds of steps to tell near-tie arms apart, the pooled
one a few. Statistics leave out the steps that prefill a call's prompt (its first
step, and its first drafting step for the draft): their time is the prompt's, not the arm's.
A step slower than 3x its arm's fastest counts at that cap (a stall of the machine, not the arm).
In generate() (StepContext.static_batch) exploitation, exploration and pruning multiply latency(k > 0)
by the wait for the batch's slowest row at the call's end (`straggler.stretch`, from the pooled
acceptance by depth, over the rows that `straggler.FinishingRows` expects to still run at the end,
and how much the rows' acceptance differs for good, `straggler.RowSpread`):
the steps at the call's end with fewer rows land in other buckets, so no arm's own latency holds them.
(Pruning without it kept near-tie arms in the running at prompt lookup, B=16, and a late block's
first bin, which explores, then drafted through a whole 32-token call at ~0.75x plain's speed.)
`prune=True`: exploration and exploitation skip arms that, with high confidence, lose to another
arm (successive elimination), a bin whose k becomes such an arm ends early, and an exploring bin
takes the arm with the least optimistic latency (optimism, as in UCB) rather than a uniform one:
near-tie arms then stop costing a bin at every turn once their bounds say they lose. An arm k > 0 whose
optimistic latency per token exceeds the least pessimistic one of any tried arm (its tokens from
lower confidence bounds of the p_j; plain decoding's tokens are certain) is left out until the
bounds move. Arm k's optimistic latency per token is a lower confidence bound of its step seconds
per row (no catch-up) divided by 1 + sum_{j<=k} u_j, u_j an upper confidence bound of p_j
(Chernoff-KL, delta = e^-4: `_confidence_bound`). An untried arm k' is bounded through any shorter
tried arm j (plain decoding included) plus k' - j more draft forwards: max_j (s_j + (k' - j) d) /
(1 + sum_{i<=k'} u_i), d = fastest drafting seconds per row and draft. Untried arms are tried plain
first, then the longest (its drafts are judged at every depth), so most arms in between are pruned
before they cost a bin. Where a speculative step costs many plain ones (a CPU
at batch 16: ~20x), or drafts are rarely accepted, uniform exploration would otherwise cost more
than the whole run gains.
Drift. Optimism trusts what it measured, and a shared machine drifts: an arm timed in a slow spell looks
slow for good (tiny-partial, B=33-64: plain's first 5 steps at 64 ms, 25-45 ms later, and the
bucket drafted at 0.8x plain's speed to the end). So a block's first bin re-measures, for
_REMEASURE_STEPS steps, an arm still in the running (plain always is) that the whole previous block
left unplayed, its old statistics dropped.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from ..costmodel import CostProfile, SwitchCostTable
from ..stats import StepRecord
from . import straggler
from .base import LengthPolicy, StepContext, non_negative_int, pow2_bucket

_LOG_INV_DELTA = 4.0   # pruning confidence: ln(1 / delta)
_REMEASURE_STEPS = 2   # a stale arm's fresh measurement (each block may take one)


@dataclass
class _BatchState:
    block: int = 1                 # j
    horizon: int = 1               # H = 2^(j-1)
    bin: int = 1                   # b, within the block
    round: int = 1                 # tau, within the bin
    locked: int = 0                # k of the current bin
    length: float = 1.0            # steps in the current bin: sqrt(H), or a stale arm's re-measure
    played: list[int] = field(default_factory=list)     # by k: the last block that played it
    seconds: list[float] = field(default_factory=list)  # by k: step seconds, summed
    row_steps: list[int] = field(default_factory=list)  # by k: rows x steps
    depths: list[list[int]] = field(default_factory=list)  # by k, by d: row-steps that verified d drafts
    fastest: list[float] = field(default_factory=list)  # by k: least step seconds per row (no catch-up)
    clean: list[list[float]] = field(default_factory=list)  # by k: [n, sum, sum of squares] of those
    draft_per_token: float = math.inf                    # least drafting seconds per row and draft
    noise: float | None = None     # relative_variance(), kept until `clean` changes (it is read per arm)
    noise_stale: bool = True

    @classmethod
    def fresh(cls, arms: int) -> "_BatchState":
        """Nothing measured yet for arms k = 0..arms-1."""
        return cls(played=[0] * arms, seconds=[0.0] * arms, row_steps=[0] * arms,
                   depths=[[0] * arms for _ in range(arms)], fastest=[math.inf] * arms,
                   clean=[[0, 0.0, 0.0] for _ in range(arms)])

    def latency(self, k: int, yields: list[float]) -> float:
        """Seconds per token of arm k: its step seconds over the tokens its row-steps emit in
        expectation, yields[d] for a row that verified d drafts (pooled over arms: see Nightjar)."""
        tokens = sum(n * y for n, y in zip(self.depths[k], yields))
        return self.seconds[k] / tokens if tokens else math.inf

    def best_case(self, k: int, yields_ub: list[float]) -> float:
        """Optimistic latency per token of arm k (a lower bound with probability >= 1 - e^-4);
        yields_ub[k] bounds the tokens per row-step of any arm k from above."""
        if self.fastest[k] < math.inf:
            return self.fast_seconds(k) / yields_ub[k]
        # untried: at least a shorter tried arm j's step plus k - j more drafts (j = 0: a plain step
        # plus k drafts; verifying more tokens never costs less)
        tried = [j for j in range(k) if self.fastest[j] < math.inf]
        if not tried or self.draft_per_token == math.inf:
            return 0.0
        return max(self.fast_seconds(j) + (k - j) * self.draft_per_token for j in tried) / yields_ub[k]

    def fast_seconds(self, k: int) -> float:
        """A lower confidence bound of arm k's step seconds per row without catch-up: the mean less
        sqrt(2 ln(1/delta) var / n) (normal approximation), never below the fastest step. The
        fastest step alone is far too optimistic where timings are noisy (a shared CPU). Under 3
        steps an arm's own spread means little (two steps in a slow spell agree), so its variance is
        the machine's: the relative variance pooled over the arms timed more, and no floor."""
        n, total, squares = self.clean[k]
        if n == 0:
            return self.fastest[k]
        mean = total / n
        if n < 3:
            pooled = self.relative_variance()
            if pooled is None:
                return self.fastest[k]
            return mean * max(0.0, 1 - math.sqrt(2 * _LOG_INV_DELTA * pooled / n))
        spread = math.sqrt(2 * _LOG_INV_DELTA * max(0.0, squares / n - mean * mean) / n)
        return max(self.fastest[k], mean - spread)

    def relative_variance(self) -> float | None:
        """The step-time variance over mean^2, pooled over the arms with >= 3 clean steps (None: none)."""
        if self.noise_stale:
            timed = [(n, total / n, squares / n) for n, total, squares in self.clean if n >= 3]
            self.noise = sum(n * max(0.0, sq / mean ** 2 - 1) for n, mean, sq in timed) \
                / sum(n for n, _, _ in timed) if timed else None
            self.noise_stale = False
        return self.noise

    def record_clean(self, k: int, per_row: float) -> None:
        """A step of arm k at its full length without catch-up, `per_row` seconds per row."""
        self.fastest[k] = min(self.fastest[k], per_row)
        n, total, squares = self.clean[k]
        self.clean[k], self.noise_stale = [n + 1, total + per_row, squares + per_row * per_row], True

    def forget(self, k: int) -> None:
        """Drop arm k's statistics (not the pooled acceptance): they are to be measured afresh."""
        self.seconds[k], self.row_steps[k], self.fastest[k] = 0.0, 0, math.inf
        self.depths[k], self.clean[k], self.noise_stale = [0] * len(self.depths[k]), [0, 0.0, 0.0], True


def _next_bin(state: _BatchState) -> None:
    state.bin, state.round = state.bin + 1, 1
    if state.bin > math.sqrt(state.horizon):             # block completed
        state.block += 1
        state.horizon, state.bin = 2 ** (state.block - 1), 1
    state.length = math.sqrt(state.horizon)


def _yields(pass_rates: list[float]) -> list[float]:
    """By d = 0..max_len: the tokens a row emits in a step that verifies d drafts,
    1 + sum_{j<=d} p_j, from the pass rates p_j by depth (`Nightjar._pass_rates`)."""
    out = [1.0]
    for p in pass_rates:
        out.append(out[-1] + p)
    return out


def _kl(p: float, q: float) -> float:
    """KL divergence of Bernoulli(q) from Bernoulli(p), 0 <= p <= 1, 0 < q < 1."""
    return (p * math.log(p / q) if p > 0 else 0.0) + (
        (1 - p) * math.log((1 - p) / (1 - q)) if p < 1 else 0.0)


def _confidence_bound(p: float, n: int, side: int) -> float:
    """The upper (side +1) or lower (-1) end of {q: n KL(p || q) <= ln(1/delta)}, delta = e^-4: a
    bound (Chernoff, as in KL-UCB) on a rate measured as p over n trials. Never wider than
    Hoeffding's p +- sqrt(ln(1/delta) / 2n), and far narrower towards 1/2 from a p near 0 or 1
    (0 of 40 passed: at most 0.10, not 0.22): deep depths, rarely passed, are what kept a useless
    drafter's long arms in the running."""
    if p > 0.5:                    # the starts below are tight for rates under 1/2: mirror
        return 1.0 - _confidence_bound(1.0 - p, n, -side)
    budget = _LOG_INV_DELTA / n
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
    return q - (_kl(p, q) - budget) * q * (1 - q) / (q - p)


class Nightjar(LengthPolicy):
    """switch_cost: a `SwitchCostTable`, a `CostProfile` (its table), a callable
    (lag, batch_size) -> seconds, a constant number of seconds, or None (0).
    buckets: "pow2" (default) shares one bandit among batch sizes up to the same power of two
    (ours: batches that shrink row by row reuse what was learned); "exact": one per size, as in
    the paper."""

    def __init__(self, max_len: int = 6, switch_cost=None, buckets: str = "pow2", prune: bool = True, seed: int = 0):
        if non_negative_int(max_len, "Nightjar(max_len)") < 1:
            raise ValueError(f"Nightjar(max_len) must be >= 1, got {max_len}")
        if buckets not in ("pow2", "exact"):
            raise ValueError(f"Nightjar(buckets) must be 'pow2' or 'exact', got {buckets!r}")
        self.max_len, self.buckets, self.prune = max_len, buckets, bool(prune)
        self.switch_cost = _as_switch_cost(switch_cost)
        self.rng = random.Random(seed)
        self.states: dict[int, _BatchState] = {}   # learned per batch size, kept across calls
        self.judged = [0] * (max_len + 1)   # by j: row-steps that asked for >= j drafts (all batch sizes)
        self.passed = [0] * (max_len + 1)   # by j: of which the first j drafts were accepted
        self.rates: dict[int, list[float]] = {}   # _pass_rates by side (a cache), as of judged = rates_at
        self.rates_at = list(self.judged)
        self.finishing = straggler.FinishingRows()   # rows that can be a call's last
        self.spread = straggler.RowSpread()          # how much rows' acceptance differs for good
        self.moments: list[tuple[float, float]] = []  # _moments (a cache, emptied with the rates)
        self.previous_k = None
        self.drafted = False        # has this call drafted yet?
        self.switched = False
        self.measured = False       # does this step's time belong to its arm (not a prompt prefill)?
        self.cut = 0                # this step's k as the loop runs it

    def begin(self, ctx: StepContext) -> None:
        # A new call: its drafter starts cold, so its first drafts prefill the prompt (lag = the
        # prompt's length). That is a switch from k = 0, and the call's first decision is a fresh
        # bin that weighs it, not the leftover of the previous call's bin.
        self.drafted, self.previous_k = False, 0
        self.spread.new_call()
        for state in self.states.values():
            if state.round > 1:
                _next_bin(state)

    def _key(self, batch_size: int) -> int:
        """The bandit a batch size uses: its own, or (pow2) that of the next power of two, so a
        batch shrinking row by row does not meet a fresh, unexplored bandit at every size."""
        return batch_size if self.buckets == "exact" else pow2_bucket(batch_size)

    def choose(self, ctx: StepContext) -> int:
        if ctx.static_batch:
            self.finishing.update(ctx)
        key = self._key(ctx.batch_size)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = _BatchState.fresh(self.max_len + 1)
        # mid-bin, at its rounds 2, 4, 8, ... and whenever the pass rates moved: is the bin's k now known
        # to lose? Then the bin ends early, at worst twice as late as with a check every step (~12 us)
        checking = not (state.round & (state.round - 1)) or not self.rates
        if state.round > 1 and state.locked and checking \
                and state.locked not in self._arms(state, ctx, 0.0, self._tails(ctx), [state.locked]):
            _next_bin(state)
        if state.round == 1:                                      # a bin starts: lock its k
            # switching on from 0 costs the draft's catch-up of what it missed (at a call's start:
            # its prompt); mid-bin the previous k is the locked one, so only here can it apply
            cost = self.switch_cost(ctx.max_lag, ctx.batch_size) if self.previous_k == 0 else 0.0
            tails = self._tails(ctx)
            arms = self._arms(state, ctx, cost, tails)
            stale = self._stale(state, arms)
            if stale is not None:
                state.forget(stale)
                state.locked, state.length = stale, min(state.length, _REMEASURE_STEPS)
            elif self.rng.random() < 1.0 / state.bin:
                state.locked = self._explore(state, arms, tails)
            else:
                state.locked = self._exploit(state, arms, cost / ctx.batch_size, ctx, tails)
        k = state.locked
        state.played[k] = state.block
        state.round += 1
        if state.round > state.length:
            _next_bin(state)
        self.measured = ctx.step > 0 and (k == 0 or self.drafted)
        self.drafted |= k > 0
        self.switched = self.previous_k == 0 and k > 0   # its draft time holds a catch-up
        self.previous_k = k
        # the k the loop will run: no drafts past the longest row's room (the call's end)
        self.cut = max(0, min(k, ctx.remaining - 1)) if ctx.remaining else k
        return k

    def _arms(self, state: _BatchState, ctx: StepContext, switch_cost: float, tails: list[float],
              among: list[int] | None = None) -> list[int]:
        """The k worth trying: all, or (prune) those whose best case beats every tried arm's worst (of
        `among` and 0, if given).
        0 always stays: staying at 0 is how a switching cost is avoided. Switching on from 0 costs
        C_switch once, spread at best over the tokens the rows may still emit (ctx.remaining): a
        call's first drafts prefill its prompt, which in a short call can cost more than
        speculation saves. (Not over a bin: the lag, so the cost, grows while k = 0, and pruning
        on it would lock k = 0 for good, the decision deadlock.)"""
        arms = list(range(self.max_len + 1))
        tried = [k for k in arms if state.row_steps[k]]
        if not self.prune or not tried:
            return arms
        switch = switch_cost / (ctx.batch_size * ctx.remaining) if ctx.remaining > 0 else 0.0
        worst = _yields(self._pass_rates(-1))
        # every k > 0 pays the switch, and in a static batch the wait for its slowest row (tails)
        bar = min(state.latency(k, worst) * tails[k] + (switch if k else 0.0) for k in tried)
        best = _yields(self._pass_rates(+1))
        among = arms[1:] if among is None else among
        return [0] + [k for k in among if k and state.best_case(k, best) * tails[k] + switch <= bar]

    def _tails(self, ctx: StepContext) -> list[float]:
        """By k: how many times the steps its latency promises arm k takes to finish a static batch's
        slowest row (`straggler.stretch`, from the measured acceptance by depth); 1 outside generate().
        The same point estimate on both sides of the pruning bounds: its own uncertainty is small next
        to the acceptance's and the step times'."""
        if not ctx.static_batch:
            return [1.0] * (self.max_len + 1)
        moments, finishing, spread = self._moments(), self.finishing(ctx.batch_size), self.spread.spread
        return [straggler.stretch_of_moments(finishing, ctx.remaining, *moments[k], ctx.rooms, spread)
                if k else 1.0 for k in range(self.max_len + 1)]

    def _moments(self) -> list[tuple[float, float]]:
        """By k: a row's tokens per step at arm k, mean and variance, from the pooled pass rates
        (`straggler.emission_moments`); kept until the rates are recomputed."""
        if not self.moments:
            passed = self._pass_rates(0)
            self.moments = [straggler.emission_moments(passed[:k]) for k in range(self.max_len + 1)]
        return self.moments

    def _stale(self, state: _BatchState, arms: list[int]) -> int | None:
        """(prune) At a block's start: the arm still in the running that the whole previous block
        left unplayed, if any (the longest unplayed), to be measured afresh (see Nightjar: drift)."""
        if not self.prune or state.bin != 1:
            return None
        stale = [k for k in arms if state.row_steps[k] and state.played[k] < state.block - 1]
        return min(stale, key=lambda k: state.played[k]) if stale else None

    def _pass_rates(self, side: int) -> list[float]:
        """By j = 1..max_len: P(a row's first j drafts are accepted), non-increasing in j: as
        measured (side 0), or an upper (+1) / lower (-1) confidence bound of it. A depth not judged
        yet: the upper bound of the depth before it, else 0."""
        if side not in self.rates:
            out, p = [], 1.0
            for j in range(1, self.max_len + 1):
                if self.judged[j]:
                    rate = self.passed[j] / self.judged[j]
                    p = min(p, _confidence_bound(rate, self.judged[j], side) if side else rate)
                elif side <= 0:
                    p = 0.0
                out.append(p)
            self.rates[side] = out
        return self.rates[side]

    def _explore(self, state: _BatchState, arms: list[int], tails: list[float]) -> int:
        """Uniform (the paper), or (prune) optimistic: the arm with the least optimistic latency per
        token, so exploration goes to arms that could still be the best rather than equally to all
        arms not yet ruled out (a near-tie arm no longer costs a bin every time its turn comes)."""
        if not self.prune:
            return self.rng.choice(arms)
        best = _yields(self._pass_rates(+1))
        return min(arms, key=lambda k: (state.best_case(k, best) * tails[k], self.rng.random()))

    def _exploit(self, state: _BatchState, arms: list[int], cost_per_row: float, ctx: StepContext,
                 tails: list[float]) -> int:
        """argmin_k latency(k) + the switching cost per row over the tokens it buys (k > 0): the
        rest of the call (ctx.remaining tokens) where known, else (the paper) the step's k. Ours: in
        a static batch, latency(k > 0) x the wait for the slowest row at the call's end
        (`straggler.stretch`, from the pooled acceptance by depth)."""
        untried = [k for k in arms if not state.row_steps[k]]
        if untried:
            # plain first, then the longest arm: its drafts are judged at every depth and bound every
            # shorter arm (`best_case`), so the arms in between are mostly pruned untried
            return min(untried, key=lambda k: (k > 0, k < self.max_len, k))
        yields = _yields(self._pass_rates(0))
        best, best_value = 0, math.inf
        for k in arms:
            switch = cost_per_row / (ctx.remaining or k) if k > 0 else 0.0
            value = state.latency(k, yields) * tails[k] + switch
            if value < best_value:
                best, best_value = k, value
        return best

    def observe(self, record: StepRecord) -> None:
        if record.k <= self.max_len:                  # row b judged its drafts 1..proposed[b]
            for proposed, accepted in zip(record.proposed, record.accepted):
                for j in range(1, proposed + 1):
                    self.judged[j] += 1
                    self.passed[j] += j <= accepted
            # the rates are recomputed (2 max_len bounds) only once a depth's judged count grew by 1/16:
            # bounds from part of the evidence hold too, and 1/16 more moves them little
            if any(n > seen * 17 / 16 for n, seen in zip(self.judged, self.rates_at)):
                self.rates, self.rates_at, self.moments = {}, list(self.judged), []
            if record.k:     # every row was asked for k drafts: how far from the pooled rates did each get?
                tokens, variance = self._moments()[record.k]
                self.spread.update(record.rows, record.accepted, tokens - 1.0, variance)
        state = self.states.get(self._key(record.batch_size))
        tokens = sum(record.emitted)
        if state is None or tokens == 0 or record.k > self.max_len or not self.measured:
            return
        # A step whose drafts the call's end cut short counts for the arm chosen: its slow last
        # steps are what choosing that arm cost (SmolLM2, int8 draft, 32 tokens: k = 4 looked 10%
        # faster than plain per token while its calls were 20% slower, the cut steps with 1-3
        # drafts at 220 ms per token counted for arms 1-3). Cut otherwise (draft offload): as run.
        k = self.previous_k if record.k == self.cut and self.previous_k is not None else record.k
        seconds, rows = record.seconds, record.batch_size
        if not self.switched:
            # a step over 3x the arm's fastest is a stall of the machine (another process, a page
            # fault), not the arm's cost: counted at that cap, so one stall cannot bury an arm
            seconds = min(seconds, 3 * rows * state.fastest[k])
        state.seconds[k] += seconds
        state.row_steps[k] += rows
        for d in record.proposed:
            state.depths[k][d] += 1
        if k == record.k and (k == 0 or (not self.switched and max(record.proposed) == k)):   # full, no catch-up
            state.record_clean(k, seconds / rows)
            if k:
                state.draft_per_token = min(state.draft_per_token, record.draft_s / (rows * k))

    def __repr__(self):
        return f"Nightjar(max_len={self.max_len}, buckets={self.buckets!r}, prune={self.prune})"


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
