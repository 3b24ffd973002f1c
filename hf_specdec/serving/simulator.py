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
    emits accepted + 1 tokens (capped at what it still needs); a policy that reads draft
    confidences (AdaSpec) sees each draft's `confidence` (default: `acceptance`), and
    may stop drafting and drop drafts before verification as in `generate()`; the policy observes a
    `StepRecord` with the simulated times, as it would from `generate()`;
  - with a `MemoryModel`, a request is admitted only when its whole KV reservation (prompt +
    output tokens, the target's and, while the draft is on the device, the draft's) fits beside
    the draft's weights. A `DraftOffload` (draft_offload=) then acts as it does on a GPU (the manager's own
    decisions; only the memory probe and the draft's residency are simulated): offloading frees
    the draft's weights and cache for more requests, and drops the draft's KV cache (every row
    then lags by its whole context); a reload takes `reload_seconds` off the decoding path, with
    speculation held at k = 0 until it lands.
`Simulator.call` runs one `generate()` call instead (a static batch): its rows start together, the
draft has not seen their prompts (its first drafts catch them up, as in the loop), and rows leave
the batch as they finish. Forward costs come from a `CostProfile` or from `RelativeCosts` (a GPU
regime stated as ratios), with `noise` on every step's seconds.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from ..costmodel import CostProfile, LatencyModel
from ..offload import OFFLOADED, RELOADING, RESIDENT, as_offload
from ..policies import StepContext, resolve_policy
from ..policies.base import probability
from ..stats import StepRecord
from .workload import Request


@dataclass(kw_only=True)
class RelativeCosts:
    """Forward seconds in a regime stated as ratios (units: anything, e.g. a batch-1 plain step).
    A target forward of B rows x w tokens costs
        target_base + target_per_width (w - 1) + target_per_token B w
    (host-bound eager kernels grow with w but not with B; a replayed graph's compute grows with B w);
    a draft forward draft_base + draft_per_token B w, or `catch_up` where it is wider than
    `graph_width` (a compiled loop runs such forwards eager); a prefill of n tokens
    target_base + prefill_per_token n."""

    target_base: float = 1.0
    target_per_width: float = 0.0
    target_per_token: float = 0.0
    draft_base: float
    draft_per_token: float = 0.0
    catch_up: float | None = None
    graph_width: int = 17
    prefill_per_token: float = 0.0

    def target(self, rows: int, width: int, context: int) -> float:
        return self.target_base + self.target_per_width * (width - 1) + self.target_per_token * rows * width

    def draft(self, rows: int, width: int, context: int) -> float:
        if self.catch_up is not None and width > self.graph_width:
            return self.catch_up
        return self.draft_base + self.draft_per_token * rows * width

    def prefill(self, tokens: int) -> float:
        return self.target_base + self.prefill_per_token * tokens


class ProfileCosts:
    """Forward seconds from a `CostProfile`'s latency models (T(N_context, N_batch_tokens))."""

    def __init__(self, profile: CostProfile, prefill: LatencyModel | None = None):
        self.profile, self.prefill_model = profile, prefill or profile.target

    def target(self, rows: int, width: int, context: int) -> float:
        return self.profile.target.forward_time(context, rows * width, wide=width > 1)

    def draft(self, rows: int, width: int, context: int) -> float:
        return self.profile.draft.forward_time(context, rows * width, wide=width > 1)

    def prefill(self, tokens: int) -> float:
        return self.prefill_model.forward_time(tokens, tokens)


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
class MemoryModel:
    """Accelerator bytes left beside the target's weights and activations, and what uses them."""

    capacity: int                 # for KV caches and the draft's weights
    kv_per_token: int             # the target's KV cache per token
    draft_bytes: int = 0          # the draft's weights
    draft_kv_per_token: int = 0   # the draft's KV cache per token
    reload_seconds: float = 0.0   # copying the draft's weights back (host -> device)

    def __post_init__(self):
        for name in ("capacity", "kv_per_token", "draft_bytes", "draft_kv_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryModel.{name} must be an integer number of bytes >= 0, got {value!r}")
        if isinstance(self.reload_seconds, bool) or not isinstance(self.reload_seconds, (int, float)) \
                or self.reload_seconds < 0:
            raise ValueError(f"MemoryModel.reload_seconds must be >= 0, got {self.reload_seconds!r}")

    def used(self, requests: list[Request], draft_resident: bool) -> int:
        """Bytes held by these requests' reservations and, if resident, the draft."""
        per_token = self.kv_per_token + (self.draft_kv_per_token if draft_resident else 0)
        return sum(r.prompt_len + r.output_len for r in requests) * per_token + \
            (self.draft_bytes if draft_resident else 0)


