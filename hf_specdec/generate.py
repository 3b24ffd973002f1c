"""`hf_specdec.generate`: speculative decoding as a `custom_generate` callable for Transformers'
`generate()` (batch >= 1). It checks the call's arguments before any work, then runs the
`DecodingLoop` (loop.py) over a `SequenceBatch`.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from . import costmodel, distributed
from ._compat import gemma4_assistant, generation, kv_cache, modeling, recurrent
from .drafters import Drafter, TargetStatesDrafter, as_drafter, output_vocab_size
from .kept import kept_for
from .loop import DecodingLoop
from .offload import DraftOffload, as_offload
from .policies import SpecPolicy, auto_policy, resolve_policy
from .sampling import TokenSampler
from .sequences import SequenceBatch
from .stops import StopJudge, judged_by_tokens
from .vocab import check_same_tokens


UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")
# Transformers' own drafting kinds (its loop, batch 1): with assistant_models= they would be dropped
TRANSFORMERS_DRAFTING = ("speculation_type", "use_mtp", "assistant_early_exit")
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")   # static: every model's KV cache is preallocated
GRAPHABLE_ATTENTION = ("sdpa", "eager")     # attention a compiled static forward can run inside a CUDA graph
# what generate() itself puts in model_kwargs for a decoder-only text model; anything else
# (token_type_ids, pixel_values, ...) would be silently ignored by our forwards, so it is refused
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", *kv_cache.CACHE_KWARG_NAMES}


def generate(model, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList | None = None,
             stopping_criteria: StoppingCriteriaList | None = None,
             generation_config: GenerationConfig | None = None, synced_gpus: bool = False,
             streamer=None, assistant_models=None, spec_policy=None,
             spec_generator: torch.Generator | None = None, spec_streamer=None, draft_offload=None, **model_kwargs):
    """Speculative decoding as `model.generate(custom_generate=hf_specdec.generate, ...)`.

    assistant_models: list of Transformers causal LMs (same vocabulary as `model`) or Drafters.
    spec_policy: SpecPolicy / LengthPolicy / DrafterSelector / a name ("fixed:4", "adaspec", ...) /
        None or "auto" (`hf_specdec.policies.auto_policy`; in this loop one per target and drafters, kept
        across calls in the target's `Kept`, kept.py).
    spec_generator: torch.Generator for every random draw (default: torch's global RNG).
    draft_offload: a `hf_specdec.DraftOffload` (True: one with its defaults) that moves the draft
        models off the accelerator while the policy has speculation off and memory is tight.
    spec_streamer: a streamer (Transformers does not forward `streamer` to custom callables;
        `hf_specdec.enable` maps `streamer=` here for you).
    Returns generate()'s output; `return_dict_in_generate=True` adds `.spec_stats`.
    """
    generation_config = generation_config or model.generation_config
    call = check_call(model, input_ids, logits_processor, stopping_criteria, generation_config, assistant_models,
                      spec_policy, spec_generator, spec_streamer, draft_offload, model_kwargs)
    kept = kept_for(model)
    if call.auto:           # lent for this call: a concurrent one learns its own
        lending = kept.policies.lent(tuple(map(_identity, call.drafters)), lambda: call.policy)
    else:
        lending = contextlib.nullcontext(call.policy)
    with lending as policy:
        return _run(model, input_ids, generation_config, model_kwargs.get("attention_mask"), call, policy, kept)


@dataclass(kw_only=True)
class SpecCall:
    """A generate() call once `check_call` has checked it: what the loop runs, nothing left to check."""

    drafters: list[Drafter]
    policy: SpecPolicy              # (with `auto`, the target's kept one is used if it has one)
    auto: bool                      # spec_policy None or "auto"
    sampler: TokenSampler
    stopping_criteria: StoppingCriteriaList
    offload: DraftOffload | None
    streamer: object | None


def check_call(model, input_ids, logits_processor, stopping_criteria, generation_config: GenerationConfig,
               assistant_models, spec_policy, spec_generator, spec_streamer, draft_offload, model_kwargs: dict) -> SpecCall:
    """Everything a call needs, checked before any work, in one place: a ValueError or TypeError
    naming the argument and what was expected; the models and caches are left as they were."""
    drafters, policy = check_spec_args(model, assistant_models, spec_policy)
    offload = as_offload(draft_offload)
    _check_inputs(model, input_ids, generation_config, model_kwargs)
    if spec_generator is not None and not isinstance(spec_generator, torch.Generator):
        raise TypeError(f"spec_generator must be a torch.Generator or None, got {type(spec_generator).__name__}")
    if spec_streamer is not None and not all(callable(getattr(spec_streamer, m, None)) for m in ("put", "end")):
        raise TypeError(f"streamer must have put() and end() (a transformers streamer), got "
                        f"{type(spec_streamer).__name__}")
    _check_cache(model, drafters, generation_config)
    ensemble_weight = _check_ensemble(generation_config, drafters)
    sampler = TokenSampler(logits_processor, generation_config.do_sample, spec_generator,  # may refuse processors
                           ensemble_weight)
    return SpecCall(drafters=drafters, policy=policy, auto=spec_policy is None or spec_policy == "auto",
                    sampler=sampler, stopping_criteria=stopping_criteria or StoppingCriteriaList(), offload=offload,
                    streamer=spec_streamer)


def _run(model, input_ids, generation_config: GenerationConfig, attention_mask, call: SpecCall, policy: SpecPolicy,
         kept) -> torch.LongTensor:
    """`generate` once checked, with the call's policy (the target's kept "auto" one, lent)."""
    drafters, sampler, stopping_criteria = call.drafters, call.sampler, call.stopping_criteria
    # generate() pads finished rows only when an EOS criterion exists; otherwise rows that a
    # criterion stopped keep producing real tokens until every row has stopped.
    freeze_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    ranks = distributed.ranks_of(model)
    if ranks is not None:        # tensor parallelism: every rank runs rank 0's decisions and draws
        distributed.check(ranks, model, drafters, input_ids, call.offload)
        policy = distributed.RankZeroPolicy(policy, ranks)
        if sampler.do_sample:
            sampler.generator = ranks.shared_generator(sampler.generator, input_ids.device)
        if not judged_by_tokens(stopping_criteria):
            stopping_criteria = StoppingCriteriaList([distributed.RankZeroCriteria(stopping_criteria, ranks)])
    if call.streamer is not None:
        call.streamer.put(input_ids.cpu())  # generate() does this for `streamer=`, which never reaches us

    static = generation_config.cache_implementation == "static"
    batch = SequenceBatch(input_ids, attention_mask, generation_config.max_length,
                          pad_token_id=generation.pad_token_id(generation_config), static_cache=static,
                          compile_config=generation.compile_config(model, generation_config) if static else None,
                          kept=kept)
    ensure_profile(policy, model, drafters, input_ids.shape[0], ranks)
    stops = StopJudge(stopping_criteria, input_ids.shape[0], generation_config.max_length, input_ids.device,
                      freeze_finished)
    loop = DecodingLoop(model, batch, drafters, policy, sampler, stops, call.streamer, call.offload)
    stats = loop.run()
    sequences = batch.output()
    if generation_config.return_dict_in_generate:
        return generation.SpecGenerateOutput(sequences=sequences, spec_stats=stats)
    return sequences


RIGHT_PADDING = "attention_mask has padding after real tokens (right padding); decoder-only generation needs left padding"


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether some row of `attention_mask` [batch, len] has a pad after a real token (one host read)."""
    return bool(_pads_after_real(attention_mask.bool()))


def _pads_after_real(real: torch.Tensor) -> torch.Tensor:
    """[] bool: whether some row of `real` [batch, len] has a pad after a real token."""
    return (real[:, :-1] & ~real[:, 1:]).any()


def _identity(drafter: Drafter):
    """What an "auto" policy learned about: a drafter's models (weakly: a dead model's key never
    equals a new one's), or its kind for one without (a fresh PromptLookupDrafter() per call is the
    same drafter)."""
    models = drafter.models()
    return tuple(map(weakref.ref, models)) if models else type(drafter).__name__


def check_decoder_only(model) -> None:
    """The batched loop's targets are decoder-only (`enable` asks before Transformers runs an encoder)."""
    if model.config.is_encoder_decoder:
        raise ValueError(f"the batched loop runs decoder-only targets; {type(model).__name__} is an encoder-decoder: "
                         "hf_specdec.enable(model, loop='transformers') runs it through Transformers' assisted loop")


def check_spec_args(model, assistant_models, spec_policy) -> tuple[list[Drafter], SpecPolicy]:
    """Validate the target, `assistant_models` and `spec_policy`; (drafters, policy)."""
    check_decoder_only(model)
    drafters = _check_drafters(model, assistant_models)
    if spec_policy is None or spec_policy == "auto":        # (generate() uses the target's kept one)
        policy = auto_policy(len(drafters), all(d.scorable for d in drafters))
    else:
        policy = resolve_policy(spec_policy)
    measured = getattr(policy.length, "profile", None)
    if measured is not None and not policy.length.profile_attached and \
            measured.meta.get("target") not in (None, costmodel.model_key(model)):
        raise ValueError(f"{policy.length!r} holds a cost profile measured on {measured.meta['target']!r}, not on "
                         f"this target ({costmodel.model_key(model)!r}); profile this target (python -m hf_specdec "
                         "profile) or give the policy no profile to have it measured")
    if policy.selector.wants_feedback(0) or policy.selector.prompt_positions:
        blind = [i for i, d in enumerate(drafters) if not d.scorable]
        if blind:
            raise ValueError(f"{policy.selector!r} scores every drafter, but assistant_models{blind} do not "
                             "implement Drafter.replay (Drafter.scorable); use a selector without full-information "
                             "feedback")
    return drafters, policy


def ensure_profile(policy: SpecPolicy, model, drafters: list[Drafter], batch_size: int,
                   ranks: distributed.Ranks | None = None) -> None:
    """A length policy made without a cost profile (AdaSpec(), DSDGoodput(), "adaspec") gets the
    cached one of this target and its costliest draft model, measured now if never before; one
    attached so earlier is replaced when the target or the batch outgrows it. ranks: a
    tensor-parallel target's (the profile is rank 0's)."""
    length = policy.length
    if getattr(length, "use_profile", None) is None:
        return
    have = length.profile
    if have is not None and (not length.profile_attached or (have.meta.get("target") == costmodel.model_key(model)
                                                             and batch_size <= max(have.meta["batch_sizes"]))):
        return
    models = [m for d in drafters for m in d.models()]
    draft = max(models, key=lambda m: sum(p.numel() for p in m.parameters())) if models else None
    length.use_profile(costmodel.cached_profile(model, draft, batch_size, ranks=ranks), attached=True)


def _check_drafters(model, assistant_models) -> list[Drafter]:
    if assistant_models is None:
        raise ValueError("assistant_models is required: a non-empty list of causal LMs or hf_specdec drafters")
    if isinstance(assistant_models, (torch.nn.Module, Drafter)):
        raise TypeError("assistant_models must be a list, e.g. assistant_models=[draft_model]")
    if not isinstance(assistant_models, (list, tuple)):
        raise TypeError(f"assistant_models must be a list of causal LMs or drafters, got {type(assistant_models).__name__}")
    if not assistant_models:
        raise ValueError("assistant_models is empty: give at least one causal LM or drafter")
    drafters = [as_drafter(obj, i) for i, obj in enumerate(assistant_models)]
    target_vocab = output_vocab_size(model)
    for i, drafter in enumerate(drafters):
        mismatch = gemma4_assistant.target_states_mismatch(drafter.model, model) if isinstance(drafter, TargetStatesDrafter) \
            else None
        if mismatch:
            raise ValueError(f"assistant_models[{i}] ({type(drafter.model).__name__}) drafts from its target's "
                             f"states, but {mismatch}")
        if any(p.is_meta for m in drafter.models() for p in m.parameters()):
            raise ValueError(f"assistant_models[{i}] has parameters on the meta device (not loaded): load its "
                             "weights first")
        if drafter.vocab_size is not None and drafter.vocab_size != target_vocab:
            raise ValueError(f"assistant_models[{i}] has vocabulary size {drafter.vocab_size} but the target has "
                             f"{target_vocab}; drafters must share the target's vocabulary")
        for draft in drafter.models():
            check_same_tokens(model, draft, f"assistant_models[{i}]")
    return drafters


def check_cache_settings(cache_implementation, cache_config) -> None:
    """The cache a call asks for, as generate()'s arguments or generation config name it: one that
    hf_specdec makes itself (`enable` checks it before generate() prepares any cache: an offloaded
    one opens an accelerator stream)."""
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation={cache_implementation!r} is not supported with "
                         f"speculative decoding; use one of {CACHE_IMPLEMENTATIONS}")
    if cache_config:
        raise ValueError(f"cache_config={cache_config!r} is not supported with speculative "
                         "decoding: hf_specdec sizes every model's cache from max_length itself")


