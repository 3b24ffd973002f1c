"""A model's decoding forward over a static KV cache: compiled once, run at every decoding shape.

One object per model, device and `CompileConfig` compiles the model's whole forward, as
Transformers compiles its plain decoding: one graph, one set of guards and one call a forward.
Two compiled functions share the work:
  - one-token forwards (plain steps, the draft's forwards: the hot path) inline every layer, as
    Transformers' own compiled decoding does;
  - wider ones (verification) run the decoder layers as nested compile regions (`regions.py`):
    inductor compiles one layer and calls it per layer, so their graph compiles about as fast for
    a deep model as for a shallow one. A region's call costs about 0.1 ms a layer on the CPU
    (inductor's Python wrapper of the subgraph): paid once a speculative step, not every token.
Where shapes pad (CUDA) no forward is one token wide: every forward runs the regional function,
and CUDA graphs replay its wrappers' work for free. The rows, the width and the logits kept are
marked dynamic: one graph serves them all, but dynamo specialises sizes 0 and 1, so a size of 1
has a graph of its own. The cache's capacity follows dynamo's automatic rule (a
static-address tensor's sizes are not marked): a grown cache recompiles once, then it is dynamic.

Unpadded, a model's one-token forwards run eager until it has made `HOT_ONE_TOKEN` of them (over
its calls): their inlined graph is the dearest to compile (every layer lowered, as Transformers'
compiled plain decoding compiles), so it is compiled only where it is the hot path: a draft's
forwards, or plain steps while speculation is off. A target's one-token forwards in a speculative
call are rare (a last token, a step with no draft) and stay eager, so a speculative first call
compiles the target's regional graph (one layer lowered) and the draft's, not the target's inlined
one (docs/results.md, "The first compiled call"); the price: a call that goes plain later compiles
that graph then.

Unpadded, a greedy draft step (the catch-up forward of the tokens the draft has not fed, then
k - 1 one-token forwards, each of the last one's argmax) runs as one compiled call (`_draft_step`)
once the model has drafted HOT_DRAFT_STEP steps of that shape: one set of guards and one call for
the step, not one a forward (a compiled call's guards, wrapper and our bookkeeping are most of a
small draft's forward on the CPU). Its forwards are inlined, so each k (and catch-up width, 1 or
2) is a graph of its own that compiles as k one-token graphs: only the shapes a policy keeps
choosing compile one, and not within a first call of a few dozen steps. (Padded, CUDA graphs
replay a forward's wrappers for free.)

Shapes differ by device:
  - CUDA (where `CompileConfig`'s default `mode="reduce-overhead"` runs CUDA graphs): graph trees
    record one CUDA graph per concrete shape, so forwards pad to few: rows to a power of two of at
    least `MIN_ROWS`, widths to `WIDTH_TIERS` (a dummy row, a hole slot: almost free on graphs);
    on an H200 a 7B's compile took ~60 s and a new shape's recording < 0.1 s
    (docs/results/compile_probe/h200.md);
  - elsewhere (the CPU) a padded row or column costs its compute, as an exact one does (a
    [2, 2] plain step cost 2-3x a [1, 1] one in its matrix products here), so no shape is padded.
Forwards wider than every tier (a prefill, a long catch-up) run eager, as Transformers runs its
prefill.

Under CUDA graph trees the next call of a compiled function overwrites the previous call's
outputs: they are copied out at once (`CompiledForwards.__call__`). The first call of a function
(and any call that compiles) is logged at INFO with the graphs it compiled and its seconds.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import types
import weakref
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from . import regions
from ._compat import hub_kernels, modeling
from .tiers import SPEC_TIERS

logger = logging.getLogger(__name__)

# widths a compiled forward takes: k + 1 verified tokens for each tier's k (a one-token step pads
# to k = 1's 2), and 17 for a drafter catching up after speculation was off
WIDTH_TIERS = (*(k + 1 for k in SPEC_TIERS if k), 17)
MIN_ROWS = 2
# one-token forwards a model runs eager before its inlined one-token graph is compiled (unpadded)
HOT_ONE_TOKEN = 32
# draft steps of one shape a model runs one forward at a time before they are compiled as one
# graph (unpadded: `CompiledForwards.draft_step`)
HOT_DRAFT_STEP = 64
# the first calls of a concrete shape: under CUDA graph trees a warm-up run, then the recording
WARMUP_CALLS = 2


def width_tier(width: int) -> int | None:
    """The compiled width a forward of `width` tokens pads to; None: wider than every tier (eager)."""
    return next((w for w in WIDTH_TIERS if w >= width), None)


@dataclass
class WarmupCount:
    """Compiled calls of one generate() call that compiled, or were among the first WARMUP_CALLS
    of their concrete shape (on a GPU: recording; not a steady cost): a step during which it
    moved held one (`StepRecord.warmup`). Per call: another call's compiles are not this one's."""

    calls: int = 0


def pads_shapes(device: torch.device) -> bool:
    """Whether compiled forwards on `device` pad their shapes to few (the module docstring)."""
    return device.type == "cuda"


def rows_bucket(rows: int) -> int:
    """The rows a compiled forward of `rows` real rows runs: a power of two, at least MIN_ROWS."""
    return max(MIN_ROWS, 1 << max(rows - 1, 0).bit_length())


def _forward(model, input_ids, attention_mask, position_ids, cache_position, cache_kwargs, logits_to_keep):
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 cache_position=cache_position, use_cache=True, logits_to_keep=logits_to_keep,
                 **cache_kwargs).logits


class CompiledForwards:
    """One model's whole forward compiled with `compile_config` (Transformers' `CompileConfig`) for
    `device` (forwards wider than one token with its decoder layers as nested compile regions).

    `dynamic`: the config's True makes every size symbolic; otherwise (Transformers' default False,
    or None) the rows, the width and the kept logits are marked dynamic, and other sizes (the
    capacity) follow dynamo's automatic rule: a size that changes is made symbolic at its one
    recompile."""

    def __init__(self, compile_config, device: torch.device):
        self.options = compile_config.to_dict()
        self.options["dynamic"] = True if self.options.get("dynamic") else None
        self.key = (repr(sorted(compile_config.to_dict().items())), str(device))
        self.number = next(_numbers)            # its compiled functions' code names
        self.pads = pads_shapes(device)
        self.functions: dict = {}      # regional?, or ("draft step", forwards) -> compiled function (made at first use)
        self.codes: list[types.CodeType] = []       # their code objects (dynamo keeps graphs per code)
        self.calls: dict[tuple, int] = {}       # concrete shape (and cache address) -> calls so far
        self.eager_one_token = 0                # one-token forwards run eager so far (`runs_compiled`)
        self.draft_steps_asked: dict[tuple, int] = {}   # (width, forwards) -> draft steps so far (`runs_draft_step`)
        self.lock = threading.Lock()            # the model's: shared by its CompiledForwards (compiled_forwards)

    def rows(self, n: int, first: int) -> int:
        """The rows a forward of `n` real rows runs (the rest: dummy rows), in a call that began with
        `first` rows. Unpadded, a call of one row runs one; a batch keeps at least MIN_ROWS as its
        rows finish (one row would compile a graph of its own in the middle of the call)."""
        if self.pads:
            return rows_bucket(n)
        return n if first == 1 else max(n, MIN_ROWS)

    def width(self, width: int) -> int | None:
        """The width a forward of `width` tokens runs; None: wider than every tier (eager)."""
        tier = width_tier(width)
        return tier if tier is None or self.pads else width

    def runs_draft_step(self, width: int, forwards: int) -> bool:
        """Whether a greedy draft step of `forwards` forwards, the first `width` wide, runs as one
        compiled call (`draft_step`): once the model ran HOT_DRAFT_STEP such steps (over its calls:
        each shape is a graph of its own, compiled only for the k a policy keeps choosing)."""
        if self.pads or forwards < 2:
            return False
        shape = (width, forwards)
        asked = self.draft_steps_asked[shape] = self.draft_steps_asked.get(shape, 0) + 1
        return asked > HOT_DRAFT_STEP

    def runs_compiled(self, width: int) -> bool:
        """Whether a forward of `width` tokens runs compiled (else eager); counts the one-token
        forwards run eager until they are hot (the module docstring)."""
        if self.pads or width > 1 or self.eager_one_token >= HOT_ONE_TOKEN:
            return True
        self.eager_one_token += 1
        return False

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask,
                 position_ids: torch.Tensor, cache_position: torch.Tensor, cache_kwargs: dict,
                 cache_address: int, warmups: WarmupCount, columns: slice) -> torch.Tensor:
        """A copy of the logits [rows, columns, vocab] of a forward (inputs already at a compiled
        shape; cache_address: where the cache's tensors are, part of what a graph records;
        warmups: the calling generate() call's count, moved if this call is a warm-up; columns:
        the positions whose logits are wanted, the only ones the head computes)."""
        # attention_mask: the slot mask [rows, slots], or with sliding windows 4-D masks
        # [rows, 1, width, slots] (one, or one per layer kind)
        masks = list(attention_mask.values()) if isinstance(attention_mask, dict) else [attention_mask]
        # the kept columns as indices, not a number (a number would be a constant of the graph);
        # a wide forward keeps at least 2, so it runs the graph of the other wide ones (a size of 1
        # would have a graph of its own: a prefill, a catch-up, would compile once more)
        stop = max(columns.stop, min(2, input_ids.shape[1]))
        start = max(0, min(columns.start, stop - 2))
        keep = torch.arange(start, stop, device=input_ids.device)
        for t in (input_ids, position_ids, *masks):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for t in (input_ids, position_ids):
            torch._dynamo.maybe_mark_dynamic(t, 1)
        for t in masks:
            if t.ndim == 4:
                torch._dynamo.maybe_mark_dynamic(t, 2)
        for t in (cache_position, keep):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        key = (*input_ids.shape, masks[0].shape[-1], len(keep), cache_address)
        regional = input_ids.shape[1] > 1
        logits = self._run(regional, _forward, key, warmups, model, input_ids, attention_mask, position_ids,
                           cache_position, cache_kwargs, keep)
        return logits[:, columns.start - start:columns.stop - start].clone()      # (the next call overwrites a CUDA graph's outputs)

    def draft_step(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor, cache_position: torch.Tensor, after: torch.Tensor,
                   cache_kwargs: dict, forwards: int, cache_address: int, warmups: WarmupCount
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy draft step in one compiled call (`_draft_step`, whose arguments these are).
        Returns its logits [rows, forwards, vocab] and their argmax [rows, forwards] (not copied:
        it runs unpadded only, where no CUDA graph overwrites them)."""
        for t in (input_ids, attention_mask, position_ids, after):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        key = ("draft step", forwards, *input_ids.shape, attention_mask.shape[-1], cache_address)
        return self._run(("draft step", forwards), _draft_step, key, warmups, model, input_ids, attention_mask,
                         position_ids, cache_position, after, cache_kwargs, forwards)

    def _run(self, kind, function, key: tuple, warmups: WarmupCount, model: torch.nn.Module, *args):
        """function(model, *args) compiled, the compiled function of `kind` made at its first use;
        a call at a new shape `key`, or one that compiled, counts in `warmups`."""
        calls = self.calls[key] = self.calls.get(key, 0) + 1
        # one compiled forward of a model at a time: a wide one installs the layers' regions on the
        # shared model, which a one-token trace in another thread would see and guard on
        with self.lock:
            if kind not in self.functions:
                hub_kernels.thread_safe_kernel_funcs()      # other threads decode while this one compiles
                # a fresh code object: dynamo keeps its graphs (and their recompile limit) per code
                # object, and what its automatic-dynamic rule learnt per code name: a name of this
                # object's own, so another model's shapes decide nothing here, shared by its functions
                # of one source, so a function first compiled after the cache grew starts with the
                # capacity dynamic (else it recompiles at the next growth)
                name = f"compiled_{function.__name__.strip('_')}_{self.number}"
                fresh = types.FunctionType(function.__code__.replace(co_name=name), function.__globals__, name)
                self.functions[kind] = torch.compile(fresh, **self.options)
                self.codes.append(fresh.__code__)
            with compile_log(model) as compiled, \
                    regions.layer_regions(model) if kind is True else contextlib.nullcontext():
                out = self.functions[kind](model, *args)
        if calls <= WARMUP_CALLS or compiled["graphs"]:      # (a guard that failed compiles a seen shape anew)
            warmups.calls += 1
        return out


