"""Continuous batching on real (tiny) models: requests that join a running batch decode exactly
as they would alone, finished requests free their rows, bad input is refused up front."""
import random

import pytest
import torch

import hf_specdec
from helpers import Scripted
from hf_specdec.cached_model import CachedModel
from hf_specdec.rows import RowInts
from hf_specdec.sequences import SequenceBatch
from hf_specdec.serving import Engine, Request
from hf_specdec.testing import build, noisy_copy


@pytest.fixture(scope="module")
def models():
    target = build("llama", 2, seed=0)
    return target, noisy_copy(target, 0.3)


def stream(n=7, seed=0):
    """n requests, three at t=0 and the rest arriving while those run, various lengths."""
    rng = random.Random(seed)
    requests, prompts = [], []
    for i in range(n):
        prompts.append([rng.randint(3, 95) for _ in range(rng.randint(3, 12))])
        requests.append(Request(i, 0.0 if i < 3 else 0.02 * i, len(prompts[-1]), rng.randint(1, 16)))
    return requests, prompts


def alone(target, prompt, new_tokens, eos=None):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos is not None and eos in out else out


POLICIES = {
    "fixed:3": lambda draft: ([draft], hf_specdec.FixedLength(3)),
    "scripted-two-drafters": lambda draft: ([draft, hf_specdec.PromptLookupDrafter()],
                                            hf_specdec.SpecPolicy(selector=hf_specdec.HedgeSpec(),
                                                                  length=Scripted(lambda s: [0, 2, 5, 1][s % 4]))),
    "nightjar": lambda draft: ([draft], hf_specdec.Nightjar(max_len=4)),
}


@pytest.mark.parametrize("name", POLICIES)
def test_requests_joining_mid_run_decode_as_if_alone(models, name):
    target, draft = models
    drafters, policy = POLICIES[name](draft)
    requests, prompts = stream()
    result = Engine(target, drafters, policy, max_batch=3, max_prompt_len=16).run(requests, prompts)
    assert max(s.batch_size for s in result.steps) == 3 and len(result.requests) == len(requests)
    joined_mid_run = [r for r in result.requests if r.first_token > min(s.time for s in result.steps)]
    assert joined_mid_run                                        # the test exercises joining
    for request, prompt in zip(requests, prompts):
        assert result.outputs[request.id] == alone(target, prompt, request.output_len), request


@pytest.mark.parametrize("name", POLICIES)
def test_requests_after_the_batch_drained_decode_as_if_alone(models, name):
    # every row retires before the next arrivals: the caches go down to no rows and start again
    target, draft = models
    drafters, policy = POLICIES[name](draft)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16]]
    requests = [Request(0, 0.0, 3, 5), Request(1, 0.0, 4, 6), Request(2, 50.0, 2, 7), Request(3, 50.0, 3, 4)]
    result = Engine(target, drafters, policy, max_batch=3, max_prompt_len=8).run(requests, prompts)
    assert min(r.first_token for r in result.requests if r.request.id >= 2) >= 50.0
    for request, prompt in zip(requests, prompts):
        assert result.outputs[request.id] == alone(target, prompt, request.output_len), request


def test_a_request_finishing_early_frees_its_row(models):
    target, draft = models
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    eos = alone(target, prompts[0], 12)[2]                       # request 0 stops at its third token
    requests = [Request(0, 0.0, 3, 12), Request(1, 0.0, 4, 40), Request(2, 0.0, 2, 5)]
    result = Engine(target, [draft], "fixed:2", max_batch=2, max_prompt_len=8,
                    eos_token_id=eos).run(requests, prompts)
    done = {r.request.id: r for r in result.requests}
    assert result.outputs[0] == alone(target, prompts[0], 12, eos) and result.outputs[0][-1] == eos
    assert done[0].tokens < 12                                   # stopped early, at EOS
    assert done[2].first_token >= done[0].finish                 # waited for a free row ...
    assert done[2].first_token < done[1].finish                  # ... which it got before 1 ended
    assert all(s.batch_size <= 2 for s in result.steps)
    for request, prompt in zip(requests[1:], prompts[1:]):
        assert result.outputs[request.id] == alone(target, prompt, request.output_len, eos)


