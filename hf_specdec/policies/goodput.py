"""Length policies that maximise predicted goodput (tokens per second) with a latency model. Pure Python.

Step time for B rows holding C context tokens, drafting j tokens and verifying v_b of row b's:
    T = sum_{i<j} T_draft(C + i B, B) + T_target(C, sum_b (v_b + 1))
with T(N_context, N_batch_tokens) = alpha N_context + gamma N_batch_tokens + delta per model
(`hf_specdec.costmodel`). Expected tokens: sum_b (1 + sum_{i<=v_b} AR_{b,i}).

AdaSpec (SoCC'25): AR_{b,i} = prod_{l<=i} a(c_{b,l}), with c the draft's confidence in its own
token and a(c) = c in the paper; by default we learn a(c) from verification outcomes and scale AR
by the drafts measured to pass over those predicted. Drafting continues while the goodput
predicted for one more token (its confidence guessed as the running mean confidence) rises
("predict-execute-correct"); then the
lowest-AR tail drafts of any row are dropped while that raises goodput (confidence-prior
verification: rows verify different numbers of tokens). With `slo_tpot`, a step predicted to take
longer than the SLO scores -1 and is not chosen. Ours: whether to draft at all also weighs the
draft's catch-up over the steps left and, in generate(), the wait for the slowest row (`straggler`).
DSDGoodput (DSD / SmartSpec): one k for the step, argmax of goodput with AR_i = alpha^i and alpha
the acceptance rate measured so far (which stops being measured once k = 0: its known deadlock).
"""
from __future__ import annotations

import math
from collections import deque
from pathlib import Path

from ..costmodel import CostProfile
from ..stats import StepRecord
from . import straggler
from .base import LengthPolicy, StepContext, non_negative_int, pow2_bucket, probability


def _as_profile(cost_model) -> CostProfile:
    if isinstance(cost_model, CostProfile):
        return cost_model
    if isinstance(cost_model, (str, Path)):
        return CostProfile.load(cost_model)
    raise TypeError(f"cost_model must be a CostProfile, the path of a profile JSON (python -m hf_specdec "
                    f"profile ...) or None (measured on first use), got {type(cost_model).__name__}")


class _Profiled(LengthPolicy):
    """A length policy that weighs a latency model: from a CostProfile (or its JSON path) given,
    or, with None, measured by generate() the first time the policy meets its models
    (`hf_specdec.costmodel.cached_profile`, cached on disk)."""

    def _use(self, cost_model, slo_tpot) -> None:
        _check_slo(slo_tpot)
        self.slo_tpot, self.profile_attached = slo_tpot, False
        self.model = None if cost_model is None else _GoodputModel(_as_profile(cost_model), slo_tpot)

    @property
    def profile(self) -> CostProfile | None:
        return None if self.model is None else self.model.profile

    def use_profile(self, profile, attached: bool = False) -> None:
        """attached: measured for the policy, not given by the user (generate() may replace it)."""
        self.model = _GoodputModel(_as_profile(profile), self.slo_tpot)
        self.profile_attached = attached


def _check_slo(slo_tpot) -> None:
    if slo_tpot is not None and (isinstance(slo_tpot, bool) or not isinstance(slo_tpot, (int, float)) or slo_tpot <= 0):
        raise ValueError(f"slo_tpot must be a number of seconds > 0 or None, got {slo_tpot!r}")


