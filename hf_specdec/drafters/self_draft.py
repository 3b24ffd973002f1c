"""Drafters derived from the target itself: a reduced-precision or int8-quantised copy."""
from __future__ import annotations

import copy
import warnings

import torch

from .model import ModelDrafter

KINDS = ("bf16", "fp16", "int8")


def self_draft(model: torch.nn.Module, kind: str = "bf16") -> ModelDrafter:
    """A `ModelDrafter` over a copy of `model`: "bf16"/"fp16" cast, or "int8" dynamic quantisation
    of every `nn.Linear` (CPU only, computed in float32 around int8 weights). The target is left
    untouched."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "int8" and not any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        # quantize_dynamic would return a float copy of the same weights under an int8 name
        raise ValueError(f"kind='int8' quantises the model's torch.nn.Linear layers; this "
                         f"{type(model).__name__} has none (already quantised?)")
    draft = copy.deepcopy(model).eval()
    if kind == "int8":
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("kind='int8' uses torch dynamic quantisation, which runs on CPU only")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecates the quantized-tensor API, not this use
            if next(draft.parameters()).dtype != torch.float32:
                draft = draft.to(torch.float32)
            draft = torch.ao.quantization.quantize_dynamic(draft, {torch.nn.Linear}, dtype=torch.qint8)
    else:
        draft = draft.to(torch.bfloat16 if kind == "bf16" else torch.float16)
    return ModelDrafter(draft, name=f"self-{kind}")
