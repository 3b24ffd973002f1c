"""The policy interface: plain objects, `choose` before a step, `observe` after it. No torch."""
from __future__ import annotations

from dataclasses import dataclass

from ..stats import StepRecord


def non_negative_int(value, where: str) -> int:
    """`value` if it is an int >= 0 (bools refused), else a ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, got {value!r}")
    return value


@dataclass
class StepContext:
    """What a policy sees before a step."""

    step: int              # 0-based target-forward index within this generate() call
    batch_size: int        # active rows
    num_drafters: int


@dataclass
class Decision:
    drafter: int           # index into assistant_models
    length: int            # draft length k; 0 = plain decoding step


class LengthPolicy:
    def choose(self, ctx: StepContext) -> int:
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        pass


class DrafterSelector:
    def choose(self, ctx: StepContext) -> int:
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        pass
