"""Several drafters at once: per-row selection, full-information scoring, the datastore drafter."""
import pytest
import torch

import hf_specdec
from helpers import assert_same, spec
from hf_specdec.policies import EXP3Spec, UCBSpec
from hf_specdec.testing import VOCAB, build, noisy_copy, prompts


@pytest.fixture(scope="module")
def models():
    target = build("llama", 3, seed=0)
    return target, noisy_copy(target, 0.02, seed=1), build("llama", 1, seed=7)


def pool(models, corpus_seed=0):
    _, close, weak = models
    corpus = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(corpus_seed))
    return [weak, close, hf_specdec.PromptLookupDrafter(), hf_specdec.DatastoreDrafter(corpus, max_ngram=3)]


SELECTORS = {   # without the prompt warm start, rows start uniform and draw different drafters
    "normalhedge": lambda: hf_specdec.HedgeSpec(seed=1, prompt_positions=0),
    "hedge": lambda: hf_specdec.HedgeSpec(learner="hedge", seed=1, prompt_positions=0),
    "adanormalhedge": lambda: hf_specdec.HedgeSpec(learner="adanormalhedge", pick="argmax", prompt_positions=0),
    "cost-aware-skipping": lambda: hf_specdec.HedgeSpec(cost_aware=True, feedback_every=3, warmup_steps=2,
                                                        prompt_positions=0),
    "warm-start": lambda: hf_specdec.HedgeSpec(prompt_positions=4),
    "ucb": UCBSpec,
    "exp3": lambda: EXP3Spec(seed=2),
}


@pytest.mark.parametrize("name", SELECTORS)
def test_greedy_identical_with_a_pool_on_a_padded_batch(models, name):
    target = models[0]
    ids, mask = prompts(5, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, repetition_penalty=1.2)
    policy = hf_specdec.SpecPolicy(SELECTORS[name](), hf_specdec.FixedLength(3))
    out = spec(target, pool(models), policy, return_dict_in_generate=True, **kwargs)
    assert_same(out.sequences, target.generate(**kwargs))
    used = {d for s in out.spec_stats.steps for d in s.drafters if d >= 0}
    assert len(used) >= 2 or name == "warm-start"                # rows really drew different drafters


def test_greedy_identical_with_eos_stops(models):
    target = models[0]
    ids, mask = prompts(4, seed=9)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[5, 17], pad_token_id=0)
    out = spec(target, pool(models), hf_specdec.HedgeSpec(), **kwargs)
    assert_same(out, target.generate(**kwargs))


def reference_gammas(target, drafter, sequence, positions, sampling):
    """gamma at buffer positions of one row, from full forwards without any cache."""
    with torch.no_grad():
        p = target(sequence[None]).logits[0].float()
        q = drafter(sequence[None]).logits[0].float()
    out = []
    for t in positions:
        if sampling:
            out.append(float(torch.minimum(p[t - 1].softmax(-1), q[t - 1].softmax(-1)).sum()))
        else:
            out.append(float(q[t - 1].argmax() == sequence[t]))
    return out


@pytest.mark.parametrize("sampling", [False, True])
def test_feedback_equals_a_recomputation_without_caches(models, sampling):
    """The gammas every model drafter reports (from proposals, heads and replay forwards over
    lagging, rolled-back caches) equal those of plain full forwards on the final sequences."""
    target, close, weak = models
    ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(5))
    extra = dict(do_sample=True, top_k=0, spec_generator=torch.Generator().manual_seed(0)) if sampling else {}
    policy = hf_specdec.SpecPolicy(hf_specdec.HedgeSpec(seed=4, feedback_every=2, warmup_steps=3),
                                   hf_specdec.FixedLength(3))
    out = spec(target, [weak, close, hf_specdec.PromptLookupDrafter()], policy, input_ids=ids,
               max_new_tokens=25, eos_token_id=None, return_dict_in_generate=True, **extra)
    length = {row: ids.shape[1] for row in range(3)}
    checked = 0
    for step in out.spec_stats.steps:
        before = dict(length)
        for row, emitted in zip(step.rows, step.emitted):
            length[row] += emitted
        for row, gammas in (step.gammas or {}).items():
            positions = range(before[row], length[row])
            assert len(gammas) == len(positions)
            for d, model in ((0, weak), (1, close)):
                expect = reference_gammas(target, model, out.sequences[row], positions, sampling)
                got = [g[d] for g in gammas]
                assert got == pytest.approx(expect, abs=1e-4), (step, row, d)
                checked += len(positions)
    assert checked > 40
    skipped = [s for s in out.spec_stats.steps if s.gammas is None]
    assert skipped, "feedback_every=2 should skip some steps"


