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

Two storages of the same slots: a dynamic cache grows by each forward's width and is cropped; a
static one (`batch.static_cache`: Transformers' `cache_implementation="static"`) is preallocated
to a capacity, each forward writes its width at slot `num_slots` on, rolled-back slots at the end
of every row are stepped back over and other holes stay masked; when it is full its rows are
compacted (real slots to the front, one gather per layer) or, if that does not free enough, it grows.
"""
from __future__ import annotations

import torch

from . import _compat
from .compiled import compiled_forwards, rows_bucket, width_tier
from .sequences import SequenceBatch


STATIC_SLACK = 64   # static caches hold a call's longest row + this many slots (then compact or grow)


class CachedModel:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = _compat.execution_device(model)
        self._logits_to_keep = _compat.accepts_logits_to_keep(model)
        self.cache = None
        self.forwards = 0   # in this generate() call

    def reset(self, batch: SequenceBatch, from_first_real: bool = False) -> None:
        """An empty cache for the active rows. from_first_real: each row starts at its first real
        token, so a prefill does not compute the holes of a left-padded prompt (a joiner, on its
        own, need not have them)."""
        n = len(batch.active)
        self.static = batch.static_cache
        self.forwards = 0
        # compiled: forwards at tier widths run compiled over `rows` = the batch's bucket (extra rows
        # are dummies that attend slot 0 only); eager: rows = n, any width
        self.compiled = compiled_forwards(self.model, batch.compile_config) if batch.compile_config else None
        self.rows = rows_bucket(n) if self.compiled else n
        if self.static:
            self.capacity = _round_up(batch.max_length + STATIC_SLACK, STATIC_SLACK)
            self.cache = _compat.new_static_cache(self.model, self.capacity)
        else:
            self.capacity = 0
            self.cache = _compat.new_cache(self.model)
        # [rows, capacity (static) or slots (dynamic)]
        self._slots = torch.zeros(self.rows, self.capacity, dtype=torch.bool, device=self.device)
        if self.rows > n:
            self._slots[n:, 0] = True
        self.used = 0                                                                      # slots written
        self._holes = False
        self.num_real = torch.zeros(n, dtype=torch.long, device=self.device)     # [n]
        self.fed = torch.zeros(n, dtype=torch.long, device=batch.tokens.device)   # [n]
        self.host_fed = [0] * n       # the same on the host while the callers say (else None)
        if from_first_real:
            self.fed = batch.real_start(batch.active).to(self.fed.device)
            self.host_fed = None

    def release(self, batch: SequenceBatch) -> None:
        """Drop the cache and its memory; every row catches up from its first token next time."""
        forwards = self.forwards
        self.reset(batch)
        self.forwards = forwards

    @property
    def num_slots(self) -> int:
        return self.used

    @property
    def slot_mask(self) -> torch.Tensor:
        """[n, slots]: whether slot s holds one of row b's tokens (a view: writes go through)."""
        return self._slots[:len(self.num_real), :self.used]

    @property
    def holes(self) -> bool:
        """Whether any slot is a hole (padding, a rolled-back draft) in some row: a host read, kept
        until `slot_mask` changes other than by real slots (drafting appends only those)."""
        if self._holes is None:
            self._holes = not bool(self.slot_mask.all())
        return self._holes

    def lag(self, batch: SequenceBatch, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens each active row has not fed yet [n]; lengths: the active rows' [n], if at hand."""
        return (batch.lengths[batch.active] if lengths is None else lengths) - self.fed

    def host_lag(self, host_lengths: list[int] | None) -> list[int] | None:
        """`lag` on the host, from the active rows' lengths there; None if either side is unknown."""
        if host_lengths is None or self.host_fed is None:
            return None
        return [length - fed for length, fed in zip(host_lengths, self.host_fed)]

    def pending(self, batch: SequenceBatch, end: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens each row has not fed yet (up to `end` [n], default its length), right-aligned with
        holes on the left, and mark them fed.

        Returns (tokens [n, width], real [n, width]); width = the largest lag (>= 1 for every row).
        """
        rows = batch.active
        host_end = batch.active_host_lengths() if end is None else None
        end = batch.lengths[rows] if end is None else end
        lag = end - self.fed
        host_lag = self.host_lag(host_end)
        if host_lag is not None:
            width, least_end = max(host_lag), min(host_end)
        else:
            width, least_end = torch.stack([lag.max(), end.min()]).tolist()   # one host read
        near_prompt = least_end - width < batch.prompt_len          # (decoding steps are past every prompt)
        self.fed, self.host_fed = end.clone(), host_end
        if width == 1 and not near_prompt:         # steady decoding: each row's last token (fewer ops)
            return batch.tokens[rows, end - 1][:, None], (lag > 0)[:, None]       # rows without lag: a hole
        offsets = torch.arange(width, device=lag.device) - width                  # [width]
        index = (end[:, None] + offsets).clamp(min=0)                            # [n, width]
        real = offsets >= -lag[:, None]
        if near_prompt:
            real &= batch.is_real(rows, index)
        return batch.tokens[rows[:, None], index], real

    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Append `tokens` [n, w] (holes where `real` is False; None: all real); logits of the last
        `keep` slots.

        Returns float32 logits [n, keep, vocab] on the device of `tokens`.
        """
        out_device, n = tokens.device, tokens.shape[0]
        if real is None:
            real = torch.ones(tokens.shape, dtype=torch.bool, device=self.device)
        else:
            self._holes = None
        tokens, real = tokens.to(self.device), real.to(self.device)
        end = tokens.shape[1]
        # compiled: into an allocated cache (the first forward allocates it, eager, as a prefill does)
        tier = width_tier(end) if self.compiled and self.used else None
        if tier is not None:            # a compiled shape: hole slots on the right up to the tier's width
            tokens, real = _pad_right(tokens, tier), _pad_right(real, tier)
        positions = (self.num_real[:, None] + real.long().cumsum(1) - 1).clamp(min=0)
        width = tokens.shape[1]
        if self.static:
            self.reserve(width)
            self._slots[:n, self.used:self.used + width] = real
            cache_position = _compat.static_cache_position(self.used, width, self.device)
            self.used += width
            mask = self._slots          # the whole capacity is the key length (unwritten slots are 0)
            if self.rows > n:           # dummy rows up to the bucket
                tokens, positions = _pad_rows(tokens, self.rows), _pad_rows(positions, self.rows)
            if tier is not None:
                logits = self.compiled(self.model, tokens, mask, positions, cache_position,
                                       _compat.cache_kwargs(self.model, self.cache))[:, end - keep:end]
            else:
                logits = self._eager(tokens, mask, positions, keep, cache_position=cache_position)
        else:
            self._slots = torch.cat([self._slots, real], dim=1)
            self.used += width          # before `holes` reads the mask: the new slots may be holes
            # no mask without holes, as generate() drops an all-ones one: building and applying it costs
            # every forward (~0.1 ms on a CPU); else a bool mask, which transformers 5 makes any mask anyway
            logits = self._eager(tokens, self._slots if self.holes else None, positions, keep)
        self.num_real += real.sum(1)
        self.forwards += 1
        return logits[:n, -keep:].to(device=out_device, dtype=torch.float32)

    def _eager(self, tokens, mask, positions, keep, **kwargs) -> torch.Tensor:
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = keep
        return self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                          **_compat.cache_kwargs(self.model, self.cache), **kwargs).logits

    def rollback(self, spec_start: int, keep: torch.Tensor, host_keep: list[int] | None = None) -> None:
        """Of the speculative slots from `spec_start` on, row b keeps its first `keep[b]` (host_keep:
        the same numbers on the host, if the caller has them: then nothing is read from the device).

        The kept tokens are the accepted drafts (already written to the buffer): they count as fed.
        """
        if spec_start == self.num_slots:      # nothing speculative (k = 0): nothing to undo
            return
        keep = keep.to(self.device)
        slot = torch.arange(self.num_slots - spec_start, device=self.device)
        spec = self.slot_mask[:, spec_start:]
        drop = spec & (slot[None, :] >= keep[:, None])
        self.num_real -= drop.sum(1)
        self.slot_mask[:, spec_start:] = spec & ~drop
        self._holes = None
        self.fed += keep.to(self.fed.device)
        if host_keep is None:
            self.host_fed = None
        elif self.host_fed is not None:
            self.host_fed = [fed + kept for fed, kept in zip(self.host_fed, host_keep)]
        # slots past spec_start + the most kept are holes in every row
        self._crop_holes(None if host_keep is None else spec_start + max(host_keep, default=0))

    def truncate(self, ends: torch.Tensor) -> None:
        """Forget row b's fed tokens from buffer position ends[b] on (its last real slots)."""
        drop = (self.fed - ends).clamp(min=0)                                    # [n]
        if not bool(drop.any()):
            return
        slots = self.slot_mask
        after = slots.flip(1).long().cumsum(1).flip(1)             # [n, slots]: real slots at or after s
        kill = slots & (after <= drop.to(self.device)[:, None])
        slots &= ~kill
        self._holes = None
        self.num_real -= kill.sum(1)
        self.fed -= drop
        self.host_fed = None
        self._crop_holes()

    def _crop_holes(self, holes_from: int | None = None) -> None:
        """Slots that are holes in every row cost attention for nothing: crop them at the end
        (rolled-back drafts) and at the front (the left padding of a longer row that left; in a
        serving loop it would pile up). Positions count real slots, so nothing else moves.
        holes_from: a slot from which on every slot is a hole, known on the host: the end is cut
        there without reading the device (holes before it stay masked)."""
        if holes_from is not None:
            if holes_from < self.used:
                if self.static:
                    _compat.set_static_length(self.cache, holes_from)
                else:
                    _compat.crop(self.cache, self.used - holes_from)
                    self._slots = self._slots[:, :holes_from]
                self.used = holes_from
            self._holes = None
            return
        used = self.slot_mask.any(0)                                             # [slots]
        if not len(used):
            return
        # one host read: whether any slot is used, the first used and one past the last used
        any_used, first_used, from_end = torch.stack([used.any(), used.int().argmax(),
                                                      used.flip(0).int().argmax()]).tolist()
        first_used, last_used = (first_used, len(used) - from_end) if any_used else (0, 0)
        if self.static:       # step back over the end; holes in front stay masked until a compaction
            if last_used < self.used:
                self.used = last_used
                _compat.set_static_length(self.cache, last_used)
            self._holes = None
            return
        _compat.crop(self.cache, self.num_slots - last_used)
        _compat.drop_front(self.cache, first_used)
        self._slots = self._slots[:, first_used:last_used]
        self.used = self._slots.shape[1]
        self._holes = None

    def reserve(self, width: int) -> None:
        """Room for `width` more slots in a static cache (a dynamic one grows anyway): compacted
        when full (every row's real slots moved to the front, in order), grown when that is not
        enough. Positions count real slots and keys carry their rotary positions, so moving slots
        changes no logit. Moving slots invalidates slot indices: a caller that will roll back to
        `num_slots` reserves the whole speculative region before reading it."""
        if self.compiled and self.used:
            width = width_tier(width) or width        # what `forward` will write
        if not self.static or self.used + width <= self.capacity:
            return
        real = self._slots[:, :self.used]                                         # [rows, used]
        count = real.sum(1)                                                       # [rows]
        keep = int(count.max()) if len(count) else 0                             # a host read, rarely
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)[:, :keep]   # [rows, keep]
        capacity = max(self.capacity, _round_up(keep + width, STATIC_SLACK))
        for layer in _compat.static_layers(self.cache):
            for name in ("keys", "values"):
                old = getattr(layer, name)                                       # [n, heads, capacity, dim]
                moved = old.gather(2, order[:, None, :, None].expand(-1, old.shape[1], -1, old.shape[3]))
                if capacity > old.shape[2]:
                    old = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
                    _compat.set_static_tensor(layer, name, old)
                    layer.max_cache_len = capacity
                old[:, :, :keep] = moved
        slots = torch.zeros(len(real), capacity, dtype=torch.bool, device=self.device)
        slots[:, :keep] = torch.arange(keep, device=self.device)[None, :] < count[:, None]
        self._slots, self.capacity, self.used = slots, capacity, keep
        _compat.set_static_length(self.cache, keep)
        self._holes = None

    def append(self, other: "CachedModel") -> None:
        """Take `other`'s rows (new requests, prefilled on their own) after this one's; the side
        with fewer slots gets hole slots on the left, so every row keeps its own positions."""
        if self.static or other.static:
            raise ValueError("cache_implementation='static' is not supported by the serving engine (rows joining "
                             "a running batch); use the default cache")
        width = max(self.num_slots, other.num_slots)
        def pad(mask):
            return torch.nn.functional.pad(mask, (width - mask.shape[1], 0), value=False)
        _compat.append_rows(self.cache, len(self.fed), other.cache, len(other.fed))
        self._slots = torch.cat([pad(self.slot_mask), pad(other.slot_mask)])
        self.used = width
        self._holes = None
        self.num_real = torch.cat([self.num_real, other.num_real])
        self.fed = torch.cat([self.fed, other.fed])
        self.host_fed = None
        self.forwards += other.forwards

    def select_rows(self, keep: torch.Tensor, host_keep: list[int] | None = None) -> None:
        """Keep rows `keep` (indices into the current active rows) — finished rows cost nothing more.
        A compiled static cache keeps its bucket until the rows fit a smaller one (its tensors stay
        where the compiled graphs read them); the rows past `len(keep)` are then dummies."""
        on_device, m = keep.to(self.device), len(keep)
        if self.static:
            rows = rows_bucket(m) if self.compiled else m
            index = torch.cat([on_device, on_device.new_zeros(rows - m)])         # [rows]: dummies read row 0
            for layer in _compat.static_layers(self.cache):
                for name in ("keys", "values"):
                    picked = getattr(layer, name)[index]
                    if rows == self.rows:
                        getattr(layer, name).copy_(picked)
                    else:
                        _compat.set_static_tensor(layer, name, picked)
            self._slots = self._slots[index]
            self._slots[m:] = False
            self._slots[m:, 0] = True
            self.rows = rows
        else:
            _compat.select_rows(self.cache, on_device)
            self._slots = self._slots[on_device]
        self.num_real = self.num_real[on_device]
        self._holes = None
        self.fed = self.fed[keep]
        self.host_fed = None if host_keep is None or self.host_fed is None else [self.host_fed[i] for i in host_keep]
        if not self.static:      # (a static cache keeps its slots; holes there cost no memory)
            self._crop_holes()   # to no slots at all when no rows are left: joiners may `append`


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _pad_right(t: torch.Tensor, width: int) -> torch.Tensor:
    """[n, w] -> [n, width] with zeros (False: holes) on the right."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, w] -> [rows, w] with zero rows below."""
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))
