"""Transformers' own assisted-generation arguments through enable(): batched, mapped to our policies."""
import pytest
import torch
from transformers import GenerationConfig, GenerationMixin

import hf_specdec
from helpers import assert_same
from hf_specdec.testing import build, noisy_copy, prompts


@pytest.fixture
def pair():
    target = build("llama", 2, seed=0)
    draft = noisy_copy(target, 0.05)      # accepts some drafts, rejects others: schedules move
    return target, draft


def schedule(draft, n, name, threshold=0.0):
    draft.generation_config.num_assistant_tokens = n
    draft.generation_config.num_assistant_tokens_schedule = name
    draft.generation_config.assistant_confidence_threshold = threshold


@pytest.mark.parametrize("name", ["constant", "heuristic"])
def test_batch_1_matches_transformers_forward_for_forward(pair, name):
    """Greedy, batch 1, threshold 0: the same tokens, the same number of target forwards and the
    same draft length at every step as Transformers' own assisted generation."""
    target, draft = pair
    forwards = []
    target.register_forward_hook(lambda *args: forwards.append(1))
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    lengths = []
    from transformers.generation.candidate_generator import AssistedCandidateGenerator
    original = AssistedCandidateGenerator.get_candidates

    def recording(self, input_ids, **kwargs):
        lengths.append(min(int(self.num_assistant_tokens), self.main_model_max_length - input_ids.shape[1] - 1))
        return original(self, input_ids, **kwargs)
    schedule(draft, 4, name)
    AssistedCandidateGenerator.get_candidates = recording
    try:
        theirs = GenerationMixin.generate(target, ids, assistant_model=draft, max_new_tokens=30, do_sample=False)
    finally:
        AssistedCandidateGenerator.get_candidates = original
    their_forwards = len(forwards)

    schedule(draft, 4, name)
    hf_specdec.enable(target)
    forwards.clear()
    ours = target.generate(ids, assistant_model=draft, max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
    assert_same(ours.sequences, theirs)
    assert len(forwards) == their_forwards
    assert [max(k, 0) for k in lengths] == [s.k for s in ours.spec_stats.steps]
    assert len(set(lengths)) > (2 if name == "heuristic" else 1)   # 4, then ... 1 near max_length; heuristic moves
    assert 1 < ours.spec_stats.mean_accepted_tokens < 5


def test_assistant_model_and_prompt_lookup_run_batched(pair):
    target, draft = pair
    ids, mask = prompts(3, seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    plain = target.generate(**kw)
    hf_specdec.enable(target)
    for extra in (dict(assistant_model=draft), dict(assistant_model=[draft, hf_specdec.PromptLookupDrafter()]),
                  dict(assistant_model=hf_specdec.ModelDrafter(draft)), dict(prompt_lookup_num_tokens=3),
                  dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=1)):
        out = target.generate(**kw, **extra, return_dict_in_generate=True)
        assert_same(out.sequences, plain)
        assert out.spec_stats.steps, extra
    lookup = target.generate(**kw, prompt_lookup_num_tokens=3, return_dict_in_generate=True)
    assert lookup.spec_stats.steps[0].k == 3 and max(s.k for s in lookup.spec_stats.steps) == 3
    # prompt lookup set in a generation config: generate() itself must not take its batch-1 mode
    config = GenerationConfig(max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=2)
    out = target.generate(input_ids=ids, attention_mask=mask, generation_config=config, return_dict_in_generate=True)
    assert_same(out.sequences, plain)
    assert out.spec_stats.steps[0].k == 2 and config.prompt_lookup_num_tokens == 2


def test_where_settings_are_read(pair):
    """The call wins, then the assistant's generation config, then the target's; nothing set: "auto"."""
    target, draft = pair
    ids, mask = prompts(2, seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    hf_specdec.enable(target)
    first_k = lambda out: out.spec_stats.steps[0].k  # noqa: E731
    schedule(draft, 5, "constant")
    assert first_k(target.generate(**kw, assistant_model=draft)) == 5
    assert first_k(target.generate(**kw, assistant_model=draft, num_assistant_tokens=2)) == 2
    assert first_k(target.generate(**kw, assistant_model=draft,
                                   generation_config=GenerationConfig(num_assistant_tokens=3))) == 3
    fresh = noisy_copy(target, 0.05)
    target.generation_config.num_assistant_tokens = 6
    target.generation_config.assistant_confidence_threshold = 0.0
    assert first_k(target.generate(**kw, assistant_model=fresh)) == 6
    target.generation_config.num_assistant_tokens = None
    target.generation_config.assistant_confidence_threshold = None
    auto = target.generate(**kw, assistant_model=fresh).spec_stats.policy    # nothing set: "auto"
    assert type(auto.length).__name__ == "MeasuredGoodput"
    assert target.generate(**kw, assistant_model=fresh).spec_stats.policy is auto   # it learns across calls
    # ours win when both are given
    both = target.generate(**kw, assistant_model=draft, assistant_models=[hf_specdec.PromptLookupDrafter()],
                           spec_policy="fixed:1")
    assert {s.k for s in both.spec_stats.steps} <= {0, 1}


def test_heuristic_length_persists_on_the_assistant_and_transient_does_not(pair):
    target, draft = pair
    ids, mask = prompts(2, seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    hf_specdec.enable(target)
    schedule(draft, 9, "heuristic")
    out = target.generate(**kw, assistant_model=draft)
    reached = draft.generation_config.num_assistant_tokens
    assert reached != 9 and out.spec_stats.steps[0].k == 9
    assert target.generate(**kw, assistant_model=draft).spec_stats.steps[0].k == reached
    schedule(draft, 9, "heuristic_transient")
    target.generate(**kw, assistant_model=draft)
    assert draft.generation_config.num_assistant_tokens == 9


def test_confidence_threshold_stops_drafting(pair):
    target, draft = pair
    ids, mask = prompts(2, seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(**{k: v for k, v in kw.items() if k != "return_dict_in_generate"})
    hf_specdec.enable(target)
    out = target.generate(**kw, assistant_model=draft, num_assistant_tokens=8, assistant_confidence_threshold=0.99)
    assert_same(out.sequences, plain)
    assert min(max(s.proposed) for s in out.spec_stats.steps[:-1]) < 8   # some step stopped early


@pytest.mark.parametrize("extra,message", [
    (dict(num_assistant_tokens_schedule="sometimes"), "num_assistant_tokens_schedule must be one of"),
    (dict(assistant_confidence_threshold=1.5), "assistant_confidence_threshold must be a probability"),
    (dict(num_assistant_tokens=0), "num_assistant_tokens must be >= 1"),
    (dict(prompt_lookup_num_tokens=3), "not both"),
    (dict(assistant_model=[]), "empty list"),
])
def test_bad_assisted_arguments_fail_before_any_work(pair, extra, message):
    target, draft = pair
    ids, mask = prompts(2, seed=6)
    hf_specdec.enable(target)
    schedule(draft, 5, "heuristic")
    forwards = []
    target.register_forward_hook(lambda *args: forwards.append(1))
    kw = {"assistant_model": draft, **extra}
    with pytest.raises(ValueError, match=message):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, **kw)
    assert not forwards and draft.generation_config.num_assistant_tokens == 5


def test_adaspec_and_dsd_profile_their_pair_once(pair, tmp_path, monkeypatch, caplog):
    """By name, without a profile: measured the first time the pair meets, cached on disk, reused."""
    from hf_specdec import costmodel
    target, draft = pair
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    measured = []
    real_profile = costmodel.profile
    monkeypatch.setattr(costmodel, "profile", lambda *a, **k: measured.append(a[2]) or real_profile(*a, **k))
    ids, mask = prompts(2, seed=7)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    plain = target.generate(**kw)
    hf_specdec.enable(target)
    with caplog.at_level("INFO", logger="hf_specdec.costmodel"):
        for name in ("adaspec", "dsd", "adaspec:4"):
            assert_same(target.generate(**kw, assistant_models=[draft], spec_policy=name), plain)
    assert measured == [[1, 2]]                       # once, at batch sizes up to 2
    assert "profiling the target and the draft" in caplog.text
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    target.generate(**kw, assistant_models=[hf_specdec.PromptLookupDrafter()], spec_policy="dsd")
    assert measured == [[1, 2], [1, 2]]               # a lookup drafter: the target alone, another entry

    other = build("llama", 3, seed=5)      # another architecture (weights alone do not change latency)
    foreign = costmodel.cached_profile(other, None, 1)
    with pytest.raises(ValueError, match="measured on"):
        target.generate(**kw, assistant_models=[draft], spec_policy=hf_specdec.AdaSpec(foreign))


def test_custom_generate_folder_loads_by_path(pair):
    """The Hub convention: custom_generate/generate.py of this checkout, loaded by Transformers."""
    from pathlib import Path
    root = str(Path(__file__).resolve().parent.parent)
    target, draft = pair
    ids, mask = prompts(3, seed=8)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    plain = target.generate(**kw)
    out = target.generate(**kw, custom_generate=root, trust_remote_code=True, assistant_models=[draft],
                          spec_policy="fixed:3", return_dict_in_generate=True)
    assert_same(out.sequences, plain)
    assert out.spec_stats.steps[0].k == 3
    lookup = target.generate(**kw, custom_generate=root, trust_remote_code=True, prompt_lookup_num_tokens=2,
                             return_dict_in_generate=True)
    assert_same(lookup.sequences, plain)
    assert lookup.spec_stats.steps[0].k == 2
    assert_same(target.generate(**kw, custom_generate=root, trust_remote_code=True), plain)


@pytest.mark.parametrize("call,message", [
    (lambda t, d: hf_specdec.enable([t, d]), "enable each model of a list in turn"),
    (lambda t, d: hf_specdec.ModelDrafter([d]), "for several drafters pass assistant_models"),
    (lambda t, d: hf_specdec.HierarchicalDrafter([d], d), "HierarchicalDrafter\\(draft\\) must be one"),
])
def test_a_list_where_one_model_is_meant(pair, call, message):
    with pytest.raises(TypeError, match=message):
        call(*pair)
