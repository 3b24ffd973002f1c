"""Speculation inside Transformers' continuous batching: `generate_batch`,
`generate(cache_implementation="paged")` and `init_continuous_batching` (what `transformers serve`
runs), after `hf_specdec.enable(model)`.

A step of Transformers' loop (`ContinuousBatchProcessor`): the scheduler packs every scheduled
request's query (a decoding request's pending token, a prefill chunk) into one row, the model runs
once over the paged cache, and Transformers' processors and sampler pick a token at each request's
last position. `SpecBatchProcessor` adds the step protocol around it:
  plan     the policy's k from the decoding requests (`SpecPolicy.choose`), cut per request to its
           room and to the batch's spare logit rows (`_propose`);
  draft    the drafter proposes from the request's tokens through the contract `generate()`'s loop
           uses (`request_rows.py`), a draft model sampling with the request's own temperature /
           top-k / top-p (a confidence-weighing policy, AdaSpec, may stop a request's drafting early
           and trim its drafts); the pending token + drafts become the request's query, scheduled
           as Transformers schedules any query (a token budget cuts the drafts, as it cuts a prefill
           chunk);
  verify   the same packed forward, with logits at each of a speculating request's positions
           (`logits_indices` widened; the processors' per-request arguments repeated per row), and
           the shared `verify` (rejection sampling, argmax equality when greedy) in place of
           Transformers' pick, over the processed scores (`_accept`);
  commit   the request appends the accepted drafts + 1 token through Transformers'
           `update_and_check_completion` (EOS and max_new_tokens as in a plain step) and steps its
           position back over the rejected drafts, whose cache slots the next forward overwrites;
  observe  the policy gets the step's record (`_observe`).

The paged cache's bookkeeping stays right: blocks are allocated by position, so a request that
stepped back reuses its slots; blocks are hashed for prefix sharing only once they hold accepted
tokens (`count_new_complete_blocks` over the kept tokens); a step where no request drafts is
Transformers' own step, untouched.

Not with speculation (a clear error before any work): asynchronous batching (it carries one token
ahead), CUDA graphs and compiled paths (padded shapes), sliding-window layers (their ring cache
would overwrite tokens still in the window with rejected drafts). Drafters: `request_rows.py`.
Tested on Transformers 5.24 and 5.23 (their continuous batching differs only in details).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import math
import threading
from dataclasses import dataclass

import torch
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import (ContinuousBatchingManager,
                                                                        ContinuousBatchProcessor)
from transformers.generation.continuous_batching.requests import FutureRequestState, RequestStatus

from . import assisted, timing
from ._compat import cb, modeling, recurrent
from .drafters import Drafter, LookupDrafter, ModelDrafter
from .generate import check_spec_args, ensure_profile
from .policies import SpecPolicy, StepContext
from .request_rows import Draft, RequestRows, RequestSampler
from .stats import StepRecord
from .tiers import SPEC_TIERS
from .verify import verify

logger = logging.getLogger(__name__)
__all__ = ["RequestRefused", "Speculation", "SpecBatchingManager", "SpecBatchProcessor", "SpecCounts", "init_continuous_batching",
           "speculating"]


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

    @property
    def max_len(self) -> int:
        """The policy's longest draft (sizes the logits reserve)."""
        length = self.policy.length
        return getattr(length, "max_len", None) or getattr(length, "k", None) or max(SPEC_TIERS)


LOG_EVERY = 1000       # drafting forwards between two INFO lines of a processor's counts
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


def speculation_from(model, generation_config, prompt_lookup_num_tokens=None, max_matching_ngram_size=None,
                     assistant_model=None, spec_policy=None) -> Speculation | None:
    """The speculation the arguments ask for (arguments first, then the generation config's
    fields), or None. Transformers' arguments map as in `generate()` (`assisted.py`): a draft model
    runs "auto" unless a schedule is set, `prompt_lookup_num_tokens=n` n drafts a step; `spec_policy=`
    wins over both."""
    given = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens, "max_matching_ngram_size": max_matching_ngram_size}
    settings = {name: assisted.setting(name, given, generation_config)
                for name in assisted.SCHEDULE_FIELDS + assisted.LOOKUP_FIELDS}
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