class _GoodputModel:
    """The latency model's goodput, corrected online per batch bucket: plain steps' time is scaled
    by their measured / modelled ratio, and a drafting step costs that plus a fixed excess, measured
    apart for its verification (`extra`) and its drafting (`draft_extra`). Fixed, not a second
    ratio: what a drafting step costs beyond its forwards is per step (the draft loop's and the
    acceptance's work; tiny pair, B=1: ~1.7 ms of a 20 ms step), and a ratio would scale every
    drafting length alike and keep the model's best length; a fixed cost is what longer drafts
    amortise (a wide forward's own jump is the profile's `LatencyModel.wide_extra`). Apart, because
    a draft's catch-up (a probe after plain steps, a call's first drafts) varies far more than the
    excess (tiny pair, B=16: 10 ms either side of a 6 ms excess): such a step teaches only its
    verification side."""

    def __init__(self, profile: CostProfile, slo_tpot: float | None):
        self.profile, self.slo_tpot = profile, slo_tpot
        self.ratio: dict[int, tuple[float, int, int]] = {}   # bucket -> (plain steps' measured / modelled, steps, clock)
        # bucket -> (drafting steps' excess seconds, steps, clock): of verifying, and of drafting
        self.extra: dict[int, tuple[float, int, int]] = {}
        self.draft_extra: dict[int, tuple[float, int, int]] = {}
        self.clock = 0                                       # steps learned from

    def _modelled(self, batch: int, context: int, drafted: int, fed: int, lag: int = 1) -> float:
        # draft forward i (< drafted) holds context + i batch tokens and feeds batch tokens, the
        # first one also what the draft missed: `lag` tokens per row (1 in steady state; a whole
        # stretch of plain steps after speculation was off). Summed in closed form (runs per decision).
        draft = self.profile.draft
        seconds = self.profile.target.forward_time(context, fed, wide=fed > batch)
        if drafted:
            seconds += drafted * draft.forward_time(context, batch) + draft.alpha * batch * drafted * (drafted - 1) / 2 \
                + (draft.gamma * batch * (lag - 1) + draft.wide_extra if lag > 1 else 0.0)
        return seconds

    def _scaled(self, batch: int, context: int, drafted: int, fed: int, lag: int = 1) -> float:
        return self.ratio.get(pow2_bucket(batch), (1.0,))[0] * self._modelled(batch, context, drafted, fed, lag)

    def step_time(self, batch: int, context: int, drafted: int, fed: int, lag: int = 1) -> float:
        """Seconds of a step of `batch` rows holding `context` tokens that runs `drafted` draft
        forwards and feeds the target `fed` tokens (each row's pending one + its verified drafts)."""
        seconds = self._scaled(batch, context, drafted, fed, lag)
        if drafted:   # an excess below 0 (the model's slope too steep) would make short drafts look free
            seconds += max(self.excess(batch), 0.0)
        return seconds

    def excess(self, batch: int) -> float:
        """Seconds a drafting step of `batch` rows was measured to take beyond the scaled model."""
        bucket = pow2_bucket(batch)
        return self.extra.get(bucket, (0.0,))[0] + self.draft_extra.get(bucket, (0.0,))[0]

    def catch_up(self, batch: int, context: int, lag: int) -> float:
        """Seconds a first draft forward spends feeding the `lag` - 1 tokens per row the draft missed
        beyond its usual one (at a call's first drafting step: the prompt)."""
        if lag <= 1:
            return 0.0
        return self._scaled(batch, context, 1, batch, lag) - self._scaled(batch, context, 1, batch)

    def learn(self, record: StepRecord, context: int, drafted: int | None = None) -> None:
        """Fold a measured step into the corrections; a step that prefilled the prompt is left out.
        drafted: the draft forwards run, if more than the longest verified row (drafts dropped
        before verification). A drafting step teaches its drafting side only without a catch-up
        (lag <= 2: the draft's last token and the target's; see the class)."""
        self.clock += 1
        if record.step == 0 or not record.batch_size:
            return
        if drafted is None:
            drafted = max(record.proposed) if record.k else 0
        batch, bucket = record.batch_size, pow2_bucket(record.batch_size)
        fed = batch + sum(record.proposed)
        if not drafted:
            modelled = self._modelled(batch, context, 0, fed)
            if modelled > 0:
                self._fold(self.ratio, bucket, record.seconds / modelled)
            return
        verification = self._scaled(batch, context, 0, fed)
        self._fold(self.extra, bucket, record.seconds - record.draft_s - verification)
        if record.lag <= 2:
            drafting = self._scaled(batch, context, drafted, fed, record.lag) - verification
            self._fold(self.draft_extra, bucket, record.draft_s - drafting)

    def _fold(self, table: dict, bucket: int, value: float) -> None:
        mean, n, last = table.get(bucket, (0.0, 0, 0))
        # a mean at first, then a running one over about the last 10 steps *of time*, not of samples:
        # a sample after a long gap (a probe after many plain steps, plain steps after much drafting)
        # weighs up to half, against an estimate the machine's drift may have made stale. Over
        # samples, a drafting cost learned in a slow spell kept drafting off for good (tiny pair,
        # B=4), rare probes moving it a tenth at a time; one sample alone would be one step's noise.
        weight = max(1.0 / (n + 1), min(0.5, 1.0 - 0.9 ** (self.clock - last)))
        table[bucket] = (mean + weight * (value - mean), n + 1, self.clock)

    def goodput(self, batch: int, context: int, drafted: int, ar: list[float], spread: float = 0.0,
                stretch: float = 1.0) -> float:
        """Of a step in which every row verifies drafts with acceptance estimates ar; spread:
        seconds charged beyond the step's own (a one-off cost shared with later steps: not judged
        against the SLO); stretch: steps taken per step the rate promises (a static batch's tail,
        `straggler`); -1 when the step is over the SLO."""
        seconds = self.step_time(batch, context, drafted, batch * (len(ar) + 1))
        if self.slo_tpot is not None and seconds > self.slo_tpot:
            return -1.0
        return batch * (1.0 + sum(ar)) / (seconds * stretch + spread)

    def best_verification(self, batch: int, context: int, drafted: int, ar: list[list[float]]) -> tuple[list[int], float]:
        """The verify lengths per row that maximise goodput once `drafted` draft forwards are run, and
        that goodput (-1: over the SLO whatever is verified). Verifying n > 0 drafts takes
        T = T1 + g (n - 1), T1 including the wide forward's fixed cost (`LatencyModel.wide_extra`),
        so past the first a draft with estimate a raises goodput (B + sum a) / T iff a > g x goodput:
        take drafts in falling order of a while that holds (AR falls along a row, so each row keeps
        a prefix), then keep them only if they beat verifying none. O(B k log(B k)), not the
        O(B^2 k^2) of dropping one at a time."""
        none = self.step_time(batch, context, drafted, batch)
        first = self.step_time(batch, context, drafted, batch + 1)
        per_token = self.step_time(batch, context, drafted, batch + 2) - first
        if self.slo_tpot is not None and none > self.slo_tpot:
            return [0] * batch, -1.0
        lengths, gained, kept = [0] * batch, 0.0, 0
        for minus_a, _, b in sorted((-a, j, b) for b, row in enumerate(ar) for j, a in enumerate(row)):
            seconds = first + per_token * kept               # with this draft verified
            if kept and -minus_a * (seconds - per_token) <= per_token * (batch + gained):   # a <= g x goodput
                break
            if self.slo_tpot is not None and seconds > self.slo_tpot:
                break
            lengths[b], gained, kept = lengths[b] + 1, gained - minus_a, kept + 1
        verified = (batch + gained) / (first + per_token * (kept - 1)) if kept else 0.0
        return (lengths, verified) if verified > batch / none else ([0] * batch, batch / none)


