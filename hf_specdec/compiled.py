"""A model's decoding forward over a static KV cache: compiled once, captured per shape.

On CUDA (where `CompileConfig`'s default `mode="reduce-overhead"` runs CUDA graphs) `torch.compile`
runs one function per model (and config) with the rows and the width of a forward marked dynamic,
so inductor compiles one graph for every decoding shape and CUDA graph trees record one CUDA graph
per concrete shape (vLLM's "compile once, capture per batch size"). On an H200 a 7B's compile took
~60 s and a new shape's recording < 0.1 s (docs/results/compile_probe/h200.md).

Elsewhere (the CPU, any other device) only the decoder layers are compiled, one graph
for every layer of every model of a layer class (`regions.py`): SmolLM2-135M's first speculative
call with a draft on a 2-core CPU took 46 s cold against 210 s compiling whole forwards, and
against 91 s for Transformers' compiled plain first call (docs/results/bench_first_call/).

Dynamo specialises sizes 0 and 1, which would cost a whole compile each; so a compiled forward
is at least `MIN_ROWS` rows and `WIDTH_TIERS[0]` tokens wide (a dummy row, a hole slot: almost
free on graphs). Rows pad to powers of two and widths to `WIDTH_TIERS`, so few shapes are
recorded. Forwards wider than every tier (a prefill, a long catch-up) run eager, as
Transformers runs its prefill.

Under CUDA graph trees the next call of a compiled function overwrites the previous call's
outputs: they are copied out at once (`CompiledForwards.__call__`). The first call of a function
(and any call that compiles) is logged at INFO with the graphs it compiled and its seconds.
"""
from __future__ import annotations

import contextlib
import logging
import time
import types
import weakref
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from . import _compat, regions
from .tiers import SPEC_TIERS

logger = logging.getLogger(__name__)

# widths a compiled forward takes: k + 1 verified tokens for each tier's k (a one-token step pads
# to k = 1's 2), and 17 for a drafter catching up after speculation was off
WIDTH_TIERS = (*(k + 1 for k in SPEC_TIERS if k), 17)
MIN_ROWS = 2
# the first calls of a concrete shape: under CUDA graph trees a warm-up run, then the recording
WARMUP_CALLS = 2


def width_tier(width: int) -> int | None:
    """The compiled width a forward of `width` tokens pads to; None: wider than every tier (eager)."""
    return next((w for w in WIDTH_TIERS if w >= width), None)


@dataclass
class WarmupCount:
    """Compiled calls of one generate() call that were among the first WARMUP_CALLS of their
    concrete shape (on a GPU: compiling or recording, not a steady cost): a step during which it
    moved held one (`StepRecord.warmup`). Per call: another call's compiles are not this one's."""

    calls: int = 0


def rows_bucket(rows: int) -> int:
    """The rows a compiled forward of `rows` real rows runs: a power of two, at least MIN_ROWS."""
    return max(MIN_ROWS, 1 << max(rows - 1, 0).bit_length())


def _forward(model, input_ids, attention_mask, position_ids, cache_position, cache_kwargs, logits_to_keep):
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 cache_position=cache_position, use_cache=True, logits_to_keep=logits_to_keep,
                 **cache_kwargs).logits


