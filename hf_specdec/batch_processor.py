"""The speculating batch processor of continuous batching: Transformers' own processor, composed.

`SpecBatchProcessor` holds Transformers' `ContinuousBatchProcessor` and adds the step protocol
around its three calls, every read or write of its internals through `_compat/cb.py`:
  plan     the policy's k from the decoding requests (`SpecPolicy.choose`), cut per request to its
           room and to the batch's spare logit rows (`_propose`); none while a prompt waits to be
           prefilled, so a joining request's first token comes as soon as in Transformers' own step
           (the draft model prefills it a step behind);
  draft    the drafter proposes from the request's tokens through the contract `generate()`'s loop
           uses (`request_rows.py`), a draft model sampling through the processors the target's step
           runs (a confidence-weighing policy, AdaSpec, may stop a request's drafting early
           and trim its drafts); the pending token + drafts become the request's query, scheduled
           as Transformers schedules any query (a token budget cuts the drafts, as it cuts a prefill
           chunk); then Transformers' `prepare_next_batch`;
  verify   the same packed forward, with logits at each of a speculating request's positions, and
           the shared `verify` (rejection sampling, argmax equality when greedy) in place of
           Transformers' pick (`_accept`);
  commit   each request appends its accepted drafts, steps its position back over the rejected ones
           (the next forward writes their slots; blocks are hashed only over kept tokens) and hands
           Transformers' own `update_batch` its last token (the replacement or bonus token, or an
           EOS among the drafts), which appends it, finishes requests, delivers outputs and forks;
  observe  the policy gets the step's record (`_observe`), with the prompt tokens other requests
           prefilled in the same forward (a race with a joining request): its time is no arm's cost.
A step where no request drafts is Transformers' own, untouched. Everything else (errors, resets,
offloading, warm-up) is Transformers' processor's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import timing
from ._compat import cb
from .policies import StepContext
from .request_rows import Draft, RequestRows, RequestSampler
from .stats import StepRecord
from .verify import verify

logger = logging.getLogger(__name__)
LOG_EVERY = 1000       # drafting forwards between two INFO lines of a processor's counts


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
    future: object             # Transformers' FutureRequestState
    first: int
    count: int
    drafts: Draft


@dataclass
class Verdict:
    """What a speculating request keeps of a step: `accepted` drafts by `verify`, of which `appended`
    go into its tokens before Transformers appends the step's last token (fewer when an EOS among
    them ends the request: the EOS is the last token)."""
    drafted: int
    accepted: int
    appended: list[int]
    logprobs: list[float] | None


class SpecBatchProcessor:
    """Transformers' batch processor with a speculative step; every attribute not defined here is
    the processor's own (`__getattr__`)."""

    def __init__(self, processor, speculation, model):
        self.processor, self.speculation, self.model = processor, speculation, model
        self.drafter = self._new_rows()
        self._drafts: dict[str, Draft] = {}       # request id -> this step's drafts
        self._rows: list[LogitRows] | None = None  # None: a plain step (Transformers' own)
        self._verdicts: dict[str, Verdict] = {}
        self._plan, self._draft_s, self._verify_s = None, 0.0, 0.0    # this step's (ctx, k's, requests), times
        self.counts = SpecCounts()

    def __getattr__(self, name):
        return getattr(self.processor, name)

    def _new_rows(self) -> RequestRows:
        sampler = RequestSampler(cb.processors(self.processor), cb.samples(self.processor))
        return RequestRows(self.speculation.new_drafter(), sampler, self.speculation.device(self.model))

    def reset(self) -> None:
        self._drafts, self._rows, self.drafter = {}, None, self._new_rows()
        self.processor.reset()

    # plan + draft (the generation loop's thread runs with autograd on unless its starter was in
    # inference mode: Transformers' forward turns it off, and so must the drafter's)
    @torch.no_grad()
    def prepare_next_batch(self) -> bool:
        self._propose()
        if not self.processor.prepare_next_batch():
            self.drafter.accepted({})
            return False
        self._rows = self._logit_rows()
        return True

    def _propose(self) -> None:
        """Each decoding request's query: its pending token + its drafts. Transformers reserves
        memory for a logit row per request (`request_limit`); every draft takes a row, so the drafts
        come out of the decoding requests' spare rows and the step schedules that many fewer requests."""
        limit, decoding = cb.request_limit(self.processor), cb.decoding_requests(self.processor)
        rooms = [cb.room(state) for state in decoding]
        self._plan, k = None, 0
        if decoding:
            lags = self.drafter.lags(decoding)
            ctx = StepContext(step=self.counts.steps, batch_size=len(decoding), num_drafters=1,
                              rows=list(range(len(decoding))), remaining=int(min(max(rooms), 1 << 30)),
                              context_tokens=sum(len(p) + len(g) for p, g in map(cb.request_tokens, decoding)),
                              max_lag=max(lags, default=0), lag_tokens=sum(lags))
            # a step that may prefill a prompt drafts nothing: the joining request's first token comes
            # as soon as in Transformers' own step, and the draft model prefills it a step behind (the
            # policy still observes the step: what a prompt token costs the target)
            if not cb.prompt_waiting(self.processor):
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
            cb.set_query(state, drafts.tokens[:n])
            if n:
                self._drafts[cb.request_id(state)] = drafts.cut(n)
        self._draft_s = timing.now() - start
        cb.limit_requests(self.processor, limit - sum(len(d.tokens) for d in self._drafts.values()))

    def _logit_rows(self) -> list[LogitRows] | None:
        """After Transformers prepared the batch: a logit row at each position of a speculating
        request (`cb.widen_logits`). None if no scheduled request drafts."""
        futures = cb.scheduled(self.processor)
        if not any(cb.request_id(cb.query(f)[0]) in self._drafts for f in futures):
            return None
        rows, positions, requests, end = [], [], [], 0
        for future in futures:
            state, length = cb.query(future)
            end += length
            drafts = self._drafts.get(cb.request_id(state), Draft([], []))
            if drafts.tokens:
                cb.whole_query(future)       # a token budget that cut the drafts left them as "remaining prefill"
                count = length
            else:
                count = int(cb.has_new_token(future))
            rows.append(LogitRows(future=future, first=len(positions), count=count, drafts=drafts.cut(count - 1)))
            positions.extend(range(end - count, end))
            requests.extend([future] * count)
        cb.widen_logits(self.processor, requests, positions)
        return rows

    # verify
    @torch.no_grad()
    def _generation_step(self, model) -> None:
        start = timing.now()
        if self._rows is None:
            cb.step(self.processor, model)
        else:
            cb.forward(self.processor, model, sum(row.count for row in self._rows), self._accept)
        self._verify_s = timing.now() - start

    def _accept(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """The step's pick, in place of Transformers' sampler: `verify` over each request's logit rows
        (scores [1, m, vocab], processed), its drafts and their distributions. Request i's last token
        goes to output_ids[0, i] (output_ids [2, >= m]; row 1: its log-probability, when asked for),
        where Transformers' `update_batch` reads it; its `Verdict` keeps the drafts before it."""
        rows = [row for row in self._rows if row.count]
        width = max(row.count for row in rows)                        # k + 1
        index = torch.tensor([[row.first + min(j, row.count - 1) for j in range(width)] for row in rows])
        target = scores[0, index.to(scores.device)]                   # [r, k + 1, vocab]
        tokens = torch.zeros(len(rows), width - 1, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, :len(row.drafts.tokens)] = torch.tensor(row.drafts.tokens, dtype=torch.long)
        counts = torch.tensor([len(row.drafts.tokens) for row in rows])
        probs = None
        if cb.samples(self.processor) and any(row.drafts.probs is not None for row in rows):
            probs = target.new_zeros(len(rows), width - 1, target.shape[-1])
            for i, row in enumerate(rows):
                if row.drafts.tokens:
                    probs[i, :len(row.drafts.tokens)] = row.drafts.probs.to(probs.device)
        tokens, counts = tokens.to(scores.device), counts.to(scores.device)
        result = verify(tokens, counts, target, probs, cb.samples(self.processor))
        emitted = torch.cat([tokens, tokens.new_zeros(len(rows), 1)], 1)          # [r, k + 1]
        emitted[torch.arange(len(rows)), result.num_accepted] = result.next_tokens
        logprobs = torch.log_softmax(target, -1).gather(-1, emitted[..., None]).squeeze(-1) \
            if cb.returns_logprobs(self.processor) else None
        self._verdicts, lasts = {}, []
        for i, (row, accepted, out) in enumerate(zip(rows, result.num_accepted.tolist(), emitted.tolist())):
            state, _ = cb.query(row.future)
            # the last token: the first EOS among the accepted drafts, else the replacement / bonus
            last = next((j for j in range(accepted) if cb.stops(state, out[j])), accepted)
            lasts.append((out[last], None if logprobs is None else logprobs[i, last]))
            self._verdicts[cb.request_id(state)] = Verdict(
                drafted=len(row.drafts.tokens), accepted=accepted, appended=out[:last],
                logprobs=None if logprobs is None else logprobs[i, :last].tolist())
        output_ids[0, :len(rows)] = torch.tensor([t for t, _ in lasts], dtype=output_ids.dtype)
        if logprobs is not None:
            output_ids[1, :len(rows)] = torch.stack([lp for _, lp in lasts]).view(torch.int32)

    # commit
    @torch.no_grad()
    def update_batch(self) -> None:
        verdicts, self._verdicts = self._verdicts, {}
        if self._rows is not None:
            for row in self._rows:
                state, length = cb.query(row.future)
                verdict = verdicts.get(cb.request_id(state))
                if verdict is not None and verdict.drafted:
                    cb.append_tokens(state, verdict.appended, verdict.logprobs)
                    # the cache keeps the pending token and the appended drafts (the last token: not yet fed)
                    cb.keep_query_prefix(cb.paged_cache(self.processor), row.future, 1 + len(verdict.appended))
        scheduled = cb.scheduled(self.processor)
        has_token = {cb.request_id(cb.query(f)[0]) for f in scheduled if cb.has_new_token(f)}
        queries = {cb.request_id(state): length for state, length in map(cb.query, scheduled)}
        self._rows = None
        self.processor.update_batch()        # Transformers': the last token, EOS, limits, outputs, forks
        kept = {rid: v.accepted for rid, v in verdicts.items() if v.drafted}
        self.counts.add(requests=len(scheduled), drafted=sum(v.drafted for v in verdicts.values()),
                        accepted=sum(kept.values()), drafting_requests=len(kept))
        self.drafter.accepted(kept)
        emitted = {rid: len(verdicts[rid].appended) + 1 if rid in verdicts else 1 for rid in has_token}
        self._observe({rid: v.drafted for rid, v in verdicts.items()}, kept, emitted, queries)

    def _observe(self, verified: dict[str, int], kept: dict[str, int], emitted: dict[str, int],
                 queries: dict[str, int]) -> None:
        """The policy learns from the step's record: per decoding request planned, drafts verified,
        accepted and tokens emitted; the drafting and verification times; the prompt tokens that
        other requests prefilled in the forward (`queries`: scheduled tokens per request)."""
        if self._plan is None:
            return
        ctx, decided_k, k, decoding = self._plan
        ids = [cb.request_id(s) for s in decoding]
        prefill_tokens = sum(queries.values()) - sum(queries.get(i, 0) for i in ids)    # other requests' queries
        record = StepRecord.of_step(ctx, k, decided_k, [verified.get(i, 0) for i in ids], [kept.get(i, 0) for i in ids],
                                    emitted=[emitted.get(i, 0) for i in ids], draft_s=self._draft_s,
                                    verify_s=self._verify_s,
                                    prefill_tokens=prefill_tokens)
        self.speculation.policy.observe(record)
