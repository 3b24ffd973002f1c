"""A drafter that drafts from the target's own states: Gemma 4 assistants
(`Gemma4AssistantForCausalLM`, `Gemma4UnifiedAssistantForCausalLM`).

Such an assistant has no cache of its own. Each draft of row b reads
  - the target's keys and values of its last layer of each attention kind (the target's slot
    cache as it is: holes masked, the sliding window applied in real positions), and
  - its input: the target's embedding of the row's last token next to a hidden state: first the
    target's final hidden state that predicted that token, then the assistant's own (projected)
    one from the previous draft,
at the position of the row's last token, which stays put while it drafts (as Transformers'
`Gemma4AssistantCandidateGenerator` runs it, one row at a time). The target keeps that hidden
state per row as it verifies (`CachedModel.keeps_hidden`), so a proposal costs k small forwards
and nothing else: nothing lags, nothing rolls back.
"""
from __future__ import annotations

import torch

from .._compat import gemma4_assistant, modeling
from ..cached_model import CachedModel, window_masks
from ..rows import RowInts
from ..sequences import SequenceBatch
from .base import ContinueDrafting, Drafter, Proposal
from .model import output_vocab_size, sample_drafts


class TargetStatesDrafter(Drafter):
    """A Gemma 4 assistant as a drafter; the loop hands it its target (`follow`)."""

    def __init__(self, model: torch.nn.Module, name: str | None = None):
        if not gemma4_assistant.reads_target_states(model):
            raise TypeError(f"TargetStatesDrafter takes a Gemma 4 assistant, got {type(model).__name__}")
        self.model = model
        self.name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        self.vocab_size = output_vocab_size(model)
        self.target: CachedModel | None = None
        self.forward_count = 0

    def follow(self, target: CachedModel) -> None:
        self.target = target
        target.keeps_hidden = True
        target.trims_window = False      # the assistant reads every slot of the target's layers
        self.sources = gemma4_assistant.kv_sharing_sources(target.model)
        # a sliding layer attends the last window + 1 tokens before the row's last token (whose own
        # K/V the target has not computed), as Transformers' flipped bidirectional window does
        window = modeling.sliding_window(self.model) or modeling.sliding_window(target.model)
        self.window = window + 2 if window else None

    def begin(self, batch, sampler):
        super().begin(batch, sampler)
        self.forward_count = 0

    def propose(self, batch: SequenceBatch, k: int, continue_drafting: ContinueDrafting | None = None) -> Proposal:
        target, rows = self.target, batch.active.tensor
        device = target.device
        if target.last_hidden is None:       # the first step: the target's verification prefills
            n = len(rows)
            return Proposal(batch.tokens.new_zeros(n, k), RowInts.full(n, 0, batch.tokens.device))
        # the target has fed every token but each row's last (its lag is 1): that token's position
        # is the number of real slots, and every real slot is before it
        positions = target.num_real.tensor[:, None]                                   # [n, 1]
        slots = target.slot_mask
        masks = window_masks(self.model, slots, positions, self.window or slots.shape[1] + 1)
        shared_kv = {kind: target.layer_states(index) for kind, index in self.sources.items()}
        embed = target.model.get_input_embeddings()
        hidden = target.last_hidden[:, None]                                   # [n, 1, hidden]

        def advance(token: torch.Tensor) -> torch.Tensor:
            """Feed drafts [n]: the logits of the next position [n, 1, vocab]."""
            nonlocal hidden
            inputs = torch.cat([embed(token.to(device)[:, None]), hidden.to(device)], dim=-1)
            logits, hidden = gemma4_assistant.assistant_step(self.model, inputs, masks, positions, shared_kv)
            self.forward_count += 1
            return logits.float().to(batch.tokens.device)

        first = advance(batch.tokens[rows, batch.active_lengths().tensor - 1])
        return sample_drafts(self.sampler, batch, k, continue_drafting, first, advance)[0]

    def forwards(self):
        return [(self.name, self.forward_count)]

    def models(self):
        return [self.model]