def _cumulative(values: list[float], acc: float = 1.0) -> list[float]:
    """Running products of `values`, starting from `acc`."""
    out = []
    for v in values:
        acc *= v
        out.append(acc)
    return out


class Calibration:
    """Acceptance probability as a function of draft confidence, learned from verification.

    AdaSpec takes acceptance = confidence, which holds for well-calibrated drafters only (a
    drafter that copies the target exactly but with flat distributions is always accepted at low
    confidence). Each confidence bin counts accepted / judged drafts behind a prior of `strength`
    pseudo-drafts at the acceptance rate of all bins together, itself starting from the bin's
    midpoint (the identity) with one pseudo-draft's weight. A midpoint prior alone held a flat
    drafter's bin 0 near 0.05 for dozens of drafts while it was accepted ~70% of the time, and an
    estimate that low stops the drafting that would correct it."""

    def __init__(self, bins: int = 10, strength: float = 4.0):
        self.bins, self.strength = bins, strength
        self.mid = [(i + 0.5) / bins for i in range(bins)]
        self.accepted = [0] * bins
        self.judged = [0] * bins
        self.all_accepted = self.all_judged = 0
        self.rows_judged = 0      # row-steps that judged a draft (a row's drafts in a step are dependent)

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.bins), self.bins - 1)

    def __call__(self, confidence: float) -> float:
        i = self._bin(confidence)
        prior = (self.all_accepted + self.mid[i]) / (self.all_judged + 1)
        return (self.accepted[i] + self.strength * prior) / (self.judged[i] + self.strength)

    def update(self, confidences: list[float], accepted: int, proposed: int) -> None:
        """One row's verified drafts: the first `accepted` passed, the next (if proposed) failed;
        later ones were never judged."""
        self.rows_judged += proposed > 0
        for j, c in enumerate(confidences[: min(proposed, accepted + 1)]):
            i = self._bin(c)
            self.judged[i] += 1
            self.accepted[i] += j < accepted
            self.all_judged += 1
            self.all_accepted += j < accepted


