"""Adaptive draft lengths: Nightjar, AdaSpec, DSD goodput and Transformers' schedules.

Policies are driven through their public API (choose / observe, and AdaSpec's drafting hooks) in a
simulated environment whose optimum is known (step time and acceptance as functions of batch size
and k), then with real tiny models for losslessness.
"""
import itertools
import json
import random
from collections import Counter

import pytest

import hf_specdec
from helpers import assert_same, spec, step_record
from hf_specdec.costmodel import CostProfile, LatencyModel, SwitchCostTable, profile, profile_prefill
from hf_specdec.policies import StepContext
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

    def __init__(self, policy, switch_seconds=0.0, seed=0, alpha=ALPHA):
        self.policy, self.switch_seconds, self.alpha = policy, switch_seconds, alpha
        self.rng = random.Random(seed)
        self.previous_k, self.lag, self.step, self.remaining = None, 0, 0, 0
        self.choices = []

    def new_call(self, batch, prompt_len=100, budget=0):
        """A generate() call starts: the drafter has not seen its prompt (it lags by all of it).
        budget: the call's max_new_tokens, told to the policy as StepContext.remaining (0: unknown)."""
        self.step, self.lag, self.previous_k, self.remaining = 0, prompt_len, 0, budget

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
            drafting = seconds * 0.15 * batch * k / (1 + 0.3 * batch * k)   # half the extra time drafts
            if k > 0 and self.previous_k == 0:
                seconds += self.switch_seconds            # the draft catches up its lag
                drafting += self.switch_seconds
            self.lag = self.lag + 1 if k == 0 else 0
            # each draft is accepted with probability alpha, and a row keeps drafts up to its first rejection
            emitted = [1 + self.accepted(k) for _ in range(batch)]
            self.policy.observe(step_record(batch, [0 if k else -1] * batch, k, [k] * batch, [e - 1 for e in emitted],
                                           emitted, drafting, seconds - drafting, step=self.step))
            self.choices.append((batch, k))
            if self.remaining:
                self.remaining = max(self.remaining - max(emitted), 1)
            self.previous_k = k
            self.step += 1
        return [k for _, k in self.choices[-steps:]]


def test_simulation_has_the_intended_optima():
    assert optimum(1) == 2 and optimum(8) == 0 and optimum(16) == 0


def latency(k, batch=1):
    return step_time(batch, k) / expected_tokens(k)


def test_nightjar_converges_per_batch_size_and_comes_back_after_load():
    sim = Sim(hf_specdec.Nightjar(max_len=6, seed=1))
    low = sim.run(1, 1500)
    high = sim.run(16, 1500)
    back = sim.run(1, 400)
    for phase, batch in ((low, 1), (high, 16), (back, 1)):
        mode, count = Counter(phase[-300:]).most_common(1)[0]
        assert mode == optimum(batch) and count >= 0.7 * 300, (batch, Counter(phase[-300:]))
    assert Counter(high[-300:])[0] >= 0.7 * 300                  # speculation switched off under load
    assert Counter(back)[0] < 0.3 * len(back)                    # and back on after it: no deadlock at k = 0


def regret_per_step(policy, seed, steps=16000):
    """Running mean of the latency per token over the optimum's, minus 1 (B=1)."""
    ks = Sim(policy, seed=seed).run(1, steps)
    regret = itertools.accumulate(latency(k) / latency(optimum(1)) - 1 for k in ks)
    return [r / (n + 1) for n, r in enumerate(regret)]


def test_nightjar_regret_grows_sublinearly():
    """Regret per step (latency per token over the optimum's) falls as the run grows: the bandit
    spends a shrinking share of its steps on other arms (the paper's exploration constant)."""
    for seed in range(4):
        regret = regret_per_step(hf_specdec.Nightjar(max_len=6, explore=1.0, seed=seed), seed)
        early, late = regret[999], regret[-1]
        assert late < 0.65 * early and late < 0.05, (seed, early, late)


def test_nightjar_smaller_exploration_constant_costs_less_early_and_still_converges():
    """explore=0.25 (the default) against the paper's 1.0: less regret over the first 128 and 1000
    steps on average over seeds, and as little at the end."""
    seeds = range(6)
    ours = [regret_per_step(hf_specdec.Nightjar(max_len=6, seed=seed), seed) for seed in seeds]
    paper = [regret_per_step(hf_specdec.Nightjar(max_len=6, explore=1.0, seed=seed), seed) for seed in seeds]
    for at in (127, 999):
        assert sum(r[at] for r in ours) < 0.85 * sum(r[at] for r in paper), at
    assert all(r[-1] < 0.05 for r in ours) and sum(r[-1] for r in ours) < 1.5 * sum(r[-1] for r in paper)


