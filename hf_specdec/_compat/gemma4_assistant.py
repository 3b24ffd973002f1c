"""Gemma 4 assistants, which draft from the target's own states (its shared K/V and hidden states)."""
from __future__ import annotations


import torch

def reads_target_states(assistant) -> bool:
    """Whether Transformers drafts with `assistant` from the target's own states (Gemma 4
    assistants read its shared K/V), not as a model of its own."""
    return type(assistant).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant"))


def target_states_mismatch(assistant, target) -> str | None:
    """Why a Gemma 4 assistant cannot read `target`'s states (None: it can): it reads hidden
    states of its `backbone_hidden_size` and a Gemma 4 target's per-kind K/V."""
    text = target.config.get_text_config()
    backbone = getattr(assistant.config, "backbone_hidden_size", None)
    if backbone is not None and backbone != text.hidden_size:
        return f"it reads hidden states of size {backbone}, the target's are {text.hidden_size}"
    if not text.model_type.startswith("gemma4"):
        return f"it reads a Gemma 4 target's K/V, the target is {type(target).__name__}"
    return None


def kv_sharing_sources(model: torch.nn.Module) -> dict[str, int]:
    """Per attention kind, the layer whose K/V a Gemma 4 assistant reads (`shared_kv_states`): the
    target's "store" layers (the last of each kind before its KV-sharing layers), else the last
    layer of each kind."""
    config = model.config.get_text_config()
    kinds = config.layer_types
    modes = getattr(config, "kv_sharing_modes", None) or [None] * len(kinds)
    sources = {kind: i for i, (kind, mode) in enumerate(zip(kinds, modes)) if mode == "store"}
    return sources or {kind: i for i, kind in enumerate(kinds)}


def assistant_step(assistant: torch.nn.Module, inputs_embeds: torch.Tensor, masks: dict[str, torch.Tensor],
                   positions: torch.Tensor, shared_kv: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafting step of a Gemma 4 assistant (`Gemma4AssistantForCausalLM` and its unified kind)
    on inputs_embeds [n, 1, 2 x target hidden] (the target's embedding of the last token and its
    hidden state) at positions [n, 1], attending the target's `shared_kv` through our 4-D `masks`
    by layer kind (its own forward builds them from a 2-D padding mask, which cannot mark a slot
    cache's holes). Returns (logits [n, 1, vocab], its next hidden state [n, 1, target hidden])."""
    hidden = assistant.model(inputs_embeds=assistant.pre_projection(inputs_embeds), attention_mask=masks,
                             position_ids=positions, shared_kv_states=shared_kv, use_cache=False).last_hidden_state
    if assistant.config.use_ordered_embeddings:
        logits = assistant.masked_embedding(hidden, assistant.lm_head.weight)
    else:
        logits = assistant.lm_head(hidden)
    return logits, assistant.post_projection(hidden)
