"""The decoding loop: a `custom_generate` callable for Transformers' `generate()` (batch >= 1).

One step (`DecodingLoop.step`) of the rows still decoding:
  plan    the policy chooses (drafter, k) from the host's copy of the rows' numbers (`SpecPolicy.plan`);
  draft   the chosen drafters propose (tokens, q), cut to the room left and the policy's trims;
  verify  `verify.target_verify`: one target forward over each row's pending token + drafts, the
          shared `verify`;
  commit  one host read (accepted counts, stops); each row appends its accepted tokens + 1, cut at
          a stop; the target and the drafters roll their caches back per row; finished rows retire;
  observe the policy gets the `StepRecord` (its phase times read without waiting on the device).
The models' side of each phase is `CachedModel`'s, on a dynamic or a static (compiled) cache.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from . import _compat, compiled, costmodel, distributed
from .cached_model import CachedModel
from .drafters import Drafter, Proposal, TargetStatesDrafter, as_drafter, output_vocab_size
from .offload import RESIDENT, DraftOffload, as_offload
from .policies import Decision, SpecPolicy, StepContext, auto_policy, resolve_policy
from .sampling import TokenSampler
from .scoring import score_drafters
from .sequences import SequenceBatch
from .stats import SpecStats, StepRecord
from .timing import PhaseClock
from .verify import target_verify


UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")
# Transformers' own drafting kinds (its loop, batch 1): with assistant_models= they would be dropped
TRANSFORMERS_DRAFTING = ("speculation_type", "use_mtp", "assistant_early_exit")
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")   # static: every model's KV cache is preallocated
GRAPHABLE_ATTENTION = ("sdpa", "eager")     # attention a compiled static forward can run inside a CUDA graph
# what generate() itself puts in model_kwargs for a decoder-only text model; anything else
# (token_type_ids, pixel_values, ...) would be silently ignored by our forwards, so it is refused
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", *_compat.CACHE_KWARG_NAMES}


def generate(model, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList | None = None,
             stopping_criteria: StoppingCriteriaList | None = None,
             generation_config: GenerationConfig | None = None, synced_gpus: bool = False,
             streamer=None, assistant_models=None, spec_policy=None,
             spec_generator: torch.Generator | None = None, spec_streamer=None, draft_offload=None, **model_kwargs):
    """Speculative decoding as `model.generate(custom_generate=hf_specdec.generate, ...)`.

    assistant_models: list of Transformers causal LMs (same vocabulary as `model`) or Drafters.
    spec_policy: SpecPolicy / LengthPolicy / DrafterSelector / a name ("fixed:4", "adaspec", ...) /
        None or "auto" (`hf_specdec.policies.auto_policy`; in this loop one per target and drafters, kept
        across calls).
    spec_generator: torch.Generator for every random draw (default: torch's global RNG).
    draft_offload: a `hf_specdec.DraftOffload` (True: one with its defaults) that moves the draft
        models off the accelerator while the policy has speculation off and memory is tight.
    spec_streamer: a streamer (Transformers does not forward `streamer` to custom callables;
        `hf_specdec.enable` maps `streamer=` here for you).
    Returns generate()'s output; `return_dict_in_generate=True` adds `.spec_stats`.
    """
    generation_config = generation_config or model.generation_config
    drafters, policy = check_spec_args(model, assistant_models, spec_policy)
    offload = as_offload(draft_offload)
    _check_call(input_ids, generation_config, model_kwargs)
    _check_cache(model, drafters, generation_config)
    ensemble_weight = _check_ensemble(generation_config, drafters)
    sampler = TokenSampler(logits_processor, generation_config.do_sample, spec_generator,  # may refuse processors
                           ensemble_weight)
    stopping_criteria = stopping_criteria or StoppingCriteriaList()
    # generate() pads finished rows only when an EOS criterion exists; otherwise rows that a
    # criterion stopped keep producing real tokens until every row has stopped.
    freeze_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    ranks = distributed.ranks_of(model)
    if ranks is not None:        # tensor parallelism: every rank runs rank 0's decisions and draws
        distributed.check(ranks, model, drafters, input_ids, draft_offload)
        policy = distributed.RankZeroPolicy(policy, ranks)
        if sampler.do_sample:
            sampler.generator = ranks.shared_generator(sampler.generator, input_ids.device)
        if not judged_by_tokens(stopping_criteria):
            stopping_criteria = StoppingCriteriaList([distributed.RankZeroCriteria(stopping_criteria, ranks)])
    if spec_streamer is not None:
        spec_streamer.put(input_ids.cpu())  # generate() does this for `streamer=`, which never reaches us

    static = generation_config.cache_implementation == "static"
    batch = SequenceBatch(input_ids, model_kwargs.get("attention_mask"), generation_config.max_length,
                          pad_token_id=_compat.pad_token_id(generation_config), static_cache=static,
                          compile_config=_compat.compile_config(model, generation_config) if static else None)
    ensure_profile(policy, model, drafters, input_ids.shape[0], ranks)
    loop = DecodingLoop(model, batch, drafters, policy, sampler, stopping_criteria, freeze_finished, spec_streamer,
                        offload)
    stats = loop.run()
    sequences = batch.output()
    if generation_config.return_dict_in_generate:
        return _compat.SpecGenerateOutput(sequences=sequences, spec_stats=stats)
    return sequences


class DecodingLoop:
    """The steps of one generate() call, or of a serving run: `begin`, then `step` while rows are
    active (`run` does both for generate()); a serving engine also `join`s new requests between
    steps. The loop owns `batch.active`; rows leave it when they finish (`retire_finished`).

    model: the target; freeze_finished: rows stop at their own stop (EOS) rather than waiting for
    the call's last; streamer: gets completed columns; offload: a DraftOffload, asked before each
    step whether the drafts may run (it may move them off the device while speculation is off)."""

    def __init__(self, model, batch: SequenceBatch, drafters: list[Drafter], policy: SpecPolicy,
                 sampler: TokenSampler, stopping_criteria, freeze_finished: bool = True, streamer=None,
                 offload: DraftOffload | None = None):
        self.batch, self.target, self.drafters, self.policy = batch, CachedModel(model), drafters, policy
        self.offload = offload
        self.sampler, self.stopping_criteria = sampler, stopping_criteria
        self.freeze_finished, self.streamer = freeze_finished, streamer
        n = batch.tokens.shape[0]                                            # every row, active or not
        self.limit = torch.full((n,), batch.max_length, dtype=torch.long, device=batch.tokens.device)
        self.stopped_at = torch.full((n,), -1, dtype=torch.long, device=batch.tokens.device)  # length at stop
        self.host_limit, self.host_stopped = [batch.max_length] * n, [-1] * n                 # the same, on the host
        self.streamed = batch.prompt_len
        self.clock = PhaseClock(self.target.device)
        self._late = []                  # (record, marks, drafter marks) of steps not yet observed
        # only generate()'s own criteria: judged in one pass (`_plain_stops`) from these two
        self._plain_criteria = judged_by_tokens(stopping_criteria)
        eos = [c.eos_token_id.to(batch.tokens.device).flatten() for c in stopping_criteria if type(c) is EosTokenCriteria]
        self._eos = torch.cat(eos) if eos else None
        self._max_length = min((c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria),
                               default=batch.max_length + 1)      # none: rows stop at their limit only

    def begin(self) -> None:
        """Empty caches for the active rows (none for a serving run, whose rows `join`)."""
        batch = self.batch
        self.target.reset(batch)
        for drafter in self.drafters:
            drafter.follow(self.target)
            drafter.begin(batch, self.sampler)
        if self.offload is not None:
            self.offload.begin(self.drafters, batch)
        names = [d.name for d in self.drafters]
        self.stats = SpecStats(drafter_names=[n if names.count(n) == 1 else f"{n}[{i}]" for i, n in enumerate(names)],
                               policy=self.policy, ensemble_weight=self.sampler.ensemble_weight)
        self.policy.begin(self.context(0) if len(batch.active) else StepContext(0, 0, len(self.drafters)))

    def run(self) -> SpecStats:
        """generate(): every active row to its end."""
        self.begin()
        self.stats.prime_seconds = self.prime()
        while len(self.batch.active):
            self.step()
            self.stream(final=False)
        self.finish()
        self.stream(final=True)
        return self.stats

    def prime(self) -> float:
        """Warm start: score every drafter on the selector's `prompt_positions` last prompt
        positions (contexts the target prefills anyway) and hand it the gammas before the first
        decision. The target stops one token short, so step 0 proceeds as usual. Returns seconds."""
        selector, batch, rows = self.policy.selector, self.batch, self.batch.active
        width = min(getattr(selector, "prompt_positions", 0), int(batch.prompt_mask.sum(1).min()) - 1)
        if width < 1:
            return 0.0
        t0 = time.perf_counter()
        end = batch.lengths[rows] - 1
        tokens, real = self.target.pending(batch, end)
        logits = self.target.forward(tokens, real, keep=width)            # predicts positions end-width+1 .. end
        scores = self.sampler.scores(batch, logits, offset=-width)
        gammas, _ = score_drafters(self.drafters, batch, end - width + 1, scores, self.sampler.do_sample)
        selector.prime({row: gammas[i].tolist() for i, row in enumerate(rows.tolist())})
        return time.perf_counter() - t0

    def context(self, step: int) -> StepContext:
        """What the policy sees before step `step`, from the host's copy of the rows' numbers (no
        device read). Also sets `least_room` and `longest` (the loop's own use of the same numbers)."""
        batch, rows = self.batch, self.batch.host_active
        lengths = batch.active_host_lengths()
        lags = [max(lag, default=0) for lag in (d.host_lag(lengths) for d in self.drafters) if lag is not None]
        if len(lags) < len(self.drafters):     # a drafter keeps no host copy: read their lags
            lags = [int(lag.max()) for d in self.drafters
                    if (lag := d.lag(batch, batch.lengths[batch.active])) is not None]
        rooms = sorted(self.host_limit[row] - length for row, length in zip(rows, lengths))
        self.longest, self.least_room = max(lengths), rooms[0] - 1       # least_room: drafts that fit in every row
        context_tokens = sum(length - batch.host_real_start[row] for row, length in zip(rows, lengths))
        return StepContext(step, len(rows), len(self.drafters), list(rows), context_tokens=context_tokens,
                           max_lag=max(lags, default=0), remaining=rooms[-1])

    def step(self) -> StepRecord:
        """One step of the active rows: plan -> draft -> verify -> commit -> observe (the module
        docstring). On the device's side it reads at most once: the accepted counts and stops."""
        begin, warmups = time.perf_counter(), compiled.warmup_calls()
        plan = self.plan()
        t0, c0 = time.perf_counter(), self.clock.mark()
        drafts, drafted = self.draft(plan)
        c1 = self.clock.mark()
        verified = target_verify(self.target, self.batch, drafts.tokens, drafts.lengths, drafts.probs, self.sampler,
                                 rollback=False, ensemble=True)
        t2, c2 = time.perf_counter(), self.clock.mark()
        record, read, waited = self.commit(plan, drafts, verified)
        # the host's own work: not its wait in the read for the device's drafting and verifying,
        # which the clock's marks already time (on a GPU they would count twice, and only on
        # steps that read: plain steps would look cheap)
        record.overhead_s = time.perf_counter() - begin - (t2 - t0) - waited
        record.warmup = compiled.warmup_calls() != warmups
        self.stats.steps.append(record)
        self._late.append((record, (c0, c1, c2), drafted))
        if read or not self.clock.events:   # the read waited for every mark so far: reading them waits on nothing
            self.observe_late()
        return record

    def plan(self) -> StepPlan:
        """The policy's choice for this step, from the host's numbers."""
        batch = self.batch
        ctx = self.context(len(self.stats.steps))
        decision, k = self.policy.plan(ctx)
        if self.offload is not None and not self.offload.step(ctx, k):   # the drafts are off the device
            k = 0
        batch.reserve(k + 1, self.longest)
        choice = _per_row_choice(decision.drafter, ctx.batch_size, len(self.drafters)) if k else [-1] * ctx.batch_size
        return StepPlan(ctx=ctx, decision=decision, k=k, choice=choice, start=batch.lengths[batch.active],
                        host_start=batch.active_host_lengths())

    def draft(self, plan: StepPlan) -> tuple[Proposal, dict]:
        """Each row's drafts, written at its end: the chosen drafter's, cut to the room left and to
        the policy's trims. Returns them and each drafter's (start, end) clock marks."""
        batch, rows, start, k = self.batch, self.batch.active, plan.start, plan.k
        drafted = {}
        if not k:
            n = len(plan.choice)
            return Proposal(start.new_zeros(n, 0), torch.zeros_like(start), host_lengths=[0] * n), drafted
        proposal = self.propose(plan.choice, k, drafted)
        lengths = torch.minimum(proposal.lengths, self.limit[rows] - start - 1)          # drafts that fit
        host_lengths = None
        if proposal.host_lengths is not None:
            host_lengths = [min(n, self.host_limit[row] - s - 1)
                            for n, row, s in zip(proposal.host_lengths, batch.host_active, plan.host_start)]
        if self.policy.length.verify_lengths is not None:   # a drafter without confidences (n-gram lookup) is certain: 1.0
            confidence = proposal.confidence if proposal.confidence is not None else \
                torch.ones_like(proposal.tokens, dtype=torch.float)
            host_lengths = lengths.tolist() if host_lengths is None else host_lengths
            host_lengths = self.policy.trim(host_lengths, [c[:n] for c, n in zip(confidence.tolist(), host_lengths)])
            lengths = torch.tensor(host_lengths, device=start.device)
        # verify only as many positions as the longest proposal (n-gram drafters may find nothing)
        width = max(host_lengths) if host_lengths is not None else int(lengths.max())
        probs = proposal.probs[:, :width] if proposal.probs is not None else None
        batch.write(rows, start, proposal.tokens[:, :width])
        return Proposal(proposal.tokens[:, :width], lengths, probs, host_lengths=host_lengths), drafted

    def commit(self, plan: StepPlan, drafts: Proposal, verified) -> tuple[StepRecord, bool, float]:
        """Each row keeps its accepted drafts + 1 token, cut at a stop; every cache forgets the
        rest; finished rows retire; drafters are scored if the selector learns so. One host read
        (the drafted and accepted counts and the stops), none on a plain step no row can stop in.
        Returns the step's record, whether it read the device and the seconds the read waited."""
        batch, rows, start = self.batch, self.batch.active, plan.start
        result, width = verified.result, drafts.tokens.shape[1]
        batch.tokens[rows, start + result.num_accepted] = result.next_tokens
        emitted = result.num_accepted + 1
        stops = self.stop_lengths(rows, start, emitted, width + 1, self.longest)     # [n] or None
        read = bool(width) or stops is not None
        proposed = accepted = [0] * len(plan.choice)
        host_stops, waited = None, 0.0
        if read:
            numbers = [drafts.lengths, result.num_accepted] + ([stops] if stops is not None else [])
            waited = time.perf_counter()
            proposed, accepted, *host_stops = host_read(torch.stack(numbers))   # the one host read
            waited = time.perf_counter() - waited
        self.target.rollback(verified.spec_start, result.num_accepted, accepted)
        for d in {c for c in plan.choice if c >= 0}:
            mine = [c == d for c in plan.choice]
            if all(mine):                                               # every row chose it
                self.drafters[d].accepted(result.num_accepted, accepted)
            else:
                chosen = torch.tensor(mine, device=start.device)
                self.drafters[d].accepted(torch.where(chosen, result.num_accepted, 0),
                                          [a if m else 0 for a, m in zip(accepted, mine)])
        host_emitted = [a + 1 for a in accepted]
        stopped = bool(host_stops) and max(host_stops[0]) >= 0
        if stopped:
            emitted, host_emitted = self.apply_stops(rows, start, emitted, stops, batch.host_active, host_stops[0],
                                                     plan.host_start, host_emitted)
        batch.lengths[rows] = start + emitted
        for row, s, e in zip(batch.host_active, plan.host_start, host_emitted):
            batch.host_lengths[row] = s + e
        ctx = plan.ctx
        record = StepRecord.of_step(ctx, plan.k, plan.decision.length, proposed, accepted,
                                    emitted=[max(e, 0) for e in host_emitted], drafters=plan.choice)
        # a row finishes at a stop or at its limit, which it reaches only with more than `least_room` tokens
        keep = self.retire_finished() if stopped or width + 1 > self.least_room else None
        resident = self.offload is None or self.offload.state == RESIDENT     # scoring runs every drafter
        if len(batch.active) and resident and self.policy.wants_feedback(ctx.step):
            start, scores = (start, verified.scores) if keep is None else (start[keep], verified.scores[keep])
            self.feedback(record, start, scores)
        return record, read, waited

    def observe_late(self) -> None:
        """Fill the pending steps' phase times from their clock marks, then let the policy observe
        them. With CUDA events this runs after a step's host read, which waited for every mark
        recorded before it: reading them never waits on the device (a plain step that reads nothing
        is observed after the next one that does). No-op when nothing is pending."""
        late, self._late = self._late, []
        seconds = self.clock.seconds
        for record, (c0, c1, c2), drafted in late:
            record.draft_s, record.verify_s = seconds(c0, c1), seconds(c1, c2)
            record.drafter_s = {d: seconds(*marks) for d, marks in drafted.items()}
            self.policy.observe(record)

    def finish(self) -> None:
        """End of the steps: the policy observes the last one (waiting for its marks if need be)."""
        self.observe_late()

    def join(self, rows: torch.Tensor, input_ids: torch.LongTensor, attention_mask: torch.Tensor,
             limits: torch.Tensor) -> None:
        """Start new requests in inactive `rows` [m] (continuous batching): prompts [m, p] (left-padded,
        mask [m, p]) are prefilled on their own by the target, which picks each one's first token, and
        by the drafters; their caches then follow the running rows', and they decode until their
        total length reaches `limits` [m] or a stop."""
        batch = self.batch
        batch.refill(rows, input_ids, attention_mask)
        self.limit[rows], self.stopped_at[rows] = limits, -1
        host_rows = rows.tolist()
        for row, limit in zip(host_rows, limits.tolist()):
            self.host_limit[row], self.host_stopped[row] = limit, -1
        self.policy.selector.join(host_rows)
        joining = batch.view(active=rows)
        joiner = CachedModel(self.target.model)
        joiner.reset(joining, from_first_real=True)       # prompts sit left-padded to the batch's width
        logits = joiner.forward(*joiner.pending(joining), keep=1)             # [m, 1, vocab]
        batch.tokens[rows, batch.prompt_len] = self.sampler.pick(self.sampler.scores(joining, logits)[:, 0])
        batch.lengths[rows] += 1                  # the first token is the target's lag: 1, as for all
        for row in host_rows:
            batch.host_lengths[row] += 1
        self.cut_at_stops(rows, batch.lengths[rows] - 1, torch.ones_like(rows))
        resident = self.offload is None or self.offload.state == RESIDENT
        for drafter in self.drafters:
            drafter.add_rows(joining, prefill=resident)
        self.target.append(joiner)
        batch.set_active(torch.cat([batch.active, rows]), batch.host_active + host_rows)
        self.retire_finished()                    # one-token requests, or a first token that stops

    def propose(self, choice: list[int], k: int, marks: dict) -> Proposal:
        """Each row's drafts from its chosen drafter; a drafter proposes for the whole batch (its
        cache is one rectangle) and rows that chose another drafter ignore it. marks: gets each
        drafter's (start, end) clock marks."""
        proposals = {}
        for d in sorted(set(choice)):
            start = self.clock.mark()
            proposals[d] = self.drafters[d].propose(self.batch, k, self.policy.continue_drafting)
            marks[d] = start, self.clock.mark()
        if len(proposals) == 1:
            return proposals[choice[0]]
        pick = torch.tensor([sorted(proposals).index(d) for d in choice], device=self.batch.tokens.device)
        rows = torch.arange(len(choice), device=pick.device)
        parts = [proposals[d] for d in sorted(proposals)]
        width = max(p.tokens.shape[1] for p in parts)            # drafters may stop at different lengths
        parts = [_pad_proposal(p, width) for p in parts]
        tokens = torch.stack([p.tokens for p in parts])[pick, rows]
        lengths = torch.stack([p.lengths for p in parts])[pick, rows]
        confidence = torch.stack([p.confidence if p.confidence is not None else torch.ones_like(p.tokens, dtype=torch.float)
                                  for p in parts])[pick, rows]
        probs = None
        if any(p.probs is not None for p in parts):   # point masses as one-hot rows next to real q
            vocab = next(p.probs.shape[-1] for p in parts if p.probs is not None)
            dense = [p.probs if p.probs is not None else
                     torch.nn.functional.one_hot(p.tokens, vocab).float() for p in parts]
            probs = torch.stack(dense)[pick, rows]
        host = None if any(p.host_lengths is None for p in parts) else \
            [proposals[d].host_lengths[i] for i, d in enumerate(choice)]
        return Proposal(tokens, lengths, probs, confidence, host_lengths=host)

    def feedback(self, record: StepRecord, start: torch.Tensor, target_scores: torch.Tensor) -> None:
        """Score every drafter on the positions this step verified (full-information feedback)."""
        gammas, seconds = score_drafters(self.drafters, self.batch, start, target_scores, self.sampler.do_sample)
        rows = self.batch.active
        count, rows = torch.stack([self.batch.lengths[rows] - start, rows]).tolist()      # one host read
        record.gammas = {row: g[:c] for row, g, c in zip(rows, gammas.tolist(), count)}   # and one more
        record.replay_s = dict(enumerate(seconds))

    def cut_at_stops(self, rows: torch.Tensor, start: torch.Tensor, emitted: torch.Tensor) -> None:
        """`stop_lengths` and `apply_stops` for rows whose lengths are already advanced (joiners)."""
        stops = self.stop_lengths(rows, start, emitted, int(emitted.max()), None)
        if stops is not None and (host_stops := stops.tolist()) and max(host_stops) >= 0:
            self.apply_stops(rows, start, emitted, stops, rows.tolist(), host_stops, start.tolist(), emitted.tolist())

    def stop_lengths(self, rows: torch.Tensor, start: torch.Tensor, emitted: torch.Tensor, most: int,
                     longest: int | None) -> torch.Tensor | None:
        """Where the stopping criteria stop each of `rows` [n] within its `emitted` [n] new tokens
        from start[n], as generate() checks them after each token: [n] the length at the stop, -1
        where none; None when no row can stop (nothing to read). most: the largest `emitted`;
        longest: the largest `start`, if known."""
        if self._plain_criteria:
            return self._plain_stops(rows, start, emitted, most, longest)
        return torch.tensor(self._stops_by_call(rows, start, emitted), device=rows.device)

    def apply_stops(self, rows: torch.Tensor, start: torch.Tensor, emitted: torch.Tensor, stops: torch.Tensor,
                    host_rows: list[int], host_stops: list[int], host_start: list[int],
                    host_emitted: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Record the stops [n] of `rows` (on the device and the host) and cut what each row keeps
        (`emitted` [n], on the device and the host); returns what each row keeps, on both."""
        self.stopped_at[rows] = stops
        for row, stop in zip(host_rows, host_stops):
            self.host_stopped[row] = stop
        if self.freeze_finished:
            emitted = torch.where(stops >= 0, stops - start, emitted)
            host_emitted = [stop - s if stop >= 0 else e for stop, s, e in zip(host_stops, host_start, host_emitted)]
        elif min(self.host_stopped) >= 0:
            # every row has stopped: all rows end at the latest stop, like generate()'s last step
            # (rows already retired at max_length included)
            latest = max(self.host_stopped)
            self.limit[:], self.host_limit = latest, [latest] * len(self.host_limit)
            self.batch.lengths.clamp_(max=latest)
            self.batch.host_lengths = [min(length, latest) for length in self.batch.host_lengths]
            emitted = torch.minimum(emitted, self.limit[rows] - start)
            host_emitted = [min(e, latest - s) for e, s in zip(host_emitted, host_start)]
        return emitted, host_emitted

    def _stops_by_call(self, rows: torch.Tensor, start: torch.Tensor, emitted: torch.Tensor) -> list[int]:
        """Any criteria: one call per distinct prefix length, grouped in Python. Returns per row the
        length at which it stopped, -1 if it did not."""
        starts, counts, stopped = start.tolist(), emitted.tolist(), self.stopped_at[rows].tolist()
        for j in range(1, max(counts) + 1):
            groups: dict[int, list[int]] = {}
            for i, (s, c, at) in enumerate(zip(starts, counts, stopped)):
                if c >= j and at < 0:
                    groups.setdefault(s + j, []).append(i)
            for length, members in groups.items():
                # full batch in original order: criteria may keep per-row state (as processors do)
                hit = self.stopping_criteria(self.batch.tokens[:, :length], None).to(rows.device)[rows[members]]
                for i, h in zip(members, hit.tolist()):
                    if h:
                        stopped[i] = length
        return stopped

    def _plain_stops(self, rows: torch.Tensor, start: torch.Tensor, emitted: torch.Tensor, most: int,
                     longest: int | None) -> torch.Tensor | None:
        """generate()'s own criteria (max length, EOS) judged for every new token at once, as the
        calls above would (they see only the length and the last token): a step that emits k + 1
        tokens per row at different lengths would otherwise cost up to (k + 1) x rows criteria calls.
        None if no row can stop (no EOS, and no row reaches max_length)."""
        tokens = self.batch.tokens
        reaches_max = longest is None or longest + most >= self._max_length     # a row may reach max_length
        if self._eos is None and not reaches_max:
            return None
        # (each of these small ops costs ~10 us on a CPU, a plain step's bookkeeping ~1 ms in all)
        offsets = torch.arange(most, device=start.device)
        positions = (start[:, None] + offsets).clamp_(max=tokens.shape[1] - 1)   # [n, j]: the j-th new token
        hit = torch.isin(tokens[rows[:, None], positions], self._eos) if self._eos is not None else None
        if reaches_max:
            at_max = positions + 1 >= self._max_length
            hit = at_max if hit is None else hit | at_max
        if most > 1:              # every row emits at least one token
            hit &= offsets < emitted[:, None]
        return torch.where(hit.any(1), start + hit.int().argmax(1) + 1, -1)

    def retire_finished(self) -> torch.Tensor:
        """Drop rows that are done (judged on the host); returns the kept rows' indices into the
        previous active rows."""
        batch, rows, host_rows = self.batch, self.batch.active, self.batch.host_active
        done = [batch.host_lengths[row] >= self.host_limit[row] or (self.freeze_finished and self.host_stopped[row] >= 0)
                for row in host_rows]
        host_keep = [i for i, d in enumerate(done) if not d]
        if len(host_keep) == len(host_rows):
            return torch.arange(len(rows), device=rows.device)
        finished = [row for row, d in zip(host_rows, done) if d]
        keep, finished_rows = torch.tensor(host_keep + finished, device=rows.device).split([len(host_keep), len(finished)])
        batch.clear_scratch(finished_rows)    # finished rows read as generate()'s: pad past the end
        batch.set_active(rows[keep], [host_rows[i] for i in host_keep])
        self.target.select_rows(keep, host_keep)        # even to no rows: the engine may append joiners next
        for drafter in self.drafters:
            drafter.select_rows(keep, host_keep)
        return keep

    def stream(self, final: bool) -> None:
        """Put completed columns, as generate() does once per step; rows advance unevenly, so a
        column goes out once every row still decoding has reached it."""
        if self.streamer is None:
            return
        batch = self.batch
        end = int(batch.lengths.max()) if final or not len(batch.active) else int(batch.lengths[batch.active].min())
        for column in range(self.streamed, end):
            self.streamer.put(batch.tokens[:, column].cpu())
        self.streamed = max(self.streamed, end)
        if final:
            self.streamer.end()


@dataclass
class StepPlan:
    """What the policy chose for a step, and where the active rows start."""

    ctx: StepContext
    decision: Decision
    k: int                           # draft length run (0: a plain step)
    choice: list[int]                # each active row's drafter (-1: none)
    start: torch.Tensor              # [n] the active rows' lengths
    host_start: list[int]            # the same on the host


def host_read(numbers: torch.Tensor) -> list:
    """The step's one read of the device: it waits for the work queued before it."""
    return numbers.tolist()


def _pad_proposal(p: Proposal, width: int) -> Proposal:
    """The same proposal with its [n, k'] tensors zero-padded to k' = width (lengths unchanged)."""
    def pad(t):
        return None if t is None else torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, width - t.shape[1]))
    return Proposal(pad(p.tokens), p.lengths, pad(p.probs), pad(p.confidence))


def judged_by_tokens(stopping_criteria) -> bool:
    """Only generate()'s own criteria (max length, EOS): they read the tokens alone."""
    return all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria)


