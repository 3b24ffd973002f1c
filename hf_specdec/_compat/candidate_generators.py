"""Transformers' own assisted loop and its candidate generators (hf_specdec.transformers_loop).

`generate()` builds its candidate generator in `_get_candidate_generator` (private) and runs it in
`_assisted_decoding`; AssistedCandidateGenerator drafts `num_assistant_tokens` and stops early
below `assistant_confidence_threshold`, PromptLookupCandidateGenerator drafts `num_output_tokens`.
"""
from __future__ import annotations

import copy
import functools
import inspect

import transformers
from transformers.generation.candidate_generator import (AssistedCandidateGenerator,  # noqa: F401 (CandidateGenerator: ours subclass it)
                                                         CandidateGenerator, PromptLookupCandidateGenerator)


def own_candidate_generator(model, call: dict, assistant=None, lookup_tokens: int | None = None, ngram: int = 2,
                            threshold: float = 0.0):
    """What Transformers would build for this call with `assistant` (a model), or with prompt
    lookup drafting up to `lookup_tokens` from n-grams up to `ngram`. `call`: the keyword
    arguments `generate()` passed to `_get_candidate_generator`. Its own schedule is switched off
    (the caller sets the length every step, `set_candidate_length`); a model assistant stops
    drafting below `threshold` (0: never)."""
    config = copy.deepcopy(call["generation_config"])
    config.prompt_lookup_num_tokens, config.max_matching_ngram_size = lookup_tokens, ngram
    generator = type(model)._get_candidate_generator(model, **{**call, "generation_config": config,
                                                              "assistant_model": assistant})
    if isinstance(generator, AssistedCandidateGenerator):
        generator.assistant_generation_config.num_assistant_tokens_schedule = "constant"
        generator.assistant_generation_config.assistant_confidence_threshold = threshold
        generator.generation_config.assistant_confidence_threshold = threshold
    elif not isinstance(generator, PromptLookupCandidateGenerator):
        raise ValueError(f"Transformers built a {type(generator).__name__} for this drafter; hf_specdec drives "
                         "AssistedCandidateGenerator and PromptLookupCandidateGenerator only")
    return generator


def sync_candidate_generator(generator, length: int) -> None:
    """Bring a model assistant's mask and positions to a sequence of `length` tokens before it
    drafts. Transformers' own loop asks its generator every step, from the prompt on, and the
    generator extends them only once it holds a cache; ours skips it on plain steps (k = 0) and
    for drafters the policy did not pick, so it may first draft, or draft again, further on."""
    if isinstance(generator, AssistedCandidateGenerator):
        from transformers.generation.candidate_generator import _prepare_attention_mask, _prepare_position_ids
        encoder_decoder = generator.assistant_model.config.is_encoder_decoder
        generator.assistant_kwargs = _prepare_attention_mask(generator.assistant_kwargs, length, encoder_decoder)
        generator.assistant_kwargs = _prepare_position_ids(generator.assistant_kwargs, length, encoder_decoder)


def set_candidate_length(generator, k: int) -> None:
    if isinstance(generator, PromptLookupCandidateGenerator):
        generator.num_output_tokens = k
    else:
        generator.num_assistant_tokens = k


@functools.lru_cache(maxsize=None)
def _candidate_generator_params() -> tuple[str, ...]:
    return tuple(inspect.signature(transformers.GenerationMixin._get_candidate_generator).parameters)[1:]


def run_with_candidate_generator(model, build, generate, *args, **kwargs):
    """`generate(*args, **kwargs)` (an assisted call) with `build(call)` as its candidate generator,
    where `call` holds the arguments generate() passes to `_get_candidate_generator`."""
    def get_candidate_generator(*a, **kw):
        return build(dict(zip(_candidate_generator_params(), a), **kw))
    previous = model.__dict__.get("_get_candidate_generator")
    model._get_candidate_generator = get_candidate_generator      # this call only
    try:
        return generate(*args, **kwargs)
    finally:
        if previous is None:
            del model._get_candidate_generator
        else:
            model._get_candidate_generator = previous
