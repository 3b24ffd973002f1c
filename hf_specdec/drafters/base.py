"""What every drafter provides to the decoding loop."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import TokenSampler
from ..sequences import SequenceBatch


@dataclass
class Proposal:
    tokens: torch.Tensor              # [n, k] draft tokens of the active rows
    lengths: torch.Tensor             # [n] row b proposes tokens[b, :lengths[b]]
    probs: torch.Tensor | None = None  # [n, k, vocab] processed draft distributions; None = point mass


class Drafter:
    """Base class. A drafter proposes up to `k` tokens per active row of a `SequenceBatch`.

    Lifecycle per `generate()` call: `begin` once, then per step (only when chosen) `propose`
    followed by `accepted` with the verified outcome; `select_rows` whenever rows finish.
    A drafter that is not chosen for a step does nothing and simply lags behind.
    """

    name: str = "drafter"
    vocab_size: int | None = None  # None: proposes token ids only (any vocabulary size)

    def begin(self, batch: SequenceBatch, sampler: TokenSampler) -> None:
        self.sampler = sampler

    def propose(self, batch: SequenceBatch, k: int) -> Proposal:
        raise NotImplementedError

    def accepted(self, num_accepted: torch.Tensor) -> None:
        """Row b accepted the first num_accepted[b] tokens of the last proposal."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Only rows `keep` (indices into the previous active rows) continue."""
