"""Adaptive draft lengths: Nightjar, AdaSpec, DSD goodput and Transformers' schedules.

Policies are driven first in a simulated environment whose optimum is known (step time and
acceptance as functions of batch size and k), then with real tiny models for losslessness.
"""
import json
import math
import random
import statistics
import time
from collections import Counter

import pytest
import torch

import hf_specdec
from helpers import Scripted, assert_same, spec, step_record
from hf_specdec.costmodel import CostProfile, LatencyModel, SwitchCostTable, profile, profile_prefill
from hf_specdec.policies import StepContext
from hf_specdec.policies.straggler import FinishingRows, RowSpread, emission_moments, stretch
from hf_specdec.testing import build, noisy_copy, prompts

ALPHA = 0.7          # per-token acceptance in the simulation


def expected_tokens(k, alpha=ALPHA):
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def step_time(batch, k):
    """Verification gets relatively dearer with the batch: speculation pays at B=1, not at B>=8."""
    return 0.01 * (1 + 0.3 * batch * k)


def optimum(batch, max_len=6):
    return min(range(max_len + 1), key=lambda k: step_time(batch, k) / expected_tokens(k))


class Sim:
    """Plays a length policy against the simulated environment; drafts are accepted independently
    with probability alpha each (expected_tokens(k) per row and step)."""

    def __init__(self, policy, switch_seconds=0.0, seed=0, alpha=ALPHA, plain_stalls=(), slow_spell=range(0)):
        self.policy, self.switch_seconds, self.alpha = policy, switch_seconds, alpha
        self.plain_stalls, self.plain_steps = set(plain_stalls), 0   # these plain steps stall (x50)
        self.slow_spell = slow_spell     # during these steps, plain steps take twice as long
        self.rng = random.Random(seed)
        self.previous_k, self.lag, self.step, self.remaining = None, 0, 0, 0
        self.choices = []

    def new_call(self, batch, prompt_len=100, budget=0):
        """A generate() call starts: the drafter has not seen its prompt (it lags by all of it).
        budget: the call's max_new_tokens, told to the policy as StepContext.remaining (0: unknown)."""
        self.step, self.lag, self.previous_k, self.remaining = 0, prompt_len, 0, budget
        self.policy.begin(StepContext(0, batch, 1, list(range(batch)), remaining=budget))

    def accepted(self, k):
        for j in range(k):
            if self.rng.random() >= self.alpha:
                return j
        return k

    def run(self, batch, steps):
        for _ in range(steps):
            ctx = StepContext(self.step, batch, 1, list(range(batch)), context_tokens=100 * batch, max_lag=self.lag,
                              remaining=self.remaining)
            k = self.policy.choose(ctx)
            seconds = step_time(batch, k) * self.rng.uniform(0.98, 1.02)
            if k == 0:
                seconds *= 50 if self.plain_steps in self.plain_stalls else 1
                seconds *= 2 if len(self.choices) in self.slow_spell else 1
                self.plain_steps += 1
            drafting = seconds * 0.15 * batch * k / (1 + 0.3 * batch * k)   # half the extra time drafts
            if k > 0 and self.previous_k == 0:
                seconds += self.switch_seconds            # the draft catches up its lag
                drafting += self.switch_seconds
            self.lag = self.lag + 1 if k == 0 else 0
            # each draft is accepted with probability alpha, and a row keeps drafts up to its first rejection
            emitted = [1 + self.accepted(k) for _ in range(batch)]
            self.policy.observe(step_record(batch, [0 if k else -1] * batch, k, [k] * batch, [e - 1 for e in emitted],
                                           emitted, drafting, seconds - drafting))
            self.choices.append((batch, k))
            if self.remaining:
                self.remaining = max(self.remaining - max(emitted), 1)
            self.previous_k = k
            self.step += 1
        return [k for _, k in self.choices[-steps:]]


def test_simulation_has_the_intended_optima():
    assert optimum(1) == 2 and optimum(8) == 0 and optimum(16) == 0


def test_nightjar_converges_per_batch_size_and_comes_back_after_load():
    sim = Sim(hf_specdec.Nightjar(max_len=6, seed=1))
    low = sim.run(1, 1500)
    high = sim.run(16, 1500)
    back = sim.run(1, 400)
    for phase, batch in ((low, 1), (high, 16), (back, 1)):
        mode, count = Counter(phase[-300:]).most_common(1)[0]
        assert mode == optimum(batch) and count >= 0.7 * 300, (batch, Counter(phase[-300:]))
    assert Counter(back)[0] < 0.3 * len(back)            # no decision deadlock at k = 0


def test_nightjar_is_not_thrown_off_by_a_stalled_step():
    # early plain steps stall (another process took the CPU): without a cap on a step's weight
    # plain decoding's mean stays buried under them and the bandit keeps speculating at B=16
    sim = Sim(hf_specdec.Nightjar(max_len=6, seed=1), plain_stalls=range(3, 23))
    ks = sim.run(16, 800)
    assert Counter(ks[-300:])[0] >= 0.7 * 300, Counter(ks[-300:])


def test_nightjar_measures_again_what_it_timed_in_a_slow_spell():
    # plain steps take twice as long for the first 100 steps (the machine was busy), speculation
    # does not: at B=4 (plain is best) an arm that is never played again keeps its slow spell
    for seed in range(4):
        sim = Sim(hf_specdec.Nightjar(max_len=6, seed=seed), seed=seed, slow_spell=range(100))
        ks = sim.run(4, 1000)
        assert Counter(ks[-200:])[optimum(4)] >= 0.8 * 200, (seed, Counter(ks[-200:]))


def test_nightjar_bounds_an_arm_timed_twice_by_the_machines_noise():
    # two steps in a slow spell agree with each other: their own spread (or the faster of them)
    # would bound the arm's mean at about what they measured, so the arm is never explored again
    from hf_specdec.policies.nightjar import _BatchState
    rng = random.Random(0)

    def timed(arms):
        state = _BatchState.fresh(2)
        for k, seconds in arms.items():
            for s in seconds:
                state.record_clean(k, s)
        return state

    noise = [0.010 * rng.uniform(0.7, 1.3) for _ in range(40)]         # the machine's noise: ~17%
    assert timed({0: noise, 1: [0.020, 0.020]}).fast_seconds(1) < 0.8 * 0.020   # arm 1: timed twice, slow
    assert timed({1: [0.020, 0.020]}).fast_seconds(1) == 0.020         # nothing timed 3 times: the fastest


def test_nightjar_switches_less_when_switching_is_expensive():
    """Calls alternate between busy (B=8: plain wins) and quiet (B=1, 60 tokens to go: k=2 saves
    ~0.16 s). A switch of 0.05 s pays for itself in a quiet call, one of 0.5 s does not."""
    def switches(cost):
        policy = hf_specdec.Nightjar(max_len=6, switch_cost=cost, seed=3)
        sim = Sim(policy, switch_seconds=cost)
        for _ in range(150):
            sim.new_call(8, budget=40)
            sim.run(8, 20)
            sim.new_call(1, budget=60)
            sim.run(1, 20)
        ks = [k for _, k in sim.choices]
        return sum(1 for a, b in zip(ks, ks[1:]) if a == 0 and b > 0)
    free, cheap, dear = switches(0.0), switches(0.05), switches(0.5)
    assert cheap >= 0.8 * free and dear < 0.3 * cheap, (free, cheap, dear)   # (exploration still switches)


