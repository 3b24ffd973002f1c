"""Continuous batching on a real model: requests arrive over time, join the running batch between
steps and leave when done; every step is the library's batched speculative step (`DecodingLoop.step`),
so the spec policy and the offload manager act each step on the current batch.

An evaluation harness, not a server: one process, requests given up front with arrival times.
Rows of one `SequenceBatch` are reused: a finished request frees its row, and a joining request's
prompt is written there (left-padded to `max_prompt_len`). Joiners are prefilled on their own (a
target forward that also gives their first token, and a forward of each model drafter), then their
KV slots are appended to the running caches (`CachedModel.append`); their row's draft lag is then
the one token the target just produced, as for every running row. Time is wall-clock time, except
that idle gaps (nothing running, next arrival in the future) are skipped rather than slept.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria

from ..cached_model import CachedModel
from ..distributed import ranks_of
from ..generate import check_spec_args, ensure_profile
from ..loop import DecodingLoop
from ..offload import RESIDENT, as_offload
from ..rows import RowInts
from ..sampling import TokenSampler
from ..sequences import SequenceBatch
from ..stops import StopJudge
from .simulator import RequestResult, RunResult, RunStep
from .workload import Request


class Engine:
    """model: the target; assistant_models / spec_policy: as for `generate()` (model and lookup
    drafters); max_batch: most running requests; max_prompt_len: longest prompt admitted;
    eos_token_id: stop a request at this token (None: run every request to its output_len, as
    trace replays do); draft_offload: as for `generate()`. Greedy decoding."""

    def __init__(self, model, assistant_models, spec_policy=None, max_batch: int = 16,
                 max_prompt_len: int = 512, eos_token_id: int | None = None, draft_offload=None):
        for name, value in (("max_batch", max_batch), ("max_prompt_len", max_prompt_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine({name}) must be an integer >= 1, got {value!r}")
        if ranks_of(model) is not None:
            raise ValueError("the serving engine runs one process; a target sharded by tensor parallelism "
                             "(distributed_config) runs through model.generate() on every rank")
        self.model = model
        self.drafters, self.policy = check_spec_args(model, assistant_models, spec_policy)
        self.offload = as_offload(draft_offload)
        stuck = [i for i, d in enumerate(self.drafters) if not d.joinable]
        if stuck:
            raise ValueError(f"assistant_models{stuck} cannot take requests mid-run; the engine runs model "
                             "drafters (ModelDrafter, plain causal LMs) and lookup drafters")
        self.max_batch, self.max_prompt_len, self.eos_token_id = max_batch, max_prompt_len, eos_token_id
        ensure_profile(self.policy, model, self.drafters, max_batch)
        pad = model.generation_config.pad_token_id
        self.pad = int(pad if pad is not None else 0)

    def run(self, requests: Sequence[Request], prompts: Sequence[Sequence[int]]) -> RunResult:
        """Serve `requests` (prompts[i] = token ids of requests[i]); returns per-request times,
        per-step batch size and k, and `result.outputs[id]` = the generated token ids."""
        if len(prompts) != len(requests):
            raise ValueError(f"prompts must give one token list per request: {len(prompts)} for {len(requests)}")
        for r, p in zip(requests, prompts):
            if not 1 <= len(p) <= self.max_prompt_len:
                raise ValueError(f"request {r.id}: prompt of {len(p)} tokens; expected 1..{self.max_prompt_len}")
        device = next(self.model.parameters()).device
        empty = torch.full((self.max_batch, self.max_prompt_len), self.pad, device=device)
        batch = SequenceBatch(empty, torch.zeros_like(empty), max_length=1 << 30, pad_token_id=self.pad)
        batch.active = RowInts.of([], device)
        criteria = StoppingCriteriaList([EosTokenCriteria(self.eos_token_id)] if self.eos_token_id is not None else [])
        stops = StopJudge(criteria, self.max_batch, batch.max_length, device, freeze_finished=True)
        # (request times are read after each step's host reads of its results: its work is done)
        loop = DecodingLoop(self.model, batch, self.drafters, self.policy, TokenSampler(None, False, None), stops,
                            offload=self.offload)
        loop.begin()
        self.stats = loop.stats

        waiting = sorted(zip(requests, prompts), key=lambda rp: rp[0].arrival)
        serving: dict[int, tuple[Request, float]] = {}       # row -> (request, first-token time)
        result = RunResult()
        start, skipped = time.perf_counter(), 0.0
        def now() -> float:
            return time.perf_counter() - start + skipped
        while waiting or serving:
            if not serving and waiting[0][0].arrival > now():
                skipped += waiting[0][0].arrival - now()      # idle: jump to the next arrival
            free = [row for row in range(self.max_batch) if row not in serving]
            joining = []
            while waiting and waiting[0][0].arrival <= now() and len(joining) < len(free):
                joining.append(waiting.pop(0))
            if joining:
                rows = RowInts.of(free[: len(joining)], device)
                width = max(len(p) for _, p in joining)
                ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for _, p in joining], device=device)
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p in joining], device=device)
                limits = RowInts.of([batch.prompt_len + r.output_len for r, _ in joining], device)
                join(loop, rows, ids, mask, limits)
                t = now()
                serving.update({row: (req, t) for row, (req, _) in zip(rows.host, joining)})
            if len(batch.active):
                record = loop.step()
                result.steps.append(RunStep(now(), record.batch_size, record.k, sum(record.emitted)))
            t, active = now(), set(batch.active.host)
            for row in [row for row in serving if row not in active]:      # finished: frees its row
                request, first = serving.pop(row)
                produced = batch.tokens[row, batch.prompt_len: batch.lengths.host[row]].tolist()
                result.outputs[request.id] = produced
                result.requests.append(RequestResult(request, first, t, len(produced)))
        loop.observe_late()
        return result


def join(loop: DecodingLoop, rows: RowInts, input_ids: torch.LongTensor, attention_mask: torch.Tensor,
         limits: RowInts) -> None:
    """Start new requests in `loop`'s inactive `rows` [m] (continuous batching): prompts [m, p]
    (left-padded, mask [m, p]) are prefilled on their own by the target, which picks each one's
    first token, and by the drafters; their caches then follow the running rows', and they decode
    until their total length reaches `limits` [m] or a stop."""
    batch, sampler = loop.batch, loop.sampler
    batch.refill(rows, input_ids, attention_mask)
    loop.stops.join(rows, limits)
    loop.policy.selector.join(rows.host)
    joining = batch.view(active=rows)
    joiner = CachedModel(loop.target.model)
    joiner.reset(joining, from_first_real=True)       # prompts sit left-padded to the batch's width
    logits = joiner.forward(*joiner.pending(joining), keep=1)             # [m, 1, vocab]
    batch.tokens[rows.tensor, batch.prompt_len] = sampler.pick(sampler.scores(joining, logits)[:, 0])
    batch.lengths[rows] = batch.lengths[rows] + 1   # the first token is the target's lag: 1, as for all
    first = RowInts.full(len(rows), 1, batch.tokens.device)
    loop.stops.cut(batch, rows, batch.lengths[rows] - 1, first)
    resident = loop.offload is None or loop.offload.state == RESIDENT
    for drafter in loop.drafters:
        drafter.add_rows(joining, prefill=resident)
    loop.target.append(joiner)
    batch.active = batch.active.cat(rows)
    loop.retire_finished()                    # one-token requests, or a first token that stops
