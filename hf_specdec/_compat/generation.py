"""`generate()`'s own pieces: its compile criteria, its prepared pad token, its output class."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

def compile_config(model: torch.nn.Module, generation_config):
    """The `CompileConfig` a static-cache generate() call compiles `model`'s decoding forwards with,
    or None where Transformers would not compile (`_valid_auto_compile_criteria`: CUDA-like devices
    or `compile_config._compile_all_devices`, not `disable_compile`, no quantizer or CPU offload
    that forbids it). Without a user config: Transformers' default with `fullgraph=True`."""
    from transformers import CompileConfig, StaticCache
    probe = StaticCache(config=model.config, max_cache_len=1)
    if not model._valid_auto_compile_criteria({"cache": probe, "past_key_values": probe}, generation_config):
        return None
    return generation_config.compile_config or CompileConfig(fullgraph=True)


def pad_token_id(generation_config) -> int:
    """The pad token generate() prepared for this call (its own fallback to EOS included), else 0."""
    pad = generation_config._pad_token_tensor
    return int(pad) if pad is not None else 0


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the speculation statistics of the call."""

    spec_stats: object | None = None