@dataclass
class SpecCounts:
    """A speculating batch processor's running totals (`SpecBatchProcessor.counts`): counts, not a
    list of steps, since a server's processor lives as long as the server."""
    steps: int = 0              # forwards
    drafting_steps: int = 0     # forwards that verified drafts
    shared_steps: int = 0       # ... of them, with another request in the same forward
    drafting_requests: int = 0  # requests that verified drafts, summed over forwards
    drafted: int = 0            # drafts verified
    accepted: int = 0

    def add(self, requests: int, drafted: int, accepted: int, drafting_requests: int = 0) -> None:
        """One forward over `requests` scheduled requests, `drafting_requests` of which verified
        `drafted` drafts in all."""
        self.steps += 1
        self.drafting_requests += drafting_requests
        self.drafting_steps += drafted > 0
        self.shared_steps += drafted > 0 and requests > 1
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted
        if drafted and self.drafting_steps % LOG_EVERY == 1:      # the first, then every LOG_EVERY-th
            logger.info("speculation: %d forwards, %d with drafts; %d of %d drafts accepted", self.steps,
                        self.drafting_steps, self.accepted, self.drafted)


@dataclass
class LogitRows:
    """Where a scheduled request's logit rows are in the step's output: `count` rows from `first`
    (a speculating request: its pending token and each draft; 0: a prefill chunk)."""
    request: FutureRequestState
    first: int
    count: int


