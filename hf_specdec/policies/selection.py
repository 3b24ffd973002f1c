"""Drafter selectors."""
from __future__ import annotations

from .base import DrafterSelector, StepContext, non_negative_int


class FixedDrafter(DrafterSelector):
    """Always use drafter `index`."""

    def __init__(self, index: int = 0):
        self.index = non_negative_int(index, "FixedDrafter(index): index")

    def choose(self, ctx: StepContext) -> int:
        if self.index >= ctx.num_drafters:
            raise ValueError(f"FixedDrafter({self.index}) but only {ctx.num_drafters} assistant_models given")
        return self.index

    def __repr__(self):
        return f"FixedDrafter({self.index})"