class AdaSpec(_Profiled):
    """cost_model: a CostProfile, a profile JSON path, or None (measured on first use); max_len: most drafts per step;
    slo_tpot: seconds per step not to exceed (None: no SLO); prior_confidence: the guess for a
    draft token's acceptance before any was seen; calibrate: map confidence to acceptance with
    a `Calibration` learned online, its AR corrected by the drafts measured to pass (False: the
    paper's acceptance = confidence); probe_every:
    draft anyway after this many non-drafting steps while the acceptance estimate is too uncertain
    to rule drafting out, so it keeps being measured (asked every probe_every idle steps; once it
    is sure, the gap doubles after each probe, up to 32 x probe_every; never at a call's first
    step); idle steps of an unchanged batch size weigh drafting itself only as often. A probe
    drafts and verifies, in every row, the length that would be best at the acceptance's upper
    confidence bound.
    probe_budget: once sure, the share of the plain steps' time that the probes may lose (unsure:
    at most drafting's optimistic gain)."""

    def __init__(self, cost_model=None, max_len: int = 8, slo_tpot: float | None = None,
                 prior_confidence: float = 0.5, calibrate: bool = True, probe_every: int = 8,
                 probe_budget: float = 0.01):
        if non_negative_int(max_len, "AdaSpec(max_len)") < 1:
            raise ValueError(f"AdaSpec(max_len) must be >= 1, got {max_len}")
        if isinstance(prior_confidence, bool) or not 0 < prior_confidence <= 1:
            raise ValueError(f"AdaSpec(prior_confidence) must be in (0, 1], got {prior_confidence!r}")
        self._use(cost_model, slo_tpot)
        self.max_len = max_len
        self.calibration = Calibration() if calibrate else (lambda c: c)
        self.prior_confidence = prior_confidence
        self.recent: deque[float] = deque(maxlen=50)             # confidences of the latest drafts
        self.probe_every = non_negative_int(probe_every, "AdaSpec(probe_every)") or 1
        if isinstance(probe_budget, bool) or not isinstance(probe_budget, (int, float)) or probe_budget <= 0:
            raise ValueError(f"AdaSpec(probe_budget) must be a number > 0, got {probe_budget!r}")
        self.probe_budget = probe_budget
        self.idle = 0                                            # steps since the last drafting step
        self.asked_batch = 0                                     # the batch size drafting was last weighed at
        self.probing = False                                     # this step drafts to measure
        self.guess = prior_confidence          # mean_acceptance(), updated when drafts are verified
        self.probe_gap = self.probe_every                        # idle steps before the next probe
        self.finishing = straggler.FinishingRows()                # rows that can be a call's last
        self.ctx: StepContext | None = None
        self.verified: list[list[float]] | None = None          # this step's confidences, for observe
        self.drafting: tuple[list, list[list[float]]] = ([], [])  # a drafter's confidences and their AR so far
        self.passed = self.expected = 1.0     # drafts accepted vs the calibrated AR's sum, recent steps

    def choose(self, ctx: StepContext) -> int:
        self.ctx, self.verified, self.probing = ctx, None, False
        batch = ctx.batch_size
        if ctx.static_batch:
            self.finishing.update(ctx)
        # While drafting is off its answer moves with the batch size, and otherwise slowly (the
        # acceptance guess moves only when drafts are verified; the context, the steps left and the
        # corrections a little each step): between the probe questions, asked every probe_every idle
        # steps, an idle step of the same batch size does not ask again. Asking weighs every length
        # (~0.1 ms, ~0.7% of a tiny-pair step at B=2), and where nothing pays that is what AdaSpec
        # loses to plain decoding.
        if ctx.step and self.idle and (self.idle + 1) % self.probe_every and batch == self.asked_batch:
            self.idle += 1
            return 0
        self.asked_batch = batch
        # The draft's catch-up (after plain steps; a call's first drafts prefill its prompt) is paid
        # once, by the first drafting step, for drafting over the rest of the call: it is spread over
        # the steps left at that rate. A short call cannot repay a long prompt's catch-up (SmolLM2,
        # int8 draft, 32 new tokens: a call's first probe cost its prompt's prefill through the
        # draft). Unknown remaining (0): not charged.
        # In a static batch (generate()) drafting also pays the wait for its slowest row at the
        # call's end (`straggler`; tiny pair, B=16, all rows running to the end: ~10%).
        catch_up = self.model.catch_up(batch, ctx.context_tokens, ctx.max_lag) if ctx.remaining else 0.0
        finishing = self.finishing(batch) if ctx.static_batch else 1      # 1 row: no wait
        def goodput(drafts: int, acceptance: float) -> float:
            ar = self._corrected(_cumulative([acceptance] * drafts))
            steps_left = max(1.0, ctx.remaining / (1 + sum(ar)))
            spread = catch_up / steps_left if drafts else 0.0
            tail = straggler.stretch(finishing, ctx.remaining, ar, ctx.rooms)
            return self.model.goodput(batch, ctx.context_tokens, drafts, ar, spread, tail)
        def best_drafting(acceptance: float) -> tuple[float, int]:
            # any length, not only one draft: a drafting step's fixed excess (`_GoodputModel.extra`)
            # can make one draft lose where two or three win. Returns (goodput, length).
            return max((goodput(j, acceptance), j) for j in range(1, self.max_len + 1))
        plain = goodput(0, 1.0)
        if best_drafting(self.guess)[0] > plain:
            self.idle, self.probe_gap = 0, self.probe_every
            return self.max_len
        # A probe step (drafting although the estimate says no) keeps the acceptance estimate
        # alive: no deadlock at 0. Only where acceptance could change the answer: if even drafts
        # that are always accepted cost more than they give, drafting never pays at this load and
        # probing would only slow it down. While the estimate is too uncertain to say no (drafting
        # pays at its upper confidence bound) probes come every `probe_every` steps; once it is
        # sure, each probe costs a draft catch-up and a wider verification for a check that
        # acceptance has not changed, so they grow rarer. Either way a probe's loss (`_probe_loss`)
        # is paid for: unsure, by what drafting would have gained over the idle steps were the
        # optimistic estimate right (a near-tie at B=16 is not worth a probe every 8 steps); sure,
        # by `probe_budget` of their time (SmolLM2, int8 draft: a call's first probe cost ~6 plain steps).
        # A probe drafts the length that would be best were the optimistic estimate right: the one
        # worth checking, and short once acceptance is known to be low (every draft past the first
        # rejected one is wasted: with the tiny pair's useless draft, five of a probe's six drafts
        # were never judged).
        # No probe at a call's first step, where the last call's idle steps could put one: that step
        # also prefills the prompt and `learn` leaves its time out, so the probe taught acceptance
        # but never the drafting cost (tiny pair, B=8: one such probe per call, plain decoding for
        # the rest of it, call after call, at 0.86x fixed:2). Nor is it counted as idle.
        if ctx.step == 0:
            return 0
        self.idle += 1
        # Whether to probe is asked every probe_every idle steps (probe_gap is a multiple of it)
        if self.idle % self.probe_every:
            return 0
        plain_s = self.model.step_time(batch, ctx.context_tokens, 0, batch)
        optimistic, length = best_drafting(self.optimistic_acceptance())
        loss = self._probe_loss(ctx, catch_up, plain_s, length)
        upside = optimistic / plain - 1
        if upside > 0 and self.idle * upside * plain_s >= loss:
            self.idle, self.probing = 0, True
        elif self.idle >= self.probe_gap and best_drafting(1.0)[0] > plain \
                and self.idle * self.probe_budget * plain_s >= loss:
            self.idle, self.probe_gap = 0, min(2 * self.probe_gap, 32 * self.probe_every)
            self.probing = True
        return length if self.probing else 0

    def _probe_loss(self, ctx: StepContext, catch_up: float, plain_s: float, drafts: int) -> float:
        """Seconds a probe (`drafts` drafts, all verified, after the draft's catch-up) costs beyond
        the plain steps (plain_s each) that would emit its expected tokens, at the current guess."""
        batch = ctx.batch_size
        probe_s = catch_up + self.model.step_time(batch, ctx.context_tokens, drafts, batch * (drafts + 1))
        return probe_s - (1 + sum(self._corrected(_cumulative([self.guess] * drafts)))) * plain_s

    def optimistic_acceptance(self) -> float:
        """An upper confidence bound of the guess: + sqrt(ln(1/delta) / 2n) over the n row-steps that
        judged drafts so far (Hoeffding, delta = e^-2); the guess itself where acceptance is not
        learned. Not n drafts: a row's drafts in a step share one stretch of text (tiny pair, B=8:
        52 drafts from a call's first 3-4 steps read 0.54 accepted, ~0.72 later; bounded over the 52
        as if independent, drafting looked sure to lose and probes grew rare for calls)."""
        if not isinstance(self.calibration, Calibration):
            return self.guess
        return min(1.0, self.guess + math.sqrt(1.0 / max(self.calibration.rows_judged, 1)))

    def mean_acceptance(self) -> float:
        """The guess for one more draft's acceptance: the latest drafts' confidences through the
        calibration as it is now (it keeps learning, so old estimates are not averaged in)."""
        if not self.recent:
            return self.prior_confidence
        return sum(self.calibration(c) for c in self.recent) / len(self.recent)

    def _corrected(self, ar: list[float]) -> list[float]:
        """AR from confidences, times the measured / predicted accepted drafts of recent steps. The
        calibration learns a draft's acceptance given its confidence, alike at every depth; where it
        is not alike, the product over a row's drafts is off. Prompt lookup (every confidence 1.0):
        0.35 of first drafts passed, 0.8-1.0 of later ones given their predecessors did, pooled into
        one 0.61: its AR predicted about twice the drafts accepted, and AdaSpec verified 4-5 per row
        where 3 were at best even with plain decoding (SmolLM2, B=4)."""
        ratio = self.passed / self.expected
        return [min(1.0, ratio * a) for a in ar]

    def _ar(self, confidences: list[list[float]], corrected: bool = True) -> list[list[float]]:
        """AR_{b,i}: probability that row b's drafts up to i are all accepted (`_corrected`, or the
        calibration's alone)."""
        ar = [_cumulative([self.calibration(c) for c in row]) for row in confidences]
        return [self._corrected(row) for row in ar] if corrected else ar

    def continue_drafting(self, confidences: list[list[float]]) -> list[bool]:
        """Draft one more token iff the step's best goodput (after `verify_lengths`' trimming) rises
        with it, the next token's acceptance guessed as row[-1] x the mean: drafts that would be
        dropped before verification are not worth their draft forward."""
        if self.probing:
            return [True] * len(confidences)
        # asked after every draft token with the same, growing lists (`Drafter.propose`): only the new
        # columns' AR are computed (O(B k), not O(B k^2)); another list (another drafter) starts afresh
        if confidences is not self.drafting[0]:
            self.drafting = (confidences, [[] for _ in confidences])
        for row_ar, row in zip(self.drafting[1], confidences):
            new = [self.calibration(c) for c in row[len(row_ar):]]
            row_ar += _cumulative(new, row_ar[-1] if row_ar else 1.0)
        ar, drafted = self.drafting[1], len(confidences[0])
        batch, context = self.ctx.batch_size, self.ctx.context_tokens
        corrected = [self._corrected(row) for row in ar]       # the ratio is fixed within a step
        _, now = self.model.best_verification(batch, context, drafted, corrected)
        longer = [row + self._corrected([raw[-1] * self.guess]) for row, raw in zip(corrected, ar)]
        _, more = self.model.best_verification(batch, context, drafted + 1, longer)
        return [more > now] * len(confidences)

    def observe(self, record: StepRecord) -> None:
        # drafts dropped before verification were still drafted: the step is a drafting one
        drafted = max((len(row) for row in self.verified), default=0) if self.verified is not None else 0
        self.model.learn(record, self.ctx.context_tokens, drafted)
        if self.verified is None:
            return
        if isinstance(self.calibration, Calibration):
            # `_corrected`'s sums fade by 2% a step (~50 drafting steps), so they follow the text's
            # drift; each starts at one pseudo-draft, a ratio of 1
            ar = self._ar(self.verified, corrected=False)
            expected = sum(sum(row[:n]) for row, n in zip(ar, record.proposed))
            self.passed = 0.98 * self.passed + sum(record.accepted) + 0.02
            self.expected = 0.98 * self.expected + expected + 0.02
            for confidences, accepted, proposed in zip(self.verified, record.accepted, record.proposed):
                self.calibration.update(confidences, accepted, proposed)
        self.guess = self.mean_acceptance()      # fixed within a step (drafting reads it)

    def verify_lengths(self, confidences: list[list[float]]) -> list[int]:
        self.verified = confidences
        self.recent.extend(c for row in confidences for c in row)
        if self.probing:
            return [len(row) for row in confidences]
        ar = self._ar(confidences)
        drafted = max((len(row) for row in ar), default=0)
        return self.model.best_verification(self.ctx.batch_size, self.ctx.context_tokens, drafted, ar)[0]

    def __repr__(self):
        return f"AdaSpec(max_len={self.max_len}, slo_tpot={self.slo_tpot})"


