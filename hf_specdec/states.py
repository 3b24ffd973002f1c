"""Recurrent and convolution layers (hybrid models: Gated DeltaNet, Mamba-2, short convolutions)
in a `CachedModel`: per row, a state instead of K/V slots.

A slot can be masked out after the fact; a state cannot: a hole that passed through a recurrence
changed it, and a rejected draft is in it. So each forward of such a model
  - puts each row's real tokens first (`arrange`): holes come after a row's last real token, where
    they change nothing the row keeps;
  - records the states after the columns a row may return to (`StatePlan`; in
    `recurrent.StateLayer`, by reference: what the forward computed anyway): its last real token,
    and while a speculative region is open every token from where the region begins (the k + 1
    positions of a verification; vLLM keeps one state slot per speculative position too);
  - `settle`s each row on the state after its last real token.
A rollback returns each row to the state after its own accepted tokens (`step_back`); the
CachedModel turns its rejected slots of the attention layers into holes (its last real ones: the
layout per row moved).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ._compat import recurrent


@dataclass(frozen=True)
class Arranged:
    """A forward's columns rearranged so each row's real tokens come first, and its states' plan."""

    order: torch.Tensor | None     # [n, w]: the given column at each column (None: as given)
    plan: recurrent.StatePlan        # the states the forward keeps
    last: list[int]                # per row, its last real column (-1: none): where it settles
    region: tuple | None           # with a region open, per row: (region token -> column offset, first, last column)
    holes: int                     # the most holes of a row

    def keep(self, keep: int) -> int:
        """Columns of logits the arranged forward computes for the last `keep` given ones."""
        return keep if self.order is None else keep + self.holes

    def logits(self, logits: torch.Tensor, width: int, keep: int) -> torch.Tensor:
        """Logits of the last `keep` given columns [n, keep, ...], from those of the last columns
        of the arranged forward [n, >= keep, ...] (a hole's column: any row's logits)."""
        if self.order is None:
            return logits[:, -keep:]
        back = self.order.argsort(1)[:, width - keep:] - (width - logits.shape[1])      # [n, keep]
        return logits.gather(1, back.clamp(min=0)[..., None].expand(-1, -1, logits.shape[-1]))


class RowStates:
    """The recurrent / convolution states of one CachedModel's rows, and its open region."""

    def __init__(self):
        self.region_start: int | None = None     # the open region's first slot
        self.region_tokens: list[int] | None = None     # real tokens each row fed in it

    def arrange(self, tokens: torch.Tensor, real: torch.Tensor, slots_before: int
                ) -> tuple[torch.Tensor, torch.Tensor, Arranged]:
        """tokens, real [n, w] with each row's real tokens first, and what the forward keeps."""
        n, width = real.shape
        lead = 0 if self.region_start is None else max(0, min(width, self.region_start - slots_before))
        lead_real = real[:, :lead].sum(1)                                     # [n] before the region
        order = None
        if width > 1 and bool((~real[:, :-1] & real[:, 1:]).any()):          # a hole before a real token
            order = torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices
            tokens, real = tokens.gather(1, order), real.gather(1, order)
        count, lead_real = real.sum(1).tolist(), lead_real.tolist()
        last = [c - 1 for c in count]
        if self.region_start is None:          # only each row's last real token (or its state before)
            region = None
            plan = recurrent.StatePlan(first=min(last, default=-1), last_only=bool(n) and min(last) == width - 1)
        else:                                  # from where the region begins to its last real token
            low = [r - 1 for r in lead_real]
            region = ([lo - t for lo, t in zip(low, self.region_tokens)], low, last)
            plan = recurrent.StatePlan(first=min(low, default=-1))
            self.region_tokens = [t + c - r for t, c, r in zip(self.region_tokens, count, lead_real)]
        return tokens, real, Arranged(order, plan, last, region, width - min(count, default=width))

    def settle(self, cache, arranged: Arranged) -> None:
        for layer in recurrent.state_layers(cache):
            layer.settle(arranged.last, arranged.region)

    def open_region(self, start: int, rows: int) -> None:
        self.region_start, self.region_tokens = start, [0] * rows

    def rollback(self, cache, kept: list[int]) -> list[int]:
        """Row b keeps the first kept[b] of its region tokens: its states step back there; the
        region closes. Returns the region tokens each row drops (its last real slots)."""
        for layer in recurrent.state_layers(cache):
            layer.step_back(kept)
        drop = [t - k for t, k in zip(self.region_tokens, kept)]
        self.region_start = self.region_tokens = None
        return drop

    def select_rows(self, keep: list[int]) -> None:
        if self.region_tokens is not None:
            self.region_tokens = [self.region_tokens[b] for b in keep]


@contextlib.contextmanager
def as_verification(model: torch.nn.Module, cache, rows: int, width: int):
    """For timing (cost profiles, benchmarks): within it, one forward of `width` tokens per row over
    `cache` (`kv_cache.new_cache(model)`) runs as our verification runs it on a model with recurrent
    or convolution layers (each position's states kept, then each row settled on its last);
    nothing changes for other models."""
    if not recurrent.state_kinds(model):
        yield
        return
    with recurrent.recording_states(model, recurrent.StatePlan(first=-1)):
        yield
        for layer in recurrent.state_layers(cache):
            layer.settle([width - 1] * rows, None)
