"""A model's forward over a static KV cache, compiled once per shape and switched by reference.

`torch.compile` with `dynamic=False` specialises a graph to its input shapes; on a CUDA device
`mode="reduce-overhead"` then replays it as a CUDA graph. A speculative loop meets a few shapes:
(rows, width) with rows a power-of-two bucket of the batch and width one of `WIDTH_TIERS`
(k + 1 verified tokens for the draft-length tiers, a drafter's one-token steps and short
catch-ups). Each shape gets its own compiled function (a fresh code object, hence its own dynamo
cache): no shape evicts or re-guards another, as SGLang keeps one captured graph per tier.
Wider forwards (prefill, a long catch-up) run eager, as Transformers runs its prefill.
"""
from __future__ import annotations

import types
import weakref

import torch

from .policies.base import SPEC_TIERS

# widths a compiled forward takes: k + 1 for the draft-length tiers k in SPEC_TIERS, and 17 for a
# drafter catching up after speculation was off; a width in between is padded up
WIDTH_TIERS = tuple(k + 1 for k in SPEC_TIERS) + (17,)


def width_tier(width: int) -> int | None:
    """The compiled width a forward of `width` tokens pads to; None: wider than every tier (eager)."""
    return next((w for w in WIDTH_TIERS if w >= width), None)


def rows_bucket(rows: int) -> int:
    """The power of two a batch of `rows` pads to (finished rows leave when it drops a bucket)."""
    return 1 << max(rows - 1, 0).bit_length()


def _forward(model, input_ids, attention_mask, position_ids, cache_position, cache_kwargs):
    # everything a decoding step varies is a tensor of fixed shape: one graph per shape
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 cache_position=cache_position, use_cache=True, logits_to_keep=input_ids.shape[1],
                 **cache_kwargs).logits


class CompiledForwards:
    """A model's forward compiled with `compile_config` (Transformers' `CompileConfig`), one compiled
    function per (rows, width, capacity)."""

    def __init__(self, compile_config):
        self.options = {**compile_config.to_dict(), "dynamic": False}
        self.functions: dict[tuple[int, int, int], callable] = {}

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, cache_position: torch.Tensor, cache_kwargs: dict) -> torch.Tensor:
        """Logits [rows, width, vocab] of a forward at a tier shape (inputs already padded to it)."""
        key = (*input_ids.shape, attention_mask.shape[1])
        function = self.functions.get(key)
        if function is None:
            name = f"forward_{'x'.join(map(str, key))}"
            fresh = types.FunctionType(_forward.__code__.replace(), _forward.__globals__, name)
            function = self.functions[key] = torch.compile(fresh, **self.options)
        return function(model, input_ids, attention_mask, position_ids, cache_position, cache_kwargs)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> {options: CompiledForwards}


def compiled_forwards(model: torch.nn.Module, compile_config) -> CompiledForwards:
    """The model's compiled forwards for this config, kept across generate() calls (compiling is slow)."""
    per_config = _COMPILED.setdefault(model, {})
    key = repr(sorted(compile_config.to_dict().items()))
    if key not in per_config:
        per_config[key] = CompiledForwards(compile_config)
    return per_config[key]