def _check_cache(model, drafters: list[Drafter], generation_config: GenerationConfig) -> None:
    """What the cache settings ask for, checked before any work: each model must be able to hold it."""
    check_cache_settings(generation_config.cache_implementation, generation_config.cache_config)
    static = generation_config.cache_implementation == "static"
    compiling = static and generation.compile_config(model, generation_config) is not None
    reading = [i for i, d in enumerate(drafters) if isinstance(d, TargetStatesDrafter)]
    if compiling and reading:
        raise ValueError(f"assistant_models{reading} draft from the target's states, which hf_specdec reads from eager "
                         "forwards only; cache_implementation='static' compiles them here: use the default cache")
    for name, one in [("the target", model)] + [(f"assistant_models[{i}]", m) for i, d in enumerate(drafters)
                                                 for m in d.models()]:
        layers = kv_cache.unsupported_layers(one)
        if layers:
            raise ValueError(f"{name} ({type(one).__name__}) has {layers} layers, in which hf_specdec cannot roll "
                             "back a rejected draft (it masks cache slots); with enable(model), assistant_model= "
                             "runs it in Transformers' own assisted generation (batch 1)")
        kinds = recurrent.state_kinds(one)
        if static and kinds:
            raise ValueError(f"{name} ({type(one).__name__}) has {sorted(kinds)[0]} layers, whose states hf_specdec keeps "
                             "per row on the default cache only; cache_implementation='static' is not supported with it")
        attention = modeling.attn_implementation(one)
        if compiling and attention not in GRAPHABLE_ATTENTION:
            raise ValueError(f"cache_implementation='static' compiles every model's decoding forward into CUDA graphs, "
                             f"which {name}'s attn_implementation={attention!r} cannot be captured in (it reads the "
                             f"device); load it with attn_implementation='sdpa' (or one of {GRAPHABLE_ATTENTION}), or "
                             "use the default cache")


