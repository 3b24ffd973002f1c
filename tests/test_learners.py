"""Online learners, the acceptance-length estimator and the delay queue (pure Python, fast)."""
import math
import random

import pytest

from hf_specdec.policies import AdaNormalHedge, Hedge, HedgeSpec, NormalHedge, StepContext
from hf_specdec.policies.feedback import DelayedFeedback, expected_accept_length
from hf_specdec.policies.learners import normalhedge_scale
from helpers import step_record

LEARNERS = [NormalHedge, Hedge, AdaNormalHedge]


@pytest.mark.parametrize("cls", LEARNERS)
def test_weights_are_a_distribution(cls):
    rng = random.Random(0)
    learner = cls(5)
    for _ in range(200):
        learner.update([rng.random() for _ in range(5)])
        w = learner.weights()
        assert all(x >= 0 for x in w) and math.isclose(sum(w), 1.0, rel_tol=1e-9)


def test_normalhedge_scale_solves_its_equation():
    rng = random.Random(1)
    for _ in range(50):
        regrets = [rng.uniform(-3, 10) for _ in range(rng.randint(1, 9))]
        if max(regrets) <= 0:
            regrets[0] = 0.5
        c = normalhedge_scale(regrets)
        mean = sum(math.exp(max(r, 0) ** 2 / (2 * c)) for r in regrets) / len(regrets)
        assert math.isclose(mean, math.e, rel_tol=1e-6)


def test_normalhedge_uniform_without_positive_regret():
    learner = NormalHedge(4)
    assert learner.weights() == [0.25] * 4
    learner.update([0.5] * 4)                      # every regret stays 0
    assert learner.weights() == [0.25] * 4
    assert normalhedge_scale([0.0, -1.0, -2.0]) == 0.0


def test_normalhedge_puts_weight_only_on_positive_regret():
    learner = NormalHedge(3)
    learner.update([0.0, 1.0, 1.0])                # expert 0 is ahead, the others behind
    w = learner.weights()
    assert w[0] == 1.0 and w[1] == w[2] == 0.0


def regret(cls, losses):
    learner = cls(len(losses[0]))
    incurred = 0.0
    for loss in losses:
        incurred += sum(w * x for w, x in zip(learner.weights(), loss))
        learner.update(loss)
    best = min(sum(loss[i] for loss in losses) for i in range(len(losses[0])))
    return incurred - best


def stochastic_losses(t, seed, means=(0.5, 0.45, 0.6, 0.7, 0.55)):
    rng = random.Random(seed)
    return [[min(1.0, max(0.0, rng.gauss(m, 0.2))) for m in means] for _ in range(t)]


def adversarial_losses(t, seed, n=4):
    """The best expert changes in growing phases; the losses swing between extremes."""
    rng = random.Random(seed)
    losses, phase, best = [], 1, 0
    while len(losses) < t:
        for _ in range(phase):
            losses.append([0.0 if i == best else (1.0 if rng.random() < 0.7 else 0.2) for i in range(n)])
        phase, best = phase * 2, (best + 1) % n
    return losses[:t]


@pytest.mark.parametrize("cls", LEARNERS)
@pytest.mark.parametrize("make", [stochastic_losses, adversarial_losses])
def test_regret_is_sublinear(cls, make):
    """Average regret falls with T (worst-case bound O(sqrt(T log N)))."""
    short = sum(regret(cls, make(500, s)) for s in range(3)) / 3
    long = sum(regret(cls, make(8000, s)) for s in range(3)) / 3
    assert long / 8000 < 0.5 * short / 500 + 1e-9 or long / 8000 < 0.01
    assert long < 3 * math.sqrt(8000 * math.log(5)) + 5


def test_regret_would_fail_for_a_learner_that_ignores_losses():
    """Negative control for the regret check: uniform weights have linear regret."""
    class Uniform(NormalHedge):
        def _update(self, losses):
            pass
    assert regret(Uniform, stochastic_losses(8000, 0)) > 3 * math.sqrt(8000 * math.log(5)) + 5


def simulate_accept_length(gammas, rng):
    """Accepted drafts + 1 of one K-draft step where draft j is accepted with prob gamma_j."""
    length = 1
    for g in gammas:
        if rng.random() >= g:
            break
        length += 1
    return length


@pytest.mark.parametrize("gammas", [[0.9, 0.8, 0.7, 0.6], [0.3, 0.95, 0.1], [1.0, 1.0], [0.0, 0.5]])
def test_expected_accept_length_matches_monte_carlo(gammas):
    rng = random.Random(0)
    n = 100_000
    mean = sum(simulate_accept_length(gammas, rng) for _ in range(n)) / n
    assert abs(expected_accept_length(gammas) - mean) < 0.02
    assert 1 <= expected_accept_length(gammas) <= len(gammas) + 1


