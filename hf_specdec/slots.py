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

from ._compat import kv_cache, modeling
from .compiled import WIDTH_TIERS, WarmupCount, compiled_forwards


SPARE_SLOTS = 64     # a padded static cache's room for drafts and holes before a compaction


def compaction(real: torch.Tensor, front: int, window_keep: torch.Tensor | None = None):
    """Where a compaction moves the slots real [rows, used]: every row's real slots to the end, in
    order (the shorter rows get holes in front); the sliding-window layers, which hold the slots
    from `front`, keep window_keep [rows, used - front] (None: their real ones), also at the end. Positions
    count real slots and keys carry their rotary positions, so moving slots changes no logit.

    Returns (keep: slots left, order [rows, keep]: the slot each comes from, the sliding layers'
    order [rows, keep - new front] (counted from `front`), the new front, the new mask [rows, keep]).
    """
    window_keep = real[:, front:] if window_keep is None else window_keep
    count = real.sum(1)                                                          # [rows]
    keep, window = torch.stack([count.max(), window_keep.sum(1).max()]).tolist()     # one host read
    order = torch.argsort(real.to(torch.int8), dim=1, stable=True)[:, real.shape[1] - keep:]
    window_order = torch.argsort(window_keep.to(torch.int8), dim=1, stable=True)[:, window_keep.shape[1] - window:]
    mask = torch.arange(keep, device=real.device)[None, :] >= keep - count[:, None]
    return keep, order, window_order, keep - window, mask


def static_capacity(tokens: int, pads: bool) -> int:
    """Slots per row of a static cache for rows of up to `tokens` tokens. Every forward attends
    the whole capacity, so unpadded (the CPU) it is `tokens` and one widest compiled step more, as
    Transformers sizes its own static cache to `max_length`: a step writes k + 1 columns for every
    row, the longest row's too, so a compacted cache then never grows. Padded (CUDA graphs,
    `compiled.pads_shapes`) SPARE_SLOTS more, a power of two, at least 256: growing is rare, and each
    growth is a new allocation that CUDA graphs record anew. (A model's first growth recompiles.)"""
    if not pads:
        return tokens + WIDTH_TIERS[-1]
    return max(256, 1 << (tokens + SPARE_SLOTS - 1).bit_length())