def _check_ensemble(generation_config: GenerationConfig, drafters: list[Drafter]) -> float | None:
    """Transformers' `assistant_ensemble_weight` (lossy ensemble verification), checked: in (0, 1],
    with drafters that have a distribution (Transformers refuses prompt lookup with it too)."""
    weight = getattr(generation_config, "assistant_ensemble_weight", None)
    if weight is None:
        return None
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1:
        raise ValueError(f"assistant_ensemble_weight must be a number in (0, 1], got {weight!r}")
    pointwise = [i for i, d in enumerate(drafters) if not d.models()]
    if pointwise:
        raise ValueError(f"assistant_ensemble_weight needs drafters with a distribution (models); "
                         f"assistant_models{pointwise} propose tokens without one (prompt lookup, a datastore)")
    return float(weight)


def _check_inputs(model, input_ids, generation_config: GenerationConfig, model_kwargs: dict) -> None:
    if generation_config.num_beams > 1:
        raise ValueError(f"beam search (num_beams={generation_config.num_beams}) is not supported with "
                         "speculative decoding; use num_beams=1")
    for flag in UNSUPPORTED_OUTPUTS:
        if getattr(generation_config, flag, False):
            raise ValueError(f"{flag}=True is not supported with speculative decoding yet")
    for name in TRANSFORMERS_DRAFTING:
        if getattr(generation_config, name, None) not in (None, False):
            raise ValueError(f"{name}={getattr(generation_config, name)!r} is Transformers' own drafting, which "
                             "hf_specdec's loop does not run; without assistant_models= (and with "
                             "hf_specdec.enable(model), without spec_policy=) Transformers runs it")
    unknown = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS and v is not None)
    if unknown:
        raise ValueError(f"model inputs {unknown} are not supported with speculative decoding; "
                         "pass input_ids and attention_mask only")
    cache = kv_cache.cache_from_model_kwargs(model_kwargs)
    if cache is not None and kv_cache.cache_in_use(cache):
        raise ValueError("a KV cache with content (cache= / past_key_values=) is not supported: hf_specdec "
                         "builds its own caches")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq_len] with seq_len >= 1, got shape {tuple(input_ids.shape)}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape):
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    # one host read for all of it: the ids' range, right padding, rows without a real token
    low, high, right, empty = torch.stack([input_ids.min(), input_ids.max(), _pads_after_real(real).long(),
                                           (~real.any(1)).any().long()]).tolist()
    vocab = model.get_input_embeddings().weight.shape[0]
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab}) (the target's embeddings), got values "
                         f"from {low} to {high}")
    if right:
        raise ValueError(RIGHT_PADDING + ": tokenizer(..., padding_side='left')")
    if empty:
        empty = (~real.any(1)).nonzero().flatten().tolist()
        raise ValueError(f"attention_mask rows {empty} have no real token: every row needs a prompt")
