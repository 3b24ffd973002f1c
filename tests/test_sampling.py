"""Sampling: the emitted tokens follow the target's distribution; seeded runs reproduce."""

import pytest
import torch

import hf_specdec
import importlib
from hf_specdec.verify import VerifyResult, verify
from helpers import Scripted, assert_same, spec
from hf_specdec.testing import build, noisy_copy

verify_module = importlib.import_module("hf_specdec.verify")

VOCAB = 6
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=5, repetition_penalty=1.3)
TOP_P = dict(do_sample=True, temperature=1.5, top_p=0.8)    # nucleus sampling, as HumanEval's runs use


def exact_distribution(target, prompt, length, sampling=SAMPLING):
    """p(t1 .. t_length | prompt) [VOCAB] * length under generate()'s own processing: the scores of
    a 1-token generate() from every prefix, enumerated."""
    probs, prefixes = torch.ones(1), prompt
    for _ in range(length):
        step = target.generate(input_ids=prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=1,
                               output_scores=True, return_dict_in_generate=True, **sampling).scores[0].softmax(-1)
        probs = (probs[:, None] * step).flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(step))[:, None]], 1)
    return probs.view([VOCAB] * length)


def empirical(target, drafter, prompt, n, seed, policy="fixed:1", sampling=SAMPLING, max_new_tokens=2, skip=0):
    """Frequencies of new tokens skip + 1 and skip + 2 [t1, t2] over n seeded rows."""
    gen = torch.Generator().manual_seed(seed)
    drafters = drafter if isinstance(drafter, list) else [drafter]
    out = spec(target, drafters, policy, input_ids=prompt.repeat(n, 1), max_new_tokens=max_new_tokens,
               spec_generator=gen, eos_token_id=None, **sampling)
    new = out[:, prompt.shape[1] + skip:]
    counts = torch.zeros(VOCAB, VOCAB)
    counts.index_put_((new[:, 0], new[:, 1]), torch.ones(n), accumulate=True)
    return counts / n


def broken_verify(draft_tokens, draft_lens, target_scores, draft_probs, do_sample, generator=None,
                  ensemble_weight=None):
    """Accepts every draft: what a sampler that skips the p/q test would do."""
    n, k = draft_tokens.shape
    bonus = torch.multinomial(target_scores[:, -1].softmax(-1), 1, generator=generator).squeeze(1)
    return VerifyResult(draft_lens.clone(), bonus)


def residual_from_p_verify(draft_tokens, draft_lens, target_scores, draft_probs, do_sample, generator=None,
                           ensemble_weight=None):
    """Correct accept test, but resamples from p instead of norm(max(0, p - q)) after a rejection."""
    res = verify(draft_tokens, draft_lens, target_scores, draft_probs, do_sample, generator)
    rows = torch.arange(len(draft_tokens))
    fresh = torch.multinomial(target_scores[rows, res.num_accepted].softmax(-1), 1, generator=generator).squeeze(1)
    rejected = res.num_accepted < draft_lens
    return VerifyResult(res.num_accepted, torch.where(rejected, fresh, res.next_tokens))


@pytest.fixture(scope="module")
def setup():
    target = build("llama", layers=2, seed=0, vocab=VOCAB, hidden=32, init=0.6)
    draft = noisy_copy(target, 0.3)                     # accepts about half of its drafts
    prompt = torch.tensor([[3, 5, 4, 3]])
    return target, draft, prompt, exact_distribution(target, prompt, 2)


