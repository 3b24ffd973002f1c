"""Transformers' continuous batching (transformers/generation/continuous_batching/, the same in 5.24
and 5.25): the one seam hf_specdec's speculating batch processor composes on. Every read or write
of its internals is a function here.

Where Transformers' manager offers no seam:
- its batch processor: the manager builds it in `_create_batch_processor` and calls its
  `_generation_step(model)`, `prepare_next_batch()` and `update_batch()`; `ComposingManager`
  hands the processor it built to `compose`, and what that returns is the manager's processor.
- its class: `init_continuous_batching` builds a `ContinuousBatchingManager` by name; `adopt`
  makes the manager it built (before it starts) an instance of a subclass.

Where Transformers' processor offers no seam for a step of speculation:
- a forward's logits: `ContinuousBatchingIOs.get_model_kwargs` gives one logit row per request and
  `ModelRunner._forward_process_and_sample` processes and samples them in one method. `forward`
  runs `_generation_step`'s three calls with the logit rows widened and the pick replaced.
- a request's query: the scheduler takes `tokens_to_process` as the query of a decoding request
  (`set_query` puts the drafts there) and one logit row per request of the batch
  (`limit_requests` leaves rows for the drafts).
- a step's result: `update_batch` takes one token per request; the accepted drafts are appended
  before it (`append_tokens`, which never finishes a request) and the request's position steps
  back over the rejected ones (`keep_query_prefix`).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import (ContinuousBatchingManager,
                                                                        ContinuousBatchProcessor)
from transformers.generation.continuous_batching.requests import RequestStatus


# --- the processor ------------------------------------------------------------------------------
def step(processor, model) -> None:
    """Transformers' own step of its processor: forward, processors, sampler."""
    processor._generation_step(model)


def samples(processor) -> bool:
    """Whether the processor samples (else: argmax)."""
    return processor.do_sample


def returns_logprobs(processor) -> bool:
    return processor.return_logprobs


def processors(processor):
    """The processor's `ContinuousBatchingLogitsProcessorList` (what its step runs on the logits)."""
    return processor.logit_processor


def paged_cache(processor):
    return processor.cache


# --- requests -----------------------------------------------------------------------------------
def decoding_requests(processor) -> list:
    """The request states of a batch processor that decode (their prefill done)."""
    return [state for state in processor.scheduler.active_requests.values()
            if state.status == RequestStatus.DECODING and state.generated_tokens]


def prompt_waiting(processor) -> bool:
    """Whether the scheduler holds a prompt still to prefill that it may schedule next: a request
    mid-prefill, or a waiting one while new requests are admitted and the cache is above the
    scheduler's safety margin (below it, decoding requests have the cache to themselves)."""
    scheduler = processor.scheduler
    if any(state.status in (RequestStatus.PENDING, RequestStatus.PREFILLING) for state in scheduler.active_requests.values()):
        return True
    return bool(scheduler.waiting_requests) and not scheduler.block_new_requests and \
        processor.cache.compute_free_capacity() >= scheduler.safety_margin


def request_id(state) -> str:
    return state.request_id


def request_tokens(state) -> tuple[list[int], list[int]]:
    """A request's (prompt, generated tokens)."""
    return state.initial_tokens, state.generated_tokens


def room(state) -> float:
    """How many tokens a request may still emit (inf: no limit)."""
    return math.inf if state.max_new_tokens is None else state.max_new_tokens - state.generated_len()


def set_query(state, drafts: list[int]) -> None:
    """A decoding request's next query: its pending token, then `drafts`."""
    state.tokens_to_process = [state.generated_tokens[-1], *drafts]


def request_limit(processor) -> int:
    """How many requests a step may hold: Transformers reserves a logit row for each."""
    return processor.cb_config.max_requests_per_batch


def limit_requests(processor, n: int) -> None:
    """The next step schedules at most n requests."""
    processor.scheduler.max_requests_per_batch = n


def stops(state, token: int) -> bool:
    """Whether `token` ends the request (one of its EOS tokens)."""
    return token in state._eos_token_ids


def append_tokens(state, tokens: list[int], logprobs: list[float] | None) -> None:
    """Append tokens that do not end the request (`stops` is False for each, and the request has room
    for one more after them), as Transformers appends a step's token."""
    for j, token in enumerate(tokens):
        finished = state.update_and_check_completion(token, None if logprobs is None else logprobs[j])
        assert not finished, "append_tokens: a token that ends the request"


# --- the scheduled batch ------------------------------------------------------------------------
def scheduled(processor) -> list:
    """The step's scheduled requests (`FutureRequestState`s), in the order of the packed forward."""
    return processor.inputs_and_outputs.requests_in_batch


def query(future) -> tuple[object, int]:
    """A scheduled request's state and its query's length this step."""
    return future.state, future.query_length


def has_new_token(future) -> bool:
    return future.has_new_token


def whole_query(future) -> None:
    """The step verifies the request's whole query (its pending token and the drafts a token budget
    left): nothing of it is left to prefill, and its last position gives a token."""
    future.state.remaining_prefill_tokens = []
    future.has_new_token = True