class _SimulatedDraft:
    """The draft's residency as `DraftOffload` sees it (what `DraftResidencyHook` is on a GPU), in
    simulated time: the simulator sets `now` before each step."""

    def __init__(self, memory: MemoryModel):
        self.state, self.nbytes, self.reload_seconds = RESIDENT, memory.draft_bytes, memory.reload_seconds
        self.now = self.ready_at = 0.0
        self.dropped = False        # the draft's cache was dropped (offload) since the simulator looked

    def offload(self) -> None:
        self.state, self.dropped = OFFLOADED, True

    def start_reload(self) -> None:
        self.state, self.ready_at = RELOADING, self.now + self.reload_seconds

    def poll(self) -> bool:
        if self.state == RELOADING and self.now >= self.ready_at:
            self.state = RESIDENT
        return self.state == RESIDENT


@dataclass
class _Row:
    request: Request
    produced: int          # output tokens so far
    first_token: float
    lag: int               # tokens the draft has not been fed yet


class Simulator:
    """profile: a CostProfile (target and draft latency models) or RelativeCosts; policy: anything `spec_policy`
    accepts; acceptance: probability that a draft token is accepted; proposal_rate: probability that
    a row has drafts at a step; max_batch: most running rows;
    prefill: the LatencyModel of prompt prefills (default: the profile's target model, fitted on
    decode steps; `costmodel.profile_prefill` measures one); memory: a `MemoryModel` (None: memory
    never limits admission; required with draft_offload, whose probe and draft it replaces);
    confidence: every draft's confidence, for policies that read it (None: `acceptance`, a
    calibrated drafter; a lookup drafter reports 1.0); noise: the standard deviation of a step's
    log-normal time factor (0: exact times); draft_offload: a `DraftOffload`, as for `generate()`."""

    def __init__(self, profile: CostProfile | RelativeCosts, policy, acceptance: float, max_batch: int = 256,
                 seed: int = 0, prefill: LatencyModel | None = None, proposal_rate: float = 1.0,
                 memory: MemoryModel | None = None, confidence: float | None = None, noise: float = 0.0,
                 draft_offload=None):
        if not isinstance(profile, (CostProfile, RelativeCosts)):
            raise TypeError(f"profile must be a CostProfile or RelativeCosts, got {type(profile).__name__}")
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise < 1:
            raise ValueError(f"noise must be a number in [0, 1), got {noise!r}")
        probability(acceptance, "acceptance")
        probability(proposal_rate, "proposal_rate")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if prefill is not None and not isinstance(prefill, LatencyModel):
            raise TypeError(f"prefill must be a LatencyModel or None, got {type(prefill).__name__}")
        if confidence is not None:
            probability(confidence, "confidence")
        self.confidence = acceptance if confidence is None else confidence
        if memory is not None and not isinstance(memory, MemoryModel):
            raise TypeError(f"memory must be a MemoryModel or None, got {type(memory).__name__}")
        self.costs = ProfileCosts(profile, prefill) if isinstance(profile, CostProfile) else profile
        self.profile, self.policy, self.noise = profile, resolve_policy(policy), noise
        if getattr(self.policy.length, "use_profile", None) and self.policy.length.profile is None:
            if not isinstance(profile, CostProfile):
                raise TypeError(f"{self.policy.length!r} weighs a CostProfile; RelativeCosts cannot give one")
            self.policy.length.use_profile(profile)      # AdaSpec() / DSDGoodput(): the simulated pair's
        self.acceptance, self.proposal_rate = acceptance, proposal_rate
        self.max_batch, self.rng = max_batch, random.Random(seed)
        self.memory = memory
        self.offload = as_offload(draft_offload)
        if self.offload is not None and memory is None:
            raise ValueError("draft_offload needs memory=MemoryModel(...): offloading acts on memory")

    def _drafted(self, k: int, rows: int) -> int:
        """Draft forwards before the length policy stops drafting (all k if it has no such hook)."""
        if self.policy.length.continue_drafting is None:
            return k
        confidences = [[] for _ in range(rows)]
        for j in range(1, k):
            for row in confidences:
                row.append(self.confidence)
            if not any(self.policy.length.continue_drafting(confidences)):
                return j
        return k

    def _accepted(self, k: int) -> int:
        n = 0
        while n < k and self.rng.random() < self.acceptance:
            n += 1
        return n

    def call(self, prompt_len: int, output_lens: list[int]) -> RunResult:
        """One generate() call: len(output_lens) rows of `prompt_len` tokens start together, the
        draft has not seen their prompts, and each row stops after its output length."""
        requests = [Request(i, 0.0, prompt_len, n) for i, n in enumerate(output_lens)]
        if len(requests) > self.max_batch:
            raise ValueError(f"a call of {len(requests)} rows needs max_batch >= {len(requests)}, got {self.max_batch}")
        return self.run(requests, draft_prefill=False)

    def run(self, requests: list[Request], draft_prefill: bool = True) -> RunResult:
        """Serve `requests` as they arrive; draft_prefill: the draft prefills joining prompts (as
        continuous batching's draft model does), else its first drafts catch them up (generate())."""
        costs = self.costs
        waiting = sorted(requests, key=lambda r: r.arrival)
        running: list[_Row] = []
        result, t, step, carried = RunResult(), 0.0, 0, 0.0
        memory, offload = self.memory, self.offload
        resident = _SimulatedDraft(memory) if memory is not None else None
        if memory is not None:
            too_big = [r.id for r in requests if memory.used([r], True) > memory.capacity]
            if too_big:
                raise ValueError(f"requests {too_big[:5]} alone, with the draft, need more than MemoryModel.capacity")
        if offload is not None:          # the real manager, on the simulated memory and draft
            offload.attach(resident, lambda: memory.capacity - memory.used([r.request for r in running],
                                                                           resident.state != OFFLOADED))

        def admits(joining: list[Request]) -> bool:
            """Can `joining` (this round's, the next candidate last) run beside the running rows?"""
            if len(running) + len(joining) > self.max_batch:
                return False
            held = [r.request for r in running] + joining
            return memory is None or memory.used(held, resident.state != OFFLOADED) <= memory.capacity
        self.policy.begin(StepContext(0, 0, 1))
        while waiting or running:
            if not running and waiting[0].arrival > t:
                t = waiting[0].arrival                      # idle until the next arrival
            joining = []
            while waiting and waiting[0].arrival <= t and admits(joining + waiting[:1]):
                joining.append(waiting.pop(0))
            if joining:                                     # prefill: one target forward, first tokens
                prompts = sum(r.prompt_len for r in joining)
                prefill_s = costs.prefill(prompts)
                t += prefill_s
                if not draft_prefill:                       # generate(): step 0 is the prefill, and is timed so
                    carried += prefill_s
                if draft_prefill and (resident is None or resident.state == RESIDENT):   # the draft prefills them too
                    t += costs.draft(1, prompts, prompts)
                    running += [_Row(r, 1, t, 1) for r in joining]
                else:                                       # offloaded: the draft will catch up all
                    running += [_Row(r, 1, t, r.prompt_len + 1) for r in joining]
                running = self._retire(running, t, result)
                if not running:
                    continue
            rows = len(running)
            context = sum(r.request.prompt_len + r.produced for r in running)
            room = max(r.request.output_len - r.produced - 1 for r in running)
            lag = max(r.lag for r in running)
            ctx = StepContext(step, rows, 1, [r.request.id for r in running], context, lag, room + 1)
            if resident is not None:
                resident.now = t                            # what the offload manager's clock reads
            decision = self.policy.choose(ctx)
            k = min(decision.k, room)                       # the loop's own budget: no draft past the room
            if offload is not None and not offload.step(ctx, k):   # the drafts are off the device
                k = 0
            if resident is not None and resident.dropped:   # offloaded: its cache went with it
                resident.dropped = False
                for r in running:
                    r.lag = r.request.prompt_len + r.produced
            if k:
                drafted = self._drafted(k, rows)
                draft_s = costs.draft(rows, lag, context) + sum(costs.draft(rows, 1, context + i * rows)
                                                                for i in range(1, drafted))
                proposed = [drafted if self.proposal_rate == 1 or self.rng.random() < self.proposal_rate else 0
                            for _ in running]
                proposed = self.policy.trim(proposed, [[self.confidence] * p for p in proposed])
                accepted = [min(self._accepted(p), r.request.output_len - r.produced - 1)
                            for p, r in zip(proposed, running)]
            else:
                draft_s, proposed, accepted = 0.0, [0] * rows, [0] * rows
            widest = max(proposed) + 1                      # every row fed as wide as the longest proposal
            verify_s = costs.target(rows, widest, context)
            if self.noise:                                  # a real step's time moves from run to run
                draft_s, verify_s = (x * math.exp(self.rng.gauss(0.0, self.noise)) for x in (draft_s, verify_s))
            t += draft_s + verify_s
            emitted = [a + 1 for a in accepted]
            for r, a, e in zip(running, accepted, emitted):
                r.produced += e
                r.lag = r.lag + e if not k else 1 + (a == k)   # the last draft was never fed
            self.policy.observe(StepRecord.of_step(ctx, k, decision.k, proposed, accepted, draft_s=draft_s,
                                                   verify_s=verify_s + carried))
            carried = 0.0
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