def test_nightjar_switches_less_when_switching_is_expensive():
    """Calls alternate between busy (B=8: plain wins) and quiet (B=1: k=2 saves ~27% a token). A
    switch of 2 ms is worth it for the tokens of one drafting step; one of 50 ms is not, so then
    only exploration and bins locked across calls switch."""
    def switches(cost):
        policy = hf_specdec.Nightjar(max_len=6, switch_cost=cost, seed=3)
        sim = Sim(policy, switch_seconds=cost)
        for _ in range(150):
            sim.new_call(8)
            sim.run(8, 20)
            sim.new_call(1)
            sim.run(1, 20)
        ks = [k for _, k in sim.choices]
        return sum(1 for a, b in zip(ks, ks[1:]) if a == 0 and b > 0)
    free, cheap, dear = switches(0.0), switches(0.002), switches(0.05)
    assert cheap >= 0.8 * free and dear < 0.65 * cheap, (free, cheap, dear)


def test_nightjar_pow2_buckets_reuse_learning_as_the_batch_shrinks():
    def zeros_while_shrinking(buckets):
        sim = Sim(hf_specdec.Nightjar(max_len=6, buckets=buckets, seed=2))
        sim.run(16, 1000)                                # learned: at this load, do not speculate
        shrinking = [k for b in range(15, 8, -1) for k in sim.run(b, 6)]
        return shrinking.count(0) / len(shrinking)
    assert zeros_while_shrinking("pow2") > 0.7 > zeros_while_shrinking("exact")


def test_nightjar_does_not_count_a_calls_prompt_prefill():
    """A call's first step also prefills the prompt in the target: its time is no arm's latency.
    The same slow step later in a call does count (and changes what is chosen next)."""
    def after_a_slow_step(step):
        sim = Sim(hf_specdec.Nightjar(max_len=6, seed=1))
        sim.run(1, 600)
        if step is not None:
            sim.policy.observe(step_record(1, [0], 2, [2], [2], [3], 0.0, 100.0, step=step))
        return sim.run(1, 300)
    assert after_a_slow_step(0) == after_a_slow_step(None)
    assert after_a_slow_step(5) != after_a_slow_step(None)


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
    """Drive one step of AdaSpec's drafting hook with drafts of the given confidence (or the lists
    `confidences(j)` after j drafts); returns the number drafted."""
    ctx = StepContext(1, batch, 1, list(range(batch)), context_tokens=64 * batch)
    if policy.choose(ctx) == 0:
        return 0
    confidences = confidences or (lambda j: [[confidence] * j for _ in range(batch)])
    for j in range(1, max_len + 1):
        if j == max_len or not any(policy.continue_drafting(confidences(j))):
            return j


def cumulative(row):
    out, acc = [], 1.0
    for c in row:
        acc *= c
        out.append(acc)
    return out


@pytest.mark.parametrize("batch,confidence", [(1, 0.9), (1, 0.6), (4, 0.8), (16, 0.7)])
def test_adaspec_stops_drafting_where_modelled_goodput_peaks(batch, confidence):
    prof = toy_profile()
    policy = hf_specdec.AdaSpec(prof, max_len=10, prior_confidence=confidence)
    got = drafted_length(policy, batch, confidence, 10)

    def goodput(j):
        ar = [confidence ** i for i in range(1, j + 1)]
        seconds = sum(prof.draft.forward_time(64 * batch + i * batch, batch) for i in range(j))
        seconds += prof.target.forward_time(64 * batch, batch * (j + 1), wide=j > 0)
        return batch * (1 + sum(ar)) / seconds
    best = max(range(1, 11), key=goodput)     # the first draft is always drafted
    assert got == best, (got, best, [round(goodput(j), 2) for j in range(11)])


def test_adaspec_respects_the_slo():
    prof = toy_profile()
    free = drafted_length(hf_specdec.AdaSpec(prof, max_len=10, prior_confidence=0.95), 1, 0.95, 10)
    slo = sum(prof.draft.forward_time(64 + i, 1) for i in range(2)) + prof.target.forward_time(64, 3) + 1e-9  # 2 fit
    capped = drafted_length(hf_specdec.AdaSpec(prof, max_len=10, slo_tpot=slo, prior_confidence=0.95), 1, 0.95, 10)
    assert free > 2 and capped == 2
    too_tight = hf_specdec.AdaSpec(prof, slo_tpot=prof.target.forward_time(64, 1) / 2)
    assert too_tight.choose(StepContext(0, 1, 1, [0], context_tokens=64)) == 0


