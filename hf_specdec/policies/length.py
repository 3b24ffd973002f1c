"""Draft-length policies."""
from __future__ import annotations

from .base import LengthPolicy, StepContext, non_negative_int


class FixedLength(LengthPolicy):
    """Always draft `k` tokens (k = 0: never speculate)."""

    def __init__(self, k: int = 4):
        self.k = non_negative_int(k, "FixedLength(k): k")

    def choose(self, ctx: StepContext) -> int:
        return self.k

    def __repr__(self):
        return f"FixedLength({self.k})"
