"""Gemma 4 targets (KV-sharing layers, sliding and full attention) and Gemma 4 assistants, which
draft from the target's own states, in our loop: batched, greedy identical to plain generate()
past the window, the assistant's drafts the ones Transformers' own generator makes."""
import pytest
import torch
from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, GenerationConfig,
                          Gemma4TextConfig)
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

import hf_specdec
from hf_specdec.drafters import TargetStatesDrafter
from hf_specdec.testing import noisy_copy, prompts
from helpers import spec

VOCAB, WINDOW = 96, 6


def _text_config(**changes) -> Gemma4TextConfig:
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
                    vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, pad_token_id=0, bos_token_id=1,
                    eos_token_id=None)
    settings.update(changes)
    return Gemma4TextConfig(**settings)


def gemma4_pair(seed=0, attention="sdpa"):
    """A tiny Gemma 4 target (2 layers that store K/V, 2 that reuse them) and a Gemma 4 assistant
    of 2 layers that reads them."""
    torch.manual_seed(seed)
    target = Gemma4ForCausalLM(_text_config()).eval()
    assistant_text = _text_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                  hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=0)
    assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=assistant_text,
                                                                 backbone_hidden_size=32)).eval()
    assistant.generation_config.num_assistant_tokens = 4       # (a checkpoint's own config sets it)
    for model in (target, assistant):
        model.config._attn_implementation = attention
        model.config.get_text_config()._attn_implementation = attention
    return target, assistant


class Recording(TargetStatesDrafter):
    """The drafter, keeping each proposal's tokens and counts."""
    def propose(self, batch, k, continue_drafting=None):
        proposal = super().propose(batch, k, continue_drafting)
        self.proposals = getattr(self, "proposals", []) + [(proposal.tokens.clone(), proposal.counts.tensor.clone())]
        return proposal


def _transformers_first_drafts(target, assistant, ids, k):
    """The drafts Transformers' own generator makes after the prefill of `ids` [1, p]."""
    out = target(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    assistant.generation_config.num_assistant_tokens = k
    generator = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(),
                                                           GenerationConfig(max_length=64))
    extended = torch.cat([ids, first], 1)
    candidates, _ = generator.get_candidates(extended, {"attention_mask": torch.ones_like(extended)}, out,
                                             is_first_iteration=False, n_last_matches=0)
    return candidates[0, extended.shape[1]:]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_first_drafts_are_transformers_own_in_every_row_of_a_padded_batch(attention):
    """After the prefill, the assistant's drafts in our loop are exactly those of Transformers'
    generator for that row alone: its inputs (the target's hidden state and embedding), positions,
    shared K/V and masks, holes of the left padding included, are the same."""
    target, assistant = gemma4_pair(attention=attention)
    ids, mask = prompts(3, seed=1, min_len=4, max_len=9, vocab=VOCAB)
    drafter = Recording(assistant)
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                    custom_generate=hf_specdec.generate, assistant_models=[drafter], spec_policy="fixed:3")
    tokens, lengths = next(p for p in drafter.proposals if int(p[1].max()))
    assert lengths.tolist() == [3, 3, 3]
    for r in range(3):
        alone = ids[r:r + 1, int((mask[r] == 0).sum()):]
        assert torch.equal(tokens[r], _transformers_first_drafts(target, assistant, alone, 3)), r


@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_identical_to_plain_past_the_window_batched(cache):
    target, assistant = gemma4_pair()
    ids, mask = prompts(3, seed=2, min_len=3, max_len=10, vocab=VOCAB)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, cache_implementation=cache)
    plain = target.generate(**kwargs)
    out = target.generate(custom_generate=hf_specdec.generate, assistant_models=[assistant], spec_policy="fixed:3",
                          return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    assert sum(sum(s.proposed) for s in out.spec_stats.steps) > 0               # it drafted


def test_enable_runs_it_in_our_loop_batched_and_at_batch_1_as_transformers():
    target, assistant = gemma4_pair()
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    alone = target.generate(input_ids=ids, assistant_model=assistant, max_new_tokens=16, do_sample=False)
    batch, mask = prompts(3, seed=3, min_len=4, max_len=9, vocab=VOCAB)
    plain = target.generate(input_ids=batch, attention_mask=mask, max_new_tokens=16, do_sample=False)
    hf_specdec.enable(target)
    try:
        assert torch.equal(target.generate(input_ids=ids, assistant_model=assistant, max_new_tokens=16,
                                           do_sample=False), alone)
        out = target.generate(input_ids=batch, attention_mask=mask, assistant_model=assistant, max_new_tokens=16,
                              do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain) and out.spec_stats.steps
    finally:
        hf_specdec.disable(target)


def test_a_gemma4_target_with_an_ordinary_draft_model():
    """KV-sharing layers (Transformers' `DummyLayer`s in the cache) hold nothing to roll back."""
    target, _ = gemma4_pair()
    draft = noisy_copy(target, 0.3)
    ids, mask = prompts(3, seed=4, min_len=3, max_len=9, vocab=VOCAB)
    for cache in (None, "static"):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                      cache_implementation=cache)
        out = target.generate(custom_generate=hf_specdec.generate, assistant_models=[draft], spec_policy="fixed:4",
                              **kwargs)
        assert torch.equal(out, target.generate(**kwargs)), cache


def test_an_assistant_that_cannot_read_its_target_is_refused_before_any_work():
    """A Gemma 4 assistant reads its target's hidden states and K/V: a target of another width, or
    not a Gemma 4, is refused before any forward; so is an assistant inside a hierarchy (it reads
    the target's states, not an intermediate's)."""
    from hf_specdec.testing import build
    target, assistant = gemma4_pair()
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    narrow = Gemma4ForCausalLM(_text_config(hidden_size=16)).eval()
    other = build("llama", 2, seed=0, vocab=VOCAB, hidden=32)
    calls = []
    for model in (narrow, other, assistant):
        model.register_forward_hook(lambda *a: calls.append(1))
    for wrong, match in ((narrow, "hidden states of size 32, the target's are 16"), (other, "a Gemma 4 target's K/V")):
        with pytest.raises(ValueError, match=match):
            spec(wrong, [assistant], "fixed:2", input_ids=ids, max_new_tokens=3, do_sample=False)
    assert not calls
    for levels in ((assistant, target), (target, assistant)):
        with pytest.raises(ValueError, match="drafts from the target's own states"):
            hf_specdec.HierarchicalDrafter(*levels)
