"""The default draft length, MeasuredGoodput: off where nothing pays, near the best fixed k where
something does, from the first call; in the simulator (pure Python) and in the real loop."""
import random

import pytest

import hf_specdec
from helpers import assert_same, spec
from hf_specdec.policies import StepContext
from hf_specdec.policies.measured import MeasuredGoodput
from hf_specdec.serving import RelativeCosts, Simulator
from hf_specdec.stats import StepRecord
from hf_specdec.testing import layer_skip_pair, prompts

EAGER = RelativeCosts(target_per_width=0.02, draft_base=0.9)           # host-bound: drafting never pays
GRAPHS = RelativeCosts(target_base=0.962, target_per_token=0.038, draft_base=0.41, catch_up=3.0)


def speed(policy, costs, acceptance, batch, seed, sim=None):
    """Output tokens per unit time of one simulated generate() call (rows of 32-256 tokens)."""
    lens = [random.Random(seed).randint(32, 256) for _ in range(batch)]
    sim = sim or Simulator(costs, policy, acceptance, max_batch=batch, seed=seed, noise=0.1)
    return sum(lens) / max(r.finish for r in sim.call(128, lens).requests), sim


@pytest.mark.parametrize("costs,acceptance,batch,floor", [
    (EAGER, 0.8, 1, 0.95), (EAGER, 0.95, 16, 0.95),     # nothing pays: near plain
    (GRAPHS, 0.8, 1, 0.9), (GRAPHS, 0.95, 4, 0.9),      # k = 2 / 6 pay 1.2-1.5x: near the best of them
])
def test_first_call_is_near_the_best_fixed_length_or_plain(costs, acceptance, batch, floor):
    seeds = range(4)
    fixed = {k: sum(speed(hf_specdec.FixedLength(k), costs, acceptance, batch, s)[0] for s in seeds)
             for k in (0, 1, 2, 4, 6, 8)}
    first = sum(speed(MeasuredGoodput(), costs, acceptance, batch, s)[0] for s in seeds)
    assert first >= floor * max(fixed.values()), (first / max(fixed.values()), fixed)


# compiled forwards on an H200 (docs/results/bench_gpu/h200.md), in batch-1 plain steps: the 7B
# target nearly flat in rows x width, the 0.5B draft a third of it, a wide catch-up run eager
H200 = RelativeCosts(target_base=1.0, target_per_token=0.005, draft_base=0.36, draft_per_token=0.001,
                     catch_up=2.7, prefill_per_token=0.018)


def test_catch_ups_learned_at_batch_1_do_not_keep_batch_16_plain():
    """A catch-up at batch 16 is one batched forward: priced from batch-1 catch-ups per row-token,
    it looked 16 times dearer than it is, and the policy never drafted there (the H200 run)."""
    def calls(policy, batch):
        sims = [Simulator(H200, policy, 0.8, max_batch=16, seed=s, noise=0.1) for s in range(3)]
        runs = [sim.call(64, [64] * batch) for sim in sims]
        tokens = sum(r.tokens for run in runs for r in run.requests)
        ks = [s.k for run in runs for s in run.steps]
        return tokens / sum(max(r.finish for r in run.requests) for run in runs), sum(ks) / len(ks)

    policy = MeasuredGoodput()
    calls(policy, 1)
    speed, mean_k = calls(policy, 16)
    plain, _ = calls(hf_specdec.FixedLength(0), 16)
    assert mean_k > 0.5 and speed > 1.03 * plain, (mean_k, speed / plain)


