"""The compiled static path on a real GPU (CUDA graph trees, inductor): run by `make gpu-check` on a
lent GPU; skipped elsewhere. Tiny models, so the compiles take seconds."""
import pytest
import torch
from torch._dynamo.utils import counters

from hf_specdec import compiled
from hf_specdec.testing import circle_continuation, circle_model, prompts
from helpers import assert_same, spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_compiled_static_greedy_is_exact_and_a_second_call_compiles_nothing(dtype):
    vocab = 4096
    target = circle_model("toy", vocab=vocab, device="cuda", dtype=dtype)
    draft = circle_model("toy", vocab=vocab, alpha=0.7, device="cuda", dtype=dtype)
    ids, mask = (t.cuda() for t in prompts(3, seed=2, min_len=4, max_len=12, vocab=vocab))
    expected = circle_continuation(ids, 48, vocab)
    graphs = []
    for policy in ("fixed:4", "auto"):
        before = counters["stats"]["unique_graphs"]
        out = spec(target, [draft], policy, input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                   cache_implementation="static", return_dict_in_generate=True)
        assert_same(out.sequences[:, ids.shape[1]:], expected)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        if policy == "fixed:4":                              # compiling, then recording graphs
            assert out.spec_stats.steps[0].warmup
    assert graphs == [2, 0]                                  # one graph per model, compiled once
    assert compiled._COMPILED[target] and compiled._COMPILED[draft]
