"""MeasuredGoodput, the default draft length: DSD's goodput argmax over step costs the loop itself
measured, with speculation switched off where no length pays. Pure Python.

A step that drafts k tokens per row emits, per row, E(k) = 1 + rho (a + a^2 + ... + a^k) tokens in
expectation (Leviathan et al.), a the per-token acceptance and rho the share of rows that propose
(a lookup drafter may find nothing). The policy picks
    argmax_k  E(k) / S_B(k)      over the arms k in SPEC_TIERS (0: a plain step),
S_B(k) the seconds of a step at batch size B: the median of the loop's own recent steps of that
arm (`StepRecord.seconds`: drafting, verification and the loop's bookkeeping, so host work counts
as it does on a GPU whose eager forwards wait on the host), or, for an arm not played yet, the
line through the arms that were. The acceptance a is its maximum-likelihood estimate under
geometric acceptance, accepted / (accepted + rejections), with a prior worth a few drafts and
older steps discounted (a call's content changes how well the draft guesses).

Why not a profile or a bandit: bare-forward profiles left out the host work that decides eager
GPU steps, and a bandit per length learns each arm's speed apart, though the arms share one
acceptance and one cost line; it needs hundreds of steps, a user's first calls have tens.

Exploration, cheap and bounded:
  - a batch bucket (a power of two of batch sizes) first plays a plain step, then the best
    drafting arm under its prior costs (a draft costing prior_slope of a plain step, the slope
    of the nearest bucket that measured one) for two steps, the first of which catches the draft
    up: where the prior predicts that this saves twice the catch-up over the tokens left (a
    guess pays twice over), else it waits for a probe;
  - while no length pays, or not enough to catch the draft up, a probe (the best drafting arm,
    for two steps) runs once the plain steps since the last drafting one took what the probe is
    predicted to lose (its catch-up, and its steps' time beyond what plain steps would take for
    their tokens), then 2, 4, ... times that, 64 at most (8 after a time when drafting paid):
    probes take a small share of the time, and plain is no dead end (DSD's deadlock at k = 0);
  - steps that catch a draft up (a call's first drafts, or after plain steps: lag > 3) are not an
    arm's cost: their drafting time's excess over a steady step's, per lagged token and in plain
    steps of their bucket, is the switching cost (a bucket without one borrows the nearest
    bucket's: a batched forward over B rows costs what the plain steps say, not B times one row's,
    which on a GPU is nearly one row's; but never less than a prefill of the tokens it feeds, at
    the target's measured cost per prompt token scaled by a draft forward's share of a plain step,
    which is what many rows' catch-up costs where forwards are compute-bound, a CPU's; before
    any was measured, that prefill alone), and switching on from plain must save
    more over the tokens left (StepContext.remaining) than it costs (Nightjar's C_switch).
Measured against Nightjar and fixed lengths in docs/benchmarks.md ("The default policy").
"""
from __future__ import annotations

import statistics
from collections import deque

from ..stats import StepRecord
from ..tiers import SPEC_TIERS
from .base import LengthPolicy, StepContext, non_negative_int, pow2_bucket, probability

STEADY_LAG = 3     # a drafter's lag between drafting steps is 1 or 2; after one plain step up to 3
FIRST_PATIENCE = 1  # plain time before a bucket's first probe, in what the probe is predicted to lose:
                    # that prediction is the priors' (nothing measured yet), and the first probe is the
                    # one that tells most (measured on the real pair: with 8, 32-token calls never drafted)
PATIENCE = 8        # ... and before the next probe after drafting paid (the costs are measured then)
MAX_PATIENCE = 64   # ... doubling after each probe up to this: a change of content is still noticed


class _BucketCosts:
    """Seconds of recent steps per arm k, at the batch sizes of one bucket, and its probing state."""

    def __init__(self, window: int):
        self.window = window
        self.seconds: dict[int, deque] = {}
        self.plain_seconds = 0.0  # of the plain steps since the last drafting one
        self.patience = FIRST_PATIENCE  # plain time before a probe, in probe costs (doubles after each)
        self.probe_left = 0       # steps of the current probe still to run
        self.draft_seconds: deque = deque(maxlen=window)    # drafting seconds per draft, in steady steps
        self.catch_up = None      # (k, drafting seconds, lag) of a catch-up step not yet weighed
        self.catch_up_per_lag: deque = deque(maxlen=window)   # a catch-up's excess, plain steps per lagged token

    def add(self, k: int, seconds: float) -> None:
        self.seconds.setdefault(k, deque(maxlen=self.window)).append(seconds)

    def measured(self) -> dict[int, float]:
        return {k: statistics.median(s) for k, s in sorted(self.seconds.items())}

    def estimate(self, k: int, prior_slope: float) -> float | None:
        """S(k): measured; else, as drafting steps lie on a line a + b k (k >= 1) that need not
        pass through the plain step's cost (a step that drafts at all may take a slower, wider
        path: on a CPU verifying 2 tokens can cost twice 1), the line through the two nearest
        drafting arms; with one drafting arm, its cost plus `prior_slope` plain steps per draft
        more; from the plain cost alone, 1 + prior_slope k plain steps. None: nothing measured."""
        points = self.measured()
        if k in points:
            return points[k]
        drafting = [j for j in points if j]
        if len(drafting) >= 2:           # the two nearest drafting arms (k = 0: the line's intercept)
            lo, hi = sorted(sorted(drafting, key=lambda j: (abs(j - k), j))[:2])
            return max(points[lo] + (points[hi] - points[lo]) / (hi - lo) * (k - lo), 0.0)
        if not points:
            return None
        plain = points[0] if 0 in points else points[drafting[0]] / (1 + prior_slope * drafting[0])
        if drafting and k:
            return points[drafting[0]] + prior_slope * plain * (k - drafting[0])
        return plain * (1 + prior_slope * k)