def _per_row_choice(drafter, n: int, num_drafters: int) -> list[int]:
    """A selector's choice (one index, or one per active row) as a list of n valid indices."""
    choice = [drafter] * n if isinstance(drafter, int) else list(drafter)
    if len(choice) != n or not all(isinstance(d, int) and 0 <= d < num_drafters for d in choice):
        raise ValueError(f"the drafter selector must return an index in [0, {num_drafters}) or a list of "
                         f"{n} such indices (one per active row), got {drafter!r}")
    return choice


# target -> {its drafters' identities: the "auto" policy}: it learns across calls
_AUTO_POLICIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _identity(drafter: Drafter):
    """What an "auto" policy learned about: a drafter's models, or its kind for one without
    (a fresh PromptLookupDrafter() per call is the same drafter)."""
    models = drafter.models()
    return tuple(map(id, models)) if models else type(drafter).__name__


def check_spec_args(model, assistant_models, spec_policy) -> tuple[list[Drafter], SpecPolicy]:
    """Validate the target, `assistant_models` and `spec_policy`; (drafters, policy)."""
    if model.config.is_encoder_decoder:
        raise ValueError(f"the batched loop runs decoder-only targets; {type(model).__name__} is an encoder-decoder: "
                         "hf_specdec.enable(model, loop='transformers') runs it through Transformers' assisted loop")
    drafters = _check_drafters(model, assistant_models)
    if spec_policy is None or spec_policy == "auto":
        scorable = all(d.scorable for d in drafters)
        known, key = _AUTO_POLICIES.setdefault(model, {}), tuple(map(_identity, drafters))
        policy = known.get(key) or known.setdefault(key, auto_policy(len(drafters), scorable))
    else:
        policy = resolve_policy(spec_policy)
    measured = getattr(policy.length, "profile", None)
    if measured is not None and not policy.length.profile_attached and \
            measured.meta.get("target") not in (None, costmodel.model_key(model)):
        raise ValueError(f"{policy.length!r} holds a cost profile measured on {measured.meta['target']!r}, not on "
                         f"this target ({costmodel.model_key(model)!r}); profile this target (python -m hf_specdec "
                         "profile) or give the policy no profile to have it measured")
    if policy.wants_feedback(0) or policy.selector.prompt_positions:
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
        if drafter.vocab_size is not None and drafter.vocab_size != target_vocab:
            raise ValueError(f"assistant_models[{i}] has vocabulary size {drafter.vocab_size} but the target has "
                             f"{target_vocab}; drafters must share the target's vocabulary")
    return drafters


