"""enable(model, loop="transformers"): our drafters and policies in Transformers' own assisted loop."""
import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

import hf_specdec
from helpers import assert_same
from hf_specdec.policies import UCBSpec
from hf_specdec.testing import build, noisy_copy, prompts


def tiny_t5(seed=0):
    torch.manual_seed(seed)
    config = T5Config(vocab_size=96, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(config).eval()


@pytest.fixture
def t5():
    target = tiny_t5()
    ids = torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    kw = dict(input_ids=ids, max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True)
    return target, noisy_copy(target, 0.05), kw, target.generate(**kw)


@pytest.mark.parametrize("drafters,policy", [
    (lambda draft: [draft], "fixed:3"),
    (lambda draft: [draft], "nightjar"),
    (lambda draft: [draft, hf_specdec.PromptLookupDrafter()], "hedgespec"),
    (lambda draft: [hf_specdec.PromptLookupDrafter()], "hf-heuristic:2"),
])
def test_encoder_decoder_greedy_identity_with_scores(t5, drafters, policy):
    target, draft, kw, plain = t5
    hf_specdec.enable(target, loop="transformers")
    out = target.generate(**kw, assistant_models=drafters(draft), spec_policy=policy)
    assert_same(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == plain.sequences.shape[1] - 1
    for ours, theirs in zip(out.scores, plain.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert out.spec_stats.target_forwards <= len(plain.scores)


def test_hedgespec_finds_the_better_drafter_in_transformers_loop():
    target = build("llama", 2, seed=0)
    good, bad = noisy_copy(target, 0.01), build("llama", 2, seed=9)
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(**kw)
    hf_specdec.enable(target, loop="transformers")
    out = target.generate(**kw, assistant_models=[bad, good], spec_policy="hedgespec")
    assert_same(out.sequences, plain.sequences)
    steps = [s.drafters[0] for s in out.spec_stats.steps]
    assert steps[-5:].count(1) >= 4, steps           # settles on the good drafter
    assert any(s.gammas for s in out.spec_stats.steps)


@pytest.mark.parametrize("make,extra,error,message", [
    (lambda d: [d], dict(spec_policy="adaspec"), ValueError, "stops or trims drafts per token"),
    (lambda d: [hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(), d)], {}, TypeError,
     "a model or a PromptLookupDrafter"),
    (lambda d: [d], dict(spec_generator=torch.Generator()), ValueError, "need the batched loop"),
    (lambda d: [d], dict(batch=2), ValueError, "batch 1"),
])
def test_bad_input_for_transformers_loop(make, extra, error, message):
    target = build("llama", 2, seed=0)
    draft = noisy_copy(target, 0.05)
    ids, mask = prompts(extra.pop("batch", 1), seed=1)
    hf_specdec.enable(target, loop="transformers")
    with pytest.raises(error, match=message):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, assistant_models=make(draft), **extra)
    assert "_get_candidate_generator" not in target.__dict__


def test_an_error_inside_the_loop_restores_the_model(t5, monkeypatch):
    from hf_specdec.transformers_loop import SpecCandidateGenerator
    target, draft, kw, plain = t5

    def broken(self, input_ids, **kwargs):
        raise RuntimeError("drafting failed")
    monkeypatch.setattr(SpecCandidateGenerator, "get_candidates", broken)
    hf_specdec.enable(target, loop="transformers")
    with pytest.raises(RuntimeError, match="drafting failed"):
        target.generate(**kw, assistant_models=[draft], spec_policy="fixed:2")
    assert "_get_candidate_generator" not in target.__dict__
    monkeypatch.undo()
    assert_same(target.generate(**kw, assistant_models=[draft], spec_policy="fixed:2").sequences, plain.sequences)


def test_confidence_stop_and_transformers_settings_in_transformers_loop(t5):
    """Transformers' own settings (default threshold 0.4, a heuristic schedule) run in its loop."""
    target, draft, kw, plain = t5
    hf_specdec.enable(target, loop="transformers")
    for extra in (dict(assistant_model=draft, num_assistant_tokens=5),
                  dict(assistant_models=[draft], spec_policy=hf_specdec.ConfidenceThreshold(0.9, max_len=6))):
        out = target.generate(**kw, **extra)
        assert_same(out.sequences, plain.sequences)
    draft.generation_config.num_assistant_tokens_schedule = "heuristic"
    draft.generation_config.num_assistant_tokens = 7
    target.generate(**kw, assistant_model=draft)
    assert draft.generation_config.num_assistant_tokens != 7           # persisted, as in Transformers


def test_loop_choice_is_checked():
    target = build("llama", 2, seed=0)
    with pytest.raises(ValueError, match="loop must be one of"):
        hf_specdec.enable(target, loop="turbo")
    hf_specdec.enable(target)
    with pytest.raises(ValueError, match="another loop"):
        hf_specdec.enable(target, loop="transformers")
    hf_specdec.disable(target)
    assert hf_specdec.enable(target, loop="transformers") is target


@pytest.mark.parametrize("policy", [None, "auto", "fixed:3", "nightjar", "dsd", "hf-heuristic:2", "confidence",
                                    hf_specdec.SpecPolicy(selector=UCBSpec(), length=hf_specdec.FixedLength(3))])
def test_decoder_only_greedy_identity_with_every_policy_in_transformers_loop(policy):
    """Every policy, the default included: its plain steps (k = 0) and a drafter the policy did not
    pick leave Transformers' generator behind, which then drafts from further on."""
    target = build("llama", 2, seed=0)
    draft, other = noisy_copy(target, 0.3), noisy_copy(target, 0.6, seed=2)
    ids = prompts(1, seed=1)[0]
    plain = target.generate(input_ids=ids, max_new_tokens=30, do_sample=False)
    hf_specdec.enable(target, loop="transformers")
    if policy is None:       # Transformers' own argument, no length set: the default policy
        out = target.generate(input_ids=ids, assistant_model=draft, max_new_tokens=30, do_sample=False,
                              return_dict_in_generate=True)
    else:
        drafters = [draft, other] if isinstance(policy, hf_specdec.SpecPolicy) else [draft]
        out = target.generate(input_ids=ids, assistant_models=drafters, spec_policy=policy, max_new_tokens=30,
                              do_sample=False, return_dict_in_generate=True)
    assert_same(out.sequences, plain)
    if policy != "dsd":      # (its profile of this tiny pair, measured here, says drafting never pays)
        assert any(s.k for s in out.spec_stats.steps)
