"""`enable(model)`: route `model.generate(..., assistant_models=..., spec_policy=...)` to hf_specdec.

Transformers' own `assistant_model=` / `prompt_lookup_num_tokens=` (and the assisted fields of the
generation config) are mapped onto those first (`assisted.py`), at any batch size; a call with
them that our loop cannot run (`assisted.transformers_only`: recurrent layers we cannot step back, an
encoder-decoder target, Transformers' newer drafting kinds, ...) goes to Transformers' own assisted
generation untouched, with one warning saying why. Calls without any of them go to the original
`generate` untouched. Transformers does not hand
`streamer`, `tokenizer` or `stop_strings` to a `custom_generate` callable, so the wrapper
translates them (streamer -> spec_streamer, stop strings -> a StopStringCriteria).

Continuous batching speculates too (`continuous_batching.py`): `enable` also wraps the instance's
`init_continuous_batching` and `generate_batch`, and a `generate(cache_implementation="paged")`
call goes to Transformers' paged path with its speculation arguments handed to our manager.
"""
from __future__ import annotations

import functools
import gc
import logging
import types
import weakref

import torch

from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from . import assisted, continuous_batching, kept, transformers_loop
from .generate import check_cache_settings, check_decoder_only
from .generate import generate as spec_generate

logger = logging.getLogger(__name__)
_SPEC_KWARGS = ("assistant_models", "spec_policy", "spec_generator", "draft_offload")
_ATTR = "_hf_specdec_originals"      # name -> the instance attribute enable() replaced (None: none)
_LOOP_ATTR = "_hf_specdec_loop"       # which loop enable() routed generate() to
LOOPS = ("hf_specdec", "transformers")


def enable(model, loop: str = "hf_specdec"):
    """Make `model.generate` accept `assistant_models=` / `spec_policy=`, and run Transformers'
    `assistant_model=` / `prompt_lookup_num_tokens=` through the same loop. loop: "hf_specdec" (ours,
    batched) or "transformers" (Transformers' assisted loop, batch 1: encoder-decoder targets,
    output_scores; `transformers_loop.py`). Returns `model`."""
    if not callable(getattr(model, "generate", None)) or not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable(model) takes one Transformers model with generate(), got {type(model).__name__}"
                        + (" (enable each model of a list in turn)" if isinstance(model, (list, tuple)) else ""))
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    if hasattr(model, _ATTR):
        if getattr(model, _LOOP_ATTR, "hf_specdec") != loop:
            raise ValueError(f"{type(model).__name__} is enabled with another loop; disable(model) first")
        return model
    setattr(model, _LOOP_ATTR, loop)
    # instance-level methods (e.g. a custom_generate repo's generate) are kept and restored by disable
    setattr(model, _ATTR, {name: model.__dict__.get(name) for name in _WRAPPED if hasattr(model, name)})
    for name, wrapper in _WRAPPED.items():
        if name in getattr(model, _ATTR):
            _wrap(model, name, wrapper)
    return model


def _wrap(model, name: str, wrapper) -> None:
    """model.<name>(*args, **kwargs) becomes wrapper(model, original, args, kwargs). The wrapper
    holds the model weakly (and the class's function, not a bound method): no reference cycle, so
    a model dropped while enabled is freed without gc.collect()."""
    ref, function, previous = weakref.ref(model), getattr(type(model), name), getattr(model, _ATTR)[name]

    @functools.wraps(function)
    def method(*args, **kwargs):
        target = ref()
        original = previous if previous is not None else types.MethodType(function, target)
        return wrapper(target, original, args, kwargs)

    setattr(model, name, method)


def call(model, original, args: tuple, kwargs: dict):
    """One `generate()` call: speculative through our loop when it names drafters (ours or
    Transformers' arguments), else `original(*args, **kwargs)` untouched."""
    if _paged(model, kwargs):       # Transformers' continuous batching: its drafts come from our manager
        return generate_batch(model, original, args, kwargs)
    after = None
    batched = getattr(model, _LOOP_ATTR, "hf_specdec") == "hf_specdec"
    if assisted.wants_assisted(model, kwargs):      # Transformers' own arguments, batched
        reason = assisted.transformers_only(model, kwargs) if batched else None
        if reason is not None:
            rows = _rows(args, kwargs)
            if rows > 1:       # (Transformers' own loop refuses it too, naming neither)
                raise ValueError(f"{reason}: only Transformers' own assisted generation runs this call, at batch 1; "
                                 f"input_ids has {rows} rows: generate them one at a time")
            logger.warning("hf_specdec: %s; this call runs Transformers' own assisted generation", reason)
            return original(*args, **kwargs)
        kwargs, after = assisted.translate(model, kwargs)
    if not any(kwargs.get(name) is not None for name in _SPEC_KWARGS):
        return original(*args, **kwargs)
    if not batched:
        out = transformers_loop.generate(model, original, args, kwargs)
    else:
        out = original(*args, **_batched_loop_kwargs(model, args, kwargs))
    if after is not None:
        after()
    return out