class MeasuredGoodput(LengthPolicy):
    """max_len: the longest draft (arms: the tiers of SPEC_TIERS up to it); prior_acceptance and
    prior_weight: the acceptance guessed before any draft, worth `prior_weight` drafts; memory:
    per-step discount of older drafts' evidence; prior_slope: a draft's cost (drafting plus
    verifying it) as a share of a plain step, until a bucket has measured it; window: recent steps
    per arm whose median is its cost."""

    def __init__(self, max_len: int = 8, prior_acceptance: float = 0.7, prior_weight: float = 2.0,
                 memory: float = 0.97, prior_slope: float = 0.5, window: int = 16):
        if non_negative_int(max_len, "MeasuredGoodput(max_len)") < 1:
            raise ValueError(f"MeasuredGoodput(max_len) must be >= 1, got {max_len}")
        probability(prior_acceptance, "MeasuredGoodput(prior_acceptance)")
        probability(memory, "MeasuredGoodput(memory)")
        for name, value in (("prior_weight", prior_weight), ("prior_slope", prior_slope)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"MeasuredGoodput({name}) must be a number > 0, got {value!r}")
        if non_negative_int(window, "MeasuredGoodput(window)") < 1:
            raise ValueError(f"MeasuredGoodput(window) must be >= 1, got {window}")
        self.max_len, self.memory, self.prior_slope, self.window = max_len, memory, prior_slope, window
        self.arms = [k for k in SPEC_TIERS if k <= max_len] + ([max_len] if max_len not in SPEC_TIERS else [])
        # evidence on acceptance: accepted drafts, rejections (a row stopping short of its drafts),
        # rows that proposed and rows asked to (discounted sums, starting from the prior)
        self.accepted, self.rejected = prior_acceptance * prior_weight, (1 - prior_acceptance) * prior_weight
        self.proposing, self.asked = 1.0, 1.0
        self.buckets: dict[int, _BucketCosts] = {}
        # seconds per prompt token of the last call's step 0 (continuous batching: of the last
        # forward that prefilled prompts)
        self.prefill_per_token = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a row emits in a step of k drafts."""
        a = self.acceptance
        return 1 + self.proposing / self.asked * sum(a ** i for i in range(1, k + 1))

    def _costs(self, batch_size: int) -> _BucketCosts:
        key = pow2_bucket(batch_size)
        if key not in self.buckets:
            self.buckets[key] = _BucketCosts(self.window)
        return self.buckets[key]

    def _slope(self, batch_size: int) -> float:
        """A draft's cost in plain steps, between two drafting arms of the nearest bucket that
        measured them and a plain step; else its drafting time alone, once measured (what a
        longer draft adds to verifying is not known yet: the next tier's step measures it); else
        the prior."""
        key = pow2_bucket(batch_size)
        for other in sorted(self.buckets, key=lambda b: abs(b.bit_length() - key.bit_length())):
            points = self.buckets[other].measured()
            drafting = [k for k in points if k]
            if 0 in points and len(drafting) >= 2:
                lo, hi = drafting[-2:]
                return max((points[hi] - points[lo]) / (hi - lo) / max(points[0], 1e-12), 0.0)   # (a coarse clock: 0 s)
        return self._draft_share()

    def goodputs(self, batch_size: int) -> dict[int, float]:
        """Predicted tokens per second (per row) of every arm; {} while nothing is measured."""
        costs, slope = self._costs(batch_size), self._slope(batch_size)
        if not costs.seconds:
            return {}
        return {k: self.expected_tokens(k) / max(costs.estimate(k, slope), 1e-12) for k in self.arms}

    def _toward(self, costs: _BucketCosts, k: int) -> int:
        """The arm to run for arm k: k once measured, else the next tier from the measured arms
        towards it (a line through noisy medians is no ground to jump far on)."""
        if k in costs.seconds:
            return k
        i = self.arms.index(k)
        nearest = min((j for j, arm in enumerate(self.arms) if arm in costs.seconds), key=lambda j: abs(j - i))
        return self.arms[nearest + (1 if i > nearest else -1)]

    def choose(self, ctx: StepContext) -> int:
        costs = self._costs(ctx.batch_size)
        if 0 not in costs.seconds:            # a bucket's first steps: the plain cost first
            return 0
        goodput = self.goodputs(ctx.batch_size)
        drafting = max((k for k in goodput if k), key=goodput.get)
        if costs.probe_left:                  # a probe runs two steps: its catch-up, then a steady one
            costs.probe_left -= 1
            return self._toward(costs, drafting)
        switch = self._catch_up(ctx) if ctx.max_lag > STEADY_LAG else 0.0
        saved = ctx.remaining * (1 / goodput[0] - 1 / goodput[drafting]) if ctx.remaining else float("inf")
        guessed = len(costs.seconds) == 1     # no drafting arm measured here: the costs are a prior's
        if goodput[drafting] > goodput[0] and saved > switch * (1 + guessed):   # a guess pays twice over
            costs.plain_seconds, costs.patience = 0.0, PATIENCE
            costs.probe_left = int(guessed)   # measure the arm too
            return self._toward(costs, drafting)
        # no length pays (or not enough to catch the draft up): plain, with a probe once the plain
        # steps since the last drafting one took `patience` times what a probe would lose
        # a probe step's time beyond what plain steps would take for its tokens: E(k) (1/gp_k - 1/gp_0)
        loss = max(self.expected_tokens(drafting) * (1 / goodput[drafting] - 1 / goodput[0]), 0.0)
        room = not ctx.remaining or ctx.remaining > 2 * (drafting + 1)     # for both of its steps
        if room and costs.plain_seconds > costs.patience * (switch + 2 * loss):
            costs.plain_seconds, costs.probe_left = 0.0, 1
            costs.patience = min(2 * costs.patience, MAX_PATIENCE)
            return self._toward(costs, drafting)
        return 0

    def _catch_up(self, ctx: StepContext) -> float:
        """Seconds a draft lagging ctx.max_lag tokens per row takes to catch up: as measured before
        per lagged token in plain steps, in this bucket or the nearest one, times this bucket's
        plain step; but no less than a prefill of the tokens it feeds (ctx.lag_tokens; else max_lag
        per row) as the target's prefill took per prompt token, scaled by what a draft forward costs
        of a plain step. (Where forwards are compute-bound, a CPU's, a catch-up of many rows costs
        their tokens, not one row's: measured at batch 1, it looked 16 times cheaper at batch 16.)"""
        tokens = ctx.lag_tokens or ctx.max_lag * ctx.batch_size
        as_prefill = self.prefill_per_token * self._draft_share() * tokens
        key = pow2_bucket(ctx.batch_size)
        for other in sorted(self.buckets, key=lambda b: abs(b.bit_length() - key.bit_length())):
            if self.buckets[other].catch_up_per_lag:
                per_lag = statistics.median(self.buckets[other].catch_up_per_lag)
                return max(per_lag * ctx.max_lag * self._costs(ctx.batch_size).measured()[0], as_prefill)
        return as_prefill

    def _draft_share(self) -> float:
        """A draft forward's seconds over a plain step's, in any bucket that measured both."""
        for costs in self.buckets.values():
            if costs.draft_seconds and 0 in costs.seconds:
                return statistics.median(costs.draft_seconds) / costs.measured()[0]
        return self.prior_slope

    def observe(self, record: StepRecord) -> None:
        if record.k:
            d = self.memory
            proposing = [(p, a) for p, a in zip(record.proposed, record.accepted) if p]
            self.accepted = d * self.accepted + sum(a for _, a in proposing)
            self.rejected = d * self.rejected + sum(a < p for p, a in proposing)
            self.proposing = d * self.proposing + len(proposing)
            self.asked = d * self.asked + record.batch_size
        if record.prefill_tokens and not record.k:     # (continuous batching) a forward that prefilled prompts
            self.prefill_per_token = record.seconds / record.prefill_tokens
        if not sum(record.emitted) or not record.steady:
            return
        costs = self._costs(record.batch_size)
        if record.k and record.lag > STEADY_LAG:     # caught a draft up (a call's first drafts too)
            costs.catch_up = (record.k, record.draft_s, record.lag)
        elif record.step == 0:                # step 0 also prefilled the prompt: no arm's cost
            self.prefill_per_token = record.seconds / max(record.lag * record.batch_size, 1)
        else:
            costs.add(record.k, record.seconds)
            if record.k:
                costs.draft_seconds.append(record.draft_s / record.k)
            else:
                costs.plain_seconds += record.seconds
        if costs.catch_up is not None and costs.draft_seconds and 0 in costs.seconds:
            # its excess over drafting k tokens in step is the switching cost
            k, seconds, lag = costs.catch_up
            costs.catch_up = None
            excess = seconds - k * statistics.median(costs.draft_seconds)
            costs.catch_up_per_lag.append(max(excess, 0.0) / lag / max(costs.measured()[0], 1e-12))

    def __repr__(self):
        return f"MeasuredGoodput(max_len={self.max_len}, acceptance={self.acceptance:.2f})"
