"""A serving simulator: the real spec policies driven by a latency model and an acceptance process.

It runs the same continuous-batching schedule as a real engine would, in simulated time, so
policies can be compared at request rates and model sizes this machine cannot run:
  - arrived requests join between steps (up to `max_batch` running); their prompts are prefilled
    by one target forward, which also gives each its first token, and one draft forward (as the
    engine does: a joiner's draft then lags by its first token only);
  - a step over the B running rows holding C context tokens asks the policy for k (capped so no
    row drafts past its output length) and costs
        k > 0: T_draft(C, sum_b L_b) + sum_{i=1}^{k-1} T_draft(C + i B, B) + T_target(C, B (k + 1))
        k = 0: T_target(C, B)
    with L_b the tokens row b's draft has not been fed (its catch-up: 1-2 in steady state, the
    switching cost after k = 0 steps) and T(N_context, N_tokens)
    the `LatencyModel`s of a `CostProfile` (fitted by the profiler, or given for a GPU and model
    size); StepContext.max_lag = max_b L_b, as from `generate()`;
  - each row proposes drafts with probability `proposal_rate` (a lookup drafter often finds no
    match; a step where no row proposes verifies one token per row, as the engine does), accepts
    each with probability `acceptance` until the first rejection, and
    emits accepted + 1 tokens (capped at what it still needs); the policy observes a
    `StepRecord` with the simulated times, as it would from `generate()`.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from ..costmodel import CostProfile, LatencyModel
from ..policies import StepContext, resolve_policy
from ..stats import StepRecord
from .workload import Request


@dataclass
class RequestResult:
    request: Request
    first_token: float     # seconds: when its first output token existed (end of its prefill)
    finish: float          # when its last token existed
    tokens: int            # output tokens (fewer than request.output_len if it stopped early)

    @property
    def latency(self) -> float:
        return self.finish - self.request.arrival

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (0 for one-token outputs)."""
        n = self.tokens - 1
        return (self.finish - self.first_token) / n if n else 0.0


@dataclass
class RunStep:
    time: float            # when the step ended
    batch_size: int
    k: int
    emitted: int


@dataclass
class RunResult:
    """What a serving run (simulated or real) produced."""

    requests: list[RequestResult] = field(default_factory=list)   # in finishing order
    steps: list[RunStep] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)   # request id -> tokens (real runs)

    def summary(self, slo_tpot: float | None = None) -> dict:
        """Output tokens/s over the run, mean / p90 end-to-end latency, mean TPOT, SLO attainment."""
        done = self.requests
        tokens = sum(r.tokens for r in done)
        span = max(r.finish for r in done) - min(r.request.arrival for r in done)
        latencies = sorted(r.latency for r in done)
        out = {"requests": len(done), "output_tokens": tokens, "tokens_per_s": tokens / span if span else 0.0,
               "mean_latency_s": statistics.fmean(latencies),
               "p90_latency_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
               "mean_tpot_s": statistics.fmean(r.tpot for r in done),
               "mean_k": statistics.fmean(s.k for s in self.steps) if self.steps else 0.0}
        if slo_tpot is not None:
            out["slo_attainment"] = sum(r.tpot <= slo_tpot for r in done) / len(done)
        return out


@dataclass
class _Row:
    request: Request
    produced: int          # output tokens so far
    first_token: float
    lag: int               # tokens the draft has not been fed yet


