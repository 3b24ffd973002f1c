"""Regional compilation: a model's decoder layers all run one compiled function.

A whole-model compile traces and lowers every layer (SmolLM2-135M's 30 on this CPU: about 2 minutes
cold with dynamic rows and width, about 25 s of that tracing). The layers are the same code with
other weights, so here the model's own forward runs as it is and each decoder layer's call goes to
one compiled function per layer class and `CompileConfig`, shared by every model: a draft of the
target's architecture and sizes compiles nothing of its own. What sets layers apart inside the
graph is taken out: each layer gets its StaticCache layer alone (`_compat.LayerCache`, which
ignores the layer index), and rows, width and the cache's capacity are dynamic from the first
compile, so neither a new batch size nor a grown cache recompiles.

Routing uses `Module._compiled_call_impl`, the hook `module.compile()` sets: set on the layers
only while some thread runs a regional forward, and it sends only that thread's calls to the
compiled function; any other call of the layer runs `_call_impl` as before.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
import weakref

import torch

from . import _compat

_routes = threading.local()    # .table: {layer: (compiled function, LayerCache)} of this thread's forward
_lock = threading.Lock()
_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # layer -> regional forwards running it
_functions: dict[tuple, object] = {}        # (CompileConfig key, layer class) -> compiled layer function


def _layer_call(layer, args, kwargs):
    return layer._call_impl(*args, **kwargs)


def layer_function(options: dict, key: str, layer_class: type):
    """The compiled function that runs every layer of `layer_class` for a config (`options`: its
    torch.compile arguments; `key`: the config's identity), made once per process."""
    if (key, layer_class) not in _functions:
        # a fresh code object: dynamo keeps its graphs (and their recompile limit) per code object
        fresh = types.FunctionType(_layer_call.__code__.replace(), _layer_call.__globals__,
                                   f"compiled_{layer_class.__name__}")
        _functions[key, layer_class] = torch.compile(fresh, **options)
    return _functions[key, layer_class]


def _mark_dynamic(args: tuple, kwargs: dict, cache: _compat.LayerCache) -> None:
    """Rows, width and capacity dynamic in a layer's inputs: hidden states and what has their
    [rows, width] (positions, rotary tables), 4-D masks [rows, 1, width, capacity], the cache
    positions [width], and the layer's keys and values [rows, heads, capacity, dim]."""
    tensors = [t for value in (*args, *kwargs.values()) for t in (value if isinstance(value, tuple) else (value,))
               if isinstance(t, torch.Tensor)]
    hidden = kwargs.get("hidden_states", tensors[0] if tensors else None)
    if hidden is None or hidden.ndim != 3:
        return
    rows, width = hidden.shape[:2]
    for t in tensors:
        if t.ndim >= 2 and t.shape[:2] == (rows, width):
            dims = (0, 1)
        elif t.ndim == 4 and t.shape[0] == rows and t.shape[2] == width:
            dims = (0, 2, 3)
        elif t.ndim == 1 and t.shape[0] == width:
            dims = (0,)
        else:
            continue
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
    for t in (cache.layer.keys, cache.layer.values):
        # a row bucket's keys are a view of the allocation: its base's capacity is guarded on too
        for whole in (t, t._base) if t._base is not None else (t,):
            torch._dynamo.maybe_mark_dynamic(whole, 2)


def compiled_by_owner(layer: torch.nn.Module) -> bool:
    """Whether `layer` was compiled by its owner (`module.compile()`), not routed here."""
    impl = layer._compiled_call_impl
    return impl is not None and not (isinstance(impl, functools.partial) and impl.func is _route)


def _route(layer, *args, **kwargs):
    """A decoder layer's call: to the compiled function during this thread's regional forward."""
    table = getattr(_routes, "table", None)
    routed = table.get(layer) if table else None
    if routed is None:
        return layer._call_impl(*args, **kwargs)
    function, layer_cache = routed
    _mark_dynamic(args, kwargs, layer_cache)
    return function(layer, *_compat.with_layer_cache(args, kwargs, layer_cache))


@contextlib.contextmanager
def routed(pairs: list[tuple[torch.nn.Module, object]], cache, options: dict, key: str):
    """While open, this thread's calls of the decoder layers in `pairs` ([(layer, its layer of the
    StaticCache `cache`)], `_compat.decoder_layers`) run the compiled layer function of their class."""
    table = {layer: (layer_function(options, key, type(layer)), _compat.LayerCache(cache, cache_layer))
             for layer, cache_layer in pairs}
    with _lock:
        for layer in table:
            count = _installed.get(layer, 0)
            if not count:
                layer._compiled_call_impl = functools.partial(_route, layer)
            _installed[layer] = count + 1
    outer, _routes.table = getattr(_routes, "table", None), table
    try:
        yield
    finally:
        _routes.table = outer
        with _lock:
            for layer in table:
                _installed[layer] -= 1
                if not _installed[layer]:
                    layer._compiled_call_impl = None
                    del _installed[layer]