class CompiledForwards:
    """One model's forward compiled with `compile_config` (Transformers' `CompileConfig`): on CUDA
    the whole forward, one graph (and with `mode="reduce-overhead"` one CUDA graph per shape);
    elsewhere its decoder layers (`regions.py`), the rest of the forward eager.

    `dynamic`: the config's True makes every size symbolic; otherwise (Transformers' default False,
    or None) the rows and the width are marked dynamic here and other sizes (the cache's capacity)
    follow dynamo's automatic rule: a size that changes is made symbolic at its one recompile
    (regional: the capacity is dynamic from the start)."""

    def __init__(self, compile_config):
        self.options = compile_config.to_dict()
        self.options["dynamic"] = True if self.options.get("dynamic") else None
        self.key = repr(sorted(compile_config.to_dict().items()))
        self.function = self.code = None        # the whole-model function, made at its first call
        self.calls: dict[tuple, int] = {}       # concrete shape (and cache address) -> calls so far

    def layers(self, model: torch.nn.Module, cache) -> list | None:
        """The decoder layers a forward of `model` over `cache` (a StaticCache) compiles, paired with
        their cache layers (`_compat.decoder_layers`), or None: the whole forward compiles (on CUDA,
        where CUDA graphs need it and per-layer guards would cost launch time; where the layers
        are not plain; or where their owner compiled them)."""
        if _compat.execution_device(model).type == "cuda":
            return None
        pairs = _compat.decoder_layers(model, cache)
        return None if pairs is None or any(regions.compiled_by_owner(layer) for layer, _ in pairs) else pairs

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask,
                 position_ids: torch.Tensor, cache_position: torch.Tensor, cache_kwargs: dict,
                 cache_address: int, warmups: WarmupCount, layers: list | None, columns: slice) -> torch.Tensor:
        """A copy of the logits [rows, columns, vocab] of a forward (inputs already padded to a
        compiled shape; cache_address: where the cache's tensors are, part of what a graph records;
        warmups: the calling generate() call's count, moved if this call is a warm-up; layers:
        `self.layers(...)`, whose masks must be 4-D: Transformers' own would be None at times;
        columns: the positions whose logits are wanted, the only ones an eager head computes)."""
        # attention_mask: the slot mask [rows, slots], or with sliding windows 4-D masks
        # [rows, 1, width, slots] (one, or one per layer kind)
        masks = list(attention_mask.values()) if isinstance(attention_mask, dict) else [attention_mask]
        for t in (input_ids, position_ids, *masks):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for t in (input_ids, position_ids):
            torch._dynamo.maybe_mark_dynamic(t, 1)
        for t in masks:
            if t.ndim == 4:
                torch._dynamo.maybe_mark_dynamic(t, 2)
        torch._dynamo.maybe_mark_dynamic(cache_position, 0)
        key = (*input_ids.shape, masks[0].shape[-1], cache_address)
        calls = self.calls[key] = self.calls.get(key, 0) + 1
        if calls <= WARMUP_CALLS:
            warmups.calls += 1
        args = (model, input_ids, attention_mask, position_ids, cache_position, cache_kwargs)
        with compile_log(model, "its decoder layers" if layers else "its whole forward"):
            if layers is None:
                if self.function is None:
                    # a fresh code object: dynamo keeps its graphs (and their recompile limit) per code object
                    fresh = types.FunctionType(_forward.__code__.replace(), _forward.__globals__, "compiled_forward")
                    self.function, self.code = torch.compile(fresh, **self.options), fresh.__code__
                # (a copy: the next call overwrites a CUDA graph's outputs)
                return self.function(*args, input_ids.shape[1])[:, columns].clone()
            # the head runs eager: only the wanted positions (on a CPU it costs like the layers)
            with regions.routed(layers, *cache_kwargs.values(), self.options, self.key):
                return _forward(*args, torch.arange(columns.start, columns.stop, device=input_ids.device))


@contextlib.contextmanager
def compile_log(model: torch.nn.Module, what: str):
    """Logs (INFO) the graphs a compiled forward of `model` compiled, and how long that took."""
    graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
    yield
    compiled = counters["stats"]["unique_graphs"] - graphs
    if compiled:
        logger.info("compiled %d graph(s) of %s's decoding forward (%s) in %.1f s", compiled,
                    type(model).__name__, what, time.perf_counter() - start)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> {options: CompiledForwards}


def compiled_forwards(model: torch.nn.Module, compile_config) -> CompiledForwards:
    """The model's compiled forward for this config, kept across generate() calls (compiling is slow)."""
    per_config = _COMPILED.setdefault(model, {})
    forwards = CompiledForwards(compile_config)
    return per_config.setdefault(forwards.key, forwards)

