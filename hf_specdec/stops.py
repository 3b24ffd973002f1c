"""Where each row stops: its limit and the stopping criteria, judged as `generate()` judges them.

`generate()` checks its criteria after every token; a speculative step emits up to k + 1 tokens a
row at once, so the judge finds, for each row, the first of its new tokens at which a criterion
fires (`find`, on the device, read with the step's one host read) and cuts the row there
(`apply`). Transformers' own criteria (max length, EOS) read only the tokens and are judged in one
pass; any other criterion is called once per distinct prefix length, on the full batch.
"""
from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .rows import RowInts, to_device


def judged_by_tokens(stopping_criteria) -> bool:
    """Only generate()'s own criteria (max length, EOS): they read the tokens alone."""
    return all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria)


class StopJudge:
    """Each row's limit (a length it never passes: max_length, or a served request's own) and where
    it stopped, for every row of the batch, active or not.

    freeze_finished: rows stop at their own stop (generate() pads finished rows only when an EOS
    criterion exists); otherwise a stopped row keeps producing until every row has stopped."""

    def __init__(self, stopping_criteria, rows: int, max_length: int, device, freeze_finished: bool):
        self.criteria, self.freeze_finished = stopping_criteria, freeze_finished
        self.limit = RowInts.full(rows, max_length, device)
        self.stopped_at = RowInts.full(rows, -1, device)          # the length at its stop; -1: none
        self._by_tokens = judged_by_tokens(stopping_criteria)
        eos = [c.eos_token_id.to(device).flatten() for c in stopping_criteria if type(c) is EosTokenCriteria]
        self._eos = torch.cat(eos) if eos else None
        self._max_length = min((c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria),
                               default=max_length + 1)     # none: rows stop at their limit only

    def room(self, rows: RowInts, lengths: RowInts) -> RowInts:
        """Tokens each of `rows` [n] may still emit, at `lengths` [n]."""
        return self.limit[rows] - lengths

    def done(self, row: int, length: int) -> bool:
        """Whether a row at `length` has finished (its limit, or its stop where rows freeze there)."""
        return length >= self.limit.host[row] or (self.freeze_finished and self.stopped_at.host[row] >= 0)

    def find(self, tokens: torch.Tensor, rows: RowInts, start: RowInts, emitted: torch.Tensor,
             most: int) -> torch.Tensor | None:
        """Where the criteria stop each of `rows` [n] within its `emitted` [n] new tokens of the
        buffer `tokens`, written from start[n] on: [n] the length at the stop, -1 where none; None
        when no row can stop (nothing to read). most: the largest `emitted`."""
        if not self._by_tokens:
            return to_device(self._by_call(tokens, rows, start, emitted), rows.tensor.device)
        reaches_max = start.max() + most >= self._max_length     # a row may reach max_length
        if self._eos is None and not reaches_max:
            return None
        # judged for every new token at once, as generate()'s calls would (they see only the length
        # and the last token): each of these small ops costs ~10 us on a CPU
        start = start.tensor
        offsets = torch.arange(most, device=start.device)
        positions = (start[:, None] + offsets).clamp_(max=tokens.shape[1] - 1)   # [n, j]: the j-th new token
        hit = torch.isin(tokens[rows.tensor[:, None], positions], self._eos) if self._eos is not None else None
        if reaches_max:
            at_max = positions + 1 >= self._max_length
            hit = at_max if hit is None else hit | at_max
        if most > 1:              # every row emits at least one token
            hit &= offsets < emitted[:, None]
        return torch.where(hit.any(1), start + hit.int().argmax(1) + 1, -1)

    def _by_call(self, tokens: torch.Tensor, rows: RowInts, start: RowInts, emitted: torch.Tensor) -> list[int]:
        """Any criteria: one call per distinct prefix length, grouped in Python. Returns per row the
        length at which it stopped (in this step or before), -1 if it did not."""
        starts, counts, stopped = start.tolist(), emitted.tolist(), self.stopped_at[rows].tolist()
        index = rows.tensor
        for j in range(1, max(counts) + 1):
            groups: dict[int, list[int]] = {}
            for i, (s, c, at) in enumerate(zip(starts, counts, stopped)):
                if c >= j and at < 0:
                    groups.setdefault(s + j, []).append(i)
            for length, members in groups.items():
                # full batch in original order: criteria may keep per-row state (as processors do)
                hit = self.criteria(tokens[:, :length], None).to(index.device)[index[members]]
                for i, h in zip(members, hit.tolist()):
                    if h:
                        stopped[i] = length
        return stopped

    def apply(self, batch, rows: RowInts, start: RowInts, emitted: RowInts, stops: RowInts) -> RowInts:
        """Record the stops [n] of `rows` (read: known on the host) and cut what each row keeps of
        its `emitted` [n] new tokens from `start` [n]; returns what each keeps."""
        self.stopped_at[rows] = stops
        if self.freeze_finished:
            return stops.map(lambda s, b, e: torch.where(s >= 0, s - b, e),
                             lambda s, b, e: s - b if s >= 0 else e, start, emitted)
        if self.stopped_at.min() >= 0:
            # every row has stopped: all rows end at the latest stop, like generate()'s last step
            # (rows already retired at max_length included)
            latest = self.stopped_at.max()
            self.limit = RowInts.full(len(self.limit), latest, self.limit.tensor.device)
            batch.lengths = batch.lengths.minimum(latest)
            return emitted.minimum(self.limit[rows] - start)
        return emitted

    def cut(self, batch, rows: RowInts, start: RowInts, emitted: RowInts) -> None:
        """`find` and `apply` for rows whose lengths are already advanced (requests joining)."""
        found = self.find(batch.tokens, rows, start, emitted.tensor, emitted.max())
        stops = None if found is None else RowInts(found, found.tolist())      # one host read
        if stops is not None and stops.max() >= 0:
            batch.lengths[rows] = start + self.apply(batch, rows, start, emitted, stops)
