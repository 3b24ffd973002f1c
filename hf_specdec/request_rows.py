"""A drafter inside continuous batching: the `Drafter` contract `generate()`'s loop calls, on rows that
follow Transformers' requests.

`RequestRows` keeps a `SequenceBatch` whose active rows are the decoding requests (a row per
request: its tokens after one masked pad token), in any order: requests that join get rows
(`Drafter.add_rows`, prefilled together), rows of finished or cancelled requests are dropped
(`select_rows`), running rows get their new tokens appended. Each step the drafter proposes on it
(`propose`) and hears what each request kept (`accepted`), exactly as in `generate()`, so a drafter
is written once. A draft model keeps its own cache (`CachedModel`: dynamic, rows with holes) rather
than a second paged cache: it runs the loop's own drafting, catch-up and rollback, tested on every
model kind, and needs nothing of the paged cache's scheduler (a draft forward is always all
decoding rows).

`RequestSampler` samples drafts as each request's target step samples: through Transformers' own
processors of the step, the distribution kept for `verify`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._compat import cb
from .drafters.base import ContinueDrafting, Drafter
from .rows import RowInts
from .sampling import TokenSampler
from .sequences import SequenceBatch


@dataclass
class Draft:
    """One request's drafts for a step: tokens [n], the drafter's confidence in each (what AdaSpec
    weighs) and the distributions they were sampled from [n, vocab] (None: a point mass)."""
    tokens: list[int]
    confidences: list[float]
    probs: torch.Tensor | None = None

    def cut(self, n: int) -> "Draft":
        return Draft(self.tokens[:n], self.confidences[:n], None if self.probs is None else self.probs[:n])


class RequestSampler(TokenSampler):
    """Drafts sampled from what each request's target step samples from: Transformers' processors of
    continuous batching, called as its model runner calls them (`cb.process`): per-request processors
    with the arguments of the request each active row follows (`follow`), the generation config's
    warpers (`per_request_processors` off, Transformers' default) as they are, and each processor
    that reads tokens with the token fed at the position, which is what the target's gets."""

    def __init__(self, processors, do_sample: bool):
        super().__init__(None, do_sample)
        self.request_processors = processors      # Transformers' ContinuousBatchingLogitsProcessorList
        self.arguments: torch.Tensor | None = None
        self.picks_argmax = False                 # (its scores are the requests' processors')

    def follow(self, states: list) -> None:
        """The active rows' requests, in row order."""
        self.arguments = cb.request_arguments(self.request_processors, states)

    def scores(self, batch: SequenceBatch, logits: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        n, m, vocab = logits.shape
        if self.arguments is None:
            return logits
        # position j of a row follows its prefix of length lengths + offset + j: the token fed there is its last
        fed = batch.active_lengths().tensor + offset - 1                                  # [n]
        fed = fed[:, None] + torch.arange(m, device=fed.device)                           # [n, m]
        input_ids = batch.tokens[batch.active.tensor].gather(1, fed)
        per_position = self.arguments.repeat_interleave(m, 1).to(logits.device)     # [processors, n * m]
        return cb.process(self.request_processors, input_ids.reshape(n * m), logits.reshape(n * m, vocab),
                          per_position).view(n, m, vocab)


class RequestRows:
    """A drafter's rows following the decoding requests of a continuous batching processor."""

    def __init__(self, drafter: Drafter, sampler: RequestSampler, device: torch.device):
        self.drafter, self.sampler = drafter, sampler
        # rows hold a request's whole sequence after one masked pad token: no prompt region to size
        empty = torch.zeros(0, 1, dtype=torch.long, device=device)
        self.batch = SequenceBatch(empty, empty, max_length=1 << 30, pad_token_id=0)
        self.batch.active = RowInts.of([], device)
        drafter.begin(self.batch, sampler)
        self.owners: list[str | None] = []        # row -> its request's id (None: free)
        self.proposed = False

    def propose(self, states: list, ks: list[int], continue_drafting: ContinueDrafting | None = None) -> list[Draft]:
        """Each request's drafts (up to ks[i] for states[i]); `continue_drafting` as in `Drafter.propose`.
        A step without drafts leaves the drafter as it is: it follows the requests (prefills those
        that joined, catches up the others) when drafting resumes, so drafting off costs nothing."""
        k = max(ks, default=0)
        self.proposed = k > 0
        if not self.proposed:
            return [Draft(tokens=[], confidences=[]) for _ in states]
        self._follow(states)
        by_id = {cb.request_id(s): s for s in states}
        self.sampler.follow([by_id[self.owners[row]] for row in self.batch.active.host])
        self.batch.reserve(k + 1)                # the drafts are written at each row's end
        proposal = self.drafter.propose(self.batch, k, continue_drafting)
        tokens, counts = proposal.tokens.tolist(), proposal.counts.tolist()
        confidences = proposal.confidence.tolist() if proposal.confidence is not None else \
            [[1.0] * len(row) for row in tokens]
        position = {self.owners[row]: i for i, row in enumerate(self.batch.active.host)}
        out = []
        for state, k_i in zip(states, ks):
            i = position[cb.request_id(state)]
            probs = None if proposal.probs is None else proposal.probs[i]
            out.append(Draft(tokens=tokens[i], confidences=confidences[i], probs=probs).cut(min(k_i, counts[i])))
        return out

    def lags(self, states: list) -> list[int]:
        """The tokens each request's row must feed before it drafts (`StepContext.max_lag`,
        `lag_tokens`): a joining request its whole sequence, a running one its lag when the drafter
        last followed it and what it emitted since; none for a drafter that never lags."""
        lags = self.drafter.lag(self.batch)
        if lags is None:
            return []
        then = {self.owners[row]: (self.batch.lengths.host[row], lag) for row, lag in zip(self.batch.active.host,
                                                                                          lags.tolist())}
        out = []
        for state in states:
            prompt, generated = cb.request_tokens(state)
            length, lag = then.get(cb.request_id(state), (1, 0))     # (a row's first token: a masked pad)
            out.append(1 + len(prompt) + len(generated) - length + lag)
        return out

    def accepted(self, counts: dict[str, int]) -> None:
        """counts: drafts each request kept (requests not in it: none)."""
        if self.proposed:
            kept = [counts.get(self.owners[row], 0) for row in self.batch.active.host]
            self.drafter.accepted(RowInts.of(kept, self.batch.tokens.device))
            self.proposed = False

    def _follow(self, states: list) -> None:
        """Make the rows the decoding requests, in any order: drop the others' rows, append each
        running request's new tokens, and add the requests that joined."""
        batch, device = self.batch, self.batch.tokens.device
        wanted = {cb.request_id(s): cb.request_tokens(s) for s in states}
        active = batch.active.host
        keep = [i for i, row in enumerate(active) if self.owners[row] in wanted]
        if len(keep) < len(active):
            for i in sorted(set(range(len(active))) - set(keep)):
                self.owners[active[i]] = None
            kept = RowInts.of(keep, device)
            self.drafter.select_rows(kept)
            batch.active = batch.active[kept]
        running = {self.owners[row]: row for row in batch.active.host}
        joining = [i for i in wanted if i not in running]
        rows = self._free_rows(len(joining))
        for row, request in zip(rows, joining):
            self.owners[row] = request
        batch.reserve(0, max((1 + len(p) + len(g) for p, g in wanted.values()), default=0))
        lengths, running_rows = batch.lengths.host[:], set(running.values())
        for request, row in list(running.items()) + list(zip(joining, rows)):
            prompt, generated = wanted[request]
            length = len(prompt) + len(generated)
            written = lengths[row] - 1 if row in running_rows else 0
            if length > written:       # a running row: its new tokens only (no copy of its whole sequence)
                new = generated[written - len(prompt):] if written >= len(prompt) else (prompt + generated)[written:]
                batch.tokens[row, 1 + written:1 + length] = torch.tensor(new, device=device)
            lengths[row] = 1 + length
        batch.lengths = RowInts.of(lengths, device)
        if joining:
            joiners = RowInts.of(rows, device)
            self.drafter.add_rows(batch.view(active=joiners), prefill=True)
            batch.active = batch.active.cat(joiners)

    def _free_rows(self, n: int) -> list[int]:
        """n rows not in use, the batch grown by as many as it lacks."""
        free = [row for row, owner in enumerate(self.owners) if owner is None][:n]
        if len(free) < n:
            grown = self.batch.append_rows(n - len(free))
            self.owners += [None] * len(grown)
            free += grown
        return free