class DynamicSlots:
    """A DynamicCache and its slot mask, for `rows` rows (any width, eager)."""

    def __init__(self, model: torch.nn.Module, rows: int, device):
        self.cache = kv_cache.new_cache(model)
        self.rows = rows
        self.mask = torch.zeros(rows, 0, dtype=torch.bool, device=device)      # [rows, used]
        self.used = 0
        self.moves = 0            # compactions so far (`compact`)
        # sliding-window layers hold slots front .. used: the slots before are outside every row's
        # window (`CachedModel._trim_window`); full-attention layers hold them all
        self.front = 0
        self.sliding = modeling.sliding_layers(model)
        self.ring = None          # (they grow with each forward)

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

    @property
    def forgets_window(self) -> bool:
        """Whether the sliding-window layers forget slots (`CachedModel._trim_window`)."""
        return bool(self.sliding)

    def step_back(self, used: int) -> None:
        """Slots from `used` on are holes in every row: forget them."""
        if used < self.front:             # (no rows left) the sliding-window layers keep nothing
            self.window_front(self.used)
            self.front = used
        kv_cache.crop(self.cache, self.used - used)
        self.mask = self.mask[:, :used]
        self.used = used

    def drop_front(self, slots: int) -> None:
        """The first `slots` slots are holes in every row: forget them."""
        kv_cache.drop_front(self.cache, slots, self.cache_layers_but(self.sliding))
        kv_cache.drop_front(self.cache, slots - self.front, self.sliding)
        self.mask = self.mask[:, slots:]
        self.used -= slots
        self.front = max(0, self.front - slots)

    def window_front(self, front: int) -> None:
        """The sliding-window layers forget the slots before `front` (no row's window reaches them)."""
        kv_cache.drop_front(self.cache, front - self.front, self.sliding)
        self.front = front

    def compact(self, window_keep: torch.Tensor | None = None) -> None:
        """Every row's real slots move to the end, in order (`compaction`)."""
        keep, order, window_order, front, self.mask = compaction(self.mask, self.front, window_keep)
        kv_cache.gather_slots(self.cache, order, self.cache_layers_but(self.sliding))
        kv_cache.gather_slots(self.cache, window_order, self.sliding)
        self.used, self.front = keep, front
        self.moves += 1

    def window_columns(self, mask: torch.Tensor) -> torch.Tensor:
        """A sliding-window layer's mask [..., used] -> the columns of the slots it holds."""
        return mask[..., self.front:]

    def cache_layers_but(self, layers: set[int]) -> set[int]:
        return set(range(len(self.cache.layers))) - layers

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` [m] (indices), in that order."""
        kv_cache.select_rows(self.cache, keep)
        self.mask = self.mask[keep]
        self.rows = len(keep)

    def append(self, other: "DynamicSlots") -> None:
        """Take `other`'s rows after these; the side with fewer slots gets holes on the left."""
        width = max(self.used, other.used)
        def pad(mask):
            return torch.nn.functional.pad(mask, (width - mask.shape[1], 0), value=False)
        kv_cache.append_rows(self.cache, self.rows, other.cache, other.rows)
        self.mask = torch.cat([pad(self.mask), pad(other.mask)])
        # the sliding-window layers end-aligned too: they hold the longer of the two (its
        # extra slots in the other rows are before their windows)
        self.front = width - max(self.used - self.front, other.used - other.front)
        self.rows, self.used = self.rows + other.rows, width


class StaticSlots:
    """A StaticCache of `alloc_rows` x `capacity` slots; the active rows use a view of `rows`
    of them (a bucket when compiled), rows past the `n` real ones are dummies. The
    sliding-window layers are a ring of `ring` slots holding the slots from `front` on (their own
    write position: `used - front`), moved to its start when it fills (`window_front`)."""

    def __init__(self):
        self.cache, self.capacity, self.alloc_rows = None, 0, 0
        self.full: list[tuple[torch.Tensor, torch.Tensor]] = []       # per layer (keys, values) [alloc_rows, ...]
        self.in_ring: list[bool] = []                                   # per entry of `full`: a ring's
        self.views: dict[int, list] = {}                               # rows -> per layer views of `full`
        self.made_for = None                                           # (dtype, device, ring) of the allocation
        self.front, self.ring, self.sliding = 0, None, set()

    def reset(self, model: torch.nn.Module, n: int, max_length: int, compile_config, device,
              warmups: WarmupCount, ring: int | None = None) -> None:
        """Empty, for `n` rows of up to `max_length` tokens: the allocation is reused when it
        fits and was made for the model's dtype and device, else a new one is made (grow only, as
        Transformers keeps its cache length). warmups: the call's count of compiled warm-ups.
        ring: the slots of a sliding-window layer (None: as many as a full one)."""
        self.compiled = compiled_forwards(model, compile_config) if compile_config else None
        self.warmups = warmups
        self.n, self.first_rows = n, n
        self.rows = self.compiled.rows(n, n) if self.compiled else n
        needed = static_capacity(max_length, self.pads)
        ring = ring if ring is not None and ring < needed else None
        made_for, self.made_for = self.made_for, (model.dtype, torch.device(device), ring)
        if self.cache is None or needed > self.capacity or self.rows > self.alloc_rows or made_for != self.made_for:
            # (allocated by the first forward: an eager prefill of `rows` rows)
            self.capacity = max(needed, self.capacity)
            self.ring = ring
            self.sliding = modeling.sliding_layers(model) if ring else set()
            self.cache = kv_cache.new_static_cache(model, self.capacity, self.sliding, ring or 0)
            self.full, self.views, self.alloc_rows = [], {}, 0
        else:
            self._use_rows(self.rows)
        self.used, self.moves, self.front = 0, 0, 0      # moves: compactions so far (`CachedModel.open_region`)
        self._set_length()
        self._mask = torch.zeros(self.alloc_rows or self.rows, self.capacity, dtype=torch.bool, device=device)
        self._mark_dummies()

    @property
    def pads(self) -> bool:
        """Whether compiled forwards pad their shapes (`compiled.pads_shapes`: CUDA graphs)."""
        return self.compiled is not None and self.compiled.pads

    @property
    def mask(self) -> torch.Tensor:
        """[n, used]: the real rows' slots (a view: writes go through)."""
        return self._mask[:self.n, :self.used]

    @property
    def forgets_window(self) -> bool:
        """Whether the sliding-window layers are a ring (`CachedModel._trim_window`)."""
        return self.ring is not None

    def _mark_dummies(self) -> None:
        self._mask[self.n:] = False
        self._mask[self.n:, 0] = True          # a dummy row attends one slot: no empty softmax

    def _set_length(self) -> None:
        kv_cache.set_static_length(self.cache, self.used, self.sliding, self.front)

    def _use_rows(self, rows: int) -> None:
        """Point every layer at the first `rows` rows of the allocation (views kept per row count:
        the same tensors, the same addresses, every time)."""
        if rows not in self.views:
            self.views[rows] = [(k[:rows], v[:rows]) for k, v in self.full]
            for pair in self.views[rows]:
                for t in pair:
                    torch._dynamo.mark_static_address(t)      # as Transformers tags its own cache tensors
                    if self.compiled:
                        torch._dynamo.maybe_mark_dynamic(t, 0)     # one graph for every row count
        for layer, (k, v) in zip(kv_cache.static_layers(self.cache), self.views[rows]):
            kv_cache.set_static_tensors(layer, k, v)
        self.rows = rows

    def forward(self, runner, tokens, real, positions, keep) -> torch.Tensor:
        """As `DynamicSlots.forward`; compiled at a tier shape once the cache is allocated."""
        n, end = tokens.shape
        compiled = self.compiled and self.full and self.compiled.runs_compiled(end)
        tier = self.compiled.width(end) if compiled else None
        width = tier or end
        self.reserve(width)
        if self.ring is not None and self.used - self.front + width > self.ring:
            self._grow_ring(runner.model, self.used - self.front + width)
        # hole slots on the right up to the tier's width, dummy rows below up to the bucket
        self._mask[:n, self.used:self.used + width] = _pad(real, n, width)    # (the pad's slots: holes)
        tokens, positions = (_pad(t, self.rows, width) for t in (tokens, positions))
        cache_position = kv_cache.static_cache_position(self.used, width, tokens.device)
        self.used += width
        mask = self._mask[:self.rows]             # the whole capacity is the key length (unwritten slots are 0)
        if tier is None:
            logits = runner.eager(self.cache, tokens, mask, positions, keep, cache_position=cache_position)
            if not self.full:                     # the first forward allocated the cache
                layers = kv_cache.static_layers(self.cache)
                ring = [self.cache.layers[i] for i in self.sliding]
                self.full = [(layer.keys, layer.values) for layer in layers]
                self.in_ring = [any(layer is r for r in ring) for layer in layers]
                self.alloc_rows = self.rows
                self._use_rows(self.rows)
            return logits
        logits = self.compiled(runner.model, tokens, runner.model_mask(mask, positions), positions, cache_position,
                               kv_cache.cache_kwargs(runner.model, self.cache), self.full[0][0].data_ptr(),
                               self.warmups, slice(end - keep, end))
        if tier > end:     # the padding's slots are not kept: the next forward writes over them (a
            self.step_back(self.used - tier + end)      # rollback counts a row's slots as its tokens)
        return logits

    def fuses_draft_step(self, width: int, forwards: int) -> bool:
        """Whether a draft step of `forwards` forwards, the first `width` wide, runs as one
        compiled call (`draft_step`)."""
        return bool(self.compiled and self.full) and self.compiled.runs_draft_step(width, forwards)

    def draft_step(self, runner, tokens: torch.Tensor, real: torch.Tensor, positions: torch.Tensor,
                   after: torch.Tensor, forwards: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy draft step in one compiled call (`CompiledForwards.draft_step`): a forward of
        tokens [n, w] (holes where real [n, w] is False) at `positions` [n, w], then forwards - 1
        one-token forwards, each of the last one's argmax, at positions after [n, 1] on. Returns
        logits [n, forwards, vocab] (each forward's last column) and their argmax [n, forwards]."""
        (n, width), drafts = tokens.shape, forwards - 1
        self.reserve(width + drafts)
        self._mask[:n, self.used:self.used + width] = real
        self._mask[:n, self.used + width:self.used + width + drafts] = False    # the graph makes each real
        tokens, positions, after = (_pad(t, self.rows, t.shape[1]) for t in (tokens, positions, after))
        cache_position = kv_cache.static_cache_position(self.used, width, tokens.device)
        logits, picked = self.compiled.draft_step(runner.model, tokens, self._mask[:self.rows], positions,
                                                  cache_position, after, kv_cache.cache_kwargs(runner.model, self.cache),
                                                  forwards, self.full[0][0].data_ptr(), self.warmups)
        self._mask[:n, self.used + width:self.used + width + drafts] = True
        self.used += width + drafts
        return logits[:n], picked[:n]

    def window_columns(self, mask: torch.Tensor) -> torch.Tensor:
        """A sliding-window layer's mask [..., capacity] -> [..., ring]: the slots its ring holds."""
        if self.ring is None:
            return mask
        part = mask[..., self.front:self.front + self.ring]
        part = torch.nn.functional.pad(part, (0, self.ring - part.shape[-1]))     # (past the capacity: holes)
        # a query seeing none of the ring (a dummy row's, a pad's) sees its first slot: no empty softmax
        part[..., 0] |= ~part.any(-1)
        return part

    def window_front(self, front: int) -> None:
        """As `DynamicSlots.window_front`: the ring's slots from `front` move to its start (in place)."""
        live, shift = self.used - front, front - self.front
        for pair, ringed in zip(self.views[self.rows], self.in_ring):
            for t in pair if ringed else ():
                t[:, :, :live] = t[:, :, shift:shift + live].clone()
        self.front = front
        self._set_length()

    def reserve(self, width: int) -> None:
        """Room for `width` more slots (the tier it pads to, when compiled): compacted when full,
        grown when that is not enough. It moves slots: a caller that will step back to `used`
        reserves the whole speculative region first."""
        if self.compiled and self.full:
            width = self.compiled.width(width) or width
        if self.used + width <= self.capacity or not self.full:
            return
        self.compact()
        if self.used + width > self.capacity:        # new tensors: compiled graphs record them anew
            self._grow(static_capacity(self.used + width, self.pads))

    def compact(self, window_keep: torch.Tensor | None = None) -> None:
        """Every row's real slots move to the end, in order (`compaction`), in place."""
        real = self._mask[:self.rows, :self.used]
        if window_keep is not None and len(window_keep) < self.rows:      # (dummy rows: their own slot)
            window_keep = torch.cat([window_keep, real[len(window_keep):, self.front:]])
        keep, order, window_order, front, mask = compaction(real, self.front, window_keep)
        pairs = self.views[self.rows]
        moved = [tuple(t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])) for t in pair)
                 for pair, index in zip(pairs, (window_order if ringed else order for ringed in self.in_ring))]
        for pair, new in zip(pairs, moved):
            for t, m in zip(pair, new):
                t[:, :, :m.shape[2]] = m
        self._mask[:self.rows] = False
        self._mask[:self.rows, :keep] = mask
        self.used, self.front = keep, front
        self.moves += 1
        self._set_length()

    def _grow(self, capacity: int) -> None:
        """Full layers of `capacity` slots, keeping their first `used` (a ring keeps its size)."""
        self._resize(False, capacity, self.used)
        self.capacity = capacity
        mask = torch.zeros(self.alloc_rows, capacity, dtype=torch.bool, device=self._mask.device)
        mask[:, :self._mask.shape[1]] = self._mask
        self._mask = mask

    def _grow_ring(self, model: torch.nn.Module, slots: int) -> None:
        """A ring of `slots` (a speculative region longer than the ring's part, or rows whose holes
        stretch their windows: rare), keeping what it holds."""
        self.ring = slots
        if self.full:
            self._resize(True, slots, self.used - self.front)
        else:                                 # (not allocated yet)
            self.cache = kv_cache.new_static_cache(model, self.capacity, self.sliding, slots)

    def _resize(self, ring: bool, slots: int, kept: int) -> None:
        """The ring's layers (or the full ones) of `slots` slots, keeping their first `kept`."""
        def resized(t):
            new = t.new_zeros(t.shape[0], t.shape[1], slots, t.shape[3])
            new[:, :, :kept] = t[:, :, :kept]
            return new
        self.full = [tuple(resized(t) for t in pair) if ringed == ring else pair
                     for pair, ringed in zip(self.full, self.in_ring)]
        self.views = {}
        self._use_rows(self.rows)

    def step_back(self, used: int) -> None:
        self.used = used
        self._set_length()

    def drop_front(self, slots: int) -> None:
        """Holes in front stay masked until a compaction: slots are not moved for them."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` [m]: copied to the front of the allocation (gathered first: the row
        sets overlap); the view drops to the bucket of m rows, whose rows past m are dummies."""
        m = len(keep)
        rows = self.compiled.rows(m, self.first_rows) if self.compiled else m
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
