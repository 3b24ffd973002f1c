"""Prompt lookup: propose what followed an earlier occurrence of the current suffix."""
from __future__ import annotations

import torch

from .base import LookupDrafter


class PromptLookupDrafter(LookupDrafter):
    """Model-free n-gram drafter over each row's own prompt and output so far.

    For n from `max_ngram` down to `min_ngram`, find the earliest occurrence of the row's last n
    tokens and propose the (up to k) tokens that followed it. Earliest, as Transformers does: on 8
    HumanEval prompts with SmolLM2 it needed 263 target forwards vs 281 for the latest match.
    Rows without a match propose nothing this step. Proposals are point masses (q = None).
    """

    def __init__(self, max_ngram: int = 2, min_ngram: int = 1):
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                             f"max_ngram={max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"prompt_lookup({min_ngram}-{max_ngram})"

    def continuation(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)                       # earlier n-grams [m, n]
            hits = (windows == seq[-n:]).all(1).nonzero().squeeze(1)
            if len(hits):
                follow = int(hits[0]) + n
                return seq[follow: follow + k]
        return seq[:0]
