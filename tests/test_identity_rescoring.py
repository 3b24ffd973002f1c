"""The benchmarks' identity verdicts: identical, diverged at a near-tie, diverged otherwise."""
import sys
from pathlib import Path

import pytest
import torch

from hf_specdec.testing import build, prompts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))
from identity import compare_rows, counts, ulp  # noqa: E402


def test_ulp_is_the_dtype_spacing():
    assert ulp(17.0, torch.bfloat16) == 0.125      # bf16 keeps 8 bits of mantissa: 16..32 step 1/8
    assert ulp(1.0, torch.float32) == pytest.approx(2 ** -23)
    assert ulp(-3.0, torch.bfloat16) == ulp(3.0, torch.bfloat16)


def test_verdicts_tell_identical_rows_from_divergences_and_measure_the_gap():
    model = build("llama", 2, seed=0)
    ids, mask = prompts(3, seed=1)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    spec = plain.clone()
    position = 2
    spec[1, ids.shape[1] + position] = (plain[1, ids.shape[1] + position] + 1) % model.config.vocab_size
    verdicts = compare_rows(model, ids, mask, plain, spec)
    assert [v["verdict"] for v in verdicts] == ["identical", "other", "identical"]
    assert verdicts[1]["position"] == position and verdicts[1]["gap"] > 0  # plain's token scored higher
    assert counts(verdicts) == {"identical": 2, "near_tie": 0, "other": 1}
    # re-scoring over a cache split must give the same logits up to rounding: a split that lost the
    # positions would widen the spread until every divergence passed as a near-tie
    assert 0 <= verdicts[1]["order_spread"] < 1e-4 * abs(verdicts[1]["gap"])
    # the same divergence counts as a near-tie only when the gap is within the allowed ulps
    wide = compare_rows(model, ids, mask, plain, spec, ulps=verdicts[1]["gap"] / verdicts[1]["ulp"] + 1)
    assert wide[1]["verdict"] == "near_tie"


def test_tokens_after_eos_are_padding_not_divergence():
    model = build("llama", 2, seed=0)
    ids, mask = prompts(1, seed=1)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    eos = int(plain[0, ids.shape[1] + 1])
    spec = plain.clone()
    spec[0, ids.shape[1] + 3:] = 0
    assert compare_rows(model, ids, mask, plain, spec, eos_token_id=eos)[0]["verdict"] == "identical"
