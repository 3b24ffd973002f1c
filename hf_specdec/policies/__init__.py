"""Speculation policies: which drafter and how many tokens, decided per step. Pure Python."""
from __future__ import annotations

from ..stats import StepRecord
from .base import Decision, DrafterSelector, LengthPolicy, StepContext
from .length import FixedLength
from .selection import FixedDrafter

__all__ = ["SpecPolicy", "FixedLength", "FixedDrafter", "Decision", "StepContext", "LengthPolicy",
           "DrafterSelector", "resolve_policy"]

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

    def choose(self, ctx: StepContext) -> Decision:
        return Decision(drafter=self.selector.choose(ctx), length=self.length.choose(ctx))

    def observe(self, record: StepRecord) -> None:
        self.selector.observe(record)
        self.length.observe(record)

    def __repr__(self):
        return f"SpecPolicy(selector={self.selector!r}, length={self.length!r})"


_SHORTCUTS = {"fixed": FixedLength}


def resolve_policy(spec) -> SpecPolicy:
    """`spec_policy` argument -> SpecPolicy. Accepts None (default), a policy object, or a string
    such as "fixed" or "fixed:4"."""
    if spec is None:
        return SpecPolicy()
    if isinstance(spec, SpecPolicy):
        return spec
    if isinstance(spec, LengthPolicy):
        return SpecPolicy(length=spec)
    if isinstance(spec, DrafterSelector):
        return SpecPolicy(selector=spec)
    if isinstance(spec, str):
        name, _, arg = spec.partition(":")
        if name not in _SHORTCUTS:
            raise ValueError(f"unknown spec_policy {spec!r}; known: {sorted(_SHORTCUTS)} (optionally ':<k>')")
        if not arg:
            return SpecPolicy(length=_SHORTCUTS[name]())
        if not arg.isdigit():
            raise ValueError(f"spec_policy {spec!r}: expected an integer after ':'")
        return SpecPolicy(length=_SHORTCUTS[name](int(arg)))
    raise TypeError(f"spec_policy must be a SpecPolicy, LengthPolicy, DrafterSelector, str or None; "
                    f"got {type(spec).__name__}")
