"""What every drafter provides to the decoding loop."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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
    tokens: torch.Tensor              # [n, k] draft tokens of the active rows
    lengths: torch.Tensor             # [n] row b proposes tokens[b, :lengths[b]]
    probs: torch.Tensor | None = None  # [n, k, vocab] processed draft distributions; None = point mass
    confidence: torch.Tensor | None = None  # [n, k] drafter's probability of each token; None = 1


# A length policy's `continue_drafting`: confidences [row][draft] so far -> per row, draft more?
Controller = Callable[[list[list[float]]], list[bool]]


class Drafter:
    """Base class. A drafter proposes up to `k` tokens per active row of a `SequenceBatch`.

    Lifecycle per `generate()` call: `begin` once, then per step (only when chosen) `propose`
    followed by `accepted` with the verified outcome; `select_rows` whenever rows finish.
    A drafter that is not chosen for a step does nothing and simply lags behind.

    What a drafter can do beyond proposing is declared, not detected:
    `scorable`: it implements `replay` (full-information feedback for drafter selection);
    `joinable`: it implements `add_rows` (requests joining a running batch).
    """

    name: str = "drafter"
    vocab_size: int | None = None  # None: proposes token ids only (any vocabulary size)
    scorable: bool = False
    joinable: bool = False

    def begin(self, batch: SequenceBatch, sampler: TokenSampler) -> None:
        self.sampler = sampler

    def propose(self, batch: SequenceBatch, k: int, controller: Controller | None = None) -> Proposal:
        """Up to k drafts per active row; a drafter with confidences consults `controller` after
        each drafted token (its argument, the confidences so far [row][draft], may grow after the
        call) and stops rows (or the whole drafting) early."""
        raise NotImplementedError

    def accepted(self, num_accepted: torch.Tensor) -> None:
        """Row b accepted the first num_accepted[b] tokens of the last proposal."""

    def lag(self, batch: SequenceBatch, lengths: torch.Tensor) -> torch.Tensor | None:
        """Tokens each active row must feed before it drafts [n], given the rows' lengths [n] (a
        tensor, so the loop reads every row's number in one host sync); None: it never lags."""
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

    def discard_after(self, ends: torch.Tensor) -> None:
        """Forget whatever was fed past buffer position ends[b] of each active row (a drafter
        inside a hierarchy ran ahead of what the target accepted)."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Only rows `keep` (indices into the previous active rows) continue."""

    def add_rows(self, batch: SequenceBatch, prefill: bool) -> None:
        """New requests join (continuous batching, `joinable` drafters): `batch.active` are the
        joining rows only (their prompt and first token written), and they follow the running rows
        from now on. With `prefill`, feed them now."""
        raise NotImplementedError(f"{type(self).__name__} cannot take rows mid-run")


class LookupDrafter(Drafter):
    """A model-free drafter: a deterministic continuation of each row's tokens (q = point mass).
    Subclasses define `continuation`; rows without one propose nothing."""

    scorable = joinable = True

    def add_rows(self, batch, prefill):
        pass              # it reads each row's tokens afresh at every proposal

    def continuation(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        """Up to k tokens [<= k] to follow the row's tokens `seq` [length] (no padding)."""
        raise NotImplementedError

    def propose(self, batch: SequenceBatch, k: int, controller: Controller | None = None) -> Proposal:
        rows = batch.active
        tokens = torch.zeros(len(rows), k, dtype=torch.long, device=batch.tokens.device)
        lengths = torch.zeros(len(rows), dtype=torch.long, device=batch.tokens.device)
        starts, ends = batch.real_start(rows).tolist(), batch.lengths[rows].tolist()
        for i, (row, start, end) in enumerate(zip(rows.tolist(), starts, ends)):
            continuation = self.continuation(batch.tokens[row, start:end], k)
            tokens[i, : len(continuation)] = continuation
            lengths[i] = len(continuation)
        return Proposal(tokens, lengths, None)

    def replay(self, batch: SequenceBatch, start: torch.Tensor) -> Prediction:
        rows = batch.active
        count = (batch.lengths[rows] - start).tolist()
        tokens = torch.zeros(len(rows), max(count), dtype=torch.long, device=batch.tokens.device)
        valid = torch.zeros_like(tokens, dtype=torch.bool)
        firsts = batch.real_start(rows).tolist()
        for i, (row, first, begin, m) in enumerate(zip(rows.tolist(), firsts, start.tolist(), count)):
            for j in range(m):
                guess = self.continuation(batch.tokens[row, first: begin + j], 1)
                if len(guess):
                    tokens[i, j], valid[i, j] = guess[0], True
        return Prediction(tokens, valid)
