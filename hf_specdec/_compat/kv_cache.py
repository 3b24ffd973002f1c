"""Transformers' KV caches (transformers.cache_utils) and the cache kwarg of model forwards: how our
slot caches are built, filled, cropped, compacted and grown per row.

- `DynamicCache(config=...)` builds one layer per decoder layer, `Cache.crop(-n)` drops the last n
  slots of every row, `Cache.batch_select_indices` keeps rows, and a layer's `keys` / `values` are
  [batch, heads, slots, head_dim] tensors.
- The KV cache kwarg: `past_key_values` up to 5.23; 5.24 renamed it `cache` in model forwards and in
  the `model_kwargs` that `generate()` hands a custom decoding loop (the old name still works there
  until 5.40 / 6.0, with a FutureWarning). Every cache kwarg we pass or read goes through
  `cache_kwargs` / `CACHE_KWARG_NAMES`, so the next rename is a change here only.
"""
from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Collection

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin

from .modeling import attn_implementation, bidirectional, layer_kinds, sliding_window, stateful
from .recurrent import StateLayer, _runnable_state_kinds, state_kinds, state_layers

# names under which generate() may hand a custom decoding loop the KV cache, newest first
CACHE_KWARG_NAMES = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def _cache_kwarg_name(model_class: type) -> str:
    # the deprecation decorators keep the wrapped signature (functools.wraps), so this reads the
    # real parameter list; a remote-code model may still use the old name on a new release
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """`{name: cache}` with the KV cache kwarg name that `model.forward` takes."""
    return {_cache_kwarg_name(type(model)): cache}


def cache_from_model_kwargs(model_kwargs: dict):
    """The cache `generate()` put in a custom loop's `model_kwargs` (under either name), or None."""
    return next((model_kwargs[name] for name in CACHE_KWARG_NAMES if model_kwargs.get(name) is not None), None)


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty dynamic KV cache for `model` in which every layer keeps every token: a sliding
    layer's window is applied by the mask (`sliding_window`), so a rejected draft can be masked
    out there too; a recurrent or convolution layer keeps its states per row (`StateLayer`).
    Refuses layer kinds that cannot hold masked slots."""
    _refuse_unsupported(model)
    if not state_kinds(model):
        return DynamicCache() if sliding_window(model) else DynamicCache(config=model.config)
    cache = DynamicCache(config=model.config)
    for i, (kind, _) in enumerate(layer_kinds(model)):
        if kind in state_kinds(model):
            cache.layers[i] = StateLayer(number_of_states=cache.layers[i].number_of_states)
        elif kind == "sliding_attention":
            cache.layers[i] = DynamicLayer()
    return cache


def cache_in_use(cache) -> bool:
    """Whether a cache someone handed us holds anything: K/V slots, or a recurrent layer's states
    (`get_seq_length` refuses a cache of those alone)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return cache.get_seq_length() > 0
    def used(layer) -> bool:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            return any(layer.has_previous_state.values())
        return not isinstance(layer, DummyLayer) and layer.is_initialized and layer.get_seq_length() > 0
    return any(used(layer) for layer in layers)


