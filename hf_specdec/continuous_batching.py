"""Speculation inside Transformers' continuous batching: `generate_batch`,
`generate(cache_implementation="paged")` and `init_continuous_batching` (what `transformers serve`
runs), after `hf_specdec.enable(model)`.

A step of Transformers' loop (`ContinuousBatchProcessor`): the scheduler packs every scheduled
request's query (a decoding request's pending token, a prefill chunk) into one row, the model runs
once over the paged cache, and Transformers' processors and sampler pick a token at each request's
last position. Our manager composes its processor into a `SpecBatchProcessor`
(`batch_processor.py`), which adds the step protocol around it: drafts join the decoding requests'
queries, logits come back at each of their positions, the shared `verify` accepts drafts, and each
request steps back over the rejected ones.

The paged cache's bookkeeping stays right: blocks are allocated by position, so a request that
stepped back reuses its slots; blocks are hashed for prefix sharing only once they hold accepted
tokens; a step where no request drafts is Transformers' own step, untouched.

Not with speculation (a clear error before any work): asynchronous batching (it carries one token
ahead), CUDA graphs and compiled paths (padded shapes), sliding-window layers (their ring cache
would overwrite tokens still in the window with rejected drafts). Drafters: `request_rows.py`.
Tested on Transformers 5.24 and 5.25 (their continuous batching differs only in details).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import threading
from dataclasses import dataclass

import torch
from transformers import ContinuousBatchingConfig

from . import assisted
from ._compat import cb, modeling, recurrent
from .batch_processor import SpecBatchProcessor, SpecCounts
from .drafters import Drafter, LookupDrafter, ModelDrafter
from .generate import check_spec_args, ensure_profile
from .policies import SpecPolicy

logger = logging.getLogger(__name__)
__all__ = ["RequestRefused", "Speculation", "SpecBatchingManager", "SpecBatchProcessor", "SpecCounts",
           "init_continuous_batching", "speculating"]


@dataclass(frozen=True)
class Speculation:
    """What a continuous batching manager speculates with: the policy that decides each step's
    draft length (`SpecPolicy.choose`) and learns from its record (`observe`), and a draft model or
    a lookup (a `LookupDrafter`, as `PromptLookupDrafter`: it holds no state, so processors share it)."""
    policy: SpecPolicy
    lookup: LookupDrafter | None = None
    draft_model: torch.nn.Module | None = None

    def __post_init__(self):
        if (self.lookup is None) == (self.draft_model is None):
            raise ValueError("Speculation takes a lookup= (a LookupDrafter) or a draft_model=, one of them")
        if self.lookup is not None and not isinstance(self.lookup, LookupDrafter):
            raise TypeError(f"Speculation(lookup=) takes a LookupDrafter, got {type(self.lookup).__name__}")

    def new_drafter(self) -> Drafter:
        """The drafter of one batch processor (a draft model's holds its cache)."""
        return ModelDrafter(self.draft_model) if self.draft_model is not None else self.lookup

    def device(self, model) -> torch.device:
        return modeling.execution_device(self.draft_model if self.draft_model is not None else model)


_PENDING: contextvars.ContextVar[Speculation | None] = contextvars.ContextVar("hf_specdec_cb", default=None)


@contextlib.contextmanager
def speculating(speculation: Speculation | None):
    """Within it, `init_continuous_batching` of an enabled model (as `generate_batch` calls it) speculates
    with `speculation` unless its own arguments say otherwise. Per thread / context."""
    token = _PENDING.set(speculation)
    try:
        yield
    finally:
        _PENDING.reset(token)


def speculation_from(model, generation_config, *, assistant_model=None, spec_policy=None, **settings) -> Speculation | None:
    """The speculation the arguments ask for, or None. `settings`: Transformers' assisted-generation
    settings given on the call (num_assistant_tokens, num_assistant_tokens_schedule,
    assistant_confidence_threshold, prompt_lookup_num_tokens, max_matching_ngram_size), read as in
    `generate()` (`assisted.py`): the call, then `generation_config`, then the assistant's own
    generation config, then the model's. A draft model runs "auto" unless a schedule is set,
    `prompt_lookup_num_tokens=n` n drafts a step; `spec_policy=` wins over both."""
    unknown = set(settings) - set(assisted.SCHEDULE_FIELDS + assisted.LOOKUP_FIELDS)
    if unknown:
        raise TypeError(f"unexpected speculation arguments {sorted(unknown)}; continuous batching takes "
                        f"assistant_model=, spec_policy= and {', '.join(assisted.SCHEDULE_FIELDS + assisted.LOOKUP_FIELDS)}")
    settings = assisted.call_settings(model, settings, generation_config, assistant_model)
    if assistant_model is None and settings["prompt_lookup_num_tokens"] is None:
        if spec_policy is not None:
            raise ValueError("spec_policy= needs a drafter: assistant_model= or prompt_lookup_num_tokens=")
        return None
    drafters, policy = assisted.drafters_and_policy(assistant_model, settings)
    drafters, policy = check_spec_args(model, drafters, policy if spec_policy is None else spec_policy)
    speculation = Speculation(policy=policy, lookup=drafters[0]) if assistant_model is None else \
        Speculation(policy=policy, draft_model=assistant_model)
    ensure_profile(policy, model, drafters, batch_size=8)      # a profiled policy's (DSD, AdaSpec): measured once
    return speculation


class RequestRefused(ValueError):
    """A request refused before it reaches the generation loop, which goes on serving the others
    (`python -m hf_specdec serve` answers it with a 400)."""


class SpecBatchingManager(cb.ComposingManager):
    """Transformers' continuous batching manager whose batch processor speculates. Built by
    `init_continuous_batching` (Transformers' own, then `adopt`ed) or directly, as Transformers' is."""

    PROCESSOR_WAIT_S = 60     # how long `add_request` waits for the loop to build the cache it checks against

    def __init__(self, model, generation_config, continuous_batching_config: ContinuousBatchingConfig,
                 workload_hints=None, *, speculation: Speculation):
        check_model(model)
        config = _for_speculation(continuous_batching_config, workload_hints, speculation)
        super().__init__(model, generation_config, config, workload_hints)
        self._speculate_with(speculation)

    @classmethod
    def adopt(cls, manager, speculation: Speculation) -> "SpecBatchingManager":
        """Transformers' manager, built for speculation (`_for_speculation`), made ours."""
        manager = cb.adopt(manager, cls)
        manager._speculate_with(speculation)
        return manager

    def _speculate_with(self, speculation: Speculation) -> None:
        self.speculation = speculation
        self._processor_made = threading.Event()
        self._processor: SpecBatchProcessor | None = None

    def compose(self, processor) -> SpecBatchProcessor:
        # (read by `add_request`: Transformers' loop registers its processor only after this returns)
        self._processor = SpecBatchProcessor(processor, self.speculation, self.model)
        self._processor_made.set()
        return self._processor

    def add_request(self, input_ids: list[int], request_id: str | None = None, *args, **kwargs) -> str | None:
        """Transformers' `add_request`, after refusing a prompt the paged cache cannot hold (`RequestRefused`):
        Transformers' loop would fail on it, and with it every request in flight and every later one."""
        if self.is_running() and self._processor_made.wait(self.PROCESSOR_WAIT_S):
            capacity = cb.capacity(cb.paged_cache(self._processor))
            if len(input_ids) + 1 > capacity:
                if request_id is not None:
                    cb.forget_handler(self, request_id)
                raise RequestRefused(f"the prompt has {len(input_ids)} tokens; the paged cache holds {capacity} "
                                     "tokens per request (prompt and new tokens): shorten it, or give the cache more "
                                     "blocks (num_blocks, --cb-num-blocks)")
        return super().add_request(input_ids, request_id, *args, **kwargs)


def check_model(model) -> None:
    """Models whose continuous batching cannot speculate: sliding-window layers (a ring cache),
    recurrent or convolution layers (a state per request, which a rejected draft has passed)."""
    if recurrent.state_kinds(model) or modeling.stateful(model):
        raise ValueError(f"{type(model).__name__} has recurrent or convolution layers: continuous batching keeps one "
                         "state per request, which rejected drafts would have changed; speculate with generate() "
                         "instead")
    if modeling.sliding_window(model) is not None:
        raise ValueError(f"{type(model).__name__} has sliding-window attention layers: continuous batching keeps "
                         "them in a ring, where rejected drafts would overwrite tokens still in the window; "
                         "speculate with generate() instead")


def _for_speculation(cb_config: ContinuousBatchingConfig | None, workload_hints, speculation: Speculation):
    """A copy of the user's config that speculation can run: synchronous, without CUDA graphs or
    compiled (padded) paths, with room for a logit row per draft. Raises if the user asked for
    what speculation cannot run."""
    config = copy.deepcopy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
    graphs = config.use_cuda_graph
    asked = {"use_async_batching": bool(config.use_async_batching),
             "use_cuda_graph": any(graphs) if isinstance(graphs, tuple) else bool(graphs),
             "varlen_compile_config": config.varlen_compile_config is not None,
             "decode_compile_config": config.decode_compile_config is not None,
             "default_compile_level": config.default_compile_level > 0}
    refused = [name for name, on in asked.items() if on]
    if refused:
        raise ValueError(f"continuous_batching_config sets {', '.join(refused)}: speculation in continuous batching "
                         "runs synchronous batches without CUDA graphs or compilation; unset them")
    config.use_async_batching, config.use_cuda_graph = False, (False, False)
    if config.max_requests_per_batch is None and getattr(workload_hints, "num_requests", 0):   # (5.25's server: 0)
        # Transformers sizes its logits reserve to one row per request; a speculating one needs max_len + 1
        config.max_requests_per_batch = min(1024, workload_hints.num_requests * (speculation.policy.max_len + 1))
    return config


def init_continuous_batching(model, original, generation_config=None, continuous_batching_config=None,
                             workload_hints=None, *, assistant_model=None, spec_policy=None, **settings):
    """`model.init_continuous_batching` of an enabled model: Transformers' manager, or ours when the
    arguments (`speculation_from`), the generation config or `speculating` ask for speculation."""
    config = generation_config if generation_config is not None else model.generation_config
    speculation = speculation_from(model, config, assistant_model=assistant_model, spec_policy=spec_policy,
                                   **settings) or _PENDING.get()
    if speculation is None:
        return original(generation_config, continuous_batching_config, workload_hints)
    cached = cb.cached_manager(model)
    if isinstance(cached, SpecBatchingManager):          # Transformers reuses a persistent manager, as is
        return original(generation_config, continuous_batching_config, workload_hints)
    if cached is not None:
        raise ValueError("a persistent continuous batching manager without speculation exists; call "
                         "model.destroy_cached_continuous_batching_manager() first")
    check_model(model)
    cb_config = _for_speculation(cb.user_config(config, continuous_batching_config), workload_hints, speculation)
    return SpecBatchingManager.adopt(original(generation_config, cb_config, workload_hints), speculation)
