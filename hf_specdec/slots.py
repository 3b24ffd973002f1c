"""Where a `CachedModel`'s KV slots live: one storage per cache kind, with the same few methods.

Both keep `mask` [rows, slots] (whether slot s holds a token of row b; holes are 0 in the
attention mask) next to the KV cache, and both run the model's forward over themselves:
  - `DynamicSlots`: Transformers' DynamicCache; grows by each forward's width, cropped at both ends.
  - `StaticSlots`: Transformers' StaticCache (`cache_implementation="static"`): preallocated
    `capacity` slots per row, each forward written at slot `used` on; stepping back moves `used`;
    full: its rows are compacted, or it grows. Compiled (`compiled.py`) when the call's
    CompileConfig says so: rows pad to a bucket (dummy rows attend slot 0 only), widths to a tier.
    Lent to one call at a time from the target's `Kept` (kept.py) and reset in place: a smaller
    row bucket is a view of the largest allocation, so the addresses CUDA graphs recorded stay
    valid; an allocation made for another dtype or device (`model.to` between calls) is dropped.
"""
from __future__ import annotations

import torch

from . import _compat
from .compiled import WarmupCount, compiled_forwards, rows_bucket, width_tier


def static_capacity(tokens: int) -> int:
    """Slots per row of a static cache for rows of up to `tokens` tokens: with 64 to spare (room
    for drafts before a compaction), a power of two, at least 256: growing is rare, and each
    growth is a new allocation (recorded anew by CUDA graphs; a model's first may recompile)."""
    return max(256, 1 << (tokens + 64 - 1).bit_length())


