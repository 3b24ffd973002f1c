"""A Transformers causal LM as drafter, with its own KV cache and per-row lag."""
from __future__ import annotations

import torch

from ..cached_model import CachedModel
from ..sequences import SequenceBatch
from .base import Drafter, Proposal


def output_vocab_size(model: torch.nn.Module) -> int:
    """Number of logits the model emits per position."""
    head = model.get_output_embeddings()
    if head is None:
        return model.config.get_text_config().vocab_size
    # nn.Linear and its dynamically quantised form both say out_features; embeddings-tied heads too
    return getattr(head, "out_features", None) or head.weight.shape[0]


class ModelDrafter(Drafter):
    def __init__(self, model: torch.nn.Module, name: str | None = None):
        self.model = model
        self.runner = CachedModel(model)
        self.name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        self.vocab_size = output_vocab_size(model)

    def begin(self, batch, sampler):
        super().begin(batch, sampler)
        self.runner.reset(batch)
        self._spec_start = None

    def propose(self, batch: SequenceBatch, k: int) -> Proposal:
        rows = batch.active
        start = batch.lengths[rows]
        tokens, real = self.runner.pending(batch)       # catch up the lag, then draft
        logits = self.runner.forward(tokens, real, keep=1)
        self._spec_start = self.runner.num_slots
        drafts, probs = [], []
        for j in range(k):
            scores = self.sampler.scores(batch, logits, offset=j)[:, 0]   # [n, vocab]
            token = self.sampler.pick(scores)
            if self.sampler.do_sample:
                probs.append(self.sampler.probs(scores))
            batch.tokens[rows, start + j] = token         # processors of position j+1 read it
            drafts.append(token)
            if j < k - 1:
                logits = self.runner.forward(token[:, None], torch.ones_like(token[:, None], dtype=torch.bool), 1)
        self._fed_drafts = k - 1                         # the last draft was never fed
        return Proposal(torch.stack(drafts, 1), torch.full_like(start, k),
                        torch.stack(probs, 1) if probs else None)

    def accepted(self, num_accepted):
        self.runner.rollback(self._spec_start, num_accepted.clamp(max=self._fed_drafts))
        self._spec_start = None

    def select_rows(self, keep):
        self.runner.select_rows(keep)