def test_adaspec_follows_the_drafts_confidence_down_and_back_up():
    """Unsure drafts (the text turned hard) shorten the drafting to the one draft the paper always
    makes; sure ones afterwards lengthen it again: nothing stays stuck."""
    policy = hf_specdec.AdaSpec(toy_profile(), max_len=8, prior_confidence=0.9)
    lengths = []
    for confidence in [0.9] * 30 + [0.1] * 100 + [0.95] * 100:
        j = drafted_length(policy, 1, confidence, 8)
        if j:
            policy.verify_lengths([[confidence] * j])
        lengths.append(j)
    assert lengths[29] > 2 and lengths[129] == 1 and lengths[-1] > 2, lengths


def test_adaspec_verifies_fewer_tokens_of_unsure_rows():
    policy = hf_specdec.AdaSpec(toy_profile(), max_len=6)
    policy.choose(StepContext(0, 2, 1, [0, 1], context_tokens=128))
    lengths = policy.verify_lengths([[0.95] * 6, [0.3] * 6])
    assert lengths[0] > lengths[1] and lengths[1] <= 2


@pytest.mark.parametrize("slo, wide_extra", [(None, 0.0), (0.0125, 0.0), (None, 0.006), (0.018, 0.006)])
def test_adaspec_verification_is_the_best_of_every_per_row_choice(slo, wide_extra):
    """Dropping the lowest-AR draft while that pays (Alg. 2) against brute force over every
    combination of per-row prefixes, also where verifying any draft pays a wide forward's fixed cost."""
    rng = random.Random(0)
    prof = toy_profile(wide_extra=wide_extra)
    for trial in range(30):
        policy = hf_specdec.AdaSpec(prof, max_len=4, slo_tpot=slo)
        batch = rng.choice([1, 2, 3])
        policy.choose(StepContext(0, batch, 1, list(range(batch)), context_tokens=64 * batch))
        confidences = [[rng.random() ** 0.3 for _ in range(4)] for _ in range(batch)]
        ar = [cumulative(row) for row in confidences]
        lengths = policy.verify_lengths(confidences)

        def goodput(choice):
            fed = batch + sum(choice)
            seconds = 4 * prof.draft.forward_time(64 * batch, batch) + prof.draft.alpha * batch * 6 \
                + prof.target.forward_time(64 * batch, fed, wide=fed > batch)
            if slo is not None and seconds > slo:
                return -1.0
            return sum(1 + sum(row[:n]) for row, n in zip(ar, choice)) / seconds
        best = max(goodput(c) for c in itertools.product(range(5), repeat=batch))
        assert goodput(lengths) == pytest.approx(best), (trial, lengths, confidences)


def test_adaspec_drafts_for_its_sure_rows_when_the_unsure_ones_will_be_trimmed():
    """One sure row among three unsure ones: their drafts will not be verified, so drafting goes on
    as long as the sure row's next token pays its draft forward."""
    policy = hf_specdec.AdaSpec(toy_profile(0.05), max_len=8, prior_confidence=0.95)
    assert drafted_length(policy, 4, None, 8, lambda j: [[0.95] * j] + [[0.1] * j] * 3) > 2
    assert drafted_length(policy, 4, None, 8, lambda j: [[0.1] * j] * 4) == 1


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
    "measured": lambda: hf_specdec.MeasuredGoodput(max_len=6),
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
    # logits are computed where the loop needs them: at every verified token of the target, at the
    # last fed token of a draft catch-up or a prefill (the output head is costly at a large vocabulary);
    # the context is prefilled in one row and copied to the others ([rows, positions] per forward)
    shapes = {"target": [], "draft": []}
    for name, model in (("target", target), ("draft", draft)):
        model.get_output_embeddings().register_forward_hook(
            lambda module, args, out, name=name: shapes[name].append(tuple(out.shape[:2])))
    profile(target, draft, batch_sizes=(2,), widths=(1, 2, 3), contexts=(4,), lags=(3,), repeats=1, progress=False)
    assert shapes["target"] == [(1, 1), (2, 1), (2, 2), (2, 3)] and shapes["draft"] == [(1, 1)] + [(2, 1)] * 4
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
    (lambda: hf_specdec.AdaSpec(toy_profile(), prior_confidence=0), "prior_confidence"),
    (lambda: hf_specdec.MeasuredGoodput(max_len=0), "max_len"),
    (lambda: hf_specdec.MeasuredGoodput(prior_acceptance=1.5), "prior_acceptance"),
    (lambda: hf_specdec.MeasuredGoodput(memory=-0.1), "memory"),
    (lambda: hf_specdec.MeasuredGoodput(prior_slope=0), "prior_slope"),
    (lambda: hf_specdec.MeasuredGoodput(window=0), "window"),
    (lambda: hf_specdec.Nightjar(explore=0), "explore"),
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