def _batched_loop_kwargs(model, args: tuple, kwargs: dict) -> dict:
    """The call's kwargs for our loop as Transformers' `custom_generate` callable. What only the
    user's own kwargs show is checked here, before generate() prepares anything (it would run an
    encoder-decoder's encoder, and make a mask from pad ids); the rest, once, in `check_call`."""
    check_decoder_only(model)
    _check_padding(model, args, kwargs)
    config = kwargs.get("generation_config") or model.generation_config
    implementation = kwargs.get("cache_implementation", config.cache_implementation)
    if implementation != "hybrid":       # (generate() unsets "hybrid", a Hub default of sliding-window models)
        check_cache_settings(implementation, kwargs.get("cache_config", getattr(config, "cache_config", None)))
    if kwargs.get("assistant_tokenizer") is not None:
        raise ValueError("assistant_tokenizer= (a draft with another tokenizer) is not supported: drafters share "
                         "the target's vocabulary")
    if kwargs.get("streamer") is not None:
        kwargs["spec_streamer"] = kwargs.pop("streamer")
    stop_strings = kwargs.pop("stop_strings", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings needs tokenizer= as well, as in plain generate()")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
        kwargs["stopping_criteria"] = criteria
    kwargs["custom_generate"] = spec_generate
    return kwargs


def generate_batch(model, original, args: tuple, kwargs: dict):
    """`generate_batch` (or a paged `generate`) with Transformers' speculation arguments:
    `assistant_model=` with its settings (num_assistant_tokens, ...), `prompt_lookup_num_tokens=`,
    `max_matching_ngram_size=`, and our `spec_policy=`, on the call or in its generation config (see
    `continuous_batching.speculation_from`). They go to our continuous batching manager; the call
    is Transformers' own."""
    unsupported = [name for name in _SPEC_KWARGS if name != "spec_policy" and kwargs.get(name) is not None]
    if unsupported:      # (Transformers' continuous batching would drop them silently)
        raise ValueError(f"{', '.join(unsupported)} not supported in continuous batching; give one draft as "
                         "assistant_model= or prompt_lookup_num_tokens=, and spec_policy=")
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None) or model.generation_config
    names = ("assistant_model", "spec_policy") + assisted.SCHEDULE_FIELDS + assisted.LOOKUP_FIELDS
    speculation = continuous_batching.speculation_from(model, config, **{name: kwargs.pop(name) for name in names
                                                                         if name in kwargs})
    if speculation is None:       # (a paged generate() already named its speculation)
        return original(*args, **kwargs)
    with continuous_batching.speculating(speculation):
        return original(*args, **kwargs)


def init_continuous_batching(model, original, args: tuple, kwargs: dict):
    return continuous_batching.init_continuous_batching(model, original, *args, **kwargs)


def _paged(model, kwargs: dict) -> bool:
    config = kwargs.get("generation_config") or model.generation_config
    return kwargs.get("cache_implementation", config.cache_implementation) == "paged"


_WRAPPED = {"generate": call, "generate_batch": generate_batch, "init_continuous_batching": init_continuous_batching}


def disable(model):
    """Undo `enable`: `model.generate` (and the continuous batching entry points) are the originals
    again, and what its calls kept (static caches of every model they ran, learned "auto" policies:
    kept.py) is freed. Returns `model`."""
    kept.forget(model)
    # dynamo's tracing leaves reference cycles holding a compiled call's inputs (a KV cache):
    # collected here, so the storages' memory goes now (not on any call's path)
    gc.collect()
    if not hasattr(model, _ATTR):
        return model
    for name, previous in getattr(model, _ATTR).items():
        if previous is None:
            delattr(model, name)
        else:
            setattr(model, name, previous)
    delattr(model, _ATTR)
    delattr(model, _LOOP_ATTR)
    return model


def _input_ids(args, kwargs):
    return args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))


def _rows(args, kwargs) -> int:
    """The call's batch size (1 where it does not say)."""
    input_ids = _input_ids(args, kwargs)
    return input_ids.shape[0] if getattr(input_ids, "ndim", 0) == 2 else 1


def _check_padding(model, args, kwargs) -> None:
    """Padded batches need an explicit attention mask (generate() would guess one from pad ids)."""
    input_ids = _input_ids(args, kwargs)
    if input_ids is None or getattr(input_ids, "ndim", 0) != 2 or input_ids.shape[0] < 2:
        return
    if kwargs.get("attention_mask") is not None:
        return
    config = kwargs.get("generation_config") or model.generation_config
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    if pad is not None and bool((input_ids == pad).any()):
        raise ValueError("input_ids contain padding (pad_token_id) but no attention_mask was given; pass the "
                         "tokenizer's attention_mask with padded batches")
