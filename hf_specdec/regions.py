"""A model's decoder layers as nested compile regions of its whole compiled forward.

A whole-forward compile inlines every decoder layer: inductor lowers and compiles each of them
(SmolLM2-135M's 30 on a 2-core CPU: about 3.5 minutes cold). The layers are the same code with
other weights, so while our compiled forward traces, each layer's `forward` is a nested compile
region (`torch.compiler.nested_compile_region`): dynamo traces every layer, finds their graphs the
same and installs one subgraph, which inductor compiles once and calls per layer. The forward
stays one graph: one set of guards and one call a step, as Transformers' own compiled forward.

The region is each layer's own `forward`, set as an instance attribute only while some thread runs
one of our compiled forwards (`layer_regions`): a method bound to the layer, so that dynamo reaches
the layer as the method's `self`, by its module path (`model.layers[i]`), and guards on it and maps
its parameters and cache slots there. (A layer reached any other way, e.g. through a weak reference,
lets torch >= 2.14 reuse layer 0's subgraph with layer 0's inputs for every layer: every layer ran
with layer 0's weights and wrote layer 0's cache.) Dynamo guards on the method's function and
`self`, not on the bound object, so a new one each time recompiles nothing. Outside `torch.compile`
a region is a plain call, so another thread's eager call of a layer meanwhile runs as before. A
layer with a `forward` of its own (an accelerate hook's) is left alone.
"""
from __future__ import annotations

import contextlib
import threading
import types
import weakref

import torch

_lock = threading.Lock()
_running: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # layer -> compiled forwards running it


@torch.compiler.nested_compile_region
def _layer_region(layer: torch.nn.Module, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


def _region_method(self: torch.nn.Module, *args, **kwargs):
    return _layer_region(self, *args, **kwargs)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of `model` (its decoder's one ModuleList of `num_hidden_layers`) whose
    forward is their class's; none where the model has no such list."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    layers = next((m for m in (decoder.children() if decoder is not None else ())
                   if isinstance(m, torch.nn.ModuleList) and len(m) == count), ())
    return [layer for layer in layers if "forward" not in layer.__dict__ or layer in _running]


@contextlib.contextmanager
def layer_regions(model: torch.nn.Module):
    """While open, `model`'s decoder layers are nested compile regions (for every thread; eager
    calls run unchanged)."""
    with _lock:
        layers = _layers(model)
        for layer in layers:
            if layer not in _running:
                # (bound only while open: the layer's own reference to itself ends with the block)
                layer.forward = types.MethodType(_region_method, layer)
            _running[layer] = _running.get(layer, 0) + 1
    try:
        yield
    finally:
        with _lock:
            for layer in layers:
                _running[layer] -= 1
                if not _running[layer]:
                    del _running[layer], layer.forward