def new_static_cache(model: torch.nn.Module, capacity: int, ring_layers: Collection[int] = (), ring: int = 0):
    """An empty preallocated KV cache of `capacity` slots per row (Transformers' StaticCache,
    allocated at its first write), every layer a full one (sliding windows: as `new_cache`), but
    the layers of index `ring_layers`, of `ring` slots."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer
    _refuse_unsupported(model)
    config = model.config
    if sliding_window(model):
        config = copy.deepcopy(config.get_text_config(decoder=True))
        config.layer_types = ["full_attention"] * config.num_hidden_layers   # (kv_sharing_modes still apply)
    cache = StaticCache(config=config, max_cache_len=capacity)
    for i in ring_layers:
        cache.layers[i] = StaticLayer(max_cache_len=ring)
    return cache


def unsupported_layers(model: torch.nn.Module) -> str | None:
    """The layers our loop cannot roll back a rejected draft in, named (None: it can run them all):
    recurrent or convolution states, chunked attention, or sliding windows where the attention
    takes no 4-D mask (the window is applied by one) or windows differ between layers."""
    config = getattr(model, "config", None)
    if config is None or config.is_encoder_decoder:
        return None
    if bidirectional(model):
        return "bidirectional attention (is_decoder=False)"
    kinds = layer_kinds(model)
    # "dummy": a layer that reads another layer's K/V (Gemma 4's KV sharing) and keeps none
    other = sorted({kind for kind, _ in kinds} - {"full_attention", "sliding_attention", "dummy"}
                   - _runnable_state_kinds(model))
    if "linear_attention" in other:      # (Mamba's cache layers are linear_attention too)
        return "stateful (linear_attention, not Gated DeltaNet or Mamba-2)"
    if other:
        return f"{other[0]}"
    if stateful(model) and not state_kinds(model):
        return "stateful (recurrent)"
    windows = {w for kind, w in kinds if kind == "sliding_attention"}
    if len(windows) > 1:
        return f"sliding-window (of {len(windows)} sizes)"
    if windows and attn_implementation(model) not in ("sdpa", "eager"):
        return f"sliding-window (attn_implementation={attn_implementation(model)!r})"
    return None


def _refuse_unsupported(model: torch.nn.Module) -> None:
    layers = unsupported_layers(model)
    if layers:
        raise ValueError(f"{type(model).__name__} has {layers} layers; hf_specdec rolls back rejected tokens by "
                         "masking cache slots, which those layers cannot do")


def slot_cache_inputs_missing(model: torch.nn.Module) -> str | None:
    """What our slot caches need that `model.forward` does not take (None: nothing): a KV cache,
    and explicit position ids (holes in a row's slots would otherwise shift its positions)."""
    params = inspect.signature(type(model).forward).parameters
    if not any(name in params for name in CACHE_KWARG_NAMES):
        return "a KV cache"
    if "position_ids" not in params:
        return "position_ids"
    return None


def layer_kv(cache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index`'s keys and values [rows, heads, slots, dim] in `cache` (dynamic or static)."""
    layer = cache.layers[index]
    return layer.keys, layer.values


def static_cache_position(first_slot: int, width: int, device) -> torch.Tensor:
    """The slots [width] a forward writes in a static cache: `first_slot` on. (5.24's StaticLayer
    writes at its own running length, which callers keep equal to first_slot.)"""
    return torch.arange(first_slot, first_slot + width, device=device)


def set_static_tensors(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Point a StaticCache layer at other `keys` / `values` [rows, heads, capacity, dim] (views of
    a larger allocation, or grown ones), of the capacity the layer then holds."""
    layer.keys, layer.values = keys, values
    layer.max_cache_len = keys.shape[2]


def set_static_length(cache, length: int, ring_layers: Collection[int] = (), front: int = 0) -> None:
    """Where the next write of every layer of a StaticCache goes (5.24: `cumulative_length`, a
    0-d tensor per layer), `length - front` in the layers of index `ring_layers`: two ops for all
    layers of a length (foreach), not one per layer."""
    for ring, at in ((False, length), (True, length - front)):
        lengths = [layer.cumulative_length for i, layer in enumerate(cache.layers)
                   if _stores(layer) and (i in ring_layers) == ring]
        if lengths:
            torch._foreach_zero_(lengths)
            torch._foreach_add_(lengths, at)


def _storing(cache) -> list:
    """The layers of `cache` that keep K/V of their own (not a KV-sharing layer's `DummyLayer`, nor
    a recurrent layer's states)."""
    return [layer for layer in cache.layers if _stores(layer)]


def _stores(layer) -> bool:
    return not isinstance(layer, (DummyLayer, StateLayer))


def static_layers(cache) -> list:
    """The initialised layers of a StaticCache: their `keys` / `values` are [n, heads, capacity, dim]."""
    return [layer for layer in _storing(cache) if layer.is_initialized]


def repeat_rows(cache: DynamicCache, times: int) -> None:
    """Every row's slots `times` times over, copies next to each other."""
    cache.batch_repeat_interleave(times)


def crop(cache: DynamicCache, num_slots: int) -> None:
    """Drop the last `num_slots` slots of every row."""
    if num_slots > 0:
        cache.crop(-num_slots)


def drop_front(cache: DynamicCache, num_slots: int, layers: Collection[int] | None = None) -> None:
    """Drop the first `num_slots` slots of every row, in the layers of index `layers` (None: all)."""
    if num_slots > 0:
        for i, layer in enumerate(cache.layers):
            if (layers is None or i in layers) and _stores(layer) and layer.is_initialized and layer.keys.numel():
                layer.keys, layer.values = layer.keys[..., num_slots:, :], layer.values[..., num_slots:, :]


def gather_slots(cache: DynamicCache, order: torch.Tensor, layers: Collection[int]) -> None:
    """The layers of index `layers` keep, in row b, the slots order[b] [rows, slots'] (in that order)."""
    for i in layers:
        layer = cache.layers[i]
        if _stores(layer) and layer.is_initialized:
            layer.keys, layer.values = (t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                                        for t in (layer.keys, layer.values))


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only `rows` (a 1-D index tensor) in the batch dimension."""
    cache.batch_select_indices(rows)


def append_rows(cache: DynamicCache, rows: int, other: DynamicCache, other_rows: int) -> None:
    """Append the `other_rows` rows of `other` to the `rows` rows of `cache` (batch dimension).
    The cache with fewer slots is left-padded with zero slots, which callers mask as holes; a
    cache without slots yet contributes only such padding."""
    for layer, extra in zip(state_layers(cache), state_layers(other)):
        layer.append(extra, rows, other_rows)

    def filled(layer):
        return layer.is_initialized and layer.keys.numel() > 0
    for layer, extra in zip(_storing(cache), _storing(other)):
        parts = [(part, n, filled(part)) for part, n in ((layer, rows), (extra, other_rows))]
        full = [part for part, _, has_slots in parts if has_slots]
        if not full:
            continue
        width = max(part.keys.shape[-2] for part in full)

        def merged(name):
            like = getattr(full[0], name)                                       # [n, heads, slots, dim]
            padded = [torch.nn.functional.pad(t := getattr(part, name), (0, 0, width - t.shape[-2], 0))
                      if has_slots else like.new_zeros(n, like.shape[1], width, like.shape[3])
                      for part, n, has_slots in parts]
            return torch.cat(padded, 0)
        keys, values = merged("keys"), merged("values")
        if not layer.is_initialized:  # the layer's own bookkeeping (device; dtype up to 5.23)
            layer.lazy_initialization(full[0].keys, full[0].values)
        layer.keys, layer.values = keys, values
