"""A model's decoder layers as nested compile regions of its whole compiled forward.

A whole-forward compile inlines every decoder layer: inductor lowers and compiles each of them
(SmolLM2-135M's 30 on a 2-core CPU: about 3.5 minutes cold). The layers are the same code with
other weights, so while our compiled forward traces, each layer's `forward` is a nested compile
region (`torch.compiler.nested_compile_region`): dynamo traces every layer, finds their graphs the
same and installs one subgraph, which inductor compiles once and calls per layer. The forward
stays one graph: one set of guards and one call a step, as Transformers' own compiled forward.

The region is each layer's own `forward`, set as an instance attribute only while some thread runs
one of our compiled forwards (`layer_regions`), as the same object every time (dynamo guards on
it). Outside `torch.compile` a region is a plain call, so another thread's eager call of a layer
meanwhile runs as before. A layer with a `forward` of its own (an accelerate hook's) is left alone.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch

_lock = threading.Lock()
_regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # layer -> its forward as a region
_running: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # layer -> compiled forwards running it


@torch.compiler.nested_compile_region
def _layer_region(layer: torch.nn.Module, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


def _region_of(layer_ref: weakref.ref, *args, **kwargs):
    # (the layer by a weak reference: a region bound to it would keep it, and its model, alive)
    return _layer_region(layer_ref(), *args, **kwargs)


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
                layer.forward = _regions.setdefault(layer, functools.partial(_region_of, weakref.ref(layer)))
            _running[layer] = _running.get(layer, 0) + 1
    try:
        yield
    finally:
        with _lock:
            for layer in layers:
                _running[layer] -= 1
                if not _running[layer]:
                    del _running[layer], layer.forward