N = 12000
# Expected TV of an N-sample empirical distribution is about 0.5 sqrt(2 / (pi N)) sum_i sqrt(p_i)
# ~ 0.012 here (plain generate() measures 0.009-0.013); the broken samplers land at 0.1-0.5.
TV_BOUND = 0.025


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_distribution_matches_target(setup, drafter):
    target, draft, prompt, exact = setup
    d = draft if drafter == "model" else hf_specdec.PromptLookupDrafter(max_ngram=1)
    tv = 0.5 * (empirical(target, d, prompt, N, seed=1) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"


def test_distribution_matches_target_with_a_reduced_draft_vocabulary(setup):
    """A draft that can propose 3 of the 6 tokens (draft_vocab.restrict_vocab): q is zero on the
    others, and the residual max(0, p - q) must give them exactly the target's probability."""
    from hf_specdec.draft_vocab import restrict_vocab
    target, draft, prompt, exact = setup
    reduced = noisy_copy(target, 0.3)
    restrict_vocab(reduced, torch.tensor([0, 3, 5]))
    tv = 0.5 * (empirical(target, reduced, prompt, N, seed=5) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"


def test_distribution_matches_target_under_nightjar(setup):
    """Nightjar picks k per step (0 included) from what earlier steps measured."""
    target, draft, prompt, exact = setup
    tv = 0.5 * (empirical(target, draft, prompt, N, seed=2, policy=hf_specdec.Nightjar(max_len=3)) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"


def test_distribution_matches_target_after_speculation_pauses(setup):
    """Steps without drafts (k = 0, as Nightjar and the offload choose) leave the drafter behind by a
    different number of tokens per row; its catch-up must not bias later tokens. Tokens 4 and 5 come
    from the pauses or from the drafting steps after them, as each row's acceptances fall."""
    target, draft, prompt, _ = setup
    exact = exact_distribution(target, prompt, 5).sum((0, 1, 2))           # [t4, t5]
    policy = Scripted(lambda step: (2, 0, 0, 3, 0, 1)[step % 6])
    freq = empirical(target, draft, prompt, N, seed=4, policy=policy, max_new_tokens=6, skip=3)
    tv = 0.5 * (freq - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"


def test_distribution_matches_target_with_top_p(setup):
    target, draft, prompt, _ = setup
    exact = exact_distribution(target, prompt, 2, TOP_P)
    tv = 0.5 * (empirical(target, draft, prompt, N, seed=1, sampling=TOP_P) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"


def test_distribution_matches_target_with_per_row_drafters(setup):
    """HedgeSpec draws each row's drafter: one verify call mixes model q and point masses."""
    target, draft, prompt, exact = setup
    pool = [draft, hf_specdec.PromptLookupDrafter(max_ngram=1)]
    policy = hf_specdec.SpecPolicy(hf_specdec.HedgeSpec(seed=3, prompt_positions=0), hf_specdec.FixedLength(1))
    tv = 0.5 * (empirical(target, pool, prompt, N, seed=1, policy=policy) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"
    out = spec(target, pool, policy, input_ids=prompt.repeat(200, 1), max_new_tokens=2, eos_token_id=None,
               return_dict_in_generate=True, **SAMPLING)
    assert set(out.spec_stats.steps[0].drafters) == {0, 1}     # both kinds of q in one verify call


def hierarchy_empirical(target, draft, lower, prompt, seed):
    """Two-token frequencies through lower -> draft (intermediate) -> target, with the hierarchy's
    level stats. Three new tokens, so that the target verifies 2 drafts of which the lower drafted
    one (the last new token is not counted)."""
    low = noisy_copy(draft, 0.1, seed=5) if lower == "model" else hf_specdec.PromptLookupDrafter(max_ngram=1)
    hierarchy = hf_specdec.HierarchicalDrafter(low, draft, draft_len=2, cycles=1)
    return empirical(target, hierarchy, prompt, N, seed, policy="fixed:2", max_new_tokens=3), hierarchy.stats


@pytest.mark.parametrize("lower", ["model", "lookup"])
def test_distribution_matches_target_through_a_hierarchy(setup, lower):
    """The intermediate's speculative sampling makes its tokens follow its own q; the target must
    then test them against that whole q (not the residual they may have come from)."""
    target, draft, prompt, exact = setup
    freq, stats = hierarchy_empirical(target, draft, lower, prompt, seed=1)
    tv = 0.5 * (freq - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"
    if lower == "model":     # both of the intermediate's paths ran: accept, and reject-and-resample
        assert 0.05 < stats.accepted / stats.proposed < 0.95, stats


def test_negative_control_broken_intermediate_is_caught(setup, monkeypatch):
    """An intermediate that accepts every lower draft passes on tokens that do not follow its q."""
    target, draft, prompt, exact = setup
    inner = {"on": False}
    monkeypatch.setattr(verify_module, "verify", lambda *a, **k: (broken_verify if inner["on"] else verify)(*a, **k))
    intermediate_verify = hf_specdec.ModelDrafter.verify     # a drafter verifies only as an intermediate

    def broken_intermediate_verify(self, *args):
        inner["on"] = True
        try:
            return intermediate_verify(self, *args)
        finally:
            inner["on"] = False
    monkeypatch.setattr(hf_specdec.ModelDrafter, "verify", broken_intermediate_verify)
    tv = 0.5 * (hierarchy_empirical(target, draft, "model", prompt, seed=1)[0] - exact).abs().sum()
    assert tv > 3 * TV_BOUND, f"a broken intermediate went unnoticed (TV {tv:.4f})"


@pytest.mark.parametrize("broken", [broken_verify, residual_from_p_verify])
def test_negative_control_broken_sampler_is_caught(setup, monkeypatch, broken):
    target, draft, prompt, exact = setup
    monkeypatch.setattr(verify_module, "verify", broken)     # what every target_verify calls
    tv = 0.5 * (empirical(target, draft, prompt, N, seed=1) - exact).abs().sum()
    assert tv > 3 * TV_BOUND, f"a broken acceptance rule went unnoticed (TV {tv:.4f})"


def test_draft_is_actually_partially_accepted(setup):
    """The distribution test exercises accept, reject-and-resample and bonus paths."""
    target, draft, prompt, _ = setup
    out = spec(target, [draft], "fixed:1", input_ids=prompt.repeat(500, 1), max_new_tokens=2,
               eos_token_id=None, return_dict_in_generate=True,
               spec_generator=torch.Generator().manual_seed(0), **SAMPLING)
    accepted = out.spec_stats.steps[0].accepted
    assert 0.2 < sum(accepted) / len(accepted) < 0.9


def test_seeded_runs_reproduce():
    target = build("qwen2", 2, seed=0)
    draft = build("qwen2", 1, seed=2)
    ids = torch.randint(3, 90, (3, 6), generator=torch.Generator().manual_seed(0))
    runs = [spec(target, [draft], "fixed:3", input_ids=ids, max_new_tokens=20, do_sample=True, top_p=0.9,
                 spec_generator=torch.Generator().manual_seed(42)) for _ in range(2)]
    assert_same(runs[0], runs[1])
    torch.manual_seed(7)
    a = spec(target, [draft], "fixed:3", input_ids=ids, max_new_tokens=20, do_sample=True)
    torch.manual_seed(7)
    b = spec(target, [draft], "fixed:3", input_ids=ids, max_new_tokens=20, do_sample=True)
    assert_same(a, b)
    other = spec(target, [draft], "fixed:3", input_ids=ids, max_new_tokens=20, do_sample=True,
                 spec_generator=torch.Generator().manual_seed(43))
    assert not torch.equal(other, runs[0])


STATIC = dict(SAMPLING, cache_implementation="static")


@pytest.mark.parametrize("drafter", ["model", "lookup", "model, compiled"])
def test_distribution_matches_target_on_the_static_path(setup, drafter, monkeypatch):
    """Preallocated caches (cache_implementation="static") hold the same slots another way;
    compiled, the forwards run padded to tier widths and a power-of-two bucket of rows (as on CUDA)."""
    from transformers import CompileConfig
    from hf_specdec import compiled
    monkeypatch.setattr(compiled, "pads_shapes", lambda device: True)
    target, draft, prompt, exact = setup
    d = hf_specdec.PromptLookupDrafter(max_ngram=1) if drafter == "lookup" else draft
    sampling = dict(STATIC)
    if drafter.endswith("compiled"):
        sampling["compile_config"] = CompileConfig(fullgraph=True, backend="eager")
        sampling["compile_config"]._compile_all_devices = True
    tv = 0.5 * (empirical(target, d, prompt, N, seed=6, policy="fixed:2", sampling=sampling,
                          max_new_tokens=3) - exact).abs().sum()          # (a third token: room for k = 2)
    assert tv < TV_BOUND, f"TV {tv:.4f}"
    if "compile_config" in sampling:
        from hf_specdec.compiled import compiled_forwards
        # step 0 verifies in the target's prefill (eager); the draft's second token (padded to 2) and
        # step 1 run compiled (12000 rows in a bucket of 16384)
        shapes = [{key[:2] for key in compiled_forwards(m, sampling["compile_config"]).calls} for m in (draft, target)]
        assert (16384, 2) in shapes[0] and shapes[1], shapes


def test_negative_control_broken_sampler_is_caught_on_the_static_path(setup, monkeypatch):
    target, draft, prompt, exact = setup
    monkeypatch.setattr(verify_module, "verify", broken_verify)
    tv = 0.5 * (empirical(target, draft, prompt, N, seed=6, policy="fixed:2", sampling=STATIC) - exact).abs().sum()
    assert tv > 3 * TV_BOUND, f"a broken acceptance rule went unnoticed (TV {tv:.4f})"


def test_ensemble_verification_follows_its_formula_not_the_target(setup):
    """assistant_ensemble_weight w (Transformers' lossy ensemble verification): with one draft,
    the first token is x with probability q(x) a(x) + (1 - sum_y q(y) a(y)) r(x), a = min(1,
    1 - w + w p / q), r = norm(max(0, p - q)). The empirical frequencies match that formula, which
    lies far from the target's own p: a lossless sampler would fail this test."""
    target, draft, prompt, _ = setup
    w = 0.3
    p, q = (exact_distribution(m, prompt, 1) for m in (target, draft))
    accept = torch.clamp(1 - w + w * p / q, max=1.0)
    residual = (p - q).clamp(min=0)
    formula = q * accept + (1 - (q * accept).sum()) * residual / residual.sum()
    assert 0.5 * (formula - p).abs().sum() > 3 * TV_BOUND                   # the test has power
    first = empirical(target, draft, prompt, N, seed=8, sampling={**SAMPLING, "assistant_ensemble_weight": w}).sum(1)
    assert 0.5 * (first - formula).abs().sum() < TV_BOUND
    assert 0.5 * (first - p).abs().sum() > 2 * TV_BOUND


def test_ensemble_verification_is_refused_with_prompt_lookup(setup):
    target, _, prompt, _ = setup
    with pytest.raises(ValueError, match="assistant_ensemble_weight needs drafters with a distribution"):
        spec(target, [hf_specdec.PromptLookupDrafter()], "fixed:2", input_ids=prompt, max_new_tokens=4,
             assistant_ensemble_weight=0.5)