class SpecBatchProcessor(ContinuousBatchProcessor):
    """Transformers' batch processor with a speculative step. Made from Transformers' own processor
    by `SpecBatchingManager` (`attach`), so every other behaviour is Transformers'."""

    speculation: Speculation

    def attach(self, speculation: Speculation, model) -> None:
        self.speculation, self._model = speculation, model
        self.drafter = self._new_rows()
        self._drafts: dict[str, Draft] = {}            # request id -> this step's drafts
        self._kept: dict[str, int] = {}                # request id -> drafts it accepted (`_accept`)
        self._rows: list[LogitRows] | None = None     # None: a plain step (Transformers' own)
        self._num_logits = 0
        self._plan, self._draft_s, self._verify_s = None, 0.0, 0.0    # this step's (ctx, k's, requests), times
        self.counts = SpecCounts()

    def _new_rows(self) -> RequestRows:
        return RequestRows(self.speculation.new_drafter(), RequestSampler(self.logit_processor, self.do_sample),
                           self.speculation.device(self._model))

    def reset(self) -> None:
        self._drafts, self._rows, self.drafter = {}, None, self._new_rows()
        super().reset()

    # plan + draft
    def prepare_next_batch(self) -> bool:
        self._propose()
        if not super().prepare_next_batch():
            self.drafter.accepted({})
            return False
        self._rows = self._widen_logits()
        return True

    def _propose(self) -> None:
        """Each decoding request's query: its pending token + its drafts. Transformers reserves
        memory for `max_requests_per_batch` logit rows, one per request; every draft takes a row, so
        the drafts come out of the decoding requests' spare rows and the step schedules that many
        fewer requests."""
        limit = self.cb_config.max_requests_per_batch
        decoding = [state for state in self.scheduler.active_requests.values()
                    if state.status == RequestStatus.DECODING and state.generated_tokens]
        rooms = [math.inf if s.max_new_tokens is None else s.max_new_tokens - s.generated_len() for s in decoding]
        self._plan, k = None, 0
        if decoding:
            ctx = StepContext(step=self.counts.steps, batch_size=len(decoding), num_drafters=1,
                              rows=list(range(len(decoding))), remaining=int(min(max(rooms), 1 << 30)),
                              context_tokens=sum(len(s.initial_tokens) + s.generated_len() for s in decoding))
            k = self.speculation.policy.choose(ctx).k
        budget, ks = limit - len(decoding), []
        for room in rooms:                          # each request within its room and the spare logit rows
            ks.append(int(max(0, min(k, room - 1, budget))))
            budget -= ks[-1]
        if decoding:
            self._plan = (ctx, k, max(ks), decoding)
        start, policy = timing.now(), self.speculation.policy
        self._drafts = {}
        proposed = self.drafter.propose(decoding, ks, policy.continue_drafting)
        lengths = [len(d.tokens) for d in proposed]
        kept = policy.trim(lengths, [d.confidences for d in proposed]) if any(lengths) else lengths
        for state, drafts, n in zip(decoding, proposed, kept):
            state.tokens_to_process = [state.generated_tokens[-1], *drafts.tokens[:n]]
            if n:
                self._drafts[state.request_id] = drafts.cut(n)
        self._draft_s = timing.now() - start
        self.scheduler.max_requests_per_batch = limit - sum(len(d.tokens) for d in self._drafts.values())

    def _widen_logits(self) -> list[LogitRows] | None:
        """After Transformers prepared the batch: a logit row at each position of a speculating
        request, the processors' arguments repeated per row. None if no scheduled request drafts."""
        ios = self.inputs_and_outputs
        scheduled = ios.requests_in_batch
        if not any(f.state.request_id in self._drafts for f in scheduled):
            return None
        rows, logits, end = [], [], 0
        for future in scheduled:
            end += future.query_length
            if future.state.request_id in self._drafts:
                # a token budget that cut the drafts left them as "remaining prefill": drop them
                future.state.remaining_prefill_tokens = []
                future.has_new_token = True
                count = future.query_length
            else:
                count = int(future.has_new_token)
            rows.append(LogitRows(request=future, first=len(logits), count=count))
            logits.extend(range(end - count, end))
        indices, arguments = cb.logit_rows(ios)
        indices[:len(logits)] = torch.tensor(logits, dtype=torch.int32)
        repeated = [row.request for row in rows for _ in range(row.count)]
        self.logit_processor.prepare_tensor_args(repeated, arguments)
        self._num_logits = len(logits)
        return rows

    # verify
    @torch.no_grad()
    def _generation_step(self, model) -> None:
        start = timing.now()
        self._verify(model)
        self._verify_s = timing.now() - start

    def _verify(self, model) -> None:
        if self._rows is None:
            return super()._generation_step(model)
        ios, n = self.inputs_and_outputs, self._num_logits
        batch_data = ios.get_model_kwargs(use_padding=False)
        indices, arguments = cb.logit_rows(ios)
        batch_data["logits_indices"], batch_data["logits_processor_args"] = indices[:n], arguments[:, :n]
        with cb.sampling_replaced(self.model_runner, self._accept):
            self.model_runner.compute_batch(model, batch_data)
        ios.retrieve_device_outputs()

    def _accept(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """The step's pick, in place of Transformers' sampler: `verify` over each request's logit rows
        (scores [1, m, vocab], processed), its drafts and their distributions. A request's emitted
        tokens, its accepted drafts then the replacement or bonus token, go to its rows of
        `output_ids` [2, >= m] (row 1: their log-probabilities, when asked for)."""
        rows = [row for row in self._rows if row.count]
        width = max(row.count for row in rows)                        # k + 1
        index = torch.tensor([[row.first + min(j, row.count - 1) for j in range(width)] for row in rows])
        target = scores[0, index.to(scores.device)]                   # [r, k + 1, vocab]
        drafts = [self._drafts.get(row.request.state.request_id, Draft([], [])).cut(row.count - 1) for row in rows]
        tokens = torch.zeros(len(rows), width - 1, dtype=torch.long)
        for i, draft in enumerate(drafts):
            tokens[i, :len(draft.tokens)] = torch.tensor(draft.tokens, dtype=torch.long)
        counts = torch.tensor([len(d.tokens) for d in drafts])
        probs = None
        if self.do_sample and any(d.probs is not None for d in drafts):
            probs = target.new_zeros(len(rows), width - 1, target.shape[-1])
            for i, draft in enumerate(drafts):
                if draft.tokens:
                    probs[i, :len(draft.tokens)] = draft.probs.to(probs.device)
        tokens, counts = tokens.to(scores.device), counts.to(scores.device)
        result = verify(tokens, counts, target, probs, self.do_sample)
        emitted = torch.cat([tokens, tokens.new_zeros(len(rows), 1)], 1)        # [r, k + 1]
        emitted[torch.arange(len(rows)), result.num_accepted] = result.next_tokens
        written = torch.arange(width, device=scores.device)[None, :] <= result.num_accepted[:, None]
        positions = index.to(scores.device)[written]
        output_ids[0, positions] = emitted[written].to(output_ids.dtype)
        if self.return_logprobs:
            logprobs = torch.log_softmax(target, -1).gather(-1, emitted[..., None]).squeeze(-1)
            output_ids[1, positions] = logprobs[written].view(torch.int32)
        self._kept = {row.request.state.request_id: n for row, n, d in zip(rows, result.num_accepted.tolist(), drafts)
                      if d.tokens}

    # commit
    def update_batch(self) -> None:
        if self._rows is None:       # no scheduled request drafted (a draft model may have): a plain step
            self.drafter.accepted({})
            scheduled = self.inputs_and_outputs.requests_in_batch
            self.counts.add(requests=len(scheduled), drafted=0, accepted=0)
            self._observe({}, {}, {f.state.request_id: 1 for f in scheduled if f.has_new_token})
            return super().update_batch()
        rows, self._rows = self._rows, None
        verified, kept, emitted = {}, {}, {}
        accepted_by_id, self._kept = self._kept, {}
        ios, n = self.inputs_and_outputs, self._num_logits
        tokens = ios.output_ids[0, :n].tolist()                       # the step's one host read
        logprobs = ios.output_ids[1, :n].view(torch.float32).tolist() if self.return_logprobs else None
        outputs = []
        for row in rows:
            state = row.request.state
            if not row.count:                                          # a prefill chunk
                if state.status == RequestStatus.PREFILLING:
                    self.cache.mark_complete_blocks(state, row.request.complete_blocks)
                continue
            if state.generated_len() == 0:                             # its prefill ended
                state.status = RequestStatus.DECODING
            chosen = tokens[row.first:row.first + row.count]
            drafted = row.count - 1 if state.request_id in self._drafts else 0
            accepted = accepted_by_id.get(state.request_id, 0)
            verified[state.request_id], kept[state.request_id] = drafted, accepted
            complete = self._step_back(row.request, drafted - accepted)
            for j in range(accepted + 1):
                finished = state.update_and_check_completion(chosen[j], logprobs[row.first + j] if logprobs else None)
                if finished:
                    break
            emitted[state.request_id] = j + 1
            self.cache.mark_complete_blocks(state, complete)
            if finished:
                self.scheduler.finish_request(state.request_id)
                self.scheduler.block_new_requests = False
            if state.streaming or state.status == RequestStatus.FINISHED:
                outputs.append(state.to_generation_output())
        self.counts.add(requests=len(rows), drafted=sum(verified.values()), accepted=sum(kept.values()),
                        drafting_requests=sum(n > 0 for n in verified.values()))
        self.drafter.accepted(kept)
        self._observe(verified, kept, emitted)
        if outputs:
            self.output_router.deliver_batch(outputs)
        if cb.forks_pending(self.scheduler):
            # Transformers' update over no requests runs only its fork step (num_return_sequences > 1)
            ios.requests_in_batch = []
            super().update_batch()

    def _observe(self, verified: dict[str, int], kept: dict[str, int], emitted: dict[str, int]) -> None:
        """The policy learns from the step's record: per decoding request planned, drafts verified,
        accepted and tokens emitted; the drafting and verification times."""
        if self._plan is None:
            return
        ctx, decided_k, k, decoding = self._plan
        ids = [s.request_id for s in decoding]
        record = StepRecord.of_step(ctx, k, decided_k, [verified.get(i, 0) for i in ids], [kept.get(i, 0) for i in ids],
                                    emitted=[emitted.get(i, 0) for i in ids], draft_s=self._draft_s,
                                    verify_s=self._verify_s)
        self.speculation.policy.observe(record)

    def _step_back(self, future: FutureRequestState, rejected: int) -> dict[str, int]:
        """Forget a request's `rejected` last cache slots (the next forward writes over them); returns
        the blocks its kept tokens completed, for prefix sharing."""
        if not rejected:
            return future.complete_blocks
        state = future.state
        kept = future.query_length - rejected
        state.position_offset -= future.query_length
        complete = self.cache.count_new_complete_blocks(state, kept)
        state.position_offset += kept
        return complete


class RequestRefused(ValueError):
    """A request refused before it reaches the generation loop, which goes on serving the others
    (`python -m hf_specdec serve` answers it with a 400)."""


class SpecBatchingManager(ContinuousBatchingManager):
    """Transformers' continuous batching manager whose batch processor speculates."""

    PROCESSOR_WAIT_S = 60     # how long `add_request` waits for the loop to build the cache it checks against

    def __init__(self, model, generation_config, continuous_batching_config: ContinuousBatchingConfig,
                 workload_hints=None, *, speculation: Speculation):
        check_model(model)
        self.speculation = speculation
        self._processor_made = threading.Event()
        config = _for_speculation(continuous_batching_config, workload_hints, speculation)
        super().__init__(model, generation_config, config, workload_hints)

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        processor = super()._create_batch_processor()
        if not isinstance(processor, SpecBatchProcessor):
            # Transformers builds its own processor class; ours only adds the speculative step
            processor.__class__ = SpecBatchProcessor
            processor.attach(self.speculation, self.model)
        self._processor_made.set()
        return processor

    def add_request(self, input_ids: list[int], request_id: str | None = None, *args, **kwargs) -> str | None:
        """Transformers' `add_request`, after refusing a prompt the paged cache cannot hold (`RequestRefused`):
        Transformers' loop would fail on it, and with it every request in flight and every later one."""
        if self.is_running() and self._processor_made.wait(self.PROCESSOR_WAIT_S):
            capacity = cb.capacity(self.batch_processor.cache)
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
    if recurrent.state_kinds(model) or getattr(model, "_is_stateful", False):
        raise ValueError(f"{type(model).__name__} has recurrent or convolution layers: continuous batching keeps one "
                         "state per request, which rejected drafts would have changed; speculate with generate() "
                         "instead")
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types or (getattr(config, "sliding_window", None) and not layer_types
                                              and getattr(config, "use_sliding_window", True)):
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
    if config.max_requests_per_batch is None and workload_hints is not None:
        # Transformers sizes its logits reserve to one row per request; a speculating one needs max_len + 1
        config.max_requests_per_batch = min(1024, workload_hints.num_requests * (speculation.max_len + 1))
    return config


def init_continuous_batching(model, original, generation_config=None, continuous_batching_config=None,
                             workload_hints=None, *, prompt_lookup_num_tokens=None, max_matching_ngram_size=None,
                             assistant_model=None, spec_policy=None):
    """`model.init_continuous_batching` of an enabled model: Transformers' manager, or ours when the
    arguments, the generation config or `speculating` ask for speculation."""
    config = generation_config if generation_config is not None else model.generation_config
    speculation = speculation_from(model, config, prompt_lookup_num_tokens, max_matching_ngram_size, assistant_model,
                                   spec_policy) \
        or _PENDING.get()
    if speculation is None:
        return original(generation_config, continuous_batching_config, workload_hints)
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, SpecBatchingManager):          # Transformers reuses a persistent manager, as is
        return original(generation_config, continuous_batching_config, workload_hints)
    if cached is not None:
        raise ValueError("a persistent continuous batching manager without speculation exists; call "
                         "model.destroy_cached_continuous_batching_manager() first")
    if config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if config.eos_token_id is None:     # as Transformers' own init_continuous_batching
        config.eos_token_id = -1
    return SpecBatchingManager(model, config, continuous_batching_config, workload_hints, speculation=speculation)