def test_engine_refuses_bad_input_before_any_work(models):
    target, draft = models
    with pytest.raises(ValueError, match="max_batch"):
        Engine(target, [draft], max_batch=0)
    engine = Engine(target, [draft], max_prompt_len=4)
    with pytest.raises(ValueError, match="prompt of 5 tokens"):
        engine.run([Request(0, 0.0, 5, 3)], [[3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="one token list per request"):
        engine.run([Request(0, 0.0, 2, 3)], [])
    hierarchy = hf_specdec.HierarchicalDrafter(noisy_copy(target, 0.5), draft)
    with pytest.raises(ValueError, match="cannot take requests mid-run"):
        Engine(target, [hierarchy])


def test_rows_leaving_free_their_cache_slots(models):
    """A long row's left padding of the others is dropped when it leaves: under sustained load the
    cache stays as wide as the rows still running need, and their logits stay the same. Once no
    slot is a hole the forward passes no mask, as generate() drops an all-ones one."""
    target, _ = models
    ids = torch.tensor([[7] * 12, [0] * 9 + [5, 6, 7]])
    batch = SequenceBatch(ids, (ids != 0).long(), max_length=40, pad_token_id=0)
    runner = CachedModel(target)
    runner.reset(batch)
    masks = []
    hook = target.register_forward_pre_hook(lambda m, a, kw: masks.append(kw["attention_mask"]), with_kwargs=True)
    try:
        runner.forward(*runner.pending(batch), keep=1)
        assert runner.num_slots == 12 and runner.holes and masks[-1] is not None    # the padding is masked
        batch.active = RowInts.of([1], "cpu")
        runner.select_rows(RowInts.of([1], "cpu"))
        assert runner.num_slots == 3                                 # only the short row's own slots
        assert not runner.holes                                      # no holes left: no mask, as generate()
        batch.tokens[1, 12] = 8
        batch.lengths = batch.lengths + RowInts.of([0, 1], "cpu")
        logits = runner.forward(*runner.pending(batch), keep=1)[0, -1]
        assert masks[-1] is None
    finally:
        hook.remove()
    alone = target(torch.tensor([[5, 6, 7, 8]])).logits[0, -1]
    torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-4)


def test_pending_leaves_rows_without_lag_as_holes(models):
    """A joiner prefilled to its last token has no lag while the running rows lag one (a drafter
    that sat out a step): its slot in the next forward is a hole, not its last token fed twice."""
    target, _ = models
    ids = torch.tensor([[5, 6, 7, 8], [4, 5, 6, 7]])
    batch = SequenceBatch(ids, torch.ones_like(ids), max_length=20, pad_token_id=0)
    runner = CachedModel(target)
    runner.reset(batch)
    batch.tokens[:, 4] = 9
    batch.lengths = batch.lengths + 1
    runner.forward(*runner.pending(batch), keep=1)              # both rows fed up to length 5
    batch.tokens[0, 5] = 3
    batch.lengths = batch.lengths + RowInts.of([1, 0], "cpu")   # row 0 lags one token, row 1 none
    tokens, real, counts = runner.pending(batch)
    assert tokens[0].tolist() == [3] and real.tolist() == [[True], [False]] and counts == [1, 0]


def test_requests_longer_than_the_first_buffer_get_all_their_tokens(models):
    """The token buffer grows as rows get longer; a request may outgrow its first size (the
    prompt width + `SequenceBatch.GROWTH`) and still gets every token it asked for."""
    target, draft = models
    result = Engine(target, [draft], hf_specdec.FixedLength(3), max_batch=1, max_prompt_len=4).run(
        [Request(0, 0.0, 3, 100)], [[5, 6, 7]])
    alone = target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=100, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, 3:].tolist()
    assert result.outputs[0] == alone


def test_a_view_shares_the_buffer_and_cannot_grow_it():
    """A view (other active rows / lengths) writes through to the batch's tokens; growing the buffer
    from a view would leave the batch without those writes, so it is refused."""
    ids = torch.tensor([[5, 6, 7], [4, 5, 6]])
    batch = SequenceBatch(ids, torch.ones_like(ids), max_length=200, pad_token_id=0)
    view = batch.view(active=RowInts.of([1], "cpu"), lengths=batch.lengths + 2)
    view.write(view.active.tensor, view.active_lengths().tensor, torch.tensor([[9]]))
    assert batch.tokens[1, 5] == 9 and batch.lengths.tolist() == [3, 3] and batch.active.tolist() == [0, 1]
    view.reserve(4)                                             # fits: nothing to grow
    with pytest.raises(RuntimeError, match="reserve on a view"):
        view.reserve(batch.capacity)
    before = batch.capacity
    batch.reserve(before)                                       # the batch itself grows
    assert batch.capacity >= 3 + before and view.tokens is not batch.tokens