def test_plain_is_no_dead_end_and_probes_thin_out():
    """No length pays while drafts are rejected: plain steps, with probes further and further apart
    (up to a cap); once drafts are accepted again, probes see it and drafting resumes."""
    policy, steps, ks = MeasuredGoodput(), 0, []
    for alpha in [0.0] * 600 + [1.0] * 200:
        ctx = StepContext(steps, 1, 1, [0], max_lag=1)
        k = policy.choose(ctx)
        accepted = k if alpha else 0
        seconds = 1.0 + 0.3 * k                    # a draft costs 0.3 of a plain step
        policy.observe(StepRecord.of_step(ctx, k, k, [k], [accepted], draft_s=0.25 * k, verify_s=seconds - 0.25 * k))
        ks.append(k)
        steps += 1
    probes = [i for i in range(1, 600) if ks[i] and not ks[i - 1]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == sorted(gaps[:4]) and gaps[3] > 2 * gaps[0] and len(probes) >= 10, probes
    assert sum(k > 0 for k in ks[100:600]) < 0.1 * 500
    assert min(ks[750:]) >= 4, ks[600:]             # back on within 150 steps, with long drafts


def test_turns_itself_off_on_a_useless_draft_and_drafts_long_with_a_perfect_one():
    """The real loop, tiny models: a deep target with a zeroed upper half, drafted by an unrelated
    1-layer model (no draft accepted) and by its exact 1-layer cut (every draft accepted, at a
    fraction of the cost). Outputs identical to plain generate() throughout."""
    target, exact = layer_skip_pair(0.0, layers=8, hidden=256, vocab=512)
    _, useless = layer_skip_pair(0.0, layers=8, hidden=256, vocab=512, seed=7)
    ids, mask = prompts(2, seed=3, vocab=512)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(**kw).sequences
    for draft, drafting in ((useless, lambda ks: sum(k > 0 for k in ks) <= 6), (exact, lambda ks: min(ks[2:-1]) >= 2)):
        policy = MeasuredGoodput()
        for call in range(2):
            out = spec(target, [hf_specdec.ModelDrafter(draft)], policy, **kw)
            assert_same(out.sequences, plain)
        ks = [s.k for s in out.spec_stats.steps]
        assert drafting(ks), ks


def test_a_dear_first_draft_does_not_hide_long_drafts_that_pay():
    """A CPU whose wide verification takes a slower path: any drafting step costs 2.2 plain steps
    plus 0.15 per draft, so k = 1 loses (2 tokens for 2.35) while k = 8 wins (9 tokens for 3.4). The
    cost line of drafting steps is not the one through the plain step: the policy climbs to k = 8."""
    policy, ks = MeasuredGoodput(), []
    for step in range(60):
        ctx = StepContext(step, 1, 1, [0], max_lag=1)
        k = policy.choose(ctx)
        seconds = 1.0 if k == 0 else 2.2 + 0.15 * k
        policy.observe(StepRecord.of_step(ctx, k, k, [k], [k], draft_s=0.15 * k, verify_s=seconds - 0.15 * k))
        ks.append(k)
    assert ks[-20:] == [8] * 20, ks


# the real pair with packed bf16 weights and an int8 draft on an AVX-512 BF16 CPU, in plain steps
# (docs/results/step_budget/avx512-bf16.md): verifying 6 tokens costs no more than one, a draft
# forward a fifth of a plain step
FLAT = RelativeCosts(target_base=1.0, draft_base=0.2)
STEEP = RelativeCosts(target_base=1.0, target_per_width=0.6, draft_base=0.2)   # unpacked float32 on AVX2


@pytest.mark.parametrize("costs,longest", [(FLAT, 4), (STEEP, 2)])
def test_the_cost_line_of_the_kernel_sets_how_long_the_default_drafts(costs, longest):
    """The same pair and acceptance, two kernels: where verification is flat in width the default
    settles on long drafts (k 4 or 6: they tie there) from its first call, near the best fixed k; where every
    verified token costs 0.6 of a plain step it settles on short ones."""
    policy = MeasuredGoodput()
    sims = [Simulator(costs, policy, 0.85, max_batch=1, seed=s, noise=0.1) for s in range(4)]
    runs = [sim.call(128, [128]) for sim in sims]
    first = sum(r.tokens for run in runs for r in run.requests) / sum(run.requests[0].finish for run in runs)
    fixed = max(sum(speed(hf_specdec.FixedLength(k), costs, 0.85, 1, s)[0] for s in range(4))
                for k in (0, 1, 2, 4, 6, 8)) / 4
    steady = [s.k for s in runs[-1].steps[-40:]]
    assert first >= 0.9 * fixed, (first / fixed, steady)
    assert (min(steady) >= longest) if costs is FLAT else (max(steady) <= longest), steady


def test_a_short_first_call_with_a_cheap_draft_drafts():
    """The real pair's 32-token calls (docs/benchmarks.md, step_budget): a 170-token prompt whose
    prefill costs 7.6 plain steps, a draft a fifth of a step, verification flat. Before any draft
    is measured the priors' guess does not pay twice its catch-up within 32 tokens; the first probe
    comes after plain time equal to its predicted loss, not 8 times it (then the call stayed plain)."""
    costs = RelativeCosts(target_base=1.0, draft_base=0.2, prefill_per_token=7.6 / 170)
    drafting = []
    for seed in range(3):
        run = Simulator(costs, MeasuredGoodput(), 0.9, max_batch=1, seed=seed, noise=0.1).call(170, [32])
        drafting.append(sum(s.k > 0 for s in run.steps) / len(run.steps))
    assert min(drafting) >= 0.3, drafting


def test_a_step_shared_with_another_request_s_prefill_is_no_arm_s_cost():
    """Continuous batching: a forward that also prefilled another request's prompt took that
    prompt's time too; what its drafts tell of acceptance counts, its seconds do not."""
    policy = MeasuredGoodput()
    ctx = StepContext(1, 1, 1, [0], max_lag=1)
    policy.observe(StepRecord.of_step(ctx, 0, 0, [0], [0], verify_s=1.0))
    before = policy.acceptance
    policy.observe(StepRecord.of_step(ctx, 4, 4, [4], [0], draft_s=0.4, verify_s=9.0, prefill_tokens=100))
    policy.observe(StepRecord.of_step(ctx, 0, 0, [0], [0], verify_s=7.0, prefill_tokens=100))
    assert policy.buckets[1].measured() == {0: 1.0}
    assert policy.acceptance < before


def test_a_catch_up_of_many_rows_costs_at_least_their_tokens_as_a_prefill():
    """Catch-ups measured one row at a time price a 16-row catch-up from the plain steps' scaling;
    where forwards are compute-bound it costs its tokens: no less than the target's measured prefill
    per prompt token, times a draft forward's share of a plain step (the real pair in continuous
    batching: priced 2 s, it took 13 s)."""
    policy = MeasuredGoodput()
    one, sixteen = StepContext(1, 1, 1, [0], max_lag=1), StepContext(1, 16, 1, list(range(16)), max_lag=1)
    for ctx, plain in ((one, 1.0), (sixteen, 2.0)):
        policy.observe(StepRecord.of_step(ctx, 0, 0, [0] * ctx.batch_size, [0] * ctx.batch_size, verify_s=plain))
        policy.observe(StepRecord.of_step(ctx, 2, 2, [2] * ctx.batch_size, [2] * ctx.batch_size, draft_s=0.5,
                                          verify_s=plain))
    caught = StepContext(2, 1, 1, [0], max_lag=100)           # one row catching up 100 tokens: 3 s more
    policy.observe(StepRecord.of_step(caught, 2, 2, [2], [2], draft_s=3.5, verify_s=1.0))
    policy.observe(StepRecord.of_step(one, 2, 2, [2], [2], draft_s=0.5, verify_s=1.0))
    joining = StepContext(3, 16, 1, list(range(16)), max_lag=100, lag_tokens=1600)
    assert policy._catch_up(joining) == pytest.approx(2 * 3.0)       # per lagged token, in plain steps
    policy.observe(StepRecord.of_step(sixteen, 0, 0, [0] * 16, [0] * 16, verify_s=20.0, prefill_tokens=1000))
    assert policy.prefill_per_token == pytest.approx(0.02)
    # 0.02 s a prompt token, a draft forward 0.25 of a plain step, 1600 tokens
    assert policy._catch_up(joining) == pytest.approx(0.02 * 0.25 * 1600)
