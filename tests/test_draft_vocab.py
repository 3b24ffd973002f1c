"""A draft over its most frequent tokens (hf_specdec.draft_vocab): its head computes the kept rows
only, greedy output stays plain generate()'s, and a token it cannot propose only costs acceptance."""
import pytest
import torch

from hf_specdec.draft_vocab import NEVER, ReducedHead, frequent_tokens, restrict_vocab
from helpers import assert_same, spec
from hf_specdec.testing import build, prompts


def test_the_head_computes_the_kept_tokens_and_never_proposes_the_others():
    model = build("llama", layers=1, seed=0)
    full_head = model.get_output_embeddings().weight.detach().clone()
    embedding = model.get_input_embeddings().weight.detach().clone()
    kept = torch.tensor([5, 2, 40, 7, 2])                  # unordered, a repeat
    assert restrict_vocab(model, kept) == 4
    head = model.get_output_embeddings()
    assert isinstance(head, ReducedHead) and head.out_features == full_head.shape[0]
    hidden = torch.randn(2, 3, full_head.shape[1])
    logits = head(hidden)
    assert logits.shape == (2, 3, full_head.shape[0])
    ids = torch.tensor([2, 5, 7, 40])
    torch.testing.assert_close(logits[..., ids], hidden @ full_head[ids].T)
    others = torch.ones(full_head.shape[0], dtype=torch.bool)
    others[ids] = False
    assert (logits[..., others] == NEVER).all() and torch.isfinite(logits.softmax(-1).log().clamp(min=-1e9)).all()
    assert torch.equal(model.get_input_embeddings().weight, embedding)       # a tied embedding stays whole


def test_greedy_output_is_plain_generate_s_and_missing_tokens_cost_acceptance():
    """A copy of the target restricted to half its tokens (those the target emits among them):
    output identical to plain generate(), fewer drafts accepted than by the whole copy."""
    target = build("llama", layers=2, seed=0)
    ids, mask = prompts(4, seed=2)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    accepted = {}
    for name, kept in (("whole", None), ("half", torch.arange(0, target.config.vocab_size, 2))):
        draft = build("llama", layers=2, seed=0)
        if kept is not None:
            restrict_vocab(draft, kept)
        out = spec(target, [draft], "fixed:4", input_ids=ids, attention_mask=mask, max_new_tokens=30,
                   do_sample=False, return_dict_in_generate=True)
        assert_same(out.sequences, plain)
        accepted[name] = out.spec_stats.acceptance_rate
    assert accepted["whole"] > 0.95 and accepted["half"] < 0.8


def test_frequent_tokens_are_counted_special_tokens_kept_and_cached(tmp_path, monkeypatch):
    from hf_specdec import draft_vocab
    from hf_specdec.embedded import load_smollm2_tokenizer
    monkeypatch.setattr(draft_vocab, "CORPUS_BYTES", 200_000)     # a slice of the standard library: seconds
    tokenizer = load_smollm2_tokenizer()
    texts = ["def f(x):\n    return x\n"] * 3 + ["import os\n"]
    top = frequent_tokens(tokenizer, 3, texts=texts)
    counted = tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    assert set(tokenizer.all_special_ids) <= set(top.tolist())
    assert len(set(top.tolist()) - set(tokenizer.all_special_ids) - set(tokenizer.get_added_vocab().values())) <= 3
    assert set(top.tolist()) & set(counted)
    # the default corpus (Python's standard library) is counted once, then read from the cache
    cache = tmp_path / "vocab.json"
    first = frequent_tokens(tokenizer, 500, cache=cache)
    assert cache.exists() and len(first) >= 500
    assert torch.equal(frequent_tokens(tokenizer, 500, cache=cache), first)
    import json
    import platform
    assert json.loads(cache.read_text())["key"]["corpus"].endswith(f"python{platform.python_version()}")
    # a Python without its standard library's sources: a clear error, not a vocabulary of a few tokens
    empty = tmp_path / "no-sources"
    empty.mkdir()
    monkeypatch.setattr(draft_vocab.sysconfig, "get_paths", lambda: {"stdlib": str(empty)})
    with pytest.raises(ValueError, match="standard library sources .*give texts="):
        frequent_tokens(tokenizer, 500)


def test_bad_input_is_refused_before_the_model_changes():
    model = build("llama", layers=1, seed=0)
    head = model.get_output_embeddings()
    with pytest.raises(ValueError, match="kept must be token ids"):
        restrict_vocab(model, torch.tensor([0, model.config.vocab_size]))
    assert model.get_output_embeddings() is head
    restrict_vocab(model, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="output head must be an nn.Linear, got ReducedHead"):
        restrict_vocab(model, torch.tensor([1]))
    from hf_specdec.embedded import load_model
    with pytest.raises(ValueError, match="draft_vocab must be None or a positive int"):
        load_model("smollm2-135m-instruct", draft_vocab=0)
    with pytest.raises(ValueError, match="n must be a positive int"):
        frequent_tokens(None, 0)