def keep_query_prefix(cache, future, kept: int) -> None:
    """The request keeps the first `kept` tokens of its query in the paged cache: its position steps
    back over the rest (the next forward writes their slots), and only blocks its kept tokens
    complete are hashed for prefix sharing."""
    state = future.state
    if kept == future.query_length:
        return
    state.position_offset -= future.query_length
    future.complete_blocks = cache.count_new_complete_blocks(state, kept)
    state.position_offset += kept


def widen_logits(processor, requests: list, rows: list[int]) -> None:
    """The step's logit rows: positions `rows` of the packed forward, with the per-request processors'
    arguments of `requests` (the request of each row)."""
    ios = processor.inputs_and_outputs
    bulk = ios._bulk_input_tensor           # row 3: logits_indices; from `static_inputs` on: the arguments
    bulk[3, :len(rows)] = torch.tensor(rows, dtype=bulk.dtype)
    processor.logit_processor.prepare_tensor_args(_scheduled([f.state for f in requests]), bulk[ios.static_inputs:])


def forward(processor, model, rows: int, pick) -> None:
    """Transformers' `_generation_step` over `rows` logit rows (`widen_logits`), whose tokens come from
    `pick(scores [1, rows, vocab] processed, output_ids)` in place of its sampler."""
    ios, runner = processor.inputs_and_outputs, processor.model_runner
    batch_data = ios.get_model_kwargs(use_padding=False)
    bulk = ios._bulk_input_tensor
    batch_data["logits_indices"], batch_data["logits_processor_args"] = bulk[3, :rows], bulk[ios.static_inputs:, :rows]
    runner._sample = pick
    try:
        runner.compute_batch(model, batch_data)
    finally:
        del runner._sample
    ios.retrieve_device_outputs()


# --- per-request sampling, for a drafter --------------------------------------------------------
def request_arguments(processors, states: list) -> torch.Tensor:
    """The per-request processors' arguments [processors, n] (int32 storage) of requests `states`,
    as Transformers prepares them for a step ([0, n] without per-request processors)."""
    storage = torch.zeros(processors.tensors_required, len(states), dtype=torch.int32)
    if not processors.tensors_required:
        return storage
    return processors.prepare_tensor_args(_scheduled(states), storage)


def _scheduled(states: list) -> list:
    """Requests as `prepare_tensor_args` reads them: each scheduled with a new token."""
    return [SimpleNamespace(state=state, has_new_token=True) for state in states]


def process(processors, input_ids: torch.Tensor, scores: torch.Tensor, arguments: torch.Tensor) -> torch.Tensor:
    """scores [m, vocab] through a step's processors exactly as Transformers' model runner calls them:
    the per-request ones with arguments [processors, m], the others (the generation config's warpers,
    with `per_request_processors` off, its default) with input_ids [m], the token fed at each
    position (all of a request's tokens Transformers gives a processor; it drops the repetition
    penalty as unsupported)."""
    if not processors.do_processing:
        return scores
    return processors(input_ids, scores, arguments)


# --- the manager --------------------------------------------------------------------------------
class ComposingManager(ContinuousBatchingManager):
    """Transformers' continuous batching manager whose batch processor is `compose(processor)` of the
    one Transformers builds; after a restart, the same one `reset()` (as Transformers resets its own)."""

    def compose(self, processor: ContinuousBatchProcessor):
        raise NotImplementedError

    def _create_batch_processor(self):
        composed = getattr(self, "batch_processor", None)
        if composed is not None and not isinstance(composed, ContinuousBatchProcessor):
            composed.reset()
            return composed
        return self.compose(super()._create_batch_processor())


def adopt(manager: ContinuousBatchingManager, cls: type) -> ContinuousBatchingManager:
    """`manager`, built by Transformers' `init_continuous_batching` and not started, made a `cls` (a
    subclass of its class that adds methods, and attributes its caller sets)."""
    assert issubclass(cls, type(manager)) and not manager.is_running()
    manager.__class__ = cls
    return manager


def user_config(generation_config, continuous_batching_config) -> ContinuousBatchingConfig | None:
    """The continuous batching config `init_continuous_batching` would use (None: its default):
    the one given, else the one a generation config carries (deprecated in Transformers)."""
    if continuous_batching_config is None and \
            isinstance(getattr(generation_config, "continuous_batching_config", None), ContinuousBatchingConfig):
        return generation_config.continuous_batching_config
    return continuous_batching_config


def cached_manager(model) -> ContinuousBatchingManager | None:
    """The persistent manager `init_continuous_batching` would return (`generate_batch(persistent_manager=True)`)."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def capacity(cache) -> int:
    """The most tokens one request can hold in a paged cache of full-attention layers (the only
    kind speculation runs on): every block of the cache."""
    return cache.max_tokens_read


def forget_handler(manager, request_id: str) -> None:
    """Drop the result handler registered for a request that was then refused (`transformers serve`
    registers it before `add_request`)."""
    with manager.output_router._lock:
        manager.output_router.result_handlers.pop(request_id, None)
