"""What a Transformers model says about itself (its config's layer kinds and windows, its attention
implementation, its forward's signature, an accelerate hook's device)."""
from __future__ import annotations

import functools
import inspect

import torch

def layer_kinds(model: torch.nn.Module) -> list[tuple[str, int | None]]:
    """Each layer's cache kind ("full_attention", "sliding_attention", "chunked_attention",
    "linear_attention", "conv", ...) and its window (sliding and chunked layers), as Transformers
    builds its caches."""
    from transformers.cache_utils import get_layer_types_and_kwargs
    if model.config.is_encoder_decoder:
        return []
    kinds, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return [(kind, kw.get("sliding_window")) for kind, kw in zip(kinds, kwargs)]


def sliding_window(model: torch.nn.Module) -> int | None:
    """The window (in tokens) of `model`'s sliding-window layers; None if it has none."""
    return max((w for kind, w in layer_kinds(model) if kind == "sliding_attention"), default=None)


def sliding_layers(model: torch.nn.Module) -> set[int]:
    """The indices of `model`'s sliding-window layers (of its cache's layers)."""
    return {i for i, (kind, _) in enumerate(layer_kinds(model)) if kind == "sliding_attention"}


def stateful(model: torch.nn.Module) -> bool:
    """Whether Transformers marks `model` as keeping a recurrent state (`_is_stateful`)."""
    return bool(getattr(model, "_is_stateful", False))


def bidirectional(model: torch.nn.Module) -> bool:
    """An encoder-style model (BERT, RoBERTa, ...) loaded as a causal LM without
    `config.is_decoder=True` attends both ways (Transformers warns at load): verifying k + 1 tokens
    in one forward lets each see the later drafts, which one-token decoding never does."""
    return getattr(model.config, "is_decoder", True) is False and _init_reads_is_decoder(type(model))


@functools.lru_cache(maxsize=None)
def _init_reads_is_decoder(cls) -> bool:
    try:
        return "is_decoder" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False


def attn_implementation(model: torch.nn.Module) -> str:
    """The attention implementation `model` was loaded with ("sdpa", "eager", "flash_attention_2", ...)."""
    return model.config._attn_implementation


def execution_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: an accelerate hook's `execution_device` if it names one (the
    weights may be elsewhere, e.g. offloaded), else the device of its first parameter."""
    hook = getattr(model, "_hf_hook", None)
    for h in getattr(hook, "hooks", (hook,)):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(model.parameters()).device


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters
