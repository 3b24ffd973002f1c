"""Transformers' own assisted-generation arguments, run through hf_specdec's batched loop.

    hf_specdec.enable(model)
    model.generate(**inputs, assistant_model=draft)               # any batch size
    model.generate(**inputs, prompt_lookup_num_tokens=3)
    model.generate(**inputs, assistant_model=draft, num_assistant_tokens=5,
                   num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0.0)

Where a setting is read: the call (a keyword or `generation_config=`), else the assistant's
generation config, else the target's. Transformers itself reads num_assistant_tokens,
num_assistant_tokens_schedule and assistant_confidence_threshold from the assistant's config only
(it ignores them on the call); a value given on the call is what the user asked for, so it wins
here. When none of the three is set anywhere, the policy is "auto" (with `assistant_ensemble_weight`,
whose lossy result depends on the draft lengths: Transformers' defaults); when any is, the others
take Transformers' defaults (20 tokens, "constant", threshold 0.4) and the schedule maps as follows:

    constant                         FixedLength(n), or ConfidenceThreshold(threshold, max_len=n)
    heuristic, heuristic_transient   HFHeuristic(n, threshold): +2 after a fully accepted step, else -1
    prompt_lookup_num_tokens=n       PromptLookupDrafter(max_ngram=max_matching_ngram_size or 2), FixedLength(n)

When the assistant's own generation config asks for "heuristic", the length reached is written back
to it after the call, so the next call starts from it, as in Transformers; "heuristic_transient"
starts afresh. A list of assistants is not consulted for settings.
Transformers also re-fits the threshold online when scikit-learn is installed; here it stays fixed.
"""
from __future__ import annotations

import logging

import torch
from transformers import GenerationConfig

from ._compat import gemma4_assistant, generation, kv_cache
from .drafters import Drafter, ModelDrafter, PromptLookupDrafter
from .generate import RIGHT_PADDING, TRANSFORMERS_DRAFTING, UNSUPPORTED_OUTPUTS, right_padded
from .policies import ConfidenceThreshold, FixedLength, HFHeuristic
from .policies.base import non_negative_int, probability

logger = logging.getLogger(__name__)
SCHEDULE_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
LOOKUP_FIELDS = ("prompt_lookup_num_tokens", "max_matching_ngram_size")
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.4}   # Transformers' (GenerationConfig's global defaults)


def wants_assisted(model, kwargs: dict) -> bool:
    """Whether a generate() call asks for Transformers' assisted generation."""
    return kwargs.get("assistant_model") is not None or \
        setting("prompt_lookup_num_tokens", kwargs, kwargs.get("generation_config"), model.generation_config) is not None


# settings of Transformers' assisted generation that only its own loop runs (at batch 1)
TRANSFORMERS_ONLY = TRANSFORMERS_DRAFTING + UNSUPPORTED_OUTPUTS


def transformers_only(model, kwargs: dict) -> str | None:
    """Why Transformers' own assisted loop, not ours, must run this call (a setting or a model our
    loop cannot honour: handing it over is what keeps its result), or None."""
    config = kwargs.get("generation_config")
    for name in TRANSFORMERS_ONLY:
        value = setting(name, kwargs, config, model.generation_config)
        if value not in (None, False):
            return f"{name}={value!r}"
    if kwargs.get("assistant_tokenizer") is not None:
        return "assistant_tokenizer= (a draft with another vocabulary)"
    if (setting("num_beams", kwargs, config, model.generation_config) or 1) > 1:
        return "num_beams > 1"
    if model.config.is_encoder_decoder:
        return f"an encoder-decoder target ({type(model).__name__})"
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and right_padded(mask):   # (Transformers runs it as given)
        return RIGHT_PADDING
    assistant = kwargs.get("assistant_model")
    own_model = isinstance(assistant, torch.nn.Module) and not gemma4_assistant.reads_target_states(assistant)
    for name, one in [("the target", model)] + [("assistant_model", assistant)] * own_model:
        layers = kv_cache.unsupported_layers(one)
        if layers:
            return f"{name} ({type(one).__name__}) has {layers} layers"
        missing = kv_cache.slot_cache_inputs_missing(one)
        if missing:
            return f"{name} ({type(one).__name__}) takes no {missing} argument"
    if gemma4_assistant.reads_target_states(assistant) and _compiles(model, kwargs):
        return (f"assistant_model is a {type(assistant).__name__}, which our loop runs on eager forwards only "
                "(cache_implementation='static' compiles them here)")
    return None


def _compiles(model, kwargs: dict) -> bool:
    """Whether this call would compile the decoding forwards (a static cache where Transformers compiles)."""
    config = kwargs.get("generation_config") or model.generation_config
    if setting("cache_implementation", kwargs, config) != "static":
        return False
    return generation.compile_config(model, config) is not None


def translate(model, kwargs: dict) -> tuple[dict, object]:
    """A generate() call's kwargs with Transformers' assisted arguments replaced by
    `assistant_models=` / `spec_policy=` (those, when given, win). Also returns what to do after
    the call: a callable writing the "heuristic" schedule's length back to the assistant's config
    (when that config asked for it, as Transformers does), else None."""
    kwargs_before, kwargs = kwargs, dict(kwargs)
    assistant = kwargs.pop("assistant_model", None)
    call_config, own = kwargs.get("generation_config"), _config_of(assistant)
    settings = call_settings(model, kwargs, call_config, assistant)
    for name in SCHEDULE_FIELDS + LOOKUP_FIELDS:
        kwargs.pop(name, None)
    after = None
    if "assistant_models" in kwargs:
        ignored = ["assistant_model"] * (assistant is not None) + [n for n in SCHEDULE_FIELDS + LOOKUP_FIELDS
                                                                   if settings[n] is not None]
        if ignored:
            logger.warning("%s ignored: assistant_models= is given (spec_policy= sets the lengths)", ", ".join(ignored))
        return kwargs, None
    # Transformers persists a heuristic length only on an assistant whose own config asks for it
    persists = own is not None and own.num_assistant_tokens_schedule == "heuristic" and \
        setting("num_assistant_tokens_schedule", kwargs_before, call_config) is None
    # lossy ensemble verification's result depends on the draft lengths: Transformers' own, then
    lossy = setting("assistant_ensemble_weight", kwargs, call_config, model.generation_config) is not None
    kwargs["assistant_models"], policy = drafters_and_policy(assistant, settings, lossy)
    if "spec_policy" not in kwargs and policy is not None:
        kwargs["spec_policy"] = policy
        if persists:
            def after():
                own.num_assistant_tokens = policy.k
    return kwargs, after


def drafters_and_policy(assistant, settings: dict, transformers_lengths: bool = False):
    lookup = settings["prompt_lookup_num_tokens"]
    if lookup is not None:
        if assistant is not None:
            raise ValueError("give assistant_model= or prompt_lookup_num_tokens=, not both (Transformers would use "
                             "prompt lookup only); for both, pass assistant_models=[draft, "
                             "hf_specdec.PromptLookupDrafter()]")
        if non_negative_int(lookup, "prompt_lookup_num_tokens") < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {lookup}")
        ngram = settings["max_matching_ngram_size"] or 2
        if non_negative_int(ngram, "max_matching_ngram_size") < 1:
            raise ValueError(f"max_matching_ngram_size must be >= 1, got {ngram}")
        return [PromptLookupDrafter(max_ngram=ngram)], FixedLength(lookup)
    drafters = list(assistant) if isinstance(assistant, (list, tuple)) else [assistant]
    if not drafters:
        raise ValueError("assistant_model is an empty list; give a model, a drafter or a list of them")
    if all(settings[name] is None for name in SCHEDULE_FIELDS) and not transformers_lengths:
        return drafters, None            # nothing configured: the default policy
    n, schedule, threshold = (DEFAULTS[name] if settings[name] is None else settings[name] for name in SCHEDULE_FIELDS)
    if non_negative_int(n, "num_assistant_tokens") < 1:
        raise ValueError(f"num_assistant_tokens must be >= 1, got {n}")
    if schedule not in SCHEDULES:
        raise ValueError(f"num_assistant_tokens_schedule must be one of {SCHEDULES}, got {schedule!r}")
    probability(threshold, "assistant_confidence_threshold")
    if schedule == "constant":
        return drafters, FixedLength(n) if threshold == 0 else ConfidenceThreshold(threshold, max_len=n)
    return drafters, HFHeuristic(n, threshold=threshold)


def call_settings(model, kwargs: dict, call_config: GenerationConfig | None, assistant) -> dict:
    """The call's assisted-generation settings (SCHEDULE_FIELDS, LOOKUP_FIELDS; None: unset): its
    keyword, else `call_config`'s, else the assistant's own generation config's, else the model's."""
    own = _config_of(assistant)
    return {name: setting(name, kwargs, call_config, own, model.generation_config)
            for name in SCHEDULE_FIELDS + LOOKUP_FIELDS}


def setting(name: str, kwargs: dict, *configs):
    """The first value set: the call's keyword, then each config in turn (None: unset)."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    return next((getattr(c, name) for c in configs if c is not None and getattr(c, name, None) is not None), None)


def _config_of(assistant) -> GenerationConfig | None:
    """The generation config of a single assistant (a model or a ModelDrafter); None otherwise."""
    model = assistant.model if isinstance(assistant, ModelDrafter) else assistant
    if isinstance(model, torch.nn.Module) and not isinstance(model, Drafter):
        return getattr(model, "generation_config", None)
    return None
