"""A Transformers causal LM with its own KV cache over a `SequenceBatch`.

Rows of one batch advance by different amounts, but a KV cache is a rectangle. So each row's
cache is a sequence of *slots*: `slot_mask[b, s]` says whether slot s holds one of row b's tokens
or is a hole (left padding, a rejected draft token, catch-up alignment). Holes get attention mask
0 and positions come from counting real slots, which gives exactly the logits of the sequence
without the holes (RoPE and learned absolute positions alike). Rolling back row b = turning its
last slots into holes; slots that are holes in every row are cropped off the end.

`fed[b]` is how many of row b's buffer tokens are in the cache; `lengths[b] - fed[b]` is the lag
that a catch-up forward feeds before anything new (after speculation was off, or another drafter
was used, the lag is long; in steady state it is the 1-2 tokens of the last step).

Where the slots live is a storage's (`slots.py`): a dynamic cache, cropped, or a static one
(`batch.static_cache`: Transformers' `cache_implementation="static"`), preallocated, lent to the
call from the target's `Kept` (kept.py) and, on an accelerator, run by compiled forwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._compat import kv_cache, modeling, recurrent
from .rows import RowInts
from .sequences import SequenceBatch
from .slots import DynamicSlots, StaticSlots
from .states import RowStates


RING_PART = 64      # the widest forward a static cache's sliding-window ring takes in one part


@dataclass(frozen=True)
class SpecRegion:
    """A step's speculative slots in one model's cache: from slot `start` on, reserved with the
    padded footprint of everything written there (`CachedModel.open_region`). `moves`: the storage's
    compactions when it opened; slots do not move while it is open (`rollback` checks)."""

    start: int
    moves: int


class CachedModel:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = modeling.execution_device(model)
        self._logits_to_keep = modeling.accepts_logits_to_keep(model)
        # sliding-window layers: the mask applies the window (in real positions: slots may be holes),
        # so the model gets 4-D masks (`model_mask`); on a dynamic cache they forget the slots that
        # no row's window reaches any more (`_trim_window`), unless a caller may bring back tokens of
        # an earlier step (a hierarchy's levels) or reads every slot (a target-states drafter)
        self.window = modeling.sliding_window(model)
        kinds = {kind for kind, _ in modeling.layer_kinds(model)}
        self.full_layers_too = "full_attention" in kinds
        self.trims_window = self.window is not None and "dummy" not in kinds     # (no K/V-sharing layers)
        # recurrent / convolution layers keep states per row, not slots (states.py)
        self.stateful = bool(recurrent.state_kinds(model))
        self.states = None
        self.slots = None
        self.forwards = 0   # in this generate() call
        # for a drafter that reads the target's states (`keeps_hidden`, set by it): per row, the
        # final hidden state [n, hidden] at its last fed and kept token (what predicted the next)
        self.keeps_hidden = False
        self.last_hidden = None

    def reset(self, batch: SequenceBatch, from_first_real: bool = False) -> None:
        """An empty cache for the active rows. from_first_real: each row starts at its first real
        token, so a prefill does not compute the holes of a left-padded prompt (a joiner, on its
        own, need not have them)."""
        n = len(batch.active)
        self.forwards = 0
        if batch.static_cache:
            if not isinstance(self.slots, StaticSlots):      # lent for the call (`close` gives it back)
                self.kept, self.slots = batch.kept, batch.kept.storages.take(self.model, StaticSlots)
            self.slots.reset(self.model, n, batch.max_length, batch.compile_config, self.device, batch.warmups,
                             self._ring_slots() if self.trims_window else None)
        else:
            self.slots = DynamicSlots(self.model, n, self.device)
        self.static = batch.static_cache
        self.states = RowStates() if self.stateful else None
        self.last_hidden = None
        self.num_real = RowInts.full(n, 0, self.device)     # [n] real slots per row (host copy: `holes`)
        # [n] buffer tokens in the cache (on the buffer's device)
        self.fed = batch.real_starts[batch.active] if from_first_real else RowInts.full(n, 0, batch.tokens.device)

    def release(self, batch: SequenceBatch) -> None:
        """Drop the cache and its memory; every row catches up from its first token next time."""
        forwards = self.forwards
        self.reset(batch)
        self.forwards = forwards

    def close(self) -> None:
        """The call ends: a static storage goes back to the target's Kept, for the next call."""
        if isinstance(self.slots, StaticSlots):
            self.kept.storages.give(self.model, self.slots)
        self.slots = None

    @property
    def num_slots(self) -> int:
        return self.slots.used

    @property
    def slot_mask(self) -> torch.Tensor:
        """[n, slots]: whether slot s holds one of row b's tokens (a view: writes go through)."""
        return self.slots.mask

    @property
    def holes(self) -> bool:
        """Whether any slot is a hole (padding, a rolled-back draft) in some row: a row has fewer
        real slots than the cache has slots. From the host's copy of `num_real`, which the loop's
        callers keep (a read of the device only where one did not: a hierarchy's inner verification,
        a truncation)."""
        if self.num_real.host is None:
            self.num_real = RowInts(self.num_real.tensor, self.num_real.tensor.tolist())
        return self.num_real.min() < self.num_slots

    def lag(self, batch: SequenceBatch) -> RowInts:
        """Tokens each active row has not fed yet [n]."""
        return batch.active_lengths() - self.fed

    def pending(self, batch: SequenceBatch, end: RowInts | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """Tokens each row has not fed yet (up to `end` [n], default its length), right-aligned with
        holes on the left, and mark them fed.

        Returns (tokens [n, width], real [n, width], the real ones per row on the host, or None where
        the lags are not known there); width = the largest lag (>= 1 for every row).
        """
        rows, end = batch.active.tensor, batch.active_lengths() if end is None else end
        lags = end - self.fed
        if lags.host is not None:
            width, least_end = lags.max(), end.min()
        else:
            width, least_end = torch.stack([lags.tensor.max(), end.tensor.min()]).tolist()   # one host read
        near_prompt = least_end - width < batch.prompt_len          # (decoding steps are past every prompt)
        counts = None      # per row its real tokens, on the host: from its first unfed or first real one on
        if lags.host is not None and batch.active.host is not None:
            first = batch.real_starts.host
            counts = [max(0, e - max(f, first[row])) for row, e, f in zip(batch.active.host, end.host, self.fed.host)]
        self.fed, lag, end = end.clone(), lags.tensor, end.tensor
        if width == 1 and not near_prompt:         # steady decoding: each row's last token (fewer ops)
            return batch.tokens[rows, end - 1][:, None], (lag > 0)[:, None], counts   # rows without lag: a hole
        offsets = torch.arange(width, device=lag.device) - width                  # [width]
        index = (end[:, None] + offsets).clamp(min=0)                            # [n, width]
        real = offsets >= -lag[:, None]
        if near_prompt:
            real &= batch.is_real(rows, index)
        return batch.tokens[rows[:, None], index], real, counts

    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None, counts: list[int] | None = None, *,
                keep: int) -> torch.Tensor:
        """Append `tokens` [n, w] (holes where `real` is False; None: all real); logits of the last
        `keep` slots. counts: the real tokens of each row, where the caller knows them on the host
        (else `holes` reads the device for them once).

        Returns float32 logits [n, keep, vocab] on the device of `tokens` (a copy: the next
        compiled call may overwrite the model's own).
        """
        ring, width = self.slots.ring, tokens.shape[1]
        if ring is not None and width > keep and self.slots.used - self.slots.front + width > ring:
            # a static cache's ring cannot hold this forward: its columns before the last `keep`
            # (before any speculative region) go first, RING_PART at a time, the window trimmed
            # before each (not compacted: a region may be open, whose slots must not move)
            head = width - keep
            for start in range(0, head, RING_PART):
                columns = slice(start, min(start + RING_PART, head))
                self._trim_window(compact=False)
                self._forward(tokens[:, columns], None if real is None else real[:, columns], None, keep=1)
            self._trim_window(compact=False)
            tokens, real, counts = tokens[:, head:], None if real is None else real[:, head:], None
        return self._forward(tokens, real, counts, keep=keep)

    def _forward(self, tokens: torch.Tensor, real: torch.Tensor | None, counts: list[int] | None, *,
                 keep: int) -> torch.Tensor:
        """`forward` of columns that fit the cache."""
        out_device, n = tokens.device, tokens.shape[0]
        width = tokens.shape[1]
        arranged = None
        if self.states is not None:       # each row's real tokens first, its states recorded
            given = torch.ones(tokens.shape, dtype=torch.bool, device=self.device) if real is None else real
            tokens, given, arranged = self.states.arrange(tokens.to(self.device), given.to(self.device), self.num_slots)
            real = None if real is None else given
        tokens, real, positions = self._positions(tokens.to(self.device), real, counts)
        if arranged is None:
            logits = self.slots.forward(self, tokens, real, positions, keep)
        else:
            with recurrent.recording_states(self.model, arranged.plan):
                logits = self.slots.forward(self, tokens, real, positions, arranged.keep(keep))
                self.states.settle(self.slots.cache, arranged)
            logits = arranged.logits(logits, width, keep)
        self.forwards += 1
        if self.keeps_hidden:
            self._keep_hidden(real, keep)
        return logits[:n, -keep:].to(device=out_device, dtype=torch.float32)

    def fuses_draft_step(self, width: int, forwards: int) -> bool:
        """Whether `draft_step` runs its forwards (the first `width` wide) as one compiled call: a
        static cache's compiled forwards, where a forward's slots and positions are all it changes
        (no windows, no recurrent states, no hidden states kept), a catch-up of at most 2 tokens
        (a step's usual lag: its bonus token, and its last draft when every draft was accepted)."""
        plain = self.window is None and self.states is None and not self.keeps_hidden
        return (plain and isinstance(self.slots, StaticSlots) and width <= 2
                and self.slots.fuses_draft_step(width, forwards))

    def draft_step(self, tokens: torch.Tensor, real: torch.Tensor | None, counts: list[int] | None,
                   forwards: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy draft step in one compiled call (where `fuses_draft_step`): `forward(tokens, real,
        counts, keep=1)`, then forwards - 1 times `forward(token[:, None], None, keep=1)` of the last
        one's argmax. Returns float32 logits [n, forwards, vocab] and their argmax [n, forwards] (on
        the device of `tokens`)."""
        out_device = tokens.device
        tokens, real, positions = self._positions(tokens.to(self.device), real, counts)
        after = self.num_real.tensor[:, None]               # the first draft's position
        logits, picked = self.slots.draft_step(self, tokens, real, positions, after, forwards)
        self.num_real = self.num_real + (forwards - 1)
        self.forwards += forwards
        return logits.to(device=out_device, dtype=torch.float32), picked.to(out_device)

    def _positions(self, tokens: torch.Tensor, real: torch.Tensor | None, counts: list[int] | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a forward of tokens [n, w] (real: as `forward`'s): the tokens, the real mask and the
        positions [n, w] (each slot's real slots before it); its real slots counted in `num_real`."""
        width = tokens.shape[1]
        if real is None:        # (a drafter's one-token forwards: their positions in the fewest ops)
            real = torch.ones(tokens.shape, dtype=torch.bool, device=self.device)
            positions = self.num_real.tensor[:, None]
            if width > 1:
                positions = positions + torch.arange(width, device=self.device)
            self.num_real = self.num_real + width
        else:
            real = real.to(self.device)
            positions = (self.num_real.tensor[:, None] + real.long().cumsum(1) - 1).clamp(min=0)
            self.num_real = RowInts(self.num_real.tensor + real.sum(1), None if counts is None or self.num_real.host is None
                                    else [a + b for a, b in zip(self.num_real.host, counts)])
        return tokens, real, positions

    def eager(self, cache, tokens, mask, positions, keep, **kwargs) -> torch.Tensor:
        """The model's own forward over `cache` (for the storages): logits [rows, >= keep, vocab]."""
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = keep
        if self.keeps_hidden:
            kwargs["output_hidden_states"] = True
        out = self.model(input_ids=tokens, attention_mask=self.model_mask(mask, positions), position_ids=positions,
                         use_cache=True, **kv_cache.cache_kwargs(self.model, cache), **kwargs)
        if self.keeps_hidden:
            self._hidden = out.hidden_states[-1][:, -keep:]
        return out.logits

    def _keep_hidden(self, real: torch.Tensor, keep: int) -> None:
        """After a forward of real [n, w]: each row's hidden state at its last real token (rows
        without one keep theirs), and the kept columns [n, keep, hidden] for `rollback` to pick
        the last accepted one from (they are slots `_hidden_from` on)."""
        n, w = real.shape
        self._hidden, self._hidden_from = self._hidden[:n], self.num_slots - keep      # (no dummy rows)
        last = (w - 1 - real.flip(1).int().argmax(1)) - (w - keep)          # [n] column of the last real token
        picked = self._hidden[torch.arange(n, device=real.device), last.clamp(0, keep - 1)]
        has_real = real.any(1)[:, None]
        self.last_hidden = picked if self.last_hidden is None else torch.where(has_real, picked, self.last_hidden)

    def layer_states(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values [n, heads, slots, dim] (the slots of `slot_mask`)."""
        keys, values = kv_cache.layer_kv(self.slots.cache, index)
        n, used = len(self.num_real), self.num_slots
        return keys[:n, :, :used], values[:n, :, :used]

    def model_mask(self, slots: torch.Tensor | None, positions: torch.Tensor):
        """The attention mask the model gets for a forward at `positions` [rows, w] over slots
        [rows, s] (the forward's own included; None: no holes, no window): the slot mask itself, or
        with sliding-window layers `window_masks`, as a mapping by layer kind for
        models with both kinds (as Transformers' own masks for them are). A 4-D mask is the model's
        own: it is never left out for sdpa's `is_causal`, which would make another graph."""
        if self.window is None:
            return slots
        masks = window_masks(self.model, slots, positions, self.window, self.slots.window_columns)
        if self.stateful:       # a recurrent layer's: none (each row's holes come after its real tokens)
            return masks | dict.fromkeys(recurrent.state_kinds(self.model))
        return masks if self.full_layers_too else masks["sliding_attention"]

    def open_region(self, lead: int, width: int) -> SpecRegion:
        """Reserve room for `lead` slots and then a speculative region of `width` (its whole
        footprint: a compiled cache pads each forward, and a compaction, which moves slots, must
        not happen inside the region); the region starts after the lead."""
        if self.trims_window and self.slots.forgets_window:
            self._trim_window()
        self.slots.reserve(lead + width)
        region = SpecRegion(start=self.num_slots + lead, moves=self.slots.moves)
        if self.states is not None:
            self.states.open_region(region.start, len(self.num_real))
        return region

    def _spare(self) -> int:
        """Slots a sliding-window layer may hold past a window when a step opens (`_trim_window`)."""
        return min(64, self.window)

    def _ring_slots(self) -> int:
        """A static cache's sliding-window ring: a window, the spare and a forward of RING_PART
        tokens (a longer one goes in parts, `forward`; a longer region grows it, `StaticSlots`)."""
        return self.window - 1 + self._spare() + RING_PART

    def _trim_window(self, compact: bool = True) -> None:
        """The sliding-window layers forget the slots before every row's last window - 1 real ones:
        no later query sees them. Where a step opens, as no rollback brings back a slot of an
        earlier step. Once per `spare` slots (a dynamic cache without holes: every step, as that is
        known on the host and moves nothing); with holes the slots are read from the device, and
        compacted (with `compact`) where a row's holes stretch its window past the spare."""
        slots, window, spare = self.slots, self.window, self._spare()
        holes = self.holes
        if slots.used - slots.front <= window - 1 + (spare if holes or self.static else 0):
            return
        if not holes:
            slots.window_front(slots.used - (window - 1))
            return
        mask = self.slot_mask[:, slots.front:]                                       # [n, span]
        after = mask.flip(1).cumsum(1).flip(1)                         # real slots at or after each slot
        in_window = mask & (after <= window - 1)
        first = torch.where(in_window.any(1), in_window.int().argmax(1), mask.shape[1])   # [n]
        front = slots.front + int(first.min())                                    # one host read
        if compact and slots.used - front > window - 1 + spare:
            slots.compact(in_window)
        else:
            slots.window_front(front)

    def rollback(self, region: SpecRegion, kept: RowInts, spec_real: list[int] | None) -> None:
        """Of the slots of `region`, row b keeps its first `kept[b]`, of its `spec_real[b]` real
        ones there (kept <= spec_real, or all of them; known on the host: then nothing is read from
        the device).

        The kept tokens are the accepted drafts (already written to the buffer): they count as fed.
        """
        if self.slots.moves != region.moves:
            raise RuntimeError("a speculative region's slots moved (the cache was compacted inside it): "
                               "its footprint was not reserved")
        spec_start = region.start
        keep = kept.tensor.to(self.device)
        if self.states is not None:       # each row's states step back, its last slots become holes
            drop = self.states.rollback(self.slots.cache, kept.host or kept.tensor.tolist())
            self._forget_last(torch.tensor(drop, device=self.device))
            self.fed = self.fed + kept
            self._crop_holes(None if kept.host is None else spec_start + kept.max())
            return
        if spec_start == self.num_slots:      # nothing speculative (k = 0): nothing to undo
            return
        dropped = None if spec_real is None or kept.host is None else [max(0, r - k) for r, k in zip(spec_real, kept.host)]
        if dropped is not None and self.num_real.host is not None and len(set(kept.host)) == 1:
            # every row keeps as many (batch 1, even acceptance): all slots from there on go (fewer ops)
            self.slot_mask[:, spec_start + kept.host[0]:] = False
            self.num_real = RowInts.of([n - d for n, d in zip(self.num_real.host, dropped)], self.device)
        else:
            slot = torch.arange(self.num_slots - spec_start, device=self.device)
            spec = self.slot_mask[:, spec_start:]
            drop = spec & (slot[None, :] >= keep[:, None])
            self.num_real = self.num_real - RowInts(drop.sum(1), dropped)
            self.slot_mask[:, spec_start:] = spec & ~drop
        if self.keeps_hidden:       # the last kept slot: the pending token's (spec_start - 1) + keep
            column = spec_start - 1 + keep - self._hidden_from
            self.last_hidden = self._hidden[torch.arange(len(keep), device=keep.device), column]
        self.fed = self.fed + kept
        # slots past spec_start + the most kept are holes in every row
        self._crop_holes(None if kept.host is None else spec_start + kept.max())

    def truncate(self, ends: torch.Tensor) -> None:
        """Forget row b's fed tokens from buffer position ends[b] on (its last real slots)."""
        drop = (self.fed.tensor - ends).clamp(min=0)                             # [n]
        if not bool(drop.any()):
            return
        if self.states is not None:
            raise ValueError(f"{type(self.model).__name__}'s recurrent states cannot forget tokens before its last "
                             "speculative step (a hierarchy's lower drafter): use it as a drafter of its own")
        self._forget_last(drop.to(self.device))
        self.fed = RowInts(self.fed.tensor - drop)
        self._crop_holes()

    def _forget_last(self, drop: torch.Tensor) -> None:
        """Row b's last drop[b] [n] real slots become holes."""
        slots = self.slot_mask
        after = slots.flip(1).long().cumsum(1).flip(1)             # [n, slots]: real slots at or after s
        kill = slots & (after <= drop[:, None])
        slots &= ~kill
        self.num_real = self.num_real - RowInts(kill.sum(1))

    def _crop_holes(self, holes_from: int | None = None) -> None:
        """Slots that are holes in every row cost attention for nothing: crop them at the end
        (rolled-back drafts) and at the front (the left padding of a longer row that left; in a
        serving loop it would pile up). Positions count real slots, so nothing else moves.
        holes_from: a slot from which on every slot is a hole, known on the host: the end is cut
        there without reading the device (holes before it stay masked)."""
        if holes_from is not None:
            if holes_from < self.num_slots:
                self.slots.step_back(holes_from)
            return
        if not len(self.num_real):              # no rows left: no slot is used
            self.slots.step_back(0)
            return
        used = self.slot_mask.any(0)                                             # [slots]
        if not len(used):
            return
        # one host read: whether any slot is used, the first used and one past the last used
        any_used, first_used, from_end = torch.stack([used.any(), used.int().argmax(),
                                                      used.flip(0).int().argmax()]).tolist()
        first_used, last_used = (first_used, len(used) - from_end) if any_used else (0, 0)
        if last_used < self.num_slots:
            self.slots.step_back(last_used)
        if first_used:
            self.slots.drop_front(first_used)

    def append(self, other: "CachedModel") -> None:
        """Take `other`'s rows (new requests, prefilled on their own) after this one's; the side
        with fewer slots gets hole slots on the left, so every row keeps its own positions."""
        if self.static or other.static:
            raise ValueError("cache_implementation='static' cannot take rows joining a running batch; use the "
                             "default cache")
        self.slots.append(other.slots)
        self.num_real = self.num_real.cat(other.num_real)
        self.fed = self.fed.cat(other.fed)
        self.forwards += other.forwards

    def select_rows(self, keep: RowInts) -> None:
        """Keep rows `keep` (indices into the current active rows) — finished rows cost nothing more."""
        on_device = keep.tensor.to(self.device)
        self.slots.select_rows(on_device)
        if self.states is not None:
            self.states.select_rows(keep.host or keep.tensor.tolist())
        self.num_real = self.num_real[RowInts(on_device, keep.host)]
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[on_device]
        self.fed = self.fed[keep]
        if not self.static:      # (a static cache keeps its slots; holes there cost no memory)
            self._crop_holes()   # to no slots at all when no rows are left: joiners may `append`


def window_masks(model: torch.nn.Module, slots: torch.Tensor, positions: torch.Tensor,
                 window: int | None, window_columns=None) -> dict[str, torch.Tensor]:
    """4-D masks [rows, 1, w, s] for queries at `positions` [rows, w] over slots [rows, s], built
    from each slot's real position (the real slots before it), by layer kind: "full_attention"
    causal, "sliding_attention" also within `window` tokens (None: no sliding layers), of the
    columns `window_columns` picks (the slots a sliding layer holds); in `model`'s attention's format."""
    # built at [rows, 1, w, s], not as views of [rows, w, s]: a compiled forward guards on a view's base
    key_positions = slots.long().cumsum(1)[:, None, None, :] - 1                    # [rows, 1, 1, s]
    query_positions = positions[:, None, :, None]                                   # [rows, 1, w, 1]
    causal = slots[:, None, None, :] & (key_positions <= query_positions)           # [rows, 1, w, s]
    masks = {"full_attention": _as_attention_mask(model, causal)}
    if window is not None:
        sliding = causal & (query_positions - key_positions < window)
        if window_columns is not None:
            sliding = window_columns(sliding)
        masks["sliding_attention"] = _as_attention_mask(model, sliding)
    return masks


def _as_attention_mask(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean 4-D mask as the model's attention takes it: boolean (sdpa), or additive (eager)."""
    if modeling.attn_implementation(model) == "sdpa":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
