"""cache_implementation="static" with compiled forwards (Transformers' rule: on CUDA-like devices,
or anywhere with `compile_config._compile_all_devices`). Compiled here with dynamo's "eager"
backend: the same graphs, guards and recompilations as inductor, without its code generation."""
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import hf_specdec
from hf_specdec import compiled
from hf_specdec.testing import build, circle_model, circle_continuation, noisy_copy, prompts
from helpers import Scripted, assert_same, spec


def _compile_config(**kwargs):
    config = CompileConfig(fullgraph=True, backend="eager", **kwargs)
    config._compile_all_devices = True          # Transformers' own switch for compiling on a CPU
    return config


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_no_recompilation_after_warm_up_while_k_moves_across_tiers_and_the_batch_drops_buckets():
    """Rows reach EOS one after another (a circle model continues last+1, ...), so the batch drops
    from bucket 8 to 4, 2 and 1 while k cycles through every tier. The first call compiles each
    shape exactly once (one graph per compiled function, no graph break); the second compiles nothing."""
    vocab, eos, new = 512, 500, 40
    target = circle_model("toy", vocab=vocab, dtype=torch.float32)
    draft = circle_model("toy", vocab=vocab, alpha=0.7, dtype=torch.float32)
    target.generation_config.eos_token_id = eos
    ids = torch.randint(1, 400, (8, 6), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = eos - torch.tensor([3, 7, 12, 18, 25, 31, 45, 60])             # rows stop at those steps
    ks = compiled.SPEC_TIERS
    expected = torch.cat([ids, circle_continuation(ids, new, vocab)], 1)
    after_eos = torch.cumsum((expected == eos).long(), 1) - (expected == eos).long() > 0
    expected[after_eos] = 0                                                          # generate() pads
    config = _compile_config()
    graphs = []
    for _ in range(2):
        before = _graphs()
        out = spec(target, [draft], Scripted(lambda step: ks[step % len(ks)]), input_ids=ids, max_new_tokens=new,
                   do_sample=False, cache_implementation="static", compile_config=config)
        assert_same(out, expected[:, :out.shape[1]])
        graphs.append(_graphs() - before)
    functions = sum(len(f.functions) for model in (target, draft) for f in compiled._COMPILED[model].values())
    shapes = {key[:2] for model in (target, draft) for f in compiled._COMPILED[model].values() for key in f.functions}
    assert {rows for rows, _ in shapes} == {8, 4, 2, 1}
    assert {width for _, width in shapes} >= {k + 1 for k in ks}
    assert graphs == [functions, 0], graphs
    assert not counters["graph_break"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_greedy_identical_with_model_drafter_lookup_and_hierarchy(arch):
    model = build(arch, 2, seed=0)
    draft = noisy_copy(model, 0.3)
    ids, mask = prompts(3, seed=3, min_len=3, max_len=12)             # padded, and a bucket of 4 rows
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    hierarchy = hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(), hf_specdec.ModelDrafter(draft),
                                               draft_len=2, cycles=2)
    for drafters, policy in (([draft], "fixed:3"), ([hf_specdec.PromptLookupDrafter()], "fixed:4"),
                             ([hierarchy], "fixed:2"), ([draft, hf_specdec.PromptLookupDrafter()], "auto")):
        out = spec(model, drafters, policy, input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                   cache_implementation="static", compile_config=_compile_config())
        assert_same(out, plain)
    assert compiled._COMPILED[model] and compiled._COMPILED[draft]
