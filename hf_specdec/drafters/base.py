"""What every drafter provides to the decoding loop."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..rows import RowInts
from ..sampling import TokenSampler
from ..sequences import SequenceBatch


@dataclass
class Prediction:
    """What a drafter would have proposed at each newly verified position (full-information
    feedback): position j of row b is buffer position start[b] + j, given the verified prefix."""

    tokens: torch.Tensor               # [n, w] its token (argmax of its distribution for a model)
    valid: torch.Tensor                # [n, w] False where it would have proposed nothing
    probs: torch.Tensor | None = None  # [n, w, vocab] its processed distribution (models, when sampling)


@dataclass
class Proposal:
    tokens: torch.Tensor              # [n, width] draft tokens of the active rows (width <= k)
    counts: RowInts                   # [n] row b proposes tokens[b, :counts[b]]
    probs: torch.Tensor | None = None  # [n, width, vocab] processed draft distributions; None = point mass
    confidence: torch.Tensor | None = None  # [n, width] drafter's probability of each token; None = 1


# A length policy's `continue_drafting`: confidences [row][draft] so far -> per row, draft more?
ContinueDrafting = Callable[[list[list[float]]], list[bool]]


class Drafter:
    """Base class. A drafter proposes up to `k` tokens per active row of a `SequenceBatch`.

    Lifecycle per `generate()` call: `begin` once, then per step (only when chosen) `propose`
    followed by `accepted` with the verified outcome; `select_rows` whenever rows finish.
    A drafter that is not chosen for a step does nothing and simply lags behind.

    What a drafter can do beyond proposing is declared, not detected:
    `scorable`: it implements `replay` (full-information feedback for drafter selection).
    """

    name: str = "drafter"
    vocab_size: int | None = None  # None: proposes token ids only (any vocabulary size)
    scorable: bool = False

    def begin(self, batch: SequenceBatch, sampler: TokenSampler) -> None:
        self.sampler = sampler

    def follow(self, target) -> None:
        """The loop's target (a `CachedModel`), before `begin`: for a drafter that reads its states."""

    def propose(self, batch: SequenceBatch, k: int, continue_drafting: ContinueDrafting | None = None) -> Proposal:
        """Up to k drafts per active row; a drafter with confidences consults `continue_drafting`
        after each drafted token (its argument, the confidences so far [row][draft], may grow after
        the call) and stops rows (or the whole drafting) early."""
        raise NotImplementedError

    def accepted(self, num_accepted: RowInts) -> None:
        """Row b accepted the first num_accepted[b] tokens of the last proposal."""

    def lag(self, batch: SequenceBatch) -> RowInts | None:
        """Tokens each active row must feed before it drafts [n]; None: it never lags."""
        return None

    def replay(self, batch: SequenceBatch, start: torch.Tensor) -> Prediction:
        """Predictions for the verified positions start[b] .. lengths[b]-1 of each active row."""
        raise NotImplementedError(f"{type(self).__name__} does not support full-information feedback")

    def forwards(self) -> list[tuple[str, int]]:
        """(name, forward passes in this generate() call) of each model it runs, cheapest first."""
        return []

    def models(self) -> list[torch.nn.Module]:
        """The models this drafter runs (what `DraftOffload` moves)."""
        return []

    def release(self, batch: SequenceBatch) -> None:
        """Drop every cached state (its models are leaving the device); catch up from scratch later."""

    def close(self) -> None:
        """The generate() call ends: give back what was lent to it (a kept static cache)."""

    def discard_after(self, ends: torch.Tensor) -> None:
        """Forget whatever was fed past buffer position ends[b] of each active row (a drafter
        inside a hierarchy ran ahead of what the target accepted)."""

    def select_rows(self, keep: RowInts) -> None:
        """Only rows `keep` (indices into the previous active rows) continue."""

    def add_rows(self, batch: SequenceBatch, prefill: bool) -> None:
        """Rows join a running batch (continuous batching's requests, `RequestRows`): `batch.active` are
        the joining rows only (their prompt and first token written), and they follow the running
        rows from now on. With `prefill`, feed them now."""
        raise NotImplementedError(f"{type(self).__name__} cannot take rows mid-run")


class LookupDrafter(Drafter):
    """A model-free drafter: a deterministic continuation of each row's tokens (q = point mass).
    Subclasses define `continuation`; rows without one propose nothing."""

    scorable = True

    def continuation(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        """Up to k tokens [<= k] to follow the row's tokens `seq` [length] (no padding, on the host)."""
        raise NotImplementedError

    @staticmethod
    def _on_host(batch: SequenceBatch, *columns: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
        """The active rows' tokens [n, longest] on the host, and their lengths and `columns` ([n]
        each) as lists: a lookup is host work, so it reads the rows once, not at every comparison."""
        rows = batch.active.tensor
        numbers = torch.stack([batch.lengths.tensor[rows], *columns]).tolist()
        return batch.tokens[rows, :max(numbers[0])].cpu(), numbers

    def propose(self, batch: SequenceBatch, k: int, continue_drafting: ContinueDrafting | None = None) -> Proposal:
        host, (ends, starts) = self._on_host(batch, batch.real_start(batch.active.tensor))
        out = torch.zeros(len(ends), k + 1, dtype=torch.long)             # [n, k drafts + their count]
        for i, (start, end) in enumerate(zip(starts, ends)):
            continuation = self.continuation(host[i, start:end], k)
            out[i, : len(continuation)] = continuation
            out[i, k] = len(continuation)
        out = out.to(batch.tokens.device)                                 # one copy back
        return Proposal(out[:, :k], RowInts(out[:, k]), None)

    def add_rows(self, batch: SequenceBatch, prefill: bool) -> None:
        """Nothing to feed: a lookup reads each row's tokens when it proposes."""

    def replay(self, batch: SequenceBatch, start: torch.Tensor) -> Prediction:
        host, (ends, firsts, begins) = self._on_host(batch, batch.real_start(batch.active.tensor), start)
        count = [end - begin for begin, end in zip(begins, ends)]
        tokens = torch.zeros(len(count), max(count), dtype=torch.long)
        valid = torch.zeros_like(tokens)
        for i, (first, begin, m) in enumerate(zip(firsts, begins, count)):
            for j in range(m):
                guess = self.continuation(host[i, first: begin + j], 1)
                if len(guess):
                    tokens[i, j], valid[i, j] = guess[0], 1
        both = torch.stack([tokens, valid]).to(batch.tokens.device)      # one copy back
        return Prediction(both[0], both[1].bool())