def _draft_step(model, input_ids, attention_mask, position_ids, cache_position, after, cache_kwargs, forwards):
    """A greedy draft step: a forward of input_ids [rows, w] (the catch-up: the tokens not fed yet,
    or the first draft) at position_ids [rows, w] and cache_position [w], over the slot mask
    attention_mask [rows, slots] (their slots marked, the drafts' holes); then forwards - 1
    one-token forwards, each of the last one's argmax, at positions after [rows, 1] on, each
    making its slot real. Returns each forward's last logits [rows, forwards, vocab] and their
    argmax [rows, forwards] (what the next forward was fed)."""
    slot = torch.arange(attention_mask.shape[1], device=input_ids.device)
    first_draft_slot = cache_position[-1:] + 1
    logits, picked = [], []
    for j in range(forwards):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    cache_position=cache_position, use_cache=True, logits_to_keep=1, **cache_kwargs).logits[:, -1]
        input_ids = out.argmax(-1, keepdim=True)
        logits.append(out)
        picked.append(input_ids)
        cache_position, position_ids = first_draft_slot + j, after + j
        attention_mask = attention_mask | (slot == cache_position)[None]
    return torch.stack(logits, 1), torch.cat(picked, 1)


@contextlib.contextmanager
def compile_log(model: torch.nn.Module):
    """Logs (INFO) the graphs a compiled forward of `model` compiled, and how long that took;
    yields a dict whose "graphs" says how many (after the block)."""
    graphs, start, record = counters["stats"]["unique_graphs"], time.perf_counter(), {}
    yield record
    compiled = record["graphs"] = counters["stats"]["unique_graphs"] - graphs
    if compiled:
        logger.info("compiled %d graph(s) of %s's decoding forward in %.1f s", compiled,
                    type(model).__name__, time.perf_counter() - start)


_numbers = itertools.count()     # CompiledForwards made so far (their functions' code names)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> {key: CompiledForwards}
_COMPILED_LOCK = threading.Lock()


def compiled_forwards(model: torch.nn.Module, compile_config) -> CompiledForwards:
    """The model's compiled forward for this config on its device, kept across generate() calls
    (compiling is slow); all of a model's share one lock (`CompiledForwards.lock`)."""
    forwards = CompiledForwards(compile_config, modeling.execution_device(model))
    with _COMPILED_LOCK:
        per_key = _COMPILED.setdefault(model, {})
        if per_key:                     # the model's lock: its first compiled forwards'
            forwards.lock = next(iter(per_key.values())).lock
        return per_key.setdefault(forwards.key, forwards)
