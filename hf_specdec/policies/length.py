"""Draft-length policies."""
from __future__ import annotations

from .base import LengthPolicy, StepContext


class FixedLength(LengthPolicy):
    """Always draft `k` tokens (k = 0: never speculate)."""

    def __init__(self, k: int = 4):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"FixedLength(k): k must be an integer >= 0, got {k!r}")
        self.k = k

    def choose(self, ctx: StepContext) -> int:
        return self.k

    def __repr__(self):
        return f"FixedLength({self.k})"
