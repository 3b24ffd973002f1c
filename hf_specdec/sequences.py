"""The token buffer every model reads from, in `generate()`'s own layout.

Row b holds `tokens[b, :lengths[b]]` = left padding + prompt + accepted tokens, exactly the row
plain `generate()` would hold. Positions past `lengths[b]` are scratch: drafts are written there
so logits processors see `prefix + drafts[:j]`, and the verified tokens overwrite them in place.
"""
from __future__ import annotations

import copy

import torch

from .compiled import WarmupCount
from .kept import Kept
from .rows import RowInts


class SequenceBatch:
    GROWTH = 64  # the buffer grows in steps of this many positions, as rows get longer
    is_view = False

    def __init__(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None,
                 max_length: int, pad_token_id: int, static_cache: bool = False, compile_config=None,
                 kept: Kept | None = None):
        batch, prompt_len = input_ids.shape
        self.static_cache = static_cache    # models keep preallocated KV caches (cache_implementation="static")
        self.compile_config = compile_config  # and compile their decoding forwards (Transformers' CompileConfig)
        self.kept = kept or Kept()          # the target's Kept: static storages are lent from it
        self.warmups = WarmupCount()        # this call's compiled warm-ups (its views share it)
        device = input_ids.device
        self.prompt_len = prompt_len
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.tokens = torch.full((batch, prompt_len + self.GROWTH), pad_token_id,
                                 dtype=torch.long, device=device)      # [batch, capacity]
        self.tokens[:, :prompt_len] = input_ids
        # each row's length, kept on the host too by the decoding loop (it learns them from its
        # one read a step), so that planning a step reads nothing from the device
        self.lengths = RowInts.full(batch, prompt_len, device)         # [batch]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.prompt_mask = attention_mask.bool()                       # [batch, prompt_len]
        real_start = prompt_len - self.prompt_mask.sum(1)
        self.real_starts = RowInts(real_start, real_start.tolist())    # [batch]: first real token
        # rows still decoding (indices into the full batch); models hold caches for these only
        self.active = RowInts(torch.arange(batch, device=device), list(range(batch)))   # [n_active]

    def view(self, active: RowInts | None = None, lengths: RowInts | None = None) -> "SequenceBatch":
        """The same buffer (token writes go through) with other active rows [m] and/or row lengths
        [batch]: what part of a step acts on (a hierarchy's inner chain, rows joining a running
        batch), leaving this batch's own unchanged. Short-lived: it cannot grow the buffer (`reserve`)."""
        out = copy.copy(self)
        out.is_view = True
        out.active = self.active if active is None else active
        out.lengths = self.lengths if lengths is None else lengths
        return out

    def append_rows(self, n: int) -> list[int]:
        """n new rows at the end, each left padding only (length `prompt_len`, nothing real), not
        active: rows a running batch takes on (continuous batching's requests). Returns their indices."""
        first, device = self.tokens.shape[0], self.tokens.device
        self.tokens = torch.cat([self.tokens, self.tokens.new_full((n, self.capacity), self.pad_token_id)])
        self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(n, self.prompt_len)])
        self.real_starts = RowInts.of(self.real_starts.host + [self.prompt_len] * n, device)
        self.lengths = RowInts.of(self.lengths.host + [self.prompt_len] * n, device)
        return list(range(first, first + n))

    def active_lengths(self) -> RowInts:
        """The active rows' lengths [n]."""
        return self.lengths[self.active]

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def is_real(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """True where buffer position `index` [n, w] of `rows` holds a token, not left padding."""
        in_prompt = index < self.prompt_len
        mask = self.prompt_mask[rows].gather(1, index.clamp(max=self.prompt_len - 1))
        return ~in_prompt | mask

    def real_start(self, rows: torch.Tensor) -> torch.Tensor:
        """Index of the first non-padding token of each row in `rows`: [n]."""
        return self.real_starts.tensor[rows]

    def write(self, rows: torch.Tensor, start: torch.Tensor, values: torch.Tensor) -> None:
        """tokens[rows[i], start[i] + j] = values[i, j] for all j: [n, w]."""
        index = start[:, None] + torch.arange(values.shape[1], device=values.device)
        self.tokens[rows[:, None], index] = values

    def reserve(self, width: int, longest: int | None = None) -> None:
        """Make room for `width` tokens past the longest row (drafts are written as scratch);
        longest: the longest row's length, if known."""
        short = (self.lengths.max() if longest is None else longest) + width - self.capacity
        if short > 0:
            if self.is_view:    # a new buffer would stay with the view: the batch would miss its writes
                raise RuntimeError("SequenceBatch.reserve on a view: reserve on the batch it views first")
            self.tokens = torch.nn.functional.pad(self.tokens, (0, short + self.GROWTH), value=self.pad_token_id)

    def clear_scratch(self, rows: torch.Tensor) -> None:
        """Reset everything past each row's end to padding (finished rows then read as generate()'s)."""
        past_end = torch.arange(self.capacity, device=rows.device)[None, :] >= self.lengths.tensor[rows, None]
        self.tokens[rows] = self.tokens[rows].masked_fill(past_end, self.pad_token_id)

    def output(self) -> torch.LongTensor:
        """[batch, prompt_len + longest row's new tokens], rows ended early padded as generate() does."""
        return self.tokens[:, : int(self.lengths.tensor.max())].clone()