class Simulator:
    """profile: a CostProfile (target and draft latency models); policy: anything `spec_policy`
    accepts; acceptance: probability that a draft token is accepted; proposal_rate: probability that
    a row has drafts at a step; max_batch: most running rows;
    prefill: the LatencyModel of prompt prefills (default: the profile's target model, fitted on
    decode steps; `costmodel.profile_prefill` measures one)."""

    def __init__(self, profile: CostProfile, policy, acceptance: float, max_batch: int = 256, seed: int = 0,
                 prefill: LatencyModel | None = None, proposal_rate: float = 1.0):
        if not isinstance(profile, CostProfile):
            raise TypeError(f"profile must be a CostProfile, got {type(profile).__name__}")
        if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0 <= acceptance <= 1:
            raise ValueError(f"acceptance must be a probability in [0, 1], got {acceptance!r}")
        if isinstance(proposal_rate, bool) or not isinstance(proposal_rate, (int, float)) or not 0 <= proposal_rate <= 1:
            raise ValueError(f"proposal_rate must be a probability in [0, 1], got {proposal_rate!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if prefill is not None and not isinstance(prefill, LatencyModel):
            raise TypeError(f"prefill must be a LatencyModel or None, got {type(prefill).__name__}")
        self.prefill = prefill or profile.target
        self.profile, self.policy = profile, resolve_policy(policy)
        self.acceptance, self.proposal_rate = acceptance, proposal_rate
        self.max_batch, self.rng = max_batch, random.Random(seed)

    def _accepted(self, k: int) -> int:
        n = 0
        while n < k and self.rng.random() < self.acceptance:
            n += 1
        return n

    def run(self, requests: list[Request]) -> RunResult:
        target, draft = self.profile.target, self.profile.draft
        waiting = sorted(requests, key=lambda r: r.arrival)
        running: list[_Row] = []
        result, t, step = RunResult(), 0.0, 0
        self.policy.begin(StepContext(0, 0, 1))
        while waiting or running:
            if not running and waiting[0].arrival > t:
                t = waiting[0].arrival                      # idle until the next arrival
            joining = []
            while waiting and waiting[0].arrival <= t and len(running) + len(joining) < self.max_batch:
                joining.append(waiting.pop(0))
            if joining:                                     # prefill: one target forward, first tokens
                prompts = sum(r.prompt_len for r in joining)
                t += self.prefill.forward_time(prompts, prompts) + draft.forward_time(prompts, prompts)
                running += [_Row(r, 1, t, 1) for r in joining]
                running = self._retire(running, t, result)
                if not running:
                    continue
            rows = len(running)
            context = sum(r.request.prompt_len + r.produced for r in running)
            room = max(r.request.output_len - r.produced - 1 for r in running)
            lag = max(r.lag for r in running)
            ctx = StepContext(step, rows, 1, [r.request.id for r in running], context, lag, room + 1)
            k = max(0, min(self.policy.choose(ctx).length, room))
            if k:
                draft_s = draft.forward_time(context, sum(r.lag for r in running)) + sum(
                    draft.forward_time(context + i * rows, rows) for i in range(1, k))
                proposed = [k if self.proposal_rate == 1 or self.rng.random() < self.proposal_rate else 0
                            for _ in running]
                accepted = [min(self._accepted(p), r.request.output_len - r.produced - 1)
                            for p, r in zip(proposed, running)]
            else:
                draft_s, proposed, accepted = 0.0, [0] * rows, [0] * rows
            verify_s = target.forward_time(context, rows * (max(proposed) + 1))   # as wide as the longest proposal
            t += draft_s + verify_s
            emitted = [a + 1 for a in accepted]
            for r, a, e in zip(running, accepted, emitted):
                r.produced += e
                r.lag = r.lag + e if not k else 1 + (a == k)   # the last draft was never fed
            self.policy.observe(StepRecord(rows, [0 if k else -1] * rows, k, proposed, accepted, emitted,
                                           draft_s, verify_s, ctx.rows))
            result.steps.append(RunStep(t, rows, k, sum(emitted)))
            running = self._retire(running, t, result)
            step += 1
        return result

    @staticmethod
    def _retire(running: list[_Row], t: float, result: RunResult) -> list[_Row]:
        for r in running:
            if r.produced >= r.request.output_len:
                result.requests.append(RequestResult(r.request, r.first_token, t, r.produced))
        return [r for r in running if r.produced < r.request.output_len]
