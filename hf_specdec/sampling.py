"""Logits -> scores -> tokens, with the same logits processors for drafters and the target.

Processors get, for position j of row b, the row's buffer prefix `tokens[b, :lengths[b] + j]`
(drafts 1..j are already written there), i.e. exactly the `input_ids` plain `generate()` would
pass at that step. Processors known not to read `input_ids` run once on all positions at once;
the rest run per position, once per distinct prefix length.
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from .rows import RowInts
from .sequences import SequenceBatch

# Processors whose output depends on the scores only (not on input_ids or their length).
_POSITION_FREE = tuple(getattr(lp, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "InfNanRemoveLogitsProcessor",
) if hasattr(lp, name))


# Processors that keep state across calls and assume exactly one call per generated token; our
# calls are per draft position and per prefix length, so their output would silently change.
_STATEFUL = ("UnbatchedClassifierFreeGuidanceLogitsProcessor", "SynthIDTextWatermarkLogitsProcessor")


class TokenSampler:
    """Applies `generate()`'s processors and picks tokens (argmax, or a draw from `generator`)."""

    def __init__(self, logits_processor: LogitsProcessorList | None, do_sample: bool,
                 generator: torch.Generator | None = None, ensemble_weight: float | None = None):
        self.processors = logits_processor or LogitsProcessorList()
        stateful = [type(p).__name__ for p in self.processors if type(p).__name__ in _STATEFUL]
        if stateful:
            raise ValueError(f"logits processors {stateful} keep per-token state and are not supported with "
                             "speculative decoding (e.g. guidance_scale, watermarking_config)")
        self.do_sample = do_sample
        self.generator = generator
        # Transformers' assistant_ensemble_weight: the target verifies against w p + (1 - w) q (lossy)
        self.ensemble_weight = ensemble_weight
        self.keeps_probs = do_sample or ensemble_weight is not None     # drafters hand over q
        self._position_free = all(isinstance(p, _POSITION_FREE) for p in self.processors)
        # its picks are the argmax of the raw logits (what a drafter may pick inside a compiled graph)
        self.picks_argmax = not do_sample and not self.processors and ensemble_weight is None

    def scores(self, batch: SequenceBatch, logits: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """Processed scores for `logits` [n, m, vocab] of the active rows, whose position j
        follows the prefix of length `lengths + offset + j` (offset: an int, or per row [n]).
        Returns [n, m, vocab] float32."""
        if not self.processors:
            return logits
        n, m, vocab = logits.shape
        rows = batch.active.tensor
        if self._position_free:
            dummy = batch.tokens[rows][:, :1].repeat_interleave(m, 0)
            return self.processors(dummy, logits.reshape(n * m, vocab)).view(n, m, vocab)
        out = torch.empty_like(logits)
        lengths = batch.active_lengths()                                             # [n]
        prefix = lengths + offset if isinstance(offset, int) else RowInts(lengths.tensor + offset)
        distinct = set(prefix.tolist())      # the host's copy (read from the device only without one)
        prefix = prefix.tensor
        full = logits.new_zeros(batch.tokens.shape[0], vocab)  # all rows: see below
        for j in range(m):
            for length in sorted(d + j for d in distinct):
                # Processors may keep per-row state indexed by the original batch row (e.g. the
                # prompt length per row), so they always get the full batch in its original
                # order; rows outside the group carry dummy (zero) scores and are ignored. Masks,
                # not index lists, select the group: no further host reads.
                group = (prefix + j == length)[:, None]                        # [n, 1]
                full[rows] = torch.where(group, logits[:, j], 0.0)
                processed = self.processors(batch.tokens[:, :length], full.clone())[rows]
                out[:, j] = torch.where(group, processed, out[:, j])
        return out

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1)

    def pick(self, scores: torch.Tensor) -> torch.Tensor:
        """One token per row from scores [n, vocab] -> [n]."""
        if not self.do_sample:
            return scores.argmax(-1)
        return torch.multinomial(self.probs(scores), 1, generator=self.generator).squeeze(1)
