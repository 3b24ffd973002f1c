"""Drafters of continuous batching: drafts for Transformers' request states, step by step.

Both propose for the decoding requests of a step (`propose(states, ks)`: up to ks[i] drafts for
states[i]) and hear what each request kept (`accepted`):
  LookupDrafts  prompt lookup (any `continuation(tokens, k)`) over each request's tokens;
  ModelDrafts   a draft model, batched over the requests: our `ModelDrafter` on a `SequenceBatch`
                whose rows follow the requests (a row per decoding request: joiners prefilled
                together, rows of finished or cancelled requests dropped, new tokens appended).
The draft model keeps its own cache (`CachedModel`: dynamic, rows with holes) rather than a second
paged cache: it then runs the loop's own drafting, catch-up and rollback, tested on every model
kind, and needs nothing of the paged cache's scheduler (a draft forward is always all decoding rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching.requests import RequestState

from .drafters.model import ModelDrafter
from .rows import RowInts
from .sampling import TokenSampler
from .sequences import SequenceBatch


@dataclass
class Drafts:
    """One request's drafts for a step, and the drafter's confidence in each (what AdaSpec weighs)."""
    tokens: list[int]
    confidences: list[float]


class LookupDrafts:
    """Drafts from each request's own tokens (prompt lookup: `PromptLookupDrafter`)."""

    def __init__(self, lookup):
        self.lookup = lookup

    def propose(self, states: list[RequestState], ks: list[int], continue_drafting=None) -> list[Drafts]:
        """Each request's drafts (up to its k), certain (confidence 1.0): a lookup has no doubt to weigh."""
        drafts = [self.lookup.continuation(torch.tensor(s.initial_tokens + s.generated_tokens), k).tolist() if k > 0
                  else [] for s, k in zip(states, ks)]
        return [Drafts(tokens=d, confidences=[1.0] * len(d)) for d in drafts]

    def accepted(self, counts: dict[str, int]) -> None:
        pass


class ModelDrafts:
    """A draft model's greedy drafts for the decoding requests, one batched forward per draft
    position. Its rows: `batch.active`, owned by `owners[row]` (a request id)."""

    def __init__(self, model):
        self.drafter = ModelDrafter(model)
        device = next(model.parameters()).device
        # rows hold a request's whole sequence after one masked pad token: no prompt region to size
        self.batch = SequenceBatch(torch.zeros(0, 1, dtype=torch.long, device=device),
                                   torch.zeros(0, 1, dtype=torch.long, device=device), max_length=1 << 30,
                                   pad_token_id=0)
        self.batch.active = RowInts.of([], device)
        self.drafter.begin(self.batch, TokenSampler(None, False))
        self.owners: list[str | None] = []        # row -> its request's id (None: free)
        self.proposed = False

    def propose(self, states: list[RequestState], ks: list[int], continue_drafting=None) -> list[Drafts]:
        """Each request's drafts (up to its k) and their confidences (the draft model's probability of
        each); `continue_drafting` (a length policy's, as in `Drafter.propose`) may stop rows early."""
        self._follow(states)
        k = max(ks, default=0)
        self.proposed = k > 0
        if not self.proposed:
            return [Drafts(tokens=[], confidences=[]) for _ in states]
        self.batch.reserve(k + 1)                # the drafts are written at each row's end
        proposal = self.drafter.propose(self.batch, k, continue_drafting)
        tokens, counts = proposal.tokens.tolist(), proposal.counts.tolist()
        confidences = proposal.confidence.tolist() if proposal.confidence is not None else \
            [[1.0] * len(row) for row in tokens]
        position = {self.owners[row]: i for i, row in enumerate(self.batch.active.host)}
        out = []
        for state, k_i in zip(states, ks):
            row, n = position[state.request_id], min(k_i, counts[position[state.request_id]])
            out.append(Drafts(tokens=tokens[row][:n], confidences=confidences[row][:n]))
        return out

    def accepted(self, counts: dict[str, int]) -> None:
        """counts: drafts each request kept (requests not in it: none)."""
        if self.proposed:
            kept = [counts.get(self.owners[row], 0) for row in self.batch.active.host]
            self.drafter.accepted(RowInts.of(kept, self.batch.tokens.device))
            self.proposed = False

    def _follow(self, states: list[RequestState]) -> None:
        """Make the rows the decoding requests, in any order: drop the others' rows, append each
        running request's new tokens, and prefill the requests that joined."""
        batch, device = self.batch, self.batch.tokens.device
        wanted = {s.request_id: s for s in states}
        active = batch.active.host
        keep = [i for i, row in enumerate(active) if self.owners[row] in wanted]
        if len(keep) < len(active):
            for i in sorted(set(range(len(active))) - set(keep)):
                self.owners[active[i]] = None
            kept = RowInts.of(keep, device)
            self.drafter.select_rows(kept)
            batch.active = batch.active[kept]
        running = {self.owners[row]: row for row in batch.active.host}
        joining = [s for s in states if s.request_id not in running]
        rows = self._free_rows(len(joining))
        for row, state in zip(rows, joining):
            self.owners[row] = state.request_id
        batch.reserve(0, max((1 + len(s.initial_tokens) + len(s.generated_tokens) for s in states), default=0))
        lengths, running_rows = batch.lengths.host[:], set(running.values())
        for state, row in [(wanted[i], r) for i, r in running.items()] + list(zip(joining, rows)):
            prompt, length = len(state.initial_tokens), len(state.initial_tokens) + len(state.generated_tokens)
            written = lengths[row] - 1 if row in running_rows else 0
            if length > written:       # a running row: its new tokens only (no copy of its whole sequence)
                new = state.generated_tokens[written - prompt:] if written >= prompt else \
                    (state.initial_tokens + state.generated_tokens)[written:]
                batch.tokens[row, 1 + written:1 + length] = torch.tensor(new, device=device)
            lengths[row] = 1 + length
        batch.lengths = RowInts.of(lengths, device)
        if joining:
            joiners = RowInts.of(rows, device)
            self.drafter.add_rows(batch.view(active=joiners), prefill=True)
            batch.active = batch.active.cat(joiners)

    def _free_rows(self, n: int) -> list[int]:
        """n rows not in use, the batch grown by as many as it lacks (a masked pad token each)."""
        free = [row for row, owner in enumerate(self.owners) if owner is None][:n]
        grow = n - len(free)
        if grow:
            batch = self.batch
            start = len(self.owners)
            batch.tokens = torch.cat([batch.tokens, batch.tokens.new_zeros(grow, batch.capacity)])
            batch.prompt_mask = torch.cat([batch.prompt_mask, batch.prompt_mask.new_zeros(grow, 1)])
            batch.real_starts = RowInts.of(batch.real_starts.host + [1] * grow, batch.tokens.device)
            batch.lengths = RowInts.of(batch.lengths.host + [1] * grow, batch.tokens.device)
            self.owners += [None] * grow
            free += list(range(start, start + grow))
        return free