def test_full_information_scores_the_right_drafter_best(models):
    """A copy of the target (always accepted) against a weak drafter: HedgeSpec ends on the copy."""
    target, _, weak = models
    ids, mask = prompts(2, seed=1)
    policy = hf_specdec.SpecPolicy(hf_specdec.HedgeSpec(seed=0), hf_specdec.FixedLength(3))
    out = spec(target, [weak, target], policy, input_ids=ids, attention_mask=mask, max_new_tokens=40,
               return_dict_in_generate=True)
    for s in out.spec_stats.steps:
        for gammas in (s.gammas or {}).values():
            assert all(g[1] == 1.0 for g in gammas)              # the copy agrees everywhere
    late = [d for s in out.spec_stats.steps[-5:] for d in s.drafters]
    assert late.count(1) == len(late)


@pytest.mark.parametrize("sampling", [False, True])
def test_prompt_warm_start_informs_the_first_choice(models, sampling):
    """Scored on the last prompt positions, the exact copy wins from step 0 on, for every row."""
    target, _, weak = models
    ids, mask = prompts(3, seed=6, min_len=8, max_len=12)
    extra = dict(do_sample=True, top_k=0) if sampling else {}
    policy = hf_specdec.SpecPolicy(hf_specdec.HedgeSpec(prompt_positions=6, pick="argmax"), hf_specdec.FixedLength(2))
    primed, prime = [], policy.selector.prime
    policy.selector.prime = lambda gammas: (primed.append(gammas), prime(gammas))[1]
    out = spec(target, [weak, hf_specdec.PromptLookupDrafter(), target], policy, input_ids=ids, attention_mask=mask,
               max_new_tokens=6, return_dict_in_generate=True, **extra)
    assert out.spec_stats.steps[0].drafters == [2, 2, 2]
    # priming scored every drafter on positions of every row before the first step
    assert len(primed) == 1 and sorted(primed[0]) == [0, 1, 2]
    assert all(len(row) > 0 and all(len(g) == 3 for g in row) for row in primed[0].values())
    if not sampling:
        assert_same(out.sequences, target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6))


def test_datastore_proposes_the_corpus_continuation():
    corpus = torch.tensor([9, 1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3, 4, 6])
    store = hf_specdec.DatastoreDrafter(corpus, max_ngram=3, min_ngram=2)
    # "1 2 3" is followed by "4" twice and "7" once: the most frequent continuation wins
    assert store.continuation(torch.tensor([0, 1, 2, 3]), 2).tolist() == [4, 5]
    assert store.continuation(torch.tensor([0, 7, 8]), 3).tolist() == [1, 2, 3]
    assert store.continuation(torch.tensor([50, 51]), 3).tolist() == []


def test_datastore_from_files(tmp_path):
    tokenizer = _char_tokenizer()
    path = tmp_path / "corpus.py"
    path.write_text("def add(a, b):\n    return a + b\n")
    store = hf_specdec.DatastoreDrafter.from_files([path], tokenizer, max_ngram=4)
    seq = torch.tensor(tokenizer("def add(a, b):\n    ret")["input_ids"])
    assert "".join(map(chr, store.continuation(seq, 5).tolist())) == "urn a"
    with pytest.raises(ValueError, match="paths must be existing files"):
        hf_specdec.DatastoreDrafter.from_files([tmp_path / "missing.py"], tokenizer)
    with pytest.raises(ValueError, match="corpus"):
        hf_specdec.DatastoreDrafter(torch.tensor([1, 2]), max_ngram=4)


def _char_tokenizer():
    class Chars:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}
    return Chars()


def test_pool_vocabulary_mismatch_names_the_drafter(models):
    target, close, _ = models
    other = build("llama", 1, seed=3, vocab=VOCAB + 8)
    with pytest.raises(ValueError, match=r"assistant_models\[2\] has vocabulary size"):
        spec(target, [close, hf_specdec.PromptLookupDrafter(), other], hf_specdec.HedgeSpec(),
             input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=3)
    with pytest.raises(ValueError, match="assistant_models is empty"):
        spec(target, [], hf_specdec.HedgeSpec(), input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=3)


def test_selector_with_a_bad_choice_is_refused(models):
    class Broken(hf_specdec.policies.DrafterSelector):
        def choose(self, ctx):
            return [0]                                           # one index for a batch of 2
    with pytest.raises(ValueError, match="one per active row"):
        spec(models[0], [models[1]], Broken(), input_ids=torch.tensor([[1, 2], [3, 4]]), max_new_tokens=3)


def test_drafter_without_replay_is_refused_before_any_work(models):
    class Blind(hf_specdec.Drafter):
        def propose(self, batch, k):
            raise AssertionError("must not be reached")
    with pytest.raises(ValueError, match=r"assistant_models\[1\] do not implement Drafter.replay"):
        spec(models[0], [models[1], Blind()], hf_specdec.HedgeSpec(), input_ids=torch.tensor([[1, 2, 3]]),
             max_new_tokens=3)
    # selectors without full-information feedback accept it
    out = spec(models[0], [models[1], Blind()], hf_specdec.FixedDrafter(0), input_ids=torch.tensor([[1, 2, 3]]),
               max_new_tokens=3)
    assert out.shape == (1, 6)
