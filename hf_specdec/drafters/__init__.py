"""Drafters: anything that proposes draft tokens for the target to verify."""
from __future__ import annotations

import torch

from .._compat import gemma4_assistant
from .base import Drafter, LookupDrafter, Prediction, Proposal
from .datastore import DatastoreDrafter
from .hierarchical import HierarchicalDrafter, LevelStats, chain
from .model import ModelDrafter, output_vocab_size
from .ngram import PromptLookupDrafter
from .self_draft import self_draft
from .target_states import TargetStatesDrafter

__all__ = ["Drafter", "LookupDrafter", "Prediction", "Proposal", "ModelDrafter", "PromptLookupDrafter",
           "DatastoreDrafter", "HierarchicalDrafter", "LevelStats", "chain", "self_draft", "TargetStatesDrafter",
           "as_drafter", "output_vocab_size"]


def as_drafter(obj, index: int = 0, where: str | None = None) -> Drafter:
    """A drafter object as is; a Transformers causal LM wrapped in a `ModelDrafter` (a Gemma 4
    assistant, which drafts from the target's states, in a `TargetStatesDrafter`). where: the
    argument named in errors (default assistant_models[index])."""
    where = where or f"assistant_models[{index}]"
    if isinstance(obj, Drafter):
        return obj
    is_causal_lm = (isinstance(obj, torch.nn.Module) and hasattr(obj, "config")
                    and callable(getattr(obj, "get_output_embeddings", None))
                    and obj.get_output_embeddings() is not None)
    if not is_causal_lm:
        raise TypeError(f"{where} must be one Transformers causal LM or hf_specdec Drafter, got {type(obj).__name__}")
    if obj.config.is_encoder_decoder:
        raise TypeError(f"{where} is an encoder-decoder model; drafters must be decoder-only")
    if gemma4_assistant.reads_target_states(obj):
        return TargetStatesDrafter(obj)
    return ModelDrafter(obj)
