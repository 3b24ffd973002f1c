"""EOS, stopping criteria and max length end rows exactly where plain generate() does; streamers
receive what plain generate() would send them."""
import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from helpers import assert_same, spec
from hf_specdec.testing import build, prompts


@pytest.fixture(scope="module")
def target():
    return build("llama", 2, seed=0)


@pytest.fixture(scope="module")
def perfect():
    return build("llama", 2, seed=0)


def test_eos_inside_an_accepted_block(target, perfect):
    ids, mask = prompts(4, seed=2)
    base = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30)
    for step in (0, 3, 7):  # EOS = the token row 1 emits at that step: lands mid-block with k=6
        eos = int(base[1, ids.shape[1] + step])
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos)
        plain = target.generate(**kwargs)
        out = spec(target, [perfect], "fixed:6", return_dict_in_generate=True, **kwargs)
        assert_same(out.sequences, plain)
        row = out.sequences[1, ids.shape[1]:]
        first = int((row == eos).nonzero()[0])
        assert first <= step and (row[first + 1:] == 0).all()  # padded after EOS, as plain
        assert max(max(s.accepted) for s in out.spec_stats.steps) >= 5  # blocks really were long


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 13])
def test_max_new_tokens_never_exceeded(target, perfect, max_new):
    ids, mask = prompts(3, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=None)
    plain = target.generate(**kwargs)
    out = spec(target, [perfect], "fixed:6", **kwargs)
    assert out.shape[1] == ids.shape[1] + max_new
    assert_same(out, plain)


class StopAfterTokenOrLength(StoppingCriteria):
    """Row b stops once `token` is among its last 2 tokens or its length reaches limits[b]
    (per-row state indexed by batch position, as generate() hands criteria the whole batch)."""

    def __init__(self, token, limits):
        self.token, self.limits = token, limits

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -2:] == self.token).any(1) | (input_ids.shape[1] >= self.limits)


@pytest.mark.parametrize("with_eos", [True, False])
def test_custom_stopping_criteria(target, perfect, with_eos):
    """With an EOS criterion finished rows are padded; without one, generate() keeps finished rows
    producing real tokens until every row has stopped — both reproduced exactly."""
    ids, mask = prompts(4, seed=6)
    base = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)
    token = int(base[2, ids.shape[1] + 5])
    limits = ids.shape[1] + torch.tensor([9, 23, 14, 17])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30,
                  stopping_criteria=StoppingCriteriaList([StopAfterTokenOrLength(token, limits)]))
    if not with_eos:
        kwargs["eos_token_id"] = None
    plain = target.generate(**kwargs)
    assert plain.shape[1] < ids.shape[1] + 30  # the criterion really ended generation early
    for drafter in (perfect, hf_specdec.PromptLookupDrafter()):
        assert_same(spec(target, [drafter], "fixed:4", **kwargs), plain)


class Recorder(BaseStreamer):
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


@pytest.mark.parametrize("batch", [1, 3])
def test_streamer_gets_what_plain_generate_sends(batch):
    model = hf_specdec.enable(build("llama", 2, seed=0))
    ids, mask = prompts(batch, seed=8)
    base = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20)
    eos = int(base[0, ids.shape[1] + 9])
    plain_rec, spec_rec = Recorder(), Recorder()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos)
    plain = model.generate(streamer=plain_rec, **kwargs)
    out = model.generate(streamer=spec_rec, assistant_models=[build("llama", 2, seed=0)],
                         spec_policy="fixed:4", **kwargs)
    assert_same(out, plain)
    assert spec_rec.calls == plain_rec.calls
    assert len(plain_rec.calls) > 5


def test_rows_stopped_and_retired_at_max_length_are_cut_back():
    """Without EOS, a row that stopped early keeps decoding, may retire at max_length, and must still
    be cut back to the last row's stop (regression: the output was 3 columns wider than plain)."""
    target = build("llama", 2, seed=0)
    ids, mask = prompts(3, seed=5)
    limits = ids.shape[1] + torch.tensor([5, 3, 13])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None,
                  stopping_criteria=StoppingCriteriaList([StopAfterTokenOrLength(-1, limits)]))
    plain = target.generate(**kwargs)
    from hf_specdec.testing import noisy_copy
    for k in (2, 6):
        assert_same(spec(target, [noisy_copy(target, 0.05)], f"fixed:{k}", **kwargs), plain)
