"""Speculation policies: which drafter and how many tokens, decided per step. Pure Python."""
from __future__ import annotations

from ..stats import StepRecord
from ..tiers import SPEC_TIERS
from .bandit import EXP3Spec, UCBSpec
from .base import Decision, DrafterSelector, LengthPolicy, StepContext
from .hedgespec import HedgeSpec
from .learners import AdaNormalHedge, Hedge, NormalHedge
from .goodput import AdaSpec, DSDGoodput
from .length import ConfidenceThreshold, FixedLength, HFHeuristic
from .measured import MeasuredGoodput
from .nightjar import Nightjar
from .selection import FixedDrafter

__all__ = ["SpecPolicy", "FixedLength", "HFHeuristic", "ConfidenceThreshold", "Nightjar", "AdaSpec", "DSDGoodput",
           "MeasuredGoodput",
           "FixedDrafter", "HedgeSpec", "UCBSpec", "EXP3Spec", "Decision",
           "StepContext", "LengthPolicy", "DrafterSelector", "resolve_policy", "auto_policy", "NormalHedge", "Hedge",
           "AdaNormalHedge"]

DEFAULT_LENGTH = 4


class SpecPolicy:
    """A drafter selector plus a length policy; the object `generate()` consults every step."""

    def __init__(self, selector: DrafterSelector | None = None, length: LengthPolicy | None = None):
        if selector is not None and not isinstance(selector, DrafterSelector):
            raise TypeError(f"selector must be a DrafterSelector, got {type(selector).__name__}")
        if length is not None and not isinstance(length, LengthPolicy):
            raise TypeError(f"length must be a LengthPolicy, got {type(length).__name__}")
        self.selector = selector or FixedDrafter(0)
        self.length = length or FixedLength(DEFAULT_LENGTH)

    def begin(self, ctx: StepContext) -> None:
        self.selector.begin(ctx)

    def choose(self, ctx: StepContext) -> Decision:
        return Decision(drafter=self.selector.choose(ctx), k=self.length.choose(ctx),
                        feedback=self.selector.wants_feedback(ctx.step))

    @property
    def continue_drafting(self):
        """The length policy's per-draft-token hook (`LengthPolicy`), None: drafts run to k."""
        return self.length.continue_drafting

    @property
    def max_len(self) -> int:
        """The longest draft a step may ask for: the length policy's bound, a fixed length's k, else
        the longest tier (a growing schedule's current k)."""
        length = self.length
        return getattr(length, "max_len", None) or getattr(length, "k", None) or max(SPEC_TIERS)

    def trim(self, lengths: list[int], confidences: list[list[float]]) -> list[int]:
        """Drafts each row keeps for verification: a trimming length policy's `verify_lengths`
        (AdaSpec), else all. confidences: per row, its drafts' confidences (read only if it trims)."""
        if self.length.verify_lengths is None:
            return lengths
        return [min(n, max(w, 0)) for n, w in zip(lengths, self.length.verify_lengths(confidences))]

    def observe(self, record: StepRecord) -> None:
        self.selector.observe(record)
        self.length.observe(record)

    def __repr__(self):
        return f"SpecPolicy(selector={self.selector!r}, length={self.length!r})"


# name -> (policy class, what ":<n>" sets, if anything)
_LENGTHS = {"fixed": (FixedLength, "k"), "measured": (MeasuredGoodput, "max_len"), "nightjar": (Nightjar, "max_len"), "adaspec": (AdaSpec, "max_len"),
            "dsd": (DSDGoodput, "max_len"), "hf-heuristic": (HFHeuristic, "initial"),
            "confidence": (ConfidenceThreshold, None)}
_SELECTORS = {"hedgespec": HedgeSpec, "ucb": UCBSpec, "exp3": EXP3Spec}
NAMES = ("auto", *_LENGTHS, *_SELECTORS)


def auto_policy(num_drafters: int = 1, full_information: bool = True) -> SpecPolicy:
    """What `spec_policy="auto"` (the default) runs: `MeasuredGoodput`'s draft length, the goodput
    argmax over step costs measured in the loop itself, 0 (no speculation) among the arms, so it
    needs no profile and switches itself off where no length pays, from the first call
    (docs/benchmarks.md, "The default policy"). Among several drafters HedgeSpec chooses when each
    can be scored on the verified tokens (full_information), else the first drafts."""
    selector = HedgeSpec() if num_drafters > 1 and full_information else None
    return SpecPolicy(selector=selector, length=MeasuredGoodput())


def resolve_policy(spec, num_drafters: int = 1, full_information: bool = True) -> SpecPolicy:
    """`spec_policy` argument -> SpecPolicy. Accepts None or "auto" (`auto_policy`), a policy
    object, or a name: "fixed", "fixed:4", "measured[:max_len]", "nightjar[:max_len]", "adaspec[:max_len]",
    "dsd[:max_len]", "hf-heuristic[:initial]", "confidence", "hedgespec", "ucb", "exp3"."""
    if spec is None or spec == "auto":
        return auto_policy(num_drafters, full_information)
    if isinstance(spec, SpecPolicy):
        return spec
    if isinstance(spec, LengthPolicy):
        return SpecPolicy(length=spec)
    if isinstance(spec, DrafterSelector):
        return SpecPolicy(selector=spec)
    if isinstance(spec, str):
        if spec in _SELECTORS:
            return SpecPolicy(selector=_SELECTORS[spec]())
        name, colon, arg = spec.partition(":")
        if name not in _LENGTHS:
            raise ValueError(f"unknown spec_policy {spec!r}; known: {', '.join(NAMES)} (fixed, measured, nightjar, adaspec, "
                             "dsd and hf-heuristic take ':<n>')")
        cls, param = _LENGTHS[name]
        if not colon:
            return SpecPolicy(length=cls())
        if param is None or not (arg.isascii() and arg.isdigit()):
            raise ValueError(f"spec_policy {spec!r}: " + (f"{name} takes no ':<n>'" if param is None
                                                          else "expected an integer after ':'"))
        return SpecPolicy(length=cls(**{param: int(arg)}))
    raise TypeError(f"spec_policy must be a SpecPolicy, LengthPolicy, DrafterSelector, str or None; "
                    f"got {type(spec).__name__}")
