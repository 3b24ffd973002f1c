"""The policy interface: plain objects, `choose` before a step, `observe` after it. No torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..stats import StepRecord


def non_negative_int(value, where: str) -> int:
    """`value` if it is an int >= 0 (bools refused), else a ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, got {value!r}")
    return value


def probability(value, where: str) -> float:
    """`value` if it is a number in [0, 1] (bools refused), else a ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{where} must be a probability in [0, 1], got {value!r}")
    return value


def pow2_bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: batch sizes that share what a policy learns."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass
class StepContext:
    """What a policy sees before a step."""

    step: int              # 0-based target-forward index within this generate() call
    batch_size: int        # active rows
    num_drafters: int
    rows: list[int] = field(default_factory=list)  # original batch index of each active row
    context_tokens: int = 0   # real tokens held by the active rows (prompt + output so far)
    max_lag: int = 0          # largest per-row lag of any model drafter (tokens it must catch up)
    remaining: int = 0        # most new tokens any active row may still emit (0: unknown)
    lag_tokens: int = 0       # tokens the drafters must catch up over all rows (0: max_lag per row)


@dataclass(kw_only=True)
class Decision:
    drafter: int | list[int]  # index into assistant_models, for all rows or per active row
    k: int                    # the step's draft length; 0 = plain decoding step
    feedback: bool = False    # score every drafter on the positions this step verifies


class LengthPolicy:
    """`choose` the step's maximal draft length k before it (ctx.step == 0: a generate() call
    starts), `observe` its record after it: two methods, as Transformers' candidate generators
    have. A policy that weighs each draft's confidence (a host read per draft token) also defines
    one or both optional hooks, None where it does not:
      continue_drafting(confidences) -> list[bool]: after each drafted token, per row, draft
        another? confidences[b][j] is the drafter's probability of row b's j-th draft (1.0 for
        lookup drafters); a row that says no keeps its drafts; drafting stops when no row wants
        more or k is reached;
      verify_lengths(confidences) -> list[int]: before verification, how many of each row's
        drafts to verify (<= len(confidences[b]))."""

    continue_drafting = None
    verify_lengths = None

    def choose(self, ctx: StepContext) -> int:
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        pass


class DrafterSelector:
    def begin(self, ctx: StepContext) -> None:
        """A generate() call starts (ctx.step == 0); reset per-call state."""

    def choose(self, ctx: StepContext) -> int | list[int]:
        """One drafter for every row, or one per active row (in ctx.rows order)."""
        raise NotImplementedError

    prompt_positions = 0   # > 0: score the drafters on this many last prompt positions first

    def prime(self, gammas: dict[int, list[list[float]]]) -> None:
        """Gammas [position][drafter] per row on the last prompt positions, before step 0."""

    def wants_feedback(self, step: int) -> bool:
        """Should every drafter be scored on the positions verified in `step` (full information)?
        The scores arrive in `observe` as `record.gammas`."""
        return False

    def observe(self, record: StepRecord) -> None:
        pass
