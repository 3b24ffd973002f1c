"""Greedy speculative output is token-identical to plain generate(), row by row."""
import pytest

import hf_specdec
from helpers import assert_same, greedy_against_plain, spec
from hf_specdec.testing import build, noisy_copy, prompts

ARCHS = ["llama", "qwen2", "gpt2"]
DRAFTS = {
    "perfect": lambda target, arch: build(arch, layers=2, seed=0),          # == target
    "between": lambda target, arch: noisy_copy(target, 0.03),
    "useless": lambda target, arch: build(arch, layers=1, seed=7),
    "lookup": lambda target, arch: hf_specdec.PromptLookupDrafter(max_ngram=2),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_kind", list(DRAFTS))
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_matches_plain(arch, draft_kind, batch):
    target = build(arch, layers=2, seed=0)
    draft = DRAFTS[draft_kind](target, arch)
    ids, mask = prompts(batch, seed=batch)
    for k, out in greedy_against_plain(target, draft, ids, mask).items():
        stats = out.spec_stats
        assert stats.tokens_generated == sum(sum(s.emitted) for s in stats.steps) > 0
        if draft_kind == "perfect":
            assert stats.acceptance_rate > 0.95 and stats.mean_accepted_tokens > 1 + 0.6 * k


def test_rows_accept_their_own_counts():
    """Rows of one step accept different numbers of drafts (never the minimum over rows)."""
    target = build("llama", 2, seed=0)
    ids, mask = prompts(6, seed=3)
    out = spec(target, [noisy_copy(target, 0.02)], "fixed:5", input_ids=ids, attention_mask=mask,
               max_new_tokens=30, return_dict_in_generate=True)
    assert any(len(set(step.accepted)) > 1 for step in out.spec_stats.steps)


def test_greedy_with_repetition_penalty_and_no_repeat_ngram():
    """Processors that read input_ids see the same prefix as in plain generate()."""
    target = build("llama", 2, seed=0)
    ids, mask = prompts(4, seed=11)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                  repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=5)
    plain = target.generate(**kwargs)
    for draft in (build("llama", 2, seed=0), hf_specdec.PromptLookupDrafter()):
        assert_same(spec(target, [draft], "fixed:4", **kwargs), plain)


def test_finished_rows_leave_the_batch():
    """Once a row stops, later steps run on fewer rows."""
    target = build("llama", 2, seed=0)
    ids, mask = prompts(4, seed=5)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40)
    # make the token row 0 emits at its 5th new step the EOS, so rows stop at different times
    eos = int(plain[0, ids.shape[1] + 4])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos)
    plain = target.generate(**kwargs)
    out = spec(target, [build("llama", 2, seed=0)], "fixed:3", return_dict_in_generate=True, **kwargs)
    assert_same(out.sequences, plain)
    sizes = [s.batch_size for s in out.spec_stats.steps]
    assert sizes[0] == 4 and sizes[-1] < 4 and sizes == sorted(sizes, reverse=True)