def test_nightjar_weighs_the_prompt_catch_up_of_each_call():
    # short calls at B=1: k=2 saves ~0.03 s per 10-step call, but a call's first drafts must
    # prefill its prompt (0.2 s). Learned across calls, that makes plain decoding the better choice.
    policy = hf_specdec.Nightjar(max_len=6, switch_cost=0.2, seed=2)
    sim = Sim(policy, switch_seconds=0.2)
    calls = []
    for _ in range(300):
        sim.new_call(1)
        calls.append(any(sim.run(1, 10)))
    assert sum(calls[-100:]) <= 20, sum(calls[-100:])
    # one long call: paying once pays off. Where the call's length is unknown the paper's exploit
    # charges the whole C_switch to one step's k tokens, so switching on from 0 is left to
    # exploration and some seeds end at plain decoding; where it is known (max_new_tokens), the
    # switch is spread over the tokens it buys and every seed ends speculating
    latency = lambda k: step_time(1, k) / expected_tokens(k)

    def final_latency(seed, budget):
        sim = Sim(hf_specdec.Nightjar(max_len=6, switch_cost=0.2, seed=seed), switch_seconds=0.2)
        sim.new_call(1, budget=budget)
        return statistics.fmean(latency(k) for k in sim.run(1, 1500)[-300:])
    unknown = [final_latency(seed, 0) for seed in range(6)]
    assert sum(f < 0.95 * latency(0) for f in unknown) >= 4, unknown
    assert statistics.fmean(unknown) < 0.9 * latency(0), unknown
    known = [final_latency(seed, 4000) for seed in range(6)]
    assert all(f < 0.9 * latency(0) for f in known), known


def test_nightjar_pow2_buckets_reuse_learning_as_the_batch_shrinks():
    def zeros_while_shrinking(buckets):
        sim = Sim(hf_specdec.Nightjar(max_len=6, buckets=buckets, seed=2))
        sim.run(16, 1000)                                # learned: at this load, do not speculate
        shrinking = [k for b in range(15, 8, -1) for k in sim.run(b, 6)]
        return shrinking.count(0) / len(shrinking)
    assert zeros_while_shrinking("pow2") > 0.7 > zeros_while_shrinking("exact")


def test_nightjar_prunes_arms_that_cannot_beat_plain_even_if_every_draft_is_accepted():
    def speculative_steps(prune):
        sim = Sim(hf_specdec.Nightjar(max_len=6, prune=prune, seed=4))
        return sum(k > 0 for k in sim.run(16, 500))
    pruned, paper = speculative_steps(True), speculative_steps(False)
    assert pruned <= 10 and paper > 5 * pruned, (pruned, paper)    # a k=1 step bounds every longer k
    sim = Sim(hf_specdec.Nightjar(max_len=6, prune=True, seed=4))
    low = sim.run(1, 1500)                              # where speculation pays, the optimum survives
    assert Counter(low[-300:]).most_common(1)[0][0] == optimum(1)

    def useless_steps(prune):                           # drafts never accepted: pooled first-draft bound
        sim = Sim(hf_specdec.Nightjar(max_len=6, prune=prune, seed=5), alpha=0.0)
        return sum(k > 0 for k in sim.run(1, 1500))
    pruned, paper = useless_steps(True), useless_steps(False)
    assert pruned < 150 and paper > 3 * pruned, (pruned, paper)


def test_nightjar_ends_a_bin_early_once_its_arm_is_known_to_lose():
    """A long bin locked on an arm that the evidence has ruled out (B=16: a draft multiplies the
    step's time ~6x) ends at its next check rather than after its sqrt(H) steps."""
    def rest_of_bin(prune):
        policy = hf_specdec.Nightjar(max_len=2, prune=prune, seed=0)
        sim = Sim(policy)
        sim.run(16, 1000)                      # evidence that k = 2 loses, with long bins by now
        state = policy.states[16]
        state.locked, state.round, state.length = 2, 2, 32      # a bin just started on k = 2
        return sim.run(16, 31)
    assert rest_of_bin(True).count(2) <= 1 and rest_of_bin(False).count(2) == 31


def test_nightjar_explores_the_arms_that_could_still_win():
    """Where k = 1..3 are all within ~25% of the best (k = 2), exploring them uniformly costs ~5% of
    a 400-step run (0.050 over 60 seeds); exploring the arm with the least optimistic latency costs
    ~3% (0.030; with the re-measure of stale arms 0.032)."""
    latency = lambda k: step_time(1, k) / expected_tokens(k)
    regret = []
    for seed in range(24):
        ks = Sim(hf_specdec.Nightjar(max_len=6, seed=seed), seed=seed).run(1, 400)
        regret.append(sum(map(latency, ks)) / (len(ks) * latency(optimum(1))) - 1)
    assert statistics.fmean(regret) < 0.037, regret


def test_nightjar_counts_a_step_cut_by_the_calls_end_for_the_arm_it_chose():
    """Near a call's end the loop drafts no further than the longest row's room: that step's cost
    is what choosing the arm cost (SmolLM2, int8: counted for the shorter arms, k = 4 looked
    faster than plain per token while its calls were slower). A step run with another k for any
    other reason (the draft offloaded: k = 0) counts as run."""
    def counted(remaining, run_k):
        policy = hf_specdec.Nightjar(max_len=4, prune=False)
        ctx = StepContext(5, 2, 1, [0, 1], context_tokens=100, max_lag=1, remaining=remaining)
        chosen = policy.choose(ctx)
        policy.drafted = policy.measured = True                      # not the call's first drafts
        accepted = [min(run_k, 1)] * 2
        policy.observe(step_record(2, [0] * 2, run_k, [run_k] * 2, accepted, [a + 1 for a in accepted], 0.01, 0.02))
        return chosen, policy.states[2].depths               # by arm, by drafts verified: row-steps
    chosen, depths = counted(remaining=3, run_k=2)
    assert chosen > 2 and depths[chosen][2] == 2 and not any(depths[2])   # cut to 2 drafts: the chosen arm's
    chosen, depths = counted(remaining=50, run_k=0)
    assert chosen > 0 and depths[0][0] == 2 and not any(depths[chosen])   # run plain for another reason: plain's


def test_nightjar_decision_costs_under_20_microseconds():
    """choose() and observe() together, per step, while Nightjar drafts and learns (B=1: k=2 pays),
    new evidence every step."""
    policy = hf_specdec.Nightjar(max_len=6)
    sim = Sim(policy)
    sim.run(1, 200)
    spent = []

    def timed(method):
        def run(arg):
            start = time.perf_counter()
            out = method(arg)
            spent.append(time.perf_counter() - start)
            return out
        return run

    policy.choose, policy.observe = timed(policy.choose), timed(policy.observe)
    ks = sim.run(1, 2000)
    per_step = [c + o for c, o, k in zip(spent[::2], spent[1::2], ks) if k > 0]
    assert len(per_step) > 1000 and statistics.median(per_step) < 20e-6


