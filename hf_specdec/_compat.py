"""The only module that touches Transformers internals (cache layout, output classes).

Checked against transformers 5.x: `DynamicCache(config=...)` builds one layer per decoder layer,
`Cache.crop(-n)` drops the last n slots of every row, `Cache.batch_select_indices` keeps rows, and
a layer's `keys` / `values` are [batch, heads, slots, head_dim] tensors.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

_MAJOR = int(transformers.__version__.split(".")[0])
if _MAJOR != 5:  # pragma: no cover - guarded at import so a mismatch fails loudly, not subtly
    raise ImportError(f"hf_specdec needs transformers 5.x, found {transformers.__version__}")


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty dynamic KV cache for `model`; refuses layer types that cannot hold masked slots."""
    cache = DynamicCache(config=model.config)
    if any(cache.is_sliding) or any(getattr(cache, "is_linear", [])):
        raise ValueError(
            f"{type(model).__name__} uses sliding-window or linear attention layers; hf_specdec rolls "
            "back rejected tokens by masking cache slots, which those layers cannot do"
        )
    return cache


def crop(cache: DynamicCache, num_slots: int) -> None:
    """Drop the last `num_slots` slots of every row."""
    if num_slots > 0:
        cache.crop(-num_slots)


def drop_front(cache: DynamicCache, num_slots: int) -> None:
    """Drop the first `num_slots` slots of every row."""
    if num_slots > 0:
        for layer in cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys, layer.values = layer.keys[..., num_slots:, :], layer.values[..., num_slots:, :]


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only `rows` (a 1-D index tensor) in the batch dimension."""
    cache.batch_select_indices(rows)


def append_rows(cache: DynamicCache, rows: int, other: DynamicCache, other_rows: int) -> None:
    """Append the `other_rows` rows of `other` to the `rows` rows of `cache` (batch dimension).
    The cache with fewer slots is left-padded with zero slots, which callers mask as holes; a
    cache without slots yet contributes only such padding."""
    def filled(layer):
        return layer.is_initialized and layer.keys.numel() > 0
    for layer, extra in zip(cache.layers, other.layers):
        parts = [(layer, rows), (extra, other_rows)]
        full = [part for part, _ in parts if filled(part)]
        if not full:
            continue
        width = max(part.keys.shape[-2] for part in full)
        for name in ("keys", "values"):
            like = getattr(full[0], name)                                      # [n, heads, slots, dim]
            tensors = [getattr(part, name) if filled(part) else like.new_zeros(n, like.shape[1], 0, like.shape[3])
                       for part, n in parts]
            setattr(layer, name, torch.cat([torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))
                                            for t in tensors], 0))
        layer.dtype, layer.device, layer.is_initialized = full[0].dtype, full[0].device, True


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


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the speculation statistics of the call."""

    spec_stats: object | None = None
