"""The decoding loop: the steps of one generate() call, or of a serving run.

One step (`DecodingLoop.step`) of the rows still decoding; each phase hands the next a value:
  plan     the policy's `Decision` from the host's copy of the rows' numbers, and the step's whole
           draft budget: k within the longest row's room and the offload's say, and each row's
           budget within its own room -> `StepPlan`;
  draft    the chosen drafters propose up to k tokens a row, cut to each row's budget and the
           policy's confidence trim -> `Proposal`;
  verify   `verify.target_verify`: one target forward over each row's pending token + drafts, the
           shared `verify` -> `Verified`;
  read     the step's one host read: accepted counts and where the stopping criteria stop each
           row -> `StepOutcome`;
  advance  each row appends its accepted drafts + 1 token, cut at a stop; the target and the
           drafters roll their caches back per row; finished rows retire -> `StepRecord`;
  observe  the policy gets the record (its phase times read without waiting on the device).
The models' side of each phase is `CachedModel`'s, on a dynamic or a static (compiled) cache.

Host reads (each a sync on a GPU), all a step makes on either cache:
  - the read above: one a step, none on a plain step in which no row can stop;
  - a step where some rows finish and others go on: one per dynamic cache (the target's, each
    model drafter's), finding the slots only finished rows used (a static cache keeps them);
  - full-information feedback (`scoring`), on the steps the selector asks for it: a few per
    drafter (its replay), independent of the batch; a hierarchy's inner cycles read once each;
  - a static cache that fills up compacts its rows: one read, rarely.
Everything else the step needs on the host comes from the host's own copies (`RowInts`: lengths,
limits, what each cache has fed and how many real slots it holds, the processors' prefix
lengths), and index lists go to the device through pinned memory, without blocking
(`rows.to_device`). tests/test_api.py counts them.

Names, one per idea:
  k          a step's draft length: the most drafts any row proposes (`Decision.k` the policy's,
             `StepPlan.k` / `StepRecord.k` after the budget; `StepRecord.decided_k` the policy's)
  max_len    a length policy's largest k (`draft_len`: a hierarchy's k per inner cycle)
  budget     per row, the most drafts it may keep this step: min(k, its room - 1)
  counts     per row, the drafts proposed (`Proposal.counts`, `verify`'s `draft_counts`,
             `StepRecord.proposed`), <= its budget
  width      the columns of a tensor of tokens (a forward's, or the drafts': the largest count)
  room       per row, the tokens it may still emit before its limit
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cached_model import CachedModel
from .drafters import Drafter, Proposal
from .offload import RESIDENT, DraftOffload
from .policies import Decision, SpecPolicy, StepContext
from .rows import RowInts, to_device
from .sampling import TokenSampler
from .scoring import prime, score_drafters
from .sequences import SequenceBatch
from .stats import SpecStats, StepRecord
from .stops import StopJudge
from . import timing
from .timing import PhaseClock
from .verify import Verified, target_verify


@dataclass(kw_only=True)
class StepPlan:
    """What the policy chose for a step, and the budget the loop runs it with."""

    ctx: StepContext
    decision: Decision
    k: int                           # the draft length run (0: a plain step)
    choice: list[int]                # each active row's drafter (-1: none)
    start: RowInts                   # [n] the active rows' lengths
    room: RowInts                    # [n] tokens each may still emit
    budget: RowInts                  # [n] drafts each may keep: min(k, room - 1)


@dataclass(kw_only=True)
class StepOutcome:
    """What the step's one host read says (nothing read on a plain step no row can stop in)."""

    accepted: RowInts                # [n] accepted drafts
    proposed: list[int]              # drafts each row proposed
    stops: RowInts | None            # [n] the length at each row's stop, -1: none; None: no row can stop
    read: bool                       # whether it read the device
    waited: float                    # seconds the read waited for the device


