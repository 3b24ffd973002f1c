"""Hierarchical speculation (draft -> intermediate -> target): lossless at both levels."""
import importlib

import pytest
import torch

import hf_specdec
from helpers import assert_same, spec
from hf_specdec.testing import build, noisy_copy, prompts
from test_sampling import N, SAMPLING, TV_BOUND, VOCAB, broken_verify, exact_distribution

verify_module = importlib.import_module("hf_specdec.verify")
drafter_module = importlib.import_module("hf_specdec.drafters.model")


@pytest.fixture(scope="module")
def trio():
    target = build("llama", 2, seed=0)
    return target, noisy_copy(target, 0.01), noisy_copy(target, 0.05, seed=2)   # target, intermediate, draft


def plain(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, **kwargs)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft_len,cycles,k", [(1, 1, 2), (3, 2, 4), (4, 3, 6), (2, 4, 3)])
def test_greedy_identity(trio, batch, draft_len, cycles, k):
    target, intermediate, draft = trio
    ids, mask = prompts(batch, seed=batch)
    h = hf_specdec.HierarchicalDrafter(draft, intermediate, draft_len=draft_len, cycles=cycles)
    out = spec(target, [h], f"fixed:{k}", input_ids=ids, attention_mask=mask, max_new_tokens=30,
               do_sample=False, return_dict_in_generate=True)
    assert_same(out.sequences, plain(target, ids, mask))
    assert 0 < h.stats.accepted < h.stats.proposed          # the inner level accepts and rejects
    outer = [(sum(s.accepted), sum(s.proposed)) for s in out.spec_stats.steps]
    assert 0 < sum(a for a, _ in outer) < sum(p for _, p in outer)   # and so does the outer one
    (_, draft_forwards), (_, intermediate_forwards) = h.forwards()
    assert intermediate_forwards >= h.stats.cycles and draft_forwards > 0


def test_chains_lookup_drafters_and_length_policies(trio):
    """A 4-model chain, a lookup drafter at the bottom, and adaptive lengths at both levels."""
    target, intermediate, draft = trio
    ids, mask = prompts(3, seed=5)
    expected = plain(target, ids, mask, repetition_penalty=1.2)
    middle = noisy_copy(target, 0.03, seed=3)
    drafters = {
        "chain": hf_specdec.chain([draft, middle, intermediate], draft_len=2, cycles=2),
        "lookup": hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(max_ngram=2), intermediate),
        "adaptive": hf_specdec.HierarchicalDrafter(draft, intermediate, draft_len=hf_specdec.HFHeuristic(initial=3)),
    }
    for name, h in drafters.items():
        policy = hf_specdec.ConfidenceThreshold(0.3, max_len=6) if name == "adaptive" else "fixed:4"
        out = spec(target, [h], policy, input_ids=ids, attention_mask=mask, max_new_tokens=30,
                   do_sample=False, repetition_penalty=1.2)
        assert_same(out, expected)
    assert len(drafters["chain"].forwards()) == 3


def test_hierarchy_inside_a_hedgespec_pool(trio):
    target, intermediate, draft = trio
    ids, mask = prompts(4, seed=2)
    h = hf_specdec.HierarchicalDrafter(draft, intermediate, draft_len=2, cycles=2)
    pool = [draft, h, hf_specdec.PromptLookupDrafter()]
    policy = hf_specdec.SpecPolicy(hf_specdec.HedgeSpec(seed=1), hf_specdec.FixedLength(3))
    out = spec(target, pool, policy, input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
               return_dict_in_generate=True)
    assert_same(out.sequences, plain(target, ids, mask))
    used = out.spec_stats.drafter_row_steps()
    assert used.get(out.spec_stats.drafter_names[1], 0) > 0    # the hierarchy drafted for some rows
    # full information: the hierarchy is scored with the intermediate's predictions on every step
    assert all(len(s.gammas[r][0]) == 3 for s in out.spec_stats.steps if s.gammas for r in s.gammas)


@pytest.fixture(scope="module")
def small_vocab():
    target = build("llama", layers=2, seed=0, vocab=VOCAB, hidden=32, init=0.6)
    prompt = torch.tensor([[3, 5, 4, 3]])
    # the draft's first token passes the intermediate ~60% of the time, the chain's tokens pass the target ~30%
    return target, noisy_copy(target, 0.3), noisy_copy(target, 0.1, seed=4), prompt, \
        exact_distribution(target, prompt, 2)


def first_two_tokens(target, drafter, prompt, seed):
    """Empirical joint distribution of the first two new tokens; k = 2 drafts come from the chain."""
    out = spec(target, [drafter], "fixed:2", input_ids=prompt.repeat(N, 1), max_new_tokens=3, eos_token_id=None,
               spec_generator=torch.Generator().manual_seed(seed), **SAMPLING)
    new = out[:, prompt.shape[1]:]
    counts = torch.zeros(VOCAB, VOCAB)
    counts.index_put_((new[:, 0], new[:, 1]), torch.ones(N), accumulate=True)
    return counts / N


def test_sampling_distribution_is_the_targets(small_vocab):
    target, intermediate, draft, prompt, exact = small_vocab
    h = hf_specdec.HierarchicalDrafter(draft, intermediate, draft_len=1, cycles=2)
    tv = 0.5 * (first_two_tokens(target, h, prompt, seed=1) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"
    assert 0.1 < h.stats.acceptance < 0.9                   # both inner outcomes were exercised


def test_negative_control_a_broken_inner_sampler_is_caught(small_vocab, monkeypatch):
    """If the intermediate accepted every draft, the chain's tokens would not follow its q."""
    target, intermediate, draft, prompt, exact = small_vocab
    def intermediate_verifies_brokenly(*args, **kwargs):     # the target's verification stays right
        with monkeypatch.context() as patch:
            patch.setattr(verify_module, "verify", broken_verify)
            return verify_module.target_verify(*args, **kwargs)
    monkeypatch.setattr(drafter_module, "target_verify", intermediate_verifies_brokenly)
    h = hf_specdec.HierarchicalDrafter(draft, intermediate, draft_len=1, cycles=2)
    tv = 0.5 * (first_two_tokens(target, h, prompt, seed=1) - exact).abs().sum()
    assert tv > 2 * TV_BOUND, f"a broken inner acceptance rule went unnoticed (TV {tv:.4f})"


def test_bad_input(trio):
    target, intermediate, draft = trio
    other_vocab = build("llama", 1, seed=3, vocab=50)
    with pytest.raises(ValueError, match="draft's vocabulary size 50"):
        hf_specdec.HierarchicalDrafter(other_vocab, intermediate)
    h = hf_specdec.HierarchicalDrafter(build("llama", 1, seed=4, vocab=50), other_vocab)
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match=r"assistant_models\[0\] has vocabulary size 50"):
        spec(target, [h], input_ids=ids, attention_mask=mask, max_new_tokens=5)
    for kwargs, match in (({"draft_len": 0}, "draft_len"), ({"cycles": 0}, "cycles"), ({"draft_len": 2.5}, "draft_len")):
        with pytest.raises(ValueError, match=match):
            hf_specdec.HierarchicalDrafter(draft, intermediate, **kwargs)
    with pytest.raises(TypeError, match="intermediate"):
        hf_specdec.HierarchicalDrafter(draft, hf_specdec.PromptLookupDrafter())
    with pytest.raises(ValueError, match="chain"):
        hf_specdec.chain([draft])
