"""cache_implementation="static": every model keeps a preallocated KV cache (Transformers'
StaticCache) written at slot positions, rolled-back slots masked or stepped back over, compacted
when full. Greedy output stays token-identical to plain generate()."""
import pytest
from transformers import GenerationConfig, StaticCache

import hf_specdec
from hf_specdec import cached_model, slots
from hf_specdec.testing import build, layer_skip_pair, noisy_copy, prompts
from helpers import assert_same, spec


def _static(model, drafters, policy, ids, mask, new=24, **kwargs):
    return spec(model, drafters, policy, input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                cache_implementation="static", **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_identical_with_model_drafter_lookup_and_hierarchy(arch, monkeypatch):
    model = build(arch, 2, seed=0)
    draft = noisy_copy(model, 0.3)
    ids, mask = prompts(4, seed=3, min_len=3, max_len=12)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    caches = []
    reset = cached_model.CachedModel.reset

    def spy(self, batch, **kwargs):
        reset(self, batch, **kwargs)
        caches.append(self.slots.cache)
    monkeypatch.setattr(cached_model.CachedModel, "reset", spy)
    hierarchy = hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(), hf_specdec.ModelDrafter(draft),
                                               draft_len=2, cycles=2)
    for drafters, policy in (([draft], "fixed:3"), ([draft], "nightjar"), ([hf_specdec.PromptLookupDrafter()], "fixed:4"),
                             ([hierarchy], "fixed:3"), ([draft, hf_specdec.PromptLookupDrafter()], "auto")):
        assert_same(_static(model, drafters, policy, ids, mask), plain)
    assert caches and all(isinstance(c, StaticCache) for c in caches)


def test_full_caches_are_compacted_and_grown_without_changing_a_token(monkeypatch):
    """With no slack a static cache fills within a few steps where rows accept different counts:
    its rows are compacted (and grown when that is not enough), and the output stays exact."""
    monkeypatch.setattr(slots, "static_capacity", lambda tokens, pads: tokens + 1)
    moved, reserve = [], slots.StaticSlots.reserve

    def counted(self, width):                  # the compactions (`moves`: each also when it grew)
        before = self.moves
        reserve(self, width)
        moved.extend([width] * (self.moves - before))
    monkeypatch.setattr(slots.StaticSlots, "reserve", counted)
    target, draft = layer_skip_pair(0.05, layers=3, hidden=64, vocab=512)
    target.generation_config.eos_token_id = None
    ids, mask = prompts(6, seed=3, min_len=3, max_len=12, vocab=512)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=60, do_sample=False)
    for policy in ("fixed:3", "fixed:6"):
        assert_same(_static(target, [draft], policy, ids, mask, new=60), plain)
    assert len(moved) >= 5


def test_dynamic_path_is_unchanged_without_the_static_setting(monkeypatch):
    model = build("llama", 2, seed=0)
    ids, mask = prompts(2, seed=1)
    caches, reset = [], cached_model.CachedModel.reset

    def spy(self, batch, **kwargs):
        reset(self, batch, **kwargs)
        caches.append(type(self.slots.cache).__name__)
    monkeypatch.setattr(cached_model.CachedModel, "reset", spy)
    spec(model, [noisy_copy(model, 0.3)], "fixed:2", input_ids=ids, attention_mask=mask, max_new_tokens=6)
    assert caches and set(caches) == {"DynamicCache"}


def test_cache_settings_it_cannot_honour_are_refused_before_any_work(monkeypatch):
    """Through enable(), before generate() prepares a cache (an offloaded one opens an accelerator
    stream: a CUDA build of torch without a GPU would fail there, not refuse); as a custom_generate
    callable (which Transformers calls after preparing one), a cache_config."""
    model = build("llama", 2, seed=0)
    ids, mask = prompts(2, seed=1)
    draft = noisy_copy(model, 0.3)
    hf_specdec.enable(model)

    def prepared(*args, **kwargs):
        raise AssertionError("generate() prepared a cache before the refusal")
    monkeypatch.setattr(type(model), "_prepare_cache_for_generation", prepared)
    try:
        for setting, named in [({"cache_implementation": "offloaded"}, "cache_implementation='offloaded'"),
                               ({"cache_implementation": "quantized"}, "cache_implementation='quantized'"),
                               ({"generation_config": GenerationConfig(cache_implementation="offloaded")},
                                "cache_implementation='offloaded'")]:
            with pytest.raises(ValueError, match=named):
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_models=[draft],
                               spec_policy="fixed:2", **setting)
    finally:
        hf_specdec.disable(model)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cache_config"):
        spec(model, [draft], "fixed:2", input_ids=ids, attention_mask=mask, max_new_tokens=4,
             cache_config={"max_cache_len": 8})