class DecodingLoop:
    """`begin`, then `step` while rows are active (`run` does both for generate()). The loop owns
    `batch.active`; rows leave it when they finish (`retire_finished`).

    model: the target; stops: each row's limit and stopping criteria; streamer: gets completed
    columns; offload: a DraftOffload, asked before each step whether the drafts may run (it may
    move them off the device while speculation is off)."""

    def __init__(self, model, batch: SequenceBatch, drafters: list[Drafter], policy: SpecPolicy,
                 sampler: TokenSampler, stops: StopJudge, streamer=None, offload: DraftOffload | None = None):
        self.batch, self.target, self.drafters, self.policy = batch, CachedModel(model), drafters, policy
        self.sampler, self.stops, self.streamer, self.offload = sampler, stops, streamer, offload
        self.streamed = batch.prompt_len
        self.clock = PhaseClock(self.target.device)
        self._late = []                  # (record, marks, drafter marks) of steps not yet observed

    def begin(self) -> None:
        """Empty caches for the active rows (none for a serving run, whose rows join)."""
        batch = self.batch
        for drafter in self.drafters:      # (before the target's cache is made: a drafter may ask it to keep every slot)
            drafter.follow(self.target)
        self.target.reset(batch)
        for drafter in self.drafters:
            drafter.begin(batch, self.sampler)
        if self.offload is not None:
            self.offload.begin(self.drafters, batch)
        names = [d.name for d in self.drafters]
        self.stats = SpecStats(drafter_names=[n if names.count(n) == 1 else f"{n}[{i}]" for i, n in enumerate(names)],
                               policy=self.policy, ensemble_weight=self.sampler.ensemble_weight)
        start = batch.active_lengths()
        self.policy.begin(self.context(0, start, self.stops.room(batch.active, start)) if len(batch.active)
                          else StepContext(0, 0, len(self.drafters)))

    def run(self) -> SpecStats:
        """generate(): every active row to its end."""
        try:
            self.begin()
            self.stats.prime_seconds = prime(self.policy.selector, self.target, self.drafters, self.batch, self.sampler)
            while len(self.batch.active):
                self.step()
                self.stream(final=False)
            self.observe_late()
            self.stream(final=True)
            return self.stats
        finally:
            self.close()

    def close(self) -> None:
        """The call ends (or failed): what its models were lent goes back."""
        self.target.close()
        for drafter in self.drafters:
            drafter.close()

    def context(self, step: int, start: RowInts, room: RowInts) -> StepContext:
        """What the policy sees before step `step`, from the host's copy of the rows' numbers:
        the active rows' lengths `start` [n] and rooms [n]."""
        batch, rows, first = self.batch, self.batch.active.tolist(), self.batch.real_starts.tolist()
        lags = [lag.max() for lag in (d.lag(batch) for d in self.drafters) if lag is not None]
        context_tokens = sum(length - first[row] for row, length in zip(rows, start.tolist()))   # (host numbers)
        return StepContext(step, len(rows), len(self.drafters), rows, context_tokens=context_tokens,
                           max_lag=max(lags, default=0), remaining=room.max())

    def step(self) -> StepRecord:
        """One step of the active rows: plan -> draft -> verify -> read -> advance -> observe (the
        module docstring). On the device's side it reads at most once."""
        begin, warmups = timing.now(), self.batch.warmups.calls
        plan = self.plan()
        t0, c0 = timing.now(), self.clock.mark()
        proposal, drafted = self.draft(plan)
        c1 = self.clock.mark()
        verified = target_verify(self.target, self.batch, proposal.tokens, proposal.counts, proposal.probs,
                                 self.sampler, rollback=False, ensemble=True)
        t2, c2 = timing.now(), self.clock.mark()
        outcome = self.read(plan, proposal, verified)
        record = self.advance(plan, proposal, verified, outcome)
        # the host's own work: not its wait in the read for the device's drafting and verifying,
        # which the clock's marks already time (on a GPU they would count twice, and only on
        # steps that read: plain steps would look cheap)
        record.overhead_s = timing.now() - begin - (t2 - t0) - outcome.waited
        record.warmup = self.batch.warmups.calls != warmups
        self.stats.steps.append(record)
        self._late.append((record, (c0, c1, c2), drafted))
        if outcome.read or not self.clock.events:   # the read waited for every mark so far: reading them waits on nothing
            self.observe_late()
        return record

    def plan(self) -> StepPlan:
        """The policy's choice for this step and the whole draft budget, from the host's numbers."""
        batch = self.batch
        start = batch.active_lengths()
        room = self.stops.room(batch.active, start)
        ctx = self.context(len(self.stats.steps), start, room)
        decision = self.policy.choose(ctx)
        k = max(0, min(decision.k, room.max() - 1))                  # no draft past the longest row's room
        if self.offload is not None and not self.offload.step(ctx, k):   # the drafts are off the device
            k = 0
        batch.reserve(k + 1, start.max())
        n = ctx.batch_size
        choice = _per_row_choice(decision.drafter, n, len(self.drafters)) if k else [-1] * n
        return StepPlan(ctx=ctx, decision=decision, k=k, choice=choice, start=start, room=room,
                        budget=(room - 1).minimum(k))

    def draft(self, plan: StepPlan) -> tuple[Proposal, dict]:
        """Each row's drafts, written at its end: the chosen drafter's, cut to the row's budget and
        the policy's confidence trim. Returns them and each drafter's (start, end) clock marks."""
        batch, n, drafted = self.batch, len(plan.choice), {}
        if not plan.k:
            return Proposal(batch.tokens.new_zeros(n, 0), RowInts.full(n, 0, batch.tokens.device)), drafted
        proposal = self.propose(plan.choice, plan.k, drafted)
        counts = proposal.counts.minimum(plan.budget)
        if self.policy.length.verify_lengths is not None:   # a drafter without confidences (n-gram lookup) is certain: 1.0
            confidence = proposal.confidence if proposal.confidence is not None else \
                torch.ones_like(proposal.tokens, dtype=torch.float)
            confidences = [c[:m] for c, m in zip(confidence.tolist(), counts.tolist())]
            counts = RowInts.of(self.policy.trim(counts.tolist(), confidences), batch.tokens.device)
        # verify only as many positions as the longest proposal (n-gram drafters may find nothing)
        width = counts.max()
        tokens, probs = proposal.tokens[:, :width], proposal.probs
        batch.write(batch.active.tensor, plan.start.tensor, tokens)
        return Proposal(tokens, counts, probs[:, :width] if probs is not None else None), drafted

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
        return _pick_rows(proposals, choice)

    def read(self, plan: StepPlan, proposal: Proposal, verified: Verified) -> StepOutcome:
        """Write each row's verified token after its accepted drafts, find the stops, and read the
        device once: the drafted and accepted counts and the stops."""
        batch, rows, start, n = self.batch, self.batch.active, plan.start, len(plan.choice)
        result, width = verified.result, proposal.tokens.shape[1]
        batch.tokens[rows.tensor, start.tensor + result.num_accepted] = result.next_tokens
        stops = self.stops.find(batch.tokens, rows, start, result.num_accepted + 1, width + 1)   # [n] or None
        if not width and stops is None:
            return StepOutcome(accepted=RowInts(result.num_accepted, [0] * n), proposed=[0] * n, stops=None,
                               read=False, waited=0.0)
        numbers = [proposal.counts.tensor, result.num_accepted] + ([stops] if stops is not None else [])
        waited = timing.now()
        proposed, accepted, *host_stops = host_read(torch.stack(numbers))     # the one host read
        return StepOutcome(accepted=RowInts(result.num_accepted, accepted), proposed=proposed,
                           stops=RowInts(stops, host_stops[0]) if host_stops else None, read=True,
                           waited=timing.now() - waited)

    def advance(self, plan: StepPlan, proposal: Proposal, verified: Verified, outcome: StepOutcome) -> StepRecord:
        """Each row keeps its accepted drafts + 1 token, cut at a stop; every cache forgets the
        rest; finished rows retire; drafters are scored if the selector asked. Reads nothing more."""
        batch, rows, accepted = self.batch, self.batch.active, outcome.accepted
        self.target.rollback(verified.region, accepted, proposal.counts.host)
        for d in set(plan.choice) - {-1}:
            mine = [c == d for c in plan.choice]
            self.drafters[d].accepted(accepted if all(mine) else accepted.map(
                lambda a, m: torch.where(m, a, 0), lambda a, m: a if m else 0,
                RowInts(to_device(mine, accepted.tensor.device, torch.bool), mine)))
        emitted = accepted + 1
        stopped = outcome.stops is not None and outcome.stops.max() >= 0
        if stopped:
            emitted = self.stops.apply(batch, rows, plan.start, emitted, outcome.stops)
        batch.lengths[rows] = plan.start + emitted
        record = StepRecord.of_step(plan.ctx, plan.k, plan.decision.k, outcome.proposed, accepted.host,
                                    emitted=[max(e, 0) for e in emitted.tolist()], drafters=plan.choice)
        # a row finishes at a stop or at its limit, which it reaches only when it emits its room
        width = proposal.tokens.shape[1]
        keep = self.retire_finished() if stopped or width + 1 >= plan.room.min() else None
        resident = self.offload is None or self.offload.state == RESIDENT     # scoring runs every drafter
        if len(batch.active) and resident and plan.decision.feedback:
            start, scores = plan.start.tensor, verified.scores
            if keep is not None:
                start, scores = start[keep.tensor], scores[keep.tensor]
            self.feedback(record, start, scores)
        return record

    def feedback(self, record: StepRecord, start: torch.Tensor, target_scores: torch.Tensor) -> None:
        """Score every drafter on the positions this step verified (full-information feedback)."""
        gammas, seconds = score_drafters(self.drafters, self.batch, start, target_scores, self.sampler.do_sample)
        count = (self.batch.active_lengths().tensor - start).tolist()           # one host read
        record.gammas = {row: g[:c] for row, g, c in zip(self.batch.active.host, gammas.tolist(), count)}  # one more
        record.replay_s = dict(enumerate(seconds))

    def observe_late(self) -> None:
        """Fill the pending steps' phase times from their clock marks, then let the policy observe
        them. With CUDA events this runs after a step's host read, which waited for every mark
        recorded before it: reading them never waits on the device (a plain step that reads nothing
        is observed after the next one that does; the last, at the end). No-op when nothing is pending."""
        late, self._late = self._late, []
        seconds = self.clock.seconds
        for record, (c0, c1, c2), drafted in late:
            record.draft_s, record.verify_s = seconds(c0, c1), seconds(c1, c2)
            record.drafter_s = {d: seconds(*marks) for d, marks in drafted.items()}
            self.policy.observe(record)

    def retire_finished(self) -> RowInts:
        """Drop rows that are done (judged on the host); returns the kept rows' indices into the
        previous active rows."""
        batch, rows = self.batch, self.batch.active
        done = [self.stops.done(row, length) for row, length in zip(rows.host, batch.lengths[rows].host)]
        keep = [i for i, d in enumerate(done) if not d]
        if len(keep) == len(rows):
            return RowInts(torch.arange(len(rows), device=rows.tensor.device), keep)
        finished = [row for row, d in zip(rows.host, done) if d]
        index = to_device(keep + finished, rows.tensor.device)
        kept = RowInts(index[:len(keep)], keep)
        batch.clear_scratch(index[len(keep):])    # finished rows read as generate()'s: pad past the end
        batch.active = rows[kept]
        self.target.select_rows(kept)        # even to no rows
        for drafter in self.drafters:
            drafter.select_rows(kept)
        return kept

    def stream(self, final: bool) -> None:
        """Put completed columns, as generate() does once per step; rows advance unevenly, so a
        column goes out once every row still decoding has reached it."""
        if self.streamer is None:
            return
        batch = self.batch
        end = batch.lengths.max() if final or not len(batch.active) else batch.active_lengths().min()
        for column in range(self.streamed, end):
            self.streamer.put(batch.tokens[:, column].cpu())
        self.streamed = max(self.streamed, end)
        if final:
            self.streamer.end()


