"""Length policies that maximise predicted goodput (tokens per second) with a latency model. Pure Python.

Step time for B rows holding C context tokens, drafting j tokens and verifying v_b of row b's:
    T = sum_{i<j} T_draft(C + i B, B) + T_target(C, sum_b (v_b + 1))
with T(N_context, N_batch_tokens) = alpha N_context + gamma N_batch_tokens + delta per model
(`hf_specdec.costmodel`). Expected tokens: sum_b (1 + sum_{i<=v_b} AR_{b,i}).

AdaSpec (SoCC'25): AR_{b,i} = prod_{l<=i} c_{b,l}, the product of the draft's confidences in its
own tokens. Drafting continues while the goodput predicted for one more token (its confidence
guessed as the running mean confidence) rises ("predict-execute-correct"); then the
lowest-AR tail drafts of any row are dropped while that raises goodput (confidence-prior
verification: rows verify different numbers of tokens). With `slo_tpot`, a step predicted to take
longer than the SLO scores -1 and is not chosen.
DSDGoodput (DSD / SmartSpec): one k for the step, argmax of goodput with AR_i = alpha^i and alpha
the acceptance rate measured so far (which stops being measured once k = 0: its known deadlock).
"""
from __future__ import annotations

from pathlib import Path

from ..costmodel import CostProfile
from ..stats import StepRecord
from .base import LengthPolicy, StepContext, non_negative_int


def _as_profile(cost_model) -> CostProfile:
    if isinstance(cost_model, CostProfile):
        return cost_model
    if isinstance(cost_model, (str, Path)):
        return CostProfile.load(cost_model)
    raise TypeError(f"cost_model must be a CostProfile or the path of a profile JSON "
                    f"(python -m hf_specdec profile ...), got {type(cost_model).__name__}")


class _GoodputModel:
    def __init__(self, profile: CostProfile, slo_tpot: float | None):
        if slo_tpot is not None and (isinstance(slo_tpot, bool) or not isinstance(slo_tpot, (int, float))
                                     or slo_tpot <= 0):
            raise ValueError(f"slo_tpot must be a number of seconds > 0 or None, got {slo_tpot!r}")
        self.profile, self.slo_tpot = profile, slo_tpot

    def step_time(self, batch: int, context: int, drafted: int, verified: list[int]) -> float:
        draft = sum(self.profile.draft.forward_time(context + i * batch, batch) for i in range(drafted))
        return draft + self.profile.target.forward_time(context, sum(v + 1 for v in verified))

    def goodput(self, batch: int, context: int, drafted: int, ar: list[list[float]]) -> float:
        """ar[b] = acceptance estimates of the drafts row b verifies; -1 when over the SLO."""
        seconds = self.step_time(batch, context, drafted, [len(row) for row in ar])
        if self.slo_tpot is not None and seconds > self.slo_tpot:
            return -1.0
        return sum(1.0 + sum(row) for row in ar) / seconds


def _cumulative(confidences: list[float]) -> list[float]:
    out, acc = [], 1.0
    for c in confidences:
        acc *= c
        out.append(acc)
    return out


class AdaSpec(LengthPolicy):
    """cost_model: a CostProfile or a profile JSON path; max_len: most drafts per step;
    slo_tpot: seconds per step not to exceed (None: no SLO); prior_confidence: the guess for a
    draft token's confidence before any was seen."""

    def __init__(self, cost_model, max_len: int = 8, slo_tpot: float | None = None,
                 prior_confidence: float = 0.5):
        if non_negative_int(max_len, "AdaSpec(max_len)") < 1:
            raise ValueError(f"AdaSpec(max_len) must be >= 1, got {max_len}")
        if isinstance(prior_confidence, bool) or not 0 < prior_confidence <= 1:
            raise ValueError(f"AdaSpec(prior_confidence) must be in (0, 1], got {prior_confidence!r}")
        self.model = _GoodputModel(_as_profile(cost_model), slo_tpot)
        self.max_len = max_len
        self.mean_confidence, self.seen = prior_confidence, 0
        self.ctx: StepContext | None = None

    def choose(self, ctx: StepContext) -> int:
        self.ctx = ctx
        plain = self.model.goodput(ctx.batch_size, ctx.context_tokens, 0, [[] for _ in range(ctx.batch_size)])
        one = self.model.goodput(ctx.batch_size, ctx.context_tokens, 1,
                                 [[self.mean_confidence] for _ in range(ctx.batch_size)])
        return self.max_len if one > plain else 0

    def continue_drafting(self, confidences: list[list[float]]) -> list[bool]:
        for row in confidences:                         # correct the guess with what was drafted
            self.seen += 1
            self.mean_confidence += (row[-1] - self.mean_confidence) / self.seen
        ar = [_cumulative(row) for row in confidences]
        drafted = len(confidences[0])
        now = self.model.goodput(self.ctx.batch_size, self.ctx.context_tokens, drafted, ar)
        guess = [row + [row[-1] * self.mean_confidence] for row in ar]
        more = self.model.goodput(self.ctx.batch_size, self.ctx.context_tokens, drafted + 1, guess) > now
        return [more] * len(confidences)

    def verify_lengths(self, confidences: list[list[float]]) -> list[int]:
        ar = [_cumulative(row) for row in confidences]
        drafted = max((len(row) for row in ar), default=0)
        best = self.model.goodput(self.ctx.batch_size, self.ctx.context_tokens, drafted, ar)
        while any(ar):
            # the lowest-estimate draft of any row is that row's last one (AR falls along a row)
            row = min((b for b in range(len(ar)) if ar[b]), key=lambda b: ar[b][-1])
            trial = [r if b != row else r[:-1] for b, r in enumerate(ar)]
            value = self.model.goodput(self.ctx.batch_size, self.ctx.context_tokens, drafted, trial)
            if value <= best:
                break
            ar, best = trial, value
        return [len(row) for row in ar]

    def __repr__(self):
        return f"AdaSpec(max_len={self.max_len}, slo_tpot={self.model.slo_tpot})"


class DSDGoodput(LengthPolicy):
    """argmax_k of predicted goodput with AR_i = alpha^i, alpha = accepted / proposed so far
    (exponential moving average with weight `smoothing` per step)."""

    def __init__(self, cost_model, max_len: int = 8, prior_acceptance: float = 0.7, smoothing: float = 0.1):
        if non_negative_int(max_len, "DSDGoodput(max_len)") < 1:
            raise ValueError(f"DSDGoodput(max_len) must be >= 1, got {max_len}")
        if isinstance(prior_acceptance, bool) or not 0 <= prior_acceptance <= 1:
            raise ValueError(f"DSDGoodput(prior_acceptance) must be in [0, 1], got {prior_acceptance!r}")
        self.model = _GoodputModel(_as_profile(cost_model), None)
        self.max_len, self.alpha, self.smoothing = max_len, prior_acceptance, smoothing

    def choose(self, ctx: StepContext) -> int:
        def value(k):
            ar = [self.alpha ** i for i in range(1, k + 1)]
            return self.model.goodput(ctx.batch_size, ctx.context_tokens, k, [ar] * ctx.batch_size)
        return max(range(self.max_len + 1), key=value)

    def observe(self, record: StepRecord) -> None:
        proposed = sum(record.proposed)
        if record.k and proposed:
            self.alpha += self.smoothing * (sum(record.accepted) / proposed - self.alpha)

    def __repr__(self):
        return f"DSDGoodput(max_len={self.max_len}, alpha={self.alpha:.2f})"