def _check_cache(model, drafters: list[Drafter], generation_config: GenerationConfig) -> None:
    """What the cache settings ask for, checked before any work: each model must be able to hold it."""
    if generation_config.cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not supported with "
                         f"speculative decoding; use one of {CACHE_IMPLEMENTATIONS}")
    if generation_config.cache_config:
        raise ValueError(f"cache_config={generation_config.cache_config!r} is not supported with speculative "
                         "decoding: hf_specdec sizes every model's cache from max_length itself")
    static = generation_config.cache_implementation == "static"
    compiling = static and _compat.compile_config(model, generation_config) is not None
    reading = [i for i, d in enumerate(drafters) if isinstance(d, TargetStatesDrafter)]
    if compiling and reading:
        raise ValueError(f"assistant_models{reading} draft from the target's states, which hf_specdec reads from eager "
                         "forwards only; cache_implementation='static' compiles them here: use the default cache")
    for name, one in [("the target", model)] + [(f"assistant_models[{i}]", m) for i, d in enumerate(drafters)
                                                 for m in d.models()]:
        layers = _compat.unsupported_layers(one)
        if layers:
            raise ValueError(f"{name} ({type(one).__name__}) has {layers} layers, in which hf_specdec cannot roll "
                             "back a rejected draft (it masks cache slots); with enable(model), assistant_model= "
                             "runs it in Transformers' own assisted generation (batch 1)")
        attention = _compat.attn_implementation(one)
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


def _check_call(input_ids, generation_config: GenerationConfig, model_kwargs: dict) -> None:
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
    cache = _compat.cache_from_model_kwargs(model_kwargs)
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("a KV cache with content (cache= / past_key_values=) is not supported: hf_specdec "
                         "builds its own caches")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq_len] with seq_len >= 1, got shape {tuple(input_ids.shape)}")
