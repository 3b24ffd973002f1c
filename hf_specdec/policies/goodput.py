"""Length policies that maximise predicted goodput (tokens per second) with a latency model. Pure Python.

A step of B rows holding C context tokens that runs j draft forwards and verifies v_b drafts of row b
is predicted to take (`hf_specdec.costmodel`, T(N_context, N_batch_tokens) per model)
    T = sum_{i<j} T_draft(C + i B, B) + T_target(C, sum_b (v_b + 1))
and to emit sum_b (1 + sum_{i<=v_b} AR_{b,i}) tokens, AR_{b,i} the probability that row b's first i
drafts are all accepted.

AdaSpec (Zhang et al., SoCC'25): AR_{b,i} = c_{b,1} ... c_{b,i}, c the draft's probability of its
own token (its confidence). The adaptive drafter (Alg. 1, "predict-execute-correct") drafts the next
token while the goodput predicted with it, its confidence guessed as the mean confidence of recent
drafts, beats the goodput of the drafts at hand; the confidence-prior verifier (Alg. 2) then drops
the lowest-AR drafts of any row while that raises the predicted goodput, so rows verify different
numbers of drafts. With an SLO (Alg. 3) a step predicted to take longer than `slo_tpot` scores -1.
In the paper the first draft is always drafted (Alg. 1 starts from best_thpt = -1) unless even that
step breaks the SLO: the drafts' confidences are what the policy learns from.
Whether to draft at all, charging the draft's catch-up after plain steps, is the default policy's
question (`MeasuredGoodput`); AdaSpec here is the paper's drafter.

DSDGoodput (DSD / SmartSpec): one k for the step, argmax of the goodput with AR_i = alpha^i and alpha
the acceptance rate measured so far; once k = 0 nothing is measured any more (its known deadlock).
"""
from __future__ import annotations

from collections import deque
from pathlib import Path

from ..costmodel import CostProfile
from ..stats import StepRecord
from .base import LengthPolicy, StepContext, non_negative_int, probability


class GoodputModel:
    """Predicted step time and goodput of a `CostProfile` (AdaSpec's efficiency estimator, Alg. 3)."""

    def __init__(self, profile: CostProfile, slo_tpot: float | None = None):
        self.profile, self.slo_tpot = profile, slo_tpot

    def step_time(self, batch: int, context: int, drafted: int, fed: int) -> float:
        """Seconds of a step that runs `drafted` draft forwards and feeds the target `fed` tokens
        (each row's pending token plus its verified drafts)."""
        draft = self.profile.draft     # forward i holds context + i batch tokens: summed in closed form
        drafting = drafted * draft.forward_time(context, batch) + draft.alpha * batch * drafted * (drafted - 1) / 2
        return drafting + self.profile.target.forward_time(context, fed, wide=fed > batch)

    def goodput(self, batch: int, context: int, drafted: int, ar: list[list[float]]) -> float:
        """Tokens per second of a step whose row b verifies len(ar[b]) drafts; -1 over the SLO."""
        verified = sum(len(row) for row in ar)
        seconds = self.step_time(batch, context, drafted, batch + verified)
        if self.slo_tpot is not None and seconds > self.slo_tpot:
            return -1.0
        return (batch + sum(map(sum, ar))) / seconds

    def best_verification(self, batch: int, context: int, drafted: int,
                          ar: list[list[float]]) -> tuple[list[int], float]:
        """Alg. 2: drop the draft with the lowest AR while that raises the goodput. AR falls along a
        row, so each row keeps a prefix. Returns the drafts to verify per row and their goodput."""
        lengths = [len(row) for row in ar]
        best = self.goodput(batch, context, drafted, ar)
        tokens, verified = batch + sum(map(sum, ar)), sum(lengths)
        for a, b in sorted((a, b) for b, row in enumerate(ar) for a in row):
            seconds = self.step_time(batch, context, drafted, batch + verified - 1)
            if self.slo_tpot is not None and seconds > self.slo_tpot:
                value = -1.0
            else:
                value = (tokens - a) / seconds
            if value <= best:
                break
            best, tokens, verified = value, tokens - a, verified - 1
            lengths[b] -= 1
        return lengths, best


def _as_profile(cost_model) -> CostProfile:
    if isinstance(cost_model, CostProfile):
        return cost_model
    if isinstance(cost_model, (str, Path)):
        return CostProfile.load(cost_model)
    raise TypeError(f"cost_model must be a CostProfile, the path of a profile JSON (python -m hf_specdec "
                    f"profile ...) or None (measured on first use), got {type(cost_model).__name__}")


