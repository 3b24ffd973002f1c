"""The token buffer and the target's cache rows: rows leaving free their slots, lags and holes,
growth past the first buffer, views."""
import pytest
import torch

import hf_specdec
from hf_specdec.cached_model import CachedModel
from hf_specdec.rows import RowInts
from hf_specdec.sequences import SequenceBatch
from hf_specdec.testing import build, noisy_copy


@pytest.fixture(scope="module")
def models():
    target = build("llama", 2, seed=0)
    return target, noisy_copy(target, 0.3)


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
    """The token buffer grows as rows get longer; a row may outgrow its first size (the prompt
    width + `SequenceBatch.GROWTH`) and still gets every token it asked for."""
    target, draft = models
    ids = torch.tensor([[5, 6, 7]])
    plain = target.generate(ids, max_new_tokens=100, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = target.generate(ids, max_new_tokens=100, do_sample=False, eos_token_id=None, pad_token_id=0,
                           custom_generate=hf_specdec.generate, assistant_models=[draft],
                           spec_policy=hf_specdec.FixedLength(3))
    assert ours.shape[1] - 3 == 100 > SequenceBatch.GROWTH and torch.equal(ours, plain)


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
