"""enable(model) never breaks a generate() call that Transformers alone runs: a call with
Transformers' own assisted arguments that our loop cannot run (sliding-window or stateful layers,
an encoder-decoder target, lossy ensemble verification, per-step scores, ...) goes to Transformers'
own assisted generation, untouched, with one warning naming why; the others run in our loop."""
import logging

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, MambaConfig, MambaForCausalLM, MistralConfig,
                          MistralForCausalLM)

import hf_specdec
from hf_specdec.testing import build, noisy_copy, prompts
from test_transformers_loop import tiny_t5

VOCAB = 96


def _mistral(seed=0):
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=6, pad_token_id=0)
    return MistralForCausalLM(config).eval()


def _gemma2(seed=0):
    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=6,
                          pad_token_id=0)
    return Gemma2ForCausalLM(config).eval()


def _llama(seed=0):
    return build("llama", 2, seed=seed, vocab=VOCAB)


def _transformers_alone(model, **kwargs):
    """What Transformers' own generate() returns (or raises) for this call."""
    try:
        return model.generate(**kwargs)
    except Exception as e:       # noqa: BLE001 - the promise covers errors too
        return e


@pytest.mark.parametrize("make,setting,reason", [
    (_mistral, {}, "sliding-window attention layers"),
    (_gemma2, {}, "sliding-window attention layers"),
    (_llama, {"assistant_ensemble_weight": 0.5}, "assistant_ensemble_weight=0.5"),
    (_llama, {"output_scores": True, "return_dict_in_generate": True}, "output_scores=True"),
    (tiny_t5, {}, "encoder-decoder target"),
])
def test_calls_our_loop_cannot_run_get_transformers_own_result(make, setting, reason, caplog):
    target, draft = make(), noisy_copy(make(), 0.05)
    ids = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    kwargs = dict(input_ids=ids, assistant_model=draft, max_new_tokens=16, do_sample=False, **setting)
    alone = _transformers_alone(target, **kwargs)
    hf_specdec.enable(target)
    with caplog.at_level(logging.WARNING, logger="hf_specdec.enable"):
        out = target.generate(**kwargs)
    hf_specdec.disable(target)
    sequences = out.sequences if setting.get("return_dict_in_generate") else out
    assert torch.equal(sequences, alone.sequences if setting.get("return_dict_in_generate") else alone)
    assert not hasattr(out, "spec_stats")                                       # Transformers' loop ran it
    warnings = [r.getMessage() for r in caplog.records if "Transformers' own assisted generation" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0]


def test_a_stateful_target_fails_as_it_does_without_enable():
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, pad_token_id=0)
    target, draft = MambaForCausalLM(config).eval(), MambaForCausalLM(config).eval()
    kwargs = dict(input_ids=torch.randint(2, VOCAB, (1, 6)), assistant_model=draft, max_new_tokens=4)
    alone = _transformers_alone(target, **kwargs)
    assert isinstance(alone, ValueError) and "stateful" in str(alone)
    hf_specdec.enable(target)
    with pytest.raises(ValueError, match="stateful"):
        target.generate(**kwargs)


def test_calls_our_loop_runs_stay_ours_and_batched():
    target = _llama()
    draft = noisy_copy(target, 0.3)
    ids, mask = prompts(3, seed=2, vocab=VOCAB)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hf_specdec.enable(target)
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=draft, max_new_tokens=12,
                          do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.spec_stats.steps
    with pytest.raises(ValueError, match="sliding-window"):      # our own argument: our loop's clear error
        target.generate(input_ids=ids, attention_mask=mask, assistant_models=[_mistral()], max_new_tokens=4)