class DynamicSlots:
    """A DynamicCache and its slot mask, for `rows` rows (any width, eager)."""

    def __init__(self, model: torch.nn.Module, rows: int, device):
        self.cache = _compat.new_cache(model)
        self.rows = rows
        self.mask = torch.zeros(rows, 0, dtype=torch.bool, device=device)      # [rows, used]
        self.used = 0
        self.moves = 0            # compactions so far (`compact`)
        # sliding-window layers hold slots front .. used: the slots before are outside every row's
        # window (`CachedModel._trim_window`); full-attention layers hold them all
        self.front = 0
        self.sliding = {i for i, (kind, _) in enumerate(_compat.layer_kinds(model)) if kind == "sliding_attention"}

    def forward(self, runner, tokens, real, positions, keep) -> torch.Tensor:
        """Append tokens [n, w] (real [n, w]) at positions [n, w]: logits [n, >= keep, vocab].
        runner: the CachedModel (its `eager` forward over this cache, and whether it `holes`)."""
        self.mask = torch.cat([self.mask, real], dim=1)
        self.used += tokens.shape[1]
        # no mask without holes, as generate() drops an all-ones one: building and applying it costs
        # every forward (~0.1 ms on a CPU); else a bool mask, which transformers 5 makes any mask anyway
        mask = self.mask if runner.holes or runner.window else None
        return runner.eager(self.cache, tokens, mask, positions, keep)

    def reserve(self, width: int) -> None:
        """Room for `width` more slots: a dynamic cache grows anyway."""

    def step_back(self, used: int) -> None:
        """Slots from `used` on are holes in every row: forget them."""
        _compat.crop(self.cache, self.used - used)
        self.mask = self.mask[:, :used]
        self.used = used

    def drop_front(self, slots: int) -> None:
        """The first `slots` slots are holes in every row: forget them."""
        _compat.drop_front(self.cache, slots, self.cache_layers_but(self.sliding))
        _compat.drop_front(self.cache, slots - self.front, self.sliding)
        self.mask = self.mask[:, slots:]
        self.used -= slots
        self.front = max(0, self.front - slots)

    def window_front(self, front: int) -> None:
        """The sliding-window layers forget the slots before `front` (no row's window reaches them)."""
        _compat.drop_front(self.cache, front - self.front, self.sliding)
        self.front = front

    def compact(self, window_slots: int) -> None:
        """Every row's real slots move to the end, in order (the shorter rows get holes in front);
        the sliding-window layers keep the last `window_slots`. Positions count real slots and keys
        carry their rotary positions, so moving slots changes no logit."""
        count = self.mask.sum(1)                                                      # [rows]
        keep = int(count.max())                                                      # a host read, rarely
        order = torch.argsort(self.mask.to(torch.int8), dim=1, stable=True)[:, self.used - keep:]   # [rows, keep]
        window_slots = min(window_slots, keep)
        _compat.gather_slots(self.cache, order, self.cache_layers_but(self.sliding))
        # (a row's hole slots may be before `front`: any slot will do, it is masked)
        _compat.gather_slots(self.cache, (order[:, keep - window_slots:] - self.front).clamp(min=0), self.sliding)
        self.mask = torch.arange(keep, device=count.device)[None, :] >= keep - count[:, None]
        self.used, self.front = keep, keep - window_slots
        self.moves += 1

    def cache_layers_but(self, layers: set[int]) -> set[int]:
        return set(range(len(self.cache.layers))) - layers

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` [m] (indices), in that order."""
        _compat.select_rows(self.cache, keep)
        self.mask = self.mask[keep]
        self.rows = len(keep)

    def append(self, other: "DynamicSlots") -> None:
        """Take `other`'s rows after these; the side with fewer slots gets holes on the left."""
        width = max(self.used, other.used)
        def pad(mask):
            return torch.nn.functional.pad(mask, (width - mask.shape[1], 0), value=False)
        _compat.append_rows(self.cache, self.rows, other.cache, other.rows)
        self.mask = torch.cat([pad(self.mask), pad(other.mask)])
        # the sliding-window layers end-aligned too: they hold the longer of the two (its
        # extra slots in the other rows are before their windows)
        self.front = width - max(self.used - self.front, other.used - other.front)
        self.rows, self.used = self.rows + other.rows, width


class StaticSlots:
    """A StaticCache of `alloc_rows` x `capacity` slots; the active rows use a view of `rows`
    of them (a bucket when compiled), rows past the `n` real ones are dummies."""

    def __init__(self):
        self.cache, self.capacity, self.alloc_rows = None, 0, 0
        self.full: list[tuple[torch.Tensor, torch.Tensor]] = []       # per layer (keys, values) [alloc_rows, ...]
        self.views: dict[int, list] = {}                               # rows -> per layer views of `full`
        self.made_for = None                                           # (dtype, device) of the allocation
        self.front = 0           # sliding-window layers hold every slot, as full ones (`DynamicSlots.front`)

    def reset(self, model: torch.nn.Module, n: int, max_length: int, compile_config, device,
              warmups: WarmupCount) -> None:
        """Empty, for `n` rows of up to `max_length` tokens: the allocation is reused when it
        fits and was made for the model's dtype and device, else a new one is made (grow only, as
        Transformers keeps its cache length). warmups: the call's count of compiled warm-ups."""
        self.compiled = compiled_forwards(model, compile_config) if compile_config else None
        self.warmups = warmups
        self.n, self.rows = n, rows_bucket(n) if self.compiled else n
        needed = static_capacity(max_length)
        made_for, self.made_for = self.made_for, (model.dtype, torch.device(device))
        if self.cache is None or needed > self.capacity or self.rows > self.alloc_rows or made_for != self.made_for:
            # (allocated by the first forward: an eager prefill of `rows` rows)
            self.capacity = max(needed, self.capacity)
            self.cache = _compat.new_static_cache(model, self.capacity)
            self.full, self.views, self.alloc_rows = [], {}, 0
        else:
            self._use_rows(self.rows)
        # the layers the compiled forwards run, paired with their cache layers (None: the whole forward)
        self.layers = self.compiled.layers(model, self.cache) if self.compiled else None
        self.used, self.moves = 0, 0              # moves: compactions so far (`CachedModel.open_region`)
        _compat.set_static_length(self.cache, 0)
        self._mask = torch.zeros(self.alloc_rows or self.rows, self.capacity, dtype=torch.bool, device=device)
        self._mark_dummies()

    @property
    def mask(self) -> torch.Tensor:
        """[n, used]: the real rows' slots (a view: writes go through)."""
        return self._mask[:self.n, :self.used]

    def _mark_dummies(self) -> None:
        self._mask[self.n:] = False
        self._mask[self.n:, 0] = True          # a dummy row attends one slot: no empty softmax

    def _use_rows(self, rows: int) -> None:
        """Point every layer at the first `rows` rows of the allocation (views kept per row count:
        the same tensors, the same addresses, every time)."""
        if rows not in self.views:
            self.views[rows] = [(k[:rows], v[:rows]) for k, v in self.full]
            for pair in self.views[rows]:
                for t in pair:
                    torch._dynamo.mark_static_address(t)      # as Transformers tags its own cache tensors
                    if self.compiled:
                        torch._dynamo.maybe_mark_dynamic(t, 0)     # one graph for every row bucket
        for layer, (k, v) in zip(_compat.static_layers(self.cache), self.views[rows]):
            _compat.set_static_tensors(layer, k, v)
        self.rows = rows

    def forward(self, runner, tokens, real, positions, keep) -> torch.Tensor:
        """As `DynamicSlots.forward`; compiled at a tier shape once the cache is allocated."""
        n, end = tokens.shape
        tier = width_tier(end) if self.compiled and self.full else None
        width = tier or end
        self.reserve(width)
        # hole slots on the right up to the tier's width, dummy rows below up to the bucket
        self._mask[:n, self.used:self.used + width] = _pad(real, n, width)    # (the pad's slots: holes)
        tokens, positions = (_pad(t, self.rows, width) for t in (tokens, positions))
        cache_position = _compat.static_cache_position(self.used, width, tokens.device)
        self.used += width
        mask = self._mask[:self.rows]             # the whole capacity is the key length (unwritten slots are 0)
        if tier is None:
            logits = runner.eager(self.cache, tokens, mask, positions, keep, cache_position=cache_position)
            if not self.full:                     # the first forward allocated the cache
                self.full = [(layer.keys, layer.values) for layer in _compat.static_layers(self.cache)]
                self.alloc_rows = self.rows
                self._use_rows(self.rows)
            return logits
        four_d = self.layers is not None       # (compiled layers: Transformers' own mask would at times be None)
        logits = self.compiled(runner.model, tokens, runner.model_mask(mask, positions, four_d=four_d), positions,
                               cache_position, _compat.cache_kwargs(runner.model, self.cache),
                               self.full[0][0].data_ptr(), self.warmups, self.layers, slice(end - keep, end))
        if tier > end:     # the padding's slots are not kept: the next forward writes over them (a
            self.step_back(self.used - tier + end)      # rollback counts a row's slots as its tokens)
        return logits

    def reserve(self, width: int) -> None:
        """Room for `width` more slots (the tier it pads to, when compiled): compacted when full
        (every row's real slots moved to the front, in order), grown when that is not enough.
        Positions count real slots and keys carry their rotary positions, so moving slots changes
        no logit. It moves slots: a caller that will step back to `used` reserves the whole
        speculative region first."""
        if self.compiled and self.full:
            width = width_tier(width) or width
        if self.used + width <= self.capacity or not self.full:
            return
        real = self._mask[:self.rows, :self.used]                                  # [rows, used]
        count = real.sum(1)                                                       # [rows]
        keep = int(count.max())                                                  # a host read, rarely
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)[:, :keep]   # [rows, keep]
        capacity = max(self.capacity, static_capacity(keep + width))
        moved = [tuple(t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])) for t in pair)
                 for pair in self.views[self.rows]]
        if capacity > self.capacity:            # new tensors: compiled graphs record them anew
            self.full = [tuple(t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3]) for t in pair)
                         for pair in self.full]
            self.views, self.capacity = {}, capacity
            mask = torch.zeros(self.alloc_rows, capacity, dtype=torch.bool, device=self._mask.device)
            mask[:, :self._mask.shape[1]] = self._mask
            self._mask = mask
            self._use_rows(self.rows)
        for pair, new in zip(self.views[self.rows], moved):
            for t, m in zip(pair, new):
                t[:, :, :keep] = m
        self._mask[:self.rows] = False
        self._mask[:self.rows, :keep] = torch.arange(keep, device=count.device)[None, :] < count[:, None]
        self.used = keep
        self.moves += 1
        _compat.set_static_length(self.cache, keep)

    def step_back(self, used: int) -> None:
        self.used = used
        _compat.set_static_length(self.cache, used)

    def drop_front(self, slots: int) -> None:
        """Holes in front stay masked until a compaction: slots are not moved for them."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` [m]: copied to the front of the allocation (gathered first: the row
        sets overlap); the view drops to the bucket of m rows, whose rows past m are dummies."""
        m = len(keep)
        rows = rows_bucket(m) if self.compiled else m
        index = torch.cat([keep, keep.new_zeros(rows - m)])                       # [rows]: dummies copy row 0
        if self.full:
            picked = [t[index] for pair in self.views[self.rows] for t in pair] if m else []
            self._use_rows(rows)
            if picked:                       # (no rows left: nothing to copy)
                torch._foreach_copy_([t for pair in self.views[rows] for t in pair], picked)
        self._mask[:rows] = self._mask[index]
        self.n, self.rows = m, rows
        self._mark_dummies()


def _pad(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[n, w] -> [rows, width] with zeros on the right and below (one op; none when it fits)."""
    if t.shape == (rows, width):
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1], 0, rows - t.shape[0]))