class _Profiled(LengthPolicy):
    """A length policy that weighs a latency model: from a CostProfile (or its JSON path) given, or,
    with None, measured by generate() the first time the policy meets its models
    (`hf_specdec.costmodel.cached_profile`, cached on disk)."""

    def _use(self, cost_model, slo_tpot) -> None:
        if slo_tpot is not None and (isinstance(slo_tpot, bool) or not isinstance(slo_tpot, (int, float))
                                     or slo_tpot <= 0):
            raise ValueError(f"slo_tpot must be a number of seconds > 0 or None, got {slo_tpot!r}")
        self.slo_tpot, self.profile_attached = slo_tpot, False
        self.model = None if cost_model is None else GoodputModel(_as_profile(cost_model), slo_tpot)

    @property
    def profile(self) -> CostProfile | None:
        return None if self.model is None else self.model.profile

    def use_profile(self, profile, attached: bool = False) -> None:
        """attached: measured for the policy, not given by the user (generate() may replace it)."""
        self.model = GoodputModel(_as_profile(profile), self.slo_tpot)
        self.profile_attached = attached


def _cumulative(values: list[float]) -> list[float]:
    """Running products of `values`."""
    out, acc = [], 1.0
    for v in values:
        acc *= v
        out.append(acc)
    return out


class AdaSpec(_Profiled):
    """cost_model: a CostProfile, a profile JSON path, or None (measured on first use); max_len: most
    drafts per step; slo_tpot: seconds per step not to exceed (None: no SLO); prior_confidence: the
    guess for a draft's confidence before any was seen."""

    def __init__(self, cost_model=None, max_len: int = 8, slo_tpot: float | None = None,
                 prior_confidence: float = 0.5):
        if non_negative_int(max_len, "AdaSpec(max_len)") < 1:
            raise ValueError(f"AdaSpec(max_len) must be >= 1, got {max_len}")
        if isinstance(prior_confidence, bool) or not isinstance(prior_confidence, (int, float)) \
                or not 0 < prior_confidence <= 1:
            raise ValueError(f"AdaSpec(prior_confidence) must be in (0, 1], got {prior_confidence!r}")
        self._use(cost_model, slo_tpot)
        self.max_len = max_len
        self.recent: deque[float] = deque([prior_confidence], maxlen=64)   # latest drafts' confidences
        self.ctx: StepContext | None = None

    def _guess(self) -> float:
        return sum(self.recent) / len(self.recent)

    def choose(self, ctx: StepContext) -> int:
        self.ctx = ctx
        if self.model.goodput(ctx.batch_size, ctx.context_tokens, 1, [[self._guess()]] * ctx.batch_size) < 0:
            return 0                          # even one draft breaks the SLO
        return self.max_len

    def continue_drafting(self, confidences: list[list[float]]) -> list[bool]:
        """Alg. 1: draft one more token iff the goodput predicted with it (after the verifier's
        trimming) beats the goodput of the drafts at hand."""
        batch, context, drafted = self.ctx.batch_size, self.ctx.context_tokens, len(confidences[0])
        ar = [_cumulative(row) for row in confidences]
        _, now = self.model.best_verification(batch, context, drafted, ar)
        guess = self._guess()
        _, more = self.model.best_verification(batch, context, drafted + 1, [row + [row[-1] * guess] for row in ar])
        return [more > now] * batch

    def verify_lengths(self, confidences: list[list[float]]) -> list[int]:
        """Alg. 2 on the drafts at hand."""
        self.recent.extend(c for row in confidences for c in row)
        drafted = max(map(len, confidences), default=0)
        ar = [_cumulative(row) for row in confidences]
        return self.model.best_verification(self.ctx.batch_size, self.ctx.context_tokens, drafted, ar)[0]

    def __repr__(self):
        return f"AdaSpec(max_len={self.max_len}, slo_tpot={self.slo_tpot})"


class DSDGoodput(_Profiled):
    """argmax_k of predicted goodput with AR_i = alpha^i, alpha = accepted / proposed so far
    (exponential moving average with weight `smoothing` per drafting step)."""

    def __init__(self, cost_model=None, max_len: int = 8, prior_acceptance: float = 0.7, smoothing: float = 0.1):
        if non_negative_int(max_len, "DSDGoodput(max_len)") < 1:
            raise ValueError(f"DSDGoodput(max_len) must be >= 1, got {max_len}")
        probability(prior_acceptance, "DSDGoodput(prior_acceptance)")
        self._use(cost_model, None)
        self.max_len, self.alpha, self.smoothing = max_len, prior_acceptance, smoothing

    def choose(self, ctx: StepContext) -> int:
        def value(k):
            return self.model.goodput(ctx.batch_size, ctx.context_tokens, k, [[self.alpha ** i for i in range(1, k + 1)]]
                                      * ctx.batch_size)
        return max(range(self.max_len + 1), key=value)

    def observe(self, record: StepRecord) -> None:
        proposed = sum(record.proposed)
        if record.k and proposed:
            self.alpha += self.smoothing * (sum(record.accepted) / proposed - self.alpha)

    def __repr__(self):
        return f"DSDGoodput(max_len={self.max_len}, alpha={self.alpha:.2f})"
