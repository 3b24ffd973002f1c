"""Draft-length policies without a cost model: fixed, and Transformers' two schedules."""
from __future__ import annotations

from ..stats import StepRecord
from .base import LengthPolicy, StepContext, non_negative_int, probability


class FixedLength(LengthPolicy):
    """Always draft `k` tokens (k = 0: never speculate)."""

    def __init__(self, k: int = 4):
        self.k = non_negative_int(k, "FixedLength(k): k")

    def choose(self, ctx: StepContext) -> int:
        return self.k

    def __repr__(self):
        return f"FixedLength({self.k})"


class HFHeuristic(LengthPolicy):
    """Transformers' "heuristic" schedule: +2 after a step in which every row accepted all its
    drafts, else -1 (never below 1). The length carries over between calls, as it does on
    Transformers' assistant. threshold > 0 adds Transformers' confidence stop (a row stops drafting
    after a token whose draft probability is below it), as its assistant applies both."""

    def __init__(self, initial: int = 20, threshold: float = 0.0):
        if non_negative_int(initial, "HFHeuristic(initial)") < 1:
            raise ValueError(f"HFHeuristic(initial) must be >= 1, got {initial}")
        self.k, self.threshold = initial, probability(threshold, "HFHeuristic(threshold)")
        if not threshold:
            self.continue_drafting = None     # no confidence is read: no host sync per draft

    def choose(self, ctx: StepContext) -> int:
        return self.k

    def continue_drafting(self, confidences: list[list[float]]) -> list[bool]:
        return [row[-1] >= self.threshold for row in confidences]

    def observe(self, record: StepRecord) -> None:
        if record.k == 0:
            return
        # as Transformers: every candidate drafted was accepted (fewer than k after a confidence stop)
        full = all(0 < p == a for a, p in zip(record.accepted, record.proposed))
        self.k = self.k + 2 if full else max(1, self.k - 1)

    def __repr__(self):
        return f"HFHeuristic(k={self.k}" + (f", threshold={self.threshold})" if self.threshold else ")")


class ConfidenceThreshold(LengthPolicy):
    """Transformers' dynamic speculation (`assistant_confidence_threshold`): a row stops drafting
    after a token whose draft probability is below `threshold`; at most `max_len` tokens."""

    def __init__(self, threshold: float = 0.4, max_len: int = 20):
        probability(threshold, "ConfidenceThreshold(threshold)")
        if non_negative_int(max_len, "ConfidenceThreshold(max_len)") < 1:
            raise ValueError(f"ConfidenceThreshold(max_len) must be >= 1, got {max_len}")
        self.threshold, self.max_len = threshold, max_len

    def choose(self, ctx: StepContext) -> int:
        return self.max_len

    def continue_drafting(self, confidences: list[list[float]]) -> list[bool]:
        return [row[-1] >= self.threshold for row in confidences]

    def __repr__(self):
        return f"ConfidenceThreshold({self.threshold}, max_len={self.max_len})"