def host_read(numbers: torch.Tensor) -> list:
    """The step's one read of the device: it waits for the work queued before it."""
    return numbers.tolist()


def _pick_rows(proposals: dict[int, Proposal], choice: list[int]) -> Proposal:
    """Row i's drafts from proposals[choice[i]] (drafters may stop at different widths: zero-padded)."""
    order = sorted(proposals)
    device = proposals[order[0]].tokens.device
    pick, rows = to_device([order.index(d) for d in choice], device), torch.arange(len(choice), device=device)
    width = max(p.tokens.shape[1] for p in proposals.values())

    def stacked(values):        # [drafters, n, width, ...] padded, then each row's own
        pad = [torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, width - t.shape[1])) for t in values]
        return torch.stack(pad)[pick, rows]
    parts = [proposals[d] for d in order]
    tokens = stacked([p.tokens for p in parts])
    confidence = stacked([p.confidence if p.confidence is not None else torch.ones_like(p.tokens, dtype=torch.float)
                          for p in parts])
    probs = None
    if any(p.probs is not None for p in parts):   # point masses as one-hot rows next to real q
        vocab = next(p.probs.shape[-1] for p in parts if p.probs is not None)
        probs = stacked([p.probs if p.probs is not None else torch.nn.functional.one_hot(p.tokens, vocab).float()
                         for p in parts])
    counts = torch.stack([p.counts.tensor for p in parts])[pick, rows]
    host = None if any(p.counts.host is None for p in parts) else \
        [proposals[d].counts.host[i] for i, d in enumerate(choice)]
    return Proposal(tokens, RowInts(counts, host), probs, confidence)


def _per_row_choice(drafter, n: int, num_drafters: int) -> list[int]:
    """A selector's choice (one index, or one per active row) as a list of n valid indices."""
    choice = [drafter] * n if isinstance(drafter, int) else list(drafter)
    if len(choice) != n or not all(isinstance(d, int) and 0 <= d < num_drafters for d in choice):
        raise ValueError(f"the drafter selector must return an index in [0, {num_drafters}) or a list of "
                         f"{n} such indices (one per active row), got {drafter!r}")
    return choice