def test_estimator_tracks_real_speculative_sampling_on_a_markov_chain():
    """Gammas read off *target* rollouts (1 - TV(p, q) along the path) against real speculative
    sampling with drafts from q. Per trajectory the estimator is exact (test above); across
    trajectories acceptance correlates with which token the target emits, so under sampling it
    is close but not exact (about 6% here; exact when greedy). It must rank drafters correctly."""
    p = [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]]    # target next-token law given last token
    drafts = {"close": [[0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4]],
              "far": [[0.2, 0.7, 0.1], [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]}
    rng, depth, n = random.Random(2), 3, 60_000

    def draw(law):
        return rng.choices(range(3), law)[0]

    def speculative_length(q, state):
        for j in range(1, depth + 1):
            x = draw(q[state])
            if rng.random() >= min(1.0, p[state][x] / q[state][x]):
                return j
            state = x
        return depth + 1

    def estimate(q, state):
        gammas = []
        for _ in range(depth):
            gammas.append(sum(min(a, b) for a, b in zip(p[state], q[state])))
            state = draw(p[state])
        return expected_accept_length(gammas)

    result = {}
    for name, q in drafts.items():
        simulated = sum(speculative_length(q, 0) for _ in range(n)) / n
        estimated = sum(estimate(q, 0) for _ in range(n)) / n
        assert abs(simulated - estimated) < 0.1 * simulated, name
        result[name] = (simulated, estimated)
    assert result["close"][0] > result["far"][0] + 0.3 and result["close"][1] > result["far"][1] + 0.3


def test_delay_queue_applies_losses_in_position_order():
    queue = DelayedFeedback(depth=2, warmup=1)
    queue.add([[0.1, 0.2]])                   # position 0: warm-up, probability feedback at once
    assert queue.pop_all() == [("prob", [0.1, 0.2])]
    queue.add([[0.5, 1.0]])                   # position 1 waits for position 2
    assert queue.pop_all() == []
    queue.add([[0.0, 1.0], [1.0, 0.0]])       # positions 2, 3: position 1 then 2 become computable
    out = queue.pop_all()
    assert [kind for kind, _ in out] == ["length", "length"]
    assert out[0][1] == [expected_accept_length([0.5, 0.0]), expected_accept_length([1.0, 1.0])]
    assert out[1][1] == [expected_accept_length([0.0, 1.0]), expected_accept_length([1.0, 0.0])]
    assert queue.pop_all() == []


def record(rows, gammas, k=2):
    return step_record(len(rows), [0] * len(rows), k, [k] * len(rows), [0] * len(rows), [1] * len(rows),
                      0.0, 0.01, rows, {0: 0.001}, gammas)


def test_hedgespec_learns_per_row_from_full_feedback():
    """Row 0's best drafter is 1, row 5's is 0; each row's learner finds its own."""
    selector = HedgeSpec(warmup=2, seed=0)
    selector.begin(StepContext(0, 2, 3, [0, 5]))
    good = {0: [0.1, 0.95, 0.2], 5: [0.9, 0.1, 0.3]}
    for step in range(40):
        selector.choose(StepContext(step, 2, 3, [0, 5]))
        selector.observe(record([0, 5], {0: [good[0]] * 3, 5: [good[5]] * 3}))
    picks = [selector.choose(StepContext(40 + i, 2, 3, [0, 5])) for i in range(20)]
    assert all(p == [1, 0] for p in picks)


def test_cost_aware_loss_prefers_the_cheap_drafter():
    """Drafter 0 is slightly better but costs as much as a verification; drafter 1 is free."""
    def final_choice(cost_aware):
        selector = HedgeSpec(cost_aware=cost_aware, pick="argmax", seed=0)
        selector.begin(StepContext(0, 1, 2, [0]))
        for step in range(60):
            selector.choose(StepContext(step, 1, 2, [0]))
            r = record([0], {0: [[0.95, 0.85]] * 3}, k=4)
            r.verify_s, r.drafter_s, r.replay_s = 0.01, {0: 0.04}, {0: 0.01, 1: 0.0001}
            selector.observe(r)
        return selector.choose(StepContext(60, 1, 2, [0]))
    assert final_choice(False) == [0]
    assert final_choice(True) == [1]


@pytest.mark.parametrize("kwargs", [dict(learner="exp4"), dict(loss="tv"), dict(pick="max"), dict(depth=0),
                                    dict(feedback_every=0), dict(warmup=-1)])
def test_hedgespec_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="HedgeSpec"):
        HedgeSpec(**kwargs)