def test_nightjar_confidence_bounds_are_chernoff_bounds_never_wider_than_hoeffding():
    from hf_specdec.policies.nightjar import _LOG_INV_DELTA, _confidence_bound, _kl

    def exact(p, n, side):             # the end of {q: n KL(p || q) <= ln(1/delta)}, by bisection
        inner, outer = p, 1.0 if side > 0 else 0.0
        for _ in range(60):
            mid = (inner + outer) / 2
            inner, outer = (mid, outer) if n * _kl(p, mid) <= _LOG_INV_DELTA else (inner, mid)
        return outer
    widths = []
    for n in (1, 3, 10, 40, 200, 5000):
        for passed in sorted({0, 1, 2, n // 7, n // 5, n // 2, n - n // 5, n - 1, n} & set(range(n + 1))):
            p = passed / n
            for side in (1, -1):
                bound, truth = _confidence_bound(p, n, side), exact(p, n, side)
                hoeffding = min(1.0, max(0.0, p + side * math.sqrt(_LOG_INV_DELTA / (2 * n))))
                assert side * (bound - truth) >= -1e-9          # a valid bound: at or beyond the exact one
                assert side * (hoeffding - bound) >= -1e-9      # never looser than Hoeffding's
                if abs(truth - p) > 1e-9:
                    widths.append(abs(bound - p) / abs(truth - p))
    assert statistics.median(widths) < 1.02 and max(widths) < 1.3
    assert _confidence_bound(0.0, 40, +1) < 0.11 < 0.2 < math.sqrt(_LOG_INV_DELTA / 80)   # 0 of 40: KL vs Hoeffding


def test_latency_model_fit_recovers_coefficients():
    truth = LatencyModel(alpha=2e-6, gamma=1e-4, delta=5e-3)
    rng = random.Random(0)
    samples = []
    for context in (32, 256, 1024, 4096):
        for tokens in (1, 4, 16, 64):
            seconds = truth.forward_time(context, tokens) * rng.uniform(0.99, 1.01)
            samples.append((context, tokens, seconds))
    fit = LatencyModel.fit(samples)
    for name in ("alpha", "gamma", "delta"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert fit.wide_extra == 0.0      # no wide forwards among the samples: not fitted


def test_latency_model_fit_separates_the_wide_forwards_fixed_cost_from_the_per_token_slope():
    # a CPU-like target: feeding a row more than one token costs a fixed 3 ms more, then 0.25 ms a token
    truth = LatencyModel(alpha=3e-6, gamma=2.5e-4, delta=9e-3, wide_extra=3e-3)
    rng = random.Random(1)

    def sample(batch, context, width):
        seconds = truth.forward_time(batch * context, batch * width, width > 1) * rng.uniform(0.99, 1.01)
        return batch * context, batch * width, seconds, width > 1
    by_batch = {batch: [sample(batch, context, width) for context in (32, 64) for width in (1, 3, 5, 8)]
                for batch in (1, 2, 4, 8)}
    samples = [s for batch_samples in by_batch.values() for s in batch_samples]
    fit = LatencyModel.fit(samples)
    for name in ("gamma", "delta", "wide_extra"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    # one line through the same times puts the jump into the slope: long verifications look dearer,
    # most at batch 1 (where the tiny pair's profile read 2.8x the slope)
    assert LatencyModel.fit([s[:3] for s in samples]).gamma > 1.3 * truth.gamma
    assert LatencyModel.fit([s[:3] for s in by_batch[1]]).gamma > 2.5 * truth.gamma


def test_switch_cost_table_interpolates_clamps_and_extends_past_the_longest_lag():
    table = SwitchCostTable([1, 5], [1, 3], [[1.0, 2.0], [5.0, 10.0]])
    assert table(1, 1) == 1.0 and table(5, 3) == 10.0
    assert table(3, 2) == pytest.approx(0.25 * (1 + 2 + 5 + 10))
    assert table(0, 2) == 0.0 and table(1, 100) == 2.0
    # a prompt-long catch-up past the grid: the last segment's slope per token goes on
    assert table(9, 1) == pytest.approx(9.0) and table(9, 100) == pytest.approx(10.0 + 4 * 2.0)


def toy_profile(draft_ratio=0.2, wide_extra=0.0):
    """A target whose verification cost grows with batch tokens (after a jump of `wide_extra`
    seconds from one token per row); a draft `draft_ratio` as dear."""
    target = LatencyModel(alpha=1e-6, gamma=2e-3, delta=1e-2, wide_extra=wide_extra)
    draft = LatencyModel(alpha=draft_ratio * 1e-6, gamma=draft_ratio * 2e-3, delta=draft_ratio * 1e-2)
    return CostProfile(target, draft, SwitchCostTable([1, 64], [1, 16], [[1e-3, 5e-3], [1e-2, 5e-2]]))


def test_profile_json_round_trip_and_malformed_files(tmp_path):
    path = tmp_path / "profile.json"
    toy_profile().save(path)
    assert CostProfile.load(path) == toy_profile()
    bad = {"not json": "{", "missing key": json.dumps({"target": {"alpha": 0, "gamma": 0, "delta": 0}}),
           "negative": json.dumps({**json.loads(path.read_text()),
                                   "draft": {"alpha": -1, "gamma": 0, "delta": 0}}),
           "ragged table": json.dumps({**json.loads(path.read_text()),
                                       "switch": {"lags": [1, 2], "batch_sizes": [1], "seconds": [[1.0]]}})}
    for name, text in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError):
            CostProfile.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        CostProfile.load(tmp_path / "missing.json")


def drafted_length(policy, batch, confidence, max_len, confidences=None):
    """Feed constant confidences (or confidences(j) for j drafted) until the policy stops drafting;
    returns the number drafted. The step is not a call's first (AdaSpec never probes there)."""
    ctx = StepContext(1, batch, 1, list(range(batch)), context_tokens=64 * batch)
    if policy.choose(ctx) == 0:
        return 0
    confidences = confidences or (lambda j: [[confidence] * j for _ in range(batch)])
    for j in range(1, max_len + 1):
        if j == max_len or not any(policy.continue_drafting(confidences(j))):
            return j


@pytest.mark.parametrize("batch,confidence", [(1, 0.9), (1, 0.6), (4, 0.8), (16, 0.7)])
def test_adaspec_stops_drafting_where_modelled_goodput_peaks(batch, confidence):
    prof = toy_profile()
    policy = hf_specdec.AdaSpec(prof, max_len=10, prior_confidence=confidence, calibrate=False)
    got = drafted_length(policy, batch, confidence, 10)

    def goodput(j):
        ar = [confidence ** i for i in range(1, j + 1)]
        seconds = sum(prof.draft.forward_time(64 * batch + i * batch, batch) for i in range(j))
        seconds += prof.target.forward_time(64 * batch, batch * (j + 1))
        return batch * (1 + sum(ar)) / seconds
    best = max(range(11), key=goodput)
    assert got == best, (got, best, [round(goodput(j), 2) for j in range(11)])


def test_adaspec_respects_the_slo():
    prof = toy_profile()
    free = drafted_length(hf_specdec.AdaSpec(prof, max_len=10, prior_confidence=0.95, calibrate=False), 1, 0.95, 10)
    slo = sum(prof.draft.forward_time(64 + i, 1) for i in range(2)) + prof.target.forward_time(64, 3) + 1e-9  # 2 fit
    capped = drafted_length(hf_specdec.AdaSpec(prof, max_len=10, slo_tpot=slo, prior_confidence=0.95,
                                               calibrate=False), 1, 0.95, 10)
    assert free > 2 and capped == 2
    too_tight = hf_specdec.AdaSpec(prof, slo_tpot=prof.target.forward_time(64, 1) / 2)
    assert too_tight.choose(StepContext(0, 1, 1, [0], context_tokens=64)) == 0


def test_adaspec_weighs_the_drafts_catch_up_against_what_is_left_of_the_call():
    """After plain steps the draft must catch up what it missed (at a call's start: the prompt). A
    short rest of the call cannot repay that, a long one can; with nothing to catch up, drafting pays."""
    def length(lag, remaining):
        policy = hf_specdec.AdaSpec(toy_profile(), max_len=6, prior_confidence=0.9, calibrate=False)
        return policy.choose(StepContext(1, 1, 1, [0], context_tokens=64, max_lag=lag, remaining=remaining))
    assert length(lag=1, remaining=8) > 0
    assert length(lag=400, remaining=8) == 0
    assert length(lag=400, remaining=4000) > 0
    assert length(lag=400, remaining=0) > 0        # the rest of the call unknown: not charged


def accepted_drafts(rng, k, acceptance):
    """How many of k drafts, each accepted with probability `acceptance`, pass before the first miss."""
    accepted = 0
    while accepted < k and rng.random() < acceptance:
        accepted += 1
    return accepted


def steps_to_finish(rng, rooms, k, acceptance):
    """Steps until every row has emitted its room, each step 1 + (accepted of k drafts) tokens."""
    left, steps = list(rooms), 0
    while max(left) > 0:
        steps += 1
        left = [n - 1 - accepted_drafts(rng, k, acceptance) for n in left]
    return steps


@pytest.mark.parametrize("batch,remaining,acceptance,k", [(16, 96, 0.7, 2), (8, 96, 0.8, 4), (16, 40, 0.6, 3)])
def test_straggler_stretch_predicts_when_a_static_batchs_last_row_finishes(batch, remaining, acceptance, k):
    """Rows emitting 1 + (accepted drafts) tokens per step, each until it has `remaining`: the
    batch's step count is the slowest row's, well past remaining / mean, as `stretch` predicts."""
    rng = random.Random(0)
    ar = [acceptance ** i for i in range(1, k + 1)]
    simulated = statistics.fmean(steps_to_finish(rng, [remaining] * batch, k, acceptance) for _ in range(300))
    mean, _ = emission_moments(ar)
    assert simulated > 1.08 * remaining / mean                        # the tail is there to price
    assert simulated == pytest.approx(remaining / mean * stretch(batch, remaining, ar), rel=0.05)
    assert stretch(1, remaining, ar) == stretch(batch, 0, ar) == 1.0   # one row; the rest unknown


def test_straggler_stretch_counts_only_rows_that_can_still_be_last():
    """A batch whose rows drifted apart (rooms 40, 38, then 16 .. 4 tokens): only the two longest
    can finish last, so the wait is a two-row one, not sixteen rows'; and no row takes more steps
    than it has tokens to go."""
    rng, acceptance, k = random.Random(0), 0.7, 3
    ar = [acceptance ** i for i in range(1, k + 1)]
    rooms = [40, 38] + [4 + i for i in range(0, 14)][::-1]
    simulated = statistics.fmean(steps_to_finish(rng, rooms, k, acceptance) for _ in range(500))
    mean, _ = emission_moments(ar)
    predicted = 40 / mean * stretch(16, 40, ar, sorted(rooms))
    assert simulated == pytest.approx(predicted, rel=0.05)
    assert stretch(16, 40, ar, sorted(rooms)) < stretch(16, 40, ar) - 0.05    # sixteen rows' wait would overprice it
    assert stretch(16, 2, [0.99] * 6) <= emission_moments([0.99] * 6)[0]


def test_row_spread_tells_rows_that_differ_for_good_from_chance_and_prices_the_slowest():
    """8 rows drafting k = 3 for 30 steps a call: rows alike (acceptance 0.7 each) read a spread of
    ~0; half the rows at 0.35 and half at 0.9 (prompt lookup: some rows' text repeats, some not)
    read one. The stretch with it never says the slowest of those rows finishes too soon (here it
    errs the other way: the normal model of the rows' rates puts the slowest below the 0.35 rows,
    at 64 steps, plain decoding's, where 46 are simulated), where the stretch for rows alike
    says far too soon."""
    k, rows = 3, 8
    def spread_of(acceptances, calls=10, seed=0):
        rng, spread = random.Random(seed), RowSpread()
        for _ in range(calls):
            spread.new_call()
            pooled = statistics.fmean(acceptances)
            mean, var = emission_moments([pooled ** i for i in range(1, k + 1)])
            for _ in range(30):
                accepted = [accepted_drafts(rng, k, a) for a in acceptances]
                spread.update(list(range(rows)), accepted, mean - 1, var)
        spread.new_call()
        return spread.spread
    assert spread_of([0.7] * rows) < 0.1
    split = [0.35] * (rows // 2) + [0.9] * (rows // 2)
    measured = spread_of(split)
    assert measured > 0.3
    rng, remaining = random.Random(1), 64
    def last_row_steps():
        steps = []
        for a in split:
            tokens = step = 0
            while tokens < remaining:
                tokens, step = tokens + 1 + accepted_drafts(rng, k, a), step + 1
            steps.append(step)
        return max(steps)
    simulated = statistics.fmean(last_row_steps() for _ in range(300))
    ar = [statistics.fmean(a ** i for a in split) for i in range(1, k + 1)]   # the pooled pass rates
    mean, _ = emission_moments(ar)
    assert simulated <= remaining / mean * stretch(rows, remaining, ar, spread=measured) <= remaining
    assert remaining / mean * stretch(rows, remaining, ar) < 0.85 * simulated


def test_finishing_rows_learns_how_many_rows_are_still_running_at_a_calls_end():
    """Rows that stop early (EOS, outputs of different lengths) cannot be the last to finish."""
    def calls(finishing, active_at):
        for _ in range(8):            # 16 rows, 96 new tokens; active_at(t): rows running after t tokens
            for t in range(96):
                if not active_at(t):  # the call is over
                    break
                finishing.update(StepContext(t, active_at(t), 1, context_tokens=0, remaining=96 - t, static_batch=True))
    finishing = FinishingRows()
    assert finishing(16) == 16                                        # nothing seen: every row may be last
    calls(finishing, lambda t: 16)                                    # every row runs to the end
    assert finishing(16) == 16 and finishing(5) == 5
    calls(finishing, lambda t: max(1, 16 - t // 6))                   # rows stop one by one (budgets 6..96)
    assert finishing(16) <= 3
    calls(finishing, lambda t: 16 if t < 40 else 0)                   # every row stops early: one was last
    assert finishing(16) == 1


def test_length_policies_price_a_static_batchs_wait_for_its_slowest_row(models):
    """A step's goodput that drafting wins by 3% at B=16 loses once the wait for the slowest row
    is counted over the 96 tokens left of a generate() call; it still wins in serving (rows are
    refilled), over a long rest of the call, and for one row."""
    def adaspec(batch, remaining, static):
        policy = hf_specdec.AdaSpec(toy_profile(0.1), max_len=6, prior_confidence=0.9, calibrate=False)
        return policy.choose(StepContext(1, batch, 1, list(range(batch)), context_tokens=64 * batch, max_lag=1,
                                         remaining=remaining, static_batch=static))
    policy, (ids, mask) = Scripted(lambda step: 2), prompts(3, seed=1)
    spec(models[0], [models[1]], policy, input_ids=ids, attention_mask=mask, max_new_tokens=12)
    assert all(c.static_batch for c in policy.contexts) and policy.contexts[0].remaining == 12    # generate()
    assert adaspec(16, 96, static=True) == 0
    assert adaspec(16, 96, static=False) > 0 and adaspec(16, 100_000, static=True) > 0 and adaspec(1, 96, True) > 0

    # Nightjar at B=16: k=2 is 3% faster per token than plain (drafts accepted with probability 0.7)
    def nightjar_drafting_share(remaining, static, seed):
        rng, policy, batch, ks = random.Random(seed), hf_specdec.Nightjar(max_len=2, seed=seed), 16, []
        for step in range(1, 601):
            k = policy.choose(StepContext(step, batch, 1, list(range(batch)), context_tokens=64 * batch, max_lag=1,
                                          remaining=remaining, static_batch=static))
            accepted = [accepted_drafts(rng, k, ALPHA) for _ in range(batch)]
            seconds = {0: 0.01, 1: 0.0185, 2: 0.02126}[k] * rng.uniform(0.98, 1.02)
            drafting = 0.3 * seconds if k else 0.0
            policy.observe(step_record(batch, [0 if k else -1] * batch, k, [k] * batch, accepted,
                                      [a + 1 for a in accepted], drafting, seconds - drafting))
            ks.append(k)
        return statistics.fmean(k > 0 for k in ks[300:])
    # pruning and exploration count the wait too: once k > 0 is known to lose, it is not explored
    # (counted by exploitation only, these shares were 0.13-0.37)
    assert max(nightjar_drafting_share(96, True, seed) for seed in range(3)) < 0.05
    assert min(nightjar_drafting_share(96, False, seed) for seed in range(3)) > 0.9
    assert min(nightjar_drafting_share(100_000, True, seed) for seed in range(3)) > 0.9


def test_adaspec_verifies_fewer_tokens_of_unsure_rows():
    policy = hf_specdec.AdaSpec(toy_profile(), max_len=6, calibrate=False)
    policy.choose(StepContext(0, 2, 1, [0, 1], context_tokens=128))
    lengths = policy.verify_lengths([[0.95] * 6, [0.3] * 6])
    assert lengths[0] > lengths[1] and lengths[1] <= 2


@pytest.mark.parametrize("slo, wide_extra", [(None, 0.0), (0.0125, 0.0), (None, 0.006), (0.018, 0.006)])
def test_adaspec_verification_is_the_best_of_every_per_row_choice(slo, wide_extra):
    """The closed-form trimming against brute force over every combination of per-row prefixes,
    also where verifying any draft first pays a wide forward's fixed cost."""
    import itertools
    rng = random.Random(0)
    for trial in range(30):
        policy = hf_specdec.AdaSpec(toy_profile(wide_extra=wide_extra), max_len=4, calibrate=False,
                                    slo_tpot=slo)
        batch = rng.choice([1, 2, 3])
        policy.choose(StepContext(0, batch, 1, list(range(batch)), context_tokens=64 * batch))
        confidences = [[rng.random() ** 0.3 for _ in range(4)] for _ in range(batch)]
        ar = policy._ar(confidences)
        lengths = policy.verify_lengths(confidences)

        def goodput(choice):
            seconds = policy.model.step_time(batch, 64 * batch, 4, batch + sum(choice))
            if slo is not None and seconds > slo:
                return -1.0
            return sum(1 + sum(row[:n]) for row, n in zip(ar, choice)) / seconds
        best = max(goodput(c) for c in itertools.product(range(5), repeat=batch))
        assert goodput(lengths) == pytest.approx(best), (trial, lengths, confidences)


def test_adaspec_drafts_for_its_sure_rows_when_the_unsure_ones_will_be_trimmed():
    """One sure row among three unsure ones: their drafts will not be verified, so drafting goes on
    as long as the sure row's next token pays its draft forward, to the length that maximises the
    step's trimmed goodput (5). Judged by verifying every row's drafts, it stopped at 1."""
    policy = hf_specdec.AdaSpec(toy_profile(0.05), max_len=8, calibrate=False, prior_confidence=0.95)

    def confidences(j):
        return [[0.95] * j] + [[0.1] * j] * 3

    def trimmed_goodput(j):
        return policy.model.best_verification(4, 64 * 4, j, policy._ar(confidences(j)))[1]
    best = max(range(1, 9), key=trimmed_goodput)
    assert drafted_length(policy, 4, None, 8, confidences) == best > 1


def test_adaspec_drafts_when_a_longer_draft_pays_though_one_does_not():
    """Drafting steps measured 10 ms slower than modelled (a CPU's slower matrix-matrix kernel, the
    loop's own work), plain ones as modelled: one draft then loses to plain decoding while longer
    ones win, and AdaSpec must draft."""
    policy = hf_specdec.AdaSpec(toy_profile(0.05), max_len=6, calibrate=False, prior_confidence=0.9)
    policy.model.extra = {1: (0.01, 10, 0)}
    ctx = StepContext(5, 1, 1, [0], context_tokens=64)

    def goodput(j):
        return policy.model.goodput(1, 64, j, [0.9 ** i for i in range(1, j + 1)])
    assert goodput(1) < goodput(0) < max(goodput(j) for j in range(2, 7))
    assert policy.choose(ctx) > 0


def test_goodput_model_learns_a_drafting_steps_fixed_cost():
    """Drafting steps cost the model plus a fixed 8 ms (as the tiny pair at B=1: plain 12 ms, one
    draft 23 ms, each further draft +3 ms). Taught by plain steps and k = 2 steps only, the model
    predicts every k's step time; a ratio learned at k = 2 would be 14% off at k = 6 and keep the
    model's own best length where longer drafts amortise the fixed cost."""
    model = hf_specdec.AdaSpec(toy_profile(), max_len=6, calibrate=False).model
    def truth(k):
        return 0.9 * model._modelled(1, 64, k, k + 1) + (0.008 if k else 0.0)
    for step in range(1, 40):
        k = 2 if step % 3 else 0
        model.learn(step_record(1, [0], k, [k], [k], [k + 1], 0.0, truth(k), step=step, lag=1), 64)
    for k in range(7):
        assert model.step_time(1, 64, k, k + 1) == pytest.approx(truth(k), rel=0.02), k


def test_goodput_model_replaces_a_stale_drafting_cost():
    """A drafting cost learned in a slow spell (30 ms over the model), then 200 plain steps: the
    next drafting step (a probe) weighs half, while back-to-back drafting steps each weigh a
    tenth (noise averages out)."""
    model = hf_specdec.AdaSpec(toy_profile(), max_len=6, calibrate=False).model
    def learn(step, k, excess):
        model.learn(step_record(1, [0], k, [k], [k], [k + 1], 0.0, model._modelled(1, 64, k, k + 1) + excess,
                               step=step, lag=1), 64)
    for step in range(1, 30):
        learn(step, 2, 0.030)
    for step in range(30, 230):
        learn(step, 0, 0.0)
    learn(230, 2, 0.002)                              # the machine is fast again
    assert model.excess(1) == pytest.approx(0.016)
    learn(231, 2, 0.030)                              # one noisy step right after: a tenth of it
    assert model.excess(1) == pytest.approx(0.0174)


def test_goodput_model_is_not_thrown_off_by_a_probes_catch_up():
    """Drafting steps cost 2 ms more to draft and 4 ms more to verify than modelled (B=16). A probe
    after 40 plain steps catches the draft up 40 tokens per row, 10 ms faster than modelled (a
    catch-up varies far more than the excess): its verification still teaches, its drafting side
    does not, so the excess stays 6 ms (folded whole at the probe's weight of a half: 1 ms)."""
    model = hf_specdec.AdaSpec(toy_profile(), max_len=6, calibrate=False).model
    def learn(step, k, lag=1, catch_up_error=0.0):
        fed = 16 * (k + 1)
        verification = model._modelled(16, 64, 0, fed) + (0.004 if k else 0.0)
        drafting = model._modelled(16, 64, k, fed, lag) - model._modelled(16, 64, 0, fed)
        drafting += 0.002 + catch_up_error
        model.learn(step_record(16, [0] * 16, k, [k] * 16, [k] * 16, [k + 1] * 16, drafting if k else 0.0,
                               verification, step=step, lag=lag), 64)
    for step in range(1, 30):
        learn(step, 3)
    for step in range(30, 70):
        learn(step, 0)
    learn(70, 3, lag=40, catch_up_error=-0.010)
    assert model.excess(16) == pytest.approx(0.006)


def test_calibration_learns_that_unsure_exact_drafts_are_accepted():
    """A drafter that always agrees with the target but with flat distributions (confidence 0.2):
    the paper's model would stop drafting at once; the calibrated one learns to draft long."""
    prof = toy_profile()
    paper = hf_specdec.AdaSpec(prof, max_len=8, prior_confidence=0.2, calibrate=False)
    calibrated = hf_specdec.AdaSpec(prof, max_len=8, prior_confidence=0.2)
    for _ in range(120):
        n = drafted_length(calibrated, 1, 0.2, 8)
        calibrated.verify_lengths([[0.2] * n])
        calibrated.observe(step_record(1, [0], 8, [n], [n], [n + 1], 0.0, 0.01))
    assert drafted_length(paper, 1, 0.2, 8) <= 1
    assert drafted_length(calibrated, 1, 0.2, 8) >= 6
    assert calibrated.calibration(0.2) > 0.9


def test_calibration_follows_a_flat_drafters_acceptance_and_pools_bins():
    """Confidences all in bin 0 (0.01) and 70% of drafts accepted: after 20 judged drafts the
    estimate is near 0.7 (a prior at the bin's midpoint, 0.05, held it at 0.59 and AdaSpec decoded
    plain where drafting paid); an unseen bin starts at the rate seen across bins, not the identity."""
    from hf_specdec.policies.goodput import Calibration
    calibration = Calibration()
    assert calibration(0.01) == pytest.approx(0.05) and calibration(0.95) == pytest.approx(0.95)
    for accepted in [3, 1, 2, 0, 6, 2]:          # 14 accepted of 20 judged (a reject ends each row)
        calibration.update([0.01] * 8, accepted, 8)
    assert sum(calibration.judged) == 20
    assert abs(calibration(0.01) - 0.7) < 0.05
    assert abs(calibration(0.55) - 0.7) < 0.05   # no data in bin 5: the pooled rate


def test_adaspec_corrects_ar_where_acceptance_depends_on_depth():
    """Prompt lookup's drafts all carry confidence 1.0, and pass as a run: the first 35% of the
    time, each later one 90% of the time given its predecessors. The calibration pools that into
    one rate, whose powers are not the AR of three drafts; corrected by the drafts measured to
    pass per verified step, the policy's expected accepted drafts match the truth."""
    rng = random.Random(0)
    policy = hf_specdec.AdaSpec(toy_profile(), max_len=3)
    truth = 0.35 * (1 + 0.9 + 0.81)          # E[accepted] of three drafts
    for step in range(1, 300):
        policy.choose(StepContext(step, 2, 1, [0, 1], context_tokens=128))
        policy.verify_lengths([[1.0] * 3] * 2)
        accepted = []
        for _ in range(2):
            n = 0
            while n < 3 and rng.random() < (0.35 if n == 0 else 0.9):
                n += 1
            accepted.append(n)
        policy.observe(step_record(2, [0, 0], 3, [3, 3], accepted, [a + 1 for a in accepted], 0.0, 0.01, step=step))
    pooled = sum(policy._ar([[1.0] * 3], corrected=False)[0])
    assert pooled > 1.15 * truth                                  # what the calibration alone predicts
    assert sum(policy._ar([[1.0] * 3])[0]) == pytest.approx(truth, rel=0.1)


def test_adaspec_probes_only_where_acceptance_could_make_drafting_pay():
    """Every probe's first draft is rejected. Probes come every `probe_every` steps while the
    acceptance estimate is too uncertain to rule drafting out, then ever rarer as the optimistic
    gain they could find shrinks; once sure, they lose at most `probe_budget` of the plain steps'
    time (default 1%); none where even drafts that are always accepted would not pay. A probe
    drafts all max_len tokens while acceptance could be high, one once it is known to be low."""
    def drafting_steps(draft_ratio, batch):
        """The gaps between probes, and the probes' loss over the plain steps' time after the first
        probe; `lengths` gets each probe's length."""
        policy = hf_specdec.AdaSpec(toy_profile(draft_ratio), max_len=6, prior_confidence=0.02, probe_every=4)
        steps, rows, lost, plain = [], [0] * batch, 0.0, 0.0
        lengths.clear()
        for step in range(1, 1500):
            k = policy.choose(StepContext(step, batch, 1, list(range(batch)), context_tokens=64 * batch))
            if k:
                steps.append(step)
                lengths.append(k)
                policy.verify_lengths([[0.02] * k] * batch)
            seconds = policy.model.step_time(batch, 64 * batch, k, (k + 1) * batch)
            plain_seconds = policy.model.step_time(batch, 64 * batch, 0, batch)
            if steps and step > steps[0]:
                lost, plain = (lost + seconds - plain_seconds, plain) if k else (lost, plain + seconds)
            policy.observe(step_record(batch, rows, k, [k] * batch, rows, [1] * batch, 0.0, seconds, step=step))
        return [b - a for a, b in zip(steps, steps[1:])], lost / max(plain, 1e-9)
    lengths = []
    gaps, _ = drafting_steps(0.05, 1)
    assert lengths[0] == 6 and set(lengths[-10:]) == {1}, lengths
    assert gaps[:3] == [4] * 3, gaps                         # unsure: every probe_every steps
    assert gaps == sorted(gaps) and gaps[-1] >= 128, gaps    # then ever rarer: 32 x probe_every, or the budget's gap
    gaps, lost = drafting_steps(0.05, 4)                     # sure after one probe (B=4): within budget
    assert len(gaps) >= 3 and lost <= 0.01, (gaps, lost)
    assert drafting_steps(1.5, 16)[0] == []                  # a draft dearer than the target: no acceptance would pay


def test_adaspec_is_as_unsure_as_the_row_steps_it_judged_not_their_drafts():
    """A row's drafts in one step share one stretch of text: 4 row-steps that judged 6 drafts each
    are 4 samples of acceptance, not 24 (tiny pair, B=8: a call's first few steps read 0.54, ~0.72
    later; bounded as if independent, drafting looked sure to lose and probes grew rare)."""
    policy = hf_specdec.AdaSpec(toy_profile(), max_len=6)
    for _ in range(4):
        policy.calibration.update([0.5] * 6, accepted=5, proposed=6)
    policy.guess = 0.3
    assert policy.optimistic_acceptance() >= 0.3 + math.sqrt(1 / 4) - 1e-9


def test_adaspec_does_not_probe_at_a_calls_first_step():
    """The last call's idle steps make a probe due, but step 0 also prefills the prompt and its time
    is not learned from: a probe there would never teach the drafting cost. It comes within the next
    probe_every steps."""
    policy = hf_specdec.AdaSpec(toy_profile(0.05), max_len=6, prior_confidence=0.02, probe_every=4)
    policy.idle = 399                                        # the last call's idle steps: a probe is due
    assert policy.choose(StepContext(0, 1, 1, [0], context_tokens=64)) == 0
    lengths = [policy.choose(StepContext(step, 1, 1, [0], context_tokens=64)) for step in range(1, 5)]
    assert sum(k > 0 for k in lengths) == 1, lengths


def test_adaspec_weighs_drafting_when_the_batch_changes_and_otherwise_every_probe_every_idle_steps():
    """Idle, AdaSpec weighs drafting again (every length: most of a decision's cost) only every
    probe_every steps or when the batch size changes, so a drop in load is answered at once. At
    B=64 no draft pays (the toy target's verification cost grows with its batch tokens), at B=1 it does."""
    policy = hf_specdec.AdaSpec(toy_profile(), max_len=6, prior_confidence=0.9, calibrate=False, probe_every=4)
    goodput, weighed = policy.model.goodput, []
    policy.model.goodput = lambda *args, **kwargs: weighed.append(True) or goodput(*args, **kwargs)
    asked = []
    for step in range(1, 13):
        weighed.clear()
        assert policy.choose(StepContext(step, 64, 1, list(range(64)), context_tokens=64 * 64)) == 0
        asked.append(bool(weighed))
    assert asked == [step == 1 or step % 4 == 0 for step in range(1, 13)], asked
    assert policy.choose(StepContext(13, 1, 1, [0], context_tokens=64)) > 0


def test_adaspec_probe_finds_that_unsure_exact_drafts_pay():
    """An exact drafter with flat distributions (confidence 0.05) on a machine where every step runs
    30% faster than profiled. Plain steps get corrected at once; a probe's step must count too
    although its draft caught up first, or speculation keeps its uncorrected (30% too slow) time
    and AdaSpec stays at k = 0 for good (as it did on the tiny exact pair at B=1)."""
    policy = hf_specdec.AdaSpec(toy_profile(0.2), max_len=6, prior_confidence=0.05, probe_every=4)
    lag, drafted = 0, []
    for step in range(1, 80):
        ctx = StepContext(step, 1, 1, [0], context_tokens=64, max_lag=lag)
        n = drafted_length(policy, 1, 0.05, 6)            # calls choose(ctx) with the same numbers
        policy.ctx = ctx
        if n:
            n = policy.verify_lengths([[0.05] * n])[0]
        seconds = policy.model._modelled(1, 64, n, n + 1, lag) * 0.7
        policy.observe(step_record(1, [0 if n else -1], 6 if n else 0, [n], [n], [n + 1], 0.0, seconds,
                                  step=step, lag=lag))
        lag = 2 if n else lag + 1
        drafted.append(n)
    assert sum(n > 0 for n in drafted[-20:]) >= 18, drafted
    assert statistics.mean(drafted[-20:]) >= 5, drafted


def test_adaspec_counts_a_step_whose_drafts_were_all_dropped_as_a_drafting_step():
    """Drafting 3 tokens and verifying none still ran 3 draft forwards: folding that time into the
    plain steps' correction made plain decoding look ever slower (and AdaSpec draft every step)."""
    policy = hf_specdec.AdaSpec(toy_profile(), max_len=6, prior_confidence=0.02)
    policy.choose(StepContext(1, 1, 1, [0], context_tokens=64))
    assert policy.verify_lengths([[0.01] * 3]) == [0]
    policy.observe(step_record(1, [0], 6, [0], [0], [1], 0.01, 0.02, step=1, lag=1))
    assert set(policy.model.extra) == {1} and not policy.model.ratio


def test_adaspec_answers_each_drafter_of_a_step_from_its_own_confidences():
    """Rows that chose different drafters: each drafter asks `continue_drafting` with its own lists,
    growing draft by draft, in the same step. The second must be answered from its own confidences
    (the policy caches a step's acceptance estimates; reused, the first drafter's sure drafts
    would keep the second's hopeless ones going)."""
    def policy():
        ada = hf_specdec.AdaSpec(toy_profile(0.05), max_len=8, calibrate=False, prior_confidence=0.9)
        assert ada.choose(StepContext(5, 2, 2, [0, 1], context_tokens=128)) > 0
        return ada

    def answers(ada, confidence, drafts):
        rows, out = [[], []], []            # the same two lists, a column appended per draft
        for _ in range(drafts):
            for row in rows:
                row.append(confidence)
            out.append(ada.continue_drafting(rows))
        return out
    shared = policy()
    assert answers(shared, 0.95, 3)[-1] == [True, True]
    assert answers(shared, 0.02, 2) == answers(policy(), 0.02, 2) == [[False, False]] * 2


def test_goodput_policies_correct_the_latency_model_with_measured_steps():
    """Speculative steps measured 4x slower than modelled (as a CPU's matrix-matrix kernel can be)
    turn drafting off although every draft is accepted; prompt prefills, which the model does not
    describe, are ignored, and a draft catch-up is modelled (it does not look like a slow step)."""
    prof = toy_profile()
    ctx = StepContext(1, 1, 1, [0], context_tokens=64)
    for policy in (hf_specdec.DSDGoodput(prof), hf_specdec.AdaSpec(prof, calibrate=False, prior_confidence=0.7)):
        k = policy.choose(ctx)
        assert k > 0
        modelled = policy.model.step_time(1, 64, k, k + 1)
        verification = policy.model.step_time(1, 64, 0, k + 1)
        outliers = [step_record(1, [0], k, [k], [k], [k + 1], 0.0, 100 * modelled, step=0),          # prefill
                    step_record(1, [0], k, [k], [k], [k + 1], policy.model.step_time(1, 64, k, k + 1, lag=40)
                               - verification, verification, step=5, lag=40)]                     # catch-up
        for record in outliers:
            policy.observe(record)
        assert policy.choose(ctx) == k
        for step in range(2, 12):
            policy.verify_lengths([[0.7] * k]) if isinstance(policy, hf_specdec.AdaSpec) else None
            # every draft accepted: the drafter lags 2 tokens (the last draft and the target's token)
            policy.observe(step_record(1, [0], k, [k], [k], [k + 1], 0.0, 4 * modelled, step=step, lag=2))
            k = policy.choose(ctx) or k
        assert policy.choose(ctx) == 0, policy


def test_dsd_goodput_can_deadlock_at_zero():
    """The baseline's known weakness: once k = 0, acceptance is no longer measured."""
    policy = hf_specdec.DSDGoodput(toy_profile(draft_ratio=0.5), prior_acceptance=0.05)
    ctx = StepContext(0, 1, 1, [0], context_tokens=64)
    assert policy.choose(ctx) == 0
    policy.observe(step_record(1, [-1], 0, [0], [0], [1], 0.0, 0.01))
    assert policy.choose(ctx) == 0


def test_hf_heuristic_schedule():
    policy = hf_specdec.HFHeuristic(initial=5)
    ctx = StepContext(0, 1, 1, [0])
    assert policy.choose(ctx) == 5
    policy.observe(step_record(1, [0], 5, [5], [5], [6], 0, 0))
    assert policy.choose(ctx) == 7
    policy.observe(step_record(1, [0], 7, [7], [2], [3], 0, 0))
    assert policy.choose(ctx) == 6


@pytest.fixture(scope="module")
def models():
    target = build("llama", 3, seed=0)
    return target, noisy_copy(target, 0.03, seed=1)


POLICIES = {
    "fixed": lambda: hf_specdec.FixedLength(3),
    "heuristic": lambda: hf_specdec.HFHeuristic(initial=3),
    "confidence": lambda: hf_specdec.ConfidenceThreshold(0.5, max_len=6),
    "dsd": lambda: hf_specdec.DSDGoodput(toy_profile(), max_len=5),
    "adaspec": lambda: hf_specdec.AdaSpec(toy_profile(), max_len=6),
    "adaspec-slo": lambda: hf_specdec.AdaSpec(toy_profile(), max_len=6, slo_tpot=0.05),
    "nightjar": lambda: hf_specdec.Nightjar(max_len=4, switch_cost=toy_profile()),
}


@pytest.mark.parametrize("name", POLICIES)
def test_every_length_policy_keeps_greedy_outputs_identical(models, name):
    target, draft = models
    ids, mask = prompts(5, seed=11)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, repetition_penalty=1.1)
    for policy in (POLICIES[name](), hf_specdec.SpecPolicy(hf_specdec.HedgeSpec(), POLICIES[name]())):
        out = spec(target, [draft, hf_specdec.PromptLookupDrafter()], policy, return_dict_in_generate=True, **kwargs)
        assert_same(out.sequences, target.generate(**kwargs))


def test_confidence_threshold_gives_rows_different_lengths(models):
    target, draft = models
    ids, mask = prompts(6, seed=2)
    out = spec(target, [draft], hf_specdec.ConfidenceThreshold(0.6, max_len=6), input_ids=ids, attention_mask=mask,
               max_new_tokens=20, return_dict_in_generate=True)
    assert any(len(set(s.proposed)) > 1 for s in out.spec_stats.steps)


def test_rows_stop_drafting_where_the_policy_says_and_stay_stopped(models):
    """`continue_drafting` answers per row: row b says no after b + 1 drafts, then yes, then no
    again. Each row keeps the drafts it had when it first said no; outputs stay generate()'s."""
    class PerRow(hf_specdec.policies.LengthPolicy):
        def choose(self, ctx):
            return 4
        def continue_drafting(self, confidences):
            return [len(row) not in (b + 1, b + 3) for b, row in enumerate(confidences)]
    target, draft = models
    ids, mask = prompts(3, seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12)
    out = spec(target, [draft], PerRow(), return_dict_in_generate=True, **kwargs)
    assert out.spec_stats.steps[0].proposed == [1, 2, 3]
    assert_same(out.sequences, target.generate(**kwargs))


def test_profiler_measures_tiny_models_and_the_cli_writes_json(tmp_path, monkeypatch):
    target, draft = build("llama", 2, seed=0), build("llama", 1, seed=1)
    prof = profile(target, draft, batch_sizes=(1, 2), widths=(1, 2), contexts=(4, 8), lags=(1, 3), repeats=1,
                   progress=False)
    assert prof.target.forward_time(8, 2) > 0 and prof.switch(3, 2) > 0
    prefill = profile_prefill(build("llama", 2, seed=0, hidden=256), lengths=(8, 64, 256), repeats=2)
    assert prefill.forward_time(256, 256) > prefill.forward_time(8, 8) > 0
    main = __import__("hf_specdec.__main__", fromlist=["main"])
    monkeypatch.setattr(main, "_load", lambda args: (target, draft))
    out = tmp_path / "p.json"
    assert main.main(["profile", "--batch-sizes", "1,2", "--widths", "1", "--contexts", "4,8", "--lags", "1,2",
                      "--repeats", "1", "--out", str(out)]) == 0
    assert CostProfile.load(out).switch.lags == [1, 2]
    with pytest.raises(SystemExit):
        main.main(["profile", "--batch-sizes", "0", "--out", str(out)])


@pytest.mark.parametrize("make,match", [
    (lambda: hf_specdec.Nightjar(max_len=0), "max_len"),
    (lambda: hf_specdec.Nightjar(switch_cost=-1), "switch_cost"),
    (lambda: hf_specdec.Nightjar(buckets="log"), "buckets"),
    (lambda: hf_specdec.AdaSpec(toy_profile(), max_len=0), "max_len"),
    (lambda: hf_specdec.AdaSpec(toy_profile(), slo_tpot=-0.1), "slo_tpot"),
    (lambda: hf_specdec.AdaSpec(toy_profile(), probe_budget=0), "probe_budget"),
    (lambda: hf_specdec.ConfidenceThreshold(1.5), "threshold"),
    (lambda: hf_specdec.HFHeuristic(initial=0), "initial"),
    (lambda: hf_specdec.DSDGoodput(toy_profile(), prior_acceptance=2), "prior_acceptance"),
    (lambda: LatencyModel(alpha=-1e-6, gamma=0, delta=0), "alpha"),
])
def test_invalid_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_cost_model_of_the_wrong_type():
    with pytest.raises(TypeError, match="cost_model"):
        hf_specdec.AdaSpec(cost_model=42)