class DSDGoodput(_Profiled):
    """argmax_k of predicted goodput with AR_i = alpha^i, alpha = accepted / proposed so far
    (exponential moving average with weight `smoothing` per step)."""

    def __init__(self, cost_model=None, max_len: int = 8, prior_acceptance: float = 0.7, smoothing: float = 0.1):
        if non_negative_int(max_len, "DSDGoodput(max_len)") < 1:
            raise ValueError(f"DSDGoodput(max_len) must be >= 1, got {max_len}")
        probability(prior_acceptance, "DSDGoodput(prior_acceptance)")
        self._use(cost_model, None)
        self.max_len, self.alpha, self.smoothing = max_len, prior_acceptance, smoothing
        self.context = 0   # the current step's context tokens

    def choose(self, ctx: StepContext) -> int:
        self.context = ctx.context_tokens
        def value(k):
            ar = [self.alpha ** i for i in range(1, k + 1)]
            return self.model.goodput(ctx.batch_size, ctx.context_tokens, k, ar)
        return max(range(self.max_len + 1), key=value)

    def observe(self, record: StepRecord) -> None:
        self.model.learn(record, self.context)
        proposed = sum(record.proposed)
        if record.k and proposed:
            self.alpha += self.smoothing * (sum(record.accepted) / proposed - self.alpha)

    def __repr__(self):
        return f"DSDGoodput(max_len={self.max_len}, alpha={self.alpha:.2f})"
