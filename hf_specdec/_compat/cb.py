"""Transformers' continuous batching (transformers/generation/continuous_batching/): the adapter through
which hf_specdec.continuous_batching reads and writes its internals."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

# Transformers' continuous batching (generation/continuous_batching/, the same in 5.23 and 5.24): a
# batch's small int32 inputs live in one bulk tensor of max_batch_tokens + 1 columns;
# `logits_indices` is a view of its row 3 cut to max_requests_per_batch, and the rows from
# `static_inputs` on hold the logits processors' per-row arguments.
def logit_rows(ios) -> tuple[torch.Tensor, torch.Tensor]:
    """A ContinuousBatchingIOs' (logits indices [max_batch_tokens], processor arguments
    [processors, max_batch_tokens]) at their full width: room for a logit row per query token."""
    bulk = ios._bulk_input_tensor
    return bulk[3], bulk[ios.static_inputs:]


def request_arguments(processors, states: list) -> torch.Tensor | None:
    """The per-request processors' arguments [processors, n] (int32 storage) of requests `states`,
    as Transformers prepares them for a step; None without per-request processors."""
    if not processors.tensors_required:
        return None
    storage = torch.zeros(processors.tensors_required, len(states), dtype=torch.int32)
    futures = [SimpleNamespace(state=state, has_new_token=True) for state in states]   # what it reads
    return processors.prepare_tensor_args(futures, storage)


def process(processors, scores: torch.Tensor, arguments: torch.Tensor) -> torch.Tensor:
    """scores [m, vocab] through the per-request processors only, row i with arguments[:, i]."""
    per_request = [p for p in processors.logits_processor if isinstance(p, ContinuousBatchingLogitsProcessor)]
    for processor, argument in zip(per_request, arguments):
        scores = processor(scores, argument)
    return scores


@contextlib.contextmanager
def sampling_replaced(runner, sample):
    """Within it, `runner` (a `ModelRunner`) picks a forward's tokens with `sample(scores [1, m, vocab],
    output_ids)` in place of its `_sample`: its `_forward_process_and_sample` runs the forward, the
    logits processors and the sampling in one method, with no seam between the processed scores
    and the pick, which a speculating step replaces with `verify`."""
    runner._sample = sample
    try:
        yield
    finally:
        del runner._sample


def capacity(cache) -> int:
    """The most tokens one request can hold in a paged cache of full-attention layers (the only
    kind speculation runs on): every block of the cache."""
    return cache.max_tokens_read


def forget_handler(manager, request_id: str) -> None:
    """Drop the result handler registered for a request that was then refused (`transformers serve`
    registers it before `add_request`)."""
    with manager.output_router._lock:
        manager.output_router.result_handlers.pop(request_id, None)


def forks_pending(scheduler) -> bool:
    """A continuous batching scheduler has requests to fork (num_return_sequences > 1)."""
    return bool(scheduler._requests_to_fork)
