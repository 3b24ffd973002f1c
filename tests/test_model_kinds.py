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


def _gemma2_flash(seed=0):
    """As loaded with attn_implementation="flash_attention_2": its padded path takes no 4-D mask."""
    model = _gemma2(seed)
    model.config._attn_implementation = "flash_attention_2"
    return model


def _mamba(seed=0):
    torch.manual_seed(seed)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, pad_token_id=0)
    return MambaForCausalLM(config).eval()


def _llama(seed=0):
    return build("llama", 2, seed=seed, vocab=VOCAB)


def _transformers_alone(model, **kwargs):
    """What Transformers' own generate() returns (or raises) for this call."""
    try:
        return model.generate(**kwargs)
    except Exception as e:       # noqa: BLE001 - the promise covers errors too
        return e


@pytest.mark.parametrize("make,setting,reason", [
    (_llama, {"output_scores": True, "return_dict_in_generate": True}, "output_scores=True"),
    (tiny_t5, {}, "encoder-decoder target"),
    (_llama, {"attention_mask": torch.tensor([[1] * 7 + [0] * 2])}, "right padding"),   # as Transformers runs it
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


def test_ensemble_verification_runs_batched_with_transformers_own_result():
    """assistant_ensemble_weight (lossy): our loop, batched, with Transformers' draft lengths; each
    row of a padded batch is what Transformers' own loop returns for that row alone."""
    target = _llama()
    draft = noisy_copy(target, 0.6)
    ids, mask = prompts(3, seed=2, min_len=4, max_len=9, vocab=VOCAB)
    kwargs = dict(assistant_model=draft, assistant_ensemble_weight=0.3, max_new_tokens=16, do_sample=False)
    alone = [target.generate(input_ids=ids[r:r + 1, int((mask[r] == 0).sum()):], **kwargs)[0, -16:] for r in range(3)]
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)[:, -16:]
    hf_specdec.enable(target)
    out = target.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    assert out.spec_stats.ensemble_weight == 0.3                          # flagged lossy
    for r in range(3):
        assert torch.equal(out.sequences[r, -16:], alone[r]), r
    assert not torch.equal(out.sequences[:, -16:], plain)                 # (lossy indeed: the test has power)


def test_sliding_windows_need_attention_that_takes_a_4d_mask():
    from hf_specdec import assisted
    reason = assisted.transformers_only(_gemma2_flash(), {"assistant_model": _gemma2(1)})
    assert reason == "the target (Gemma2ForCausalLM) has sliding-window (attn_implementation='flash_attention_2') layers"
    assert assisted.transformers_only(_gemma2(), {"assistant_model": _gemma2(1)}) is None


def test_a_stateful_target_our_loop_cannot_run_gets_transformers_own_result():
    """A Mamba target (no rule of ours records its states): Transformers' own assisted generation
    decides, with enable() as without (5.24 refuses it as stateful; 5.25 rolls it back itself at batch 1)."""
    target, draft = _mamba(), _mamba(1)
    kwargs = dict(input_ids=torch.randint(2, VOCAB, (1, 6)), assistant_model=draft, max_new_tokens=4, do_sample=False)
    alone = _transformers_alone(target, **kwargs)
    hf_specdec.enable(target)
    ours = _transformers_alone(target, **kwargs)
    if isinstance(alone, Exception):
        assert isinstance(alone, ValueError) and "stateful" in str(alone)
        assert type(ours) is type(alone) and str(ours) == str(alone)
    else:
        assert torch.equal(ours, alone)


def test_calls_our_loop_runs_stay_ours_and_batched():
    target = _llama()
    draft = noisy_copy(target, 0.3)
    ids, mask = prompts(3, seed=2, vocab=VOCAB)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hf_specdec.enable(target)
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=draft, max_new_tokens=12,
                          do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.spec_stats.steps
    with pytest.raises(ValueError, match=r"assistant_models\[0\] \(MambaForCausalLM\) has stateful"):
        target.generate(input_ids=ids, attention_mask=mask, assistant_models=[_mamba()], max_new_tokens=4)


# every decoder-only causal LM type of the installed Transformers, shrunk
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, vocab_size=VOCAB, max_position_embeddings=256, sliding_window=6, attention_window=6,
             n_embd=32, n_layer=2, n_head=2, n_positions=256, n_inner=64, ffn_dim=64, num_layers=2, d_model=32,
             pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)


def _tiny_of_type(model_type: str, seed: int = 0):
    """A tiny random model of this registered causal-LM type, or None where shrinking its default
    config does not give one that builds (composite, encoder-decoder, over 3M parameters, ...)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    try:
        config = CONFIG_MAPPING[model_type]()
        if config.is_encoder_decoder or type(config.get_text_config()) is not type(config):
            return None
        for name, value in SMALL.items():
            if hasattr(config, name):
                setattr(config, name, value)
        if getattr(config, "layer_types", None) is not None:      # 2 layers, each kind the model has
            kinds = list(dict.fromkeys(config.layer_types))
            config.layer_types = (kinds * 2)[:2]
        with torch.device("meta"):
            if sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) > 3e6:
                return None
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.generate(torch.randint(3, VOCAB, (1, 7)), max_new_tokens=8, do_sample=False)   # the calls below
        return model
    except Exception:        # noqa: BLE001 - a type this shrinking does not fit
        return None


def _registry_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_every_registered_decoder_only_type_keeps_its_result_under_enable(caplog):
    """For each decoder-only type of the installed Transformers that builds tiny: enable() +
    assistant_model= at batch 1 returns what Transformers alone returns (its tokens, or its error),
    and where our loop runs the call, a padded batch of 3 is identical to plain generate()."""
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    batch, mask = prompts(3, seed=4, min_len=3, max_len=7, vocab=VOCAB)
    groups = {"ours": [], "transformers": [], "refused by both": [], "ours where Transformers fails": []}
    for model_type in _registry_types():
        target, draft = _tiny_of_type(model_type), _tiny_of_type(model_type, seed=1)
        if target is None or draft is None:
            continue
        kwargs = dict(input_ids=ids, assistant_model=draft, max_new_tokens=8, do_sample=False)
        alone = _transformers_alone(target, **kwargs)
        hf_specdec.enable(target)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_specdec.enable"):
            ours = _transformers_alone(target, **kwargs)
        handed = any("Transformers' own assisted generation" in r.getMessage() for r in caplog.records)
        plain = hf_specdec.disable(target).generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        hf_specdec.enable(target)
        if isinstance(alone, Exception) and isinstance(ours, Exception):     # (handed over: the same error)
            assert not handed or (type(ours) is type(alone) and str(ours) == str(alone)), model_type
            groups["refused by both"].append(model_type)
        elif isinstance(alone, Exception):        # Transformers' loop fails where ours runs: lossless
            assert not handed and torch.equal(ours, plain), (model_type, alone)
            groups["ours where Transformers fails"].append(model_type)
        else:
            assert isinstance(ours, torch.Tensor) and torch.equal(ours, alone), (model_type, ours)
            groups["transformers" if handed else "ours"].append(model_type)
        if not handed and not isinstance(ours, Exception):
            plain = hf_specdec.disable(target).generate(input_ids=batch, attention_mask=mask, max_new_tokens=8,
                                                        do_sample=False)
            hf_specdec.enable(target)
            out = target.generate(input_ids=batch, attention_mask=mask, assistant_model=draft, max_new_tokens=8,
                                  do_sample=False)
            assert torch.equal(out, plain), model_type
        hf_specdec.disable(target)
    logging.getLogger(__name__).info("model types: %s", groups)
    assert len(groups["ours"]) >= 20 and len(groups["transformers"]) >= 3, groups


def test_early_exit_drafting_is_transformers_own_untouched():
    """assistant_early_exit=n (the target's first n layers draft): no drafter of ours is named, so
    the call is Transformers' own, before and after enable()."""
    target = build("llama", 3, seed=0, vocab=VOCAB)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    kwargs = dict(input_ids=ids, assistant_early_exit=1, max_new_tokens=12, do_sample=False)
    alone = target.generate(**kwargs)
    hf_specdec.enable(target)
    assert torch.equal(target.generate(**kwargs), alone)
    assert torch.equal(alone, target.generate(input_ids=ids, max_new_tokens=12, do_sample=False))


def test_convolution_layers_run_in_our_loop():
    """LFM2's short-convolution layers keep a state per row in our loop (states.py): the call is
    ours, batched, and returns Transformers' own result (which crops them) at batch 1."""
    from transformers import Lfm2Config, Lfm2ForCausalLM
    def lfm2(seed):
        torch.manual_seed(seed)
        return Lfm2ForCausalLM(Lfm2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1,
                                          layer_types=["conv", "full_attention"], pad_token_id=0)).eval()
    target, draft = lfm2(0), lfm2(1)
    kwargs = dict(input_ids=torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1)),
                  assistant_model=draft, max_new_tokens=12, do_sample=False)
    alone = target.generate(**kwargs)
    hf_specdec.enable(target)
    try:
        out = target.generate(**kwargs, return_dict_in_generate=True)
        assert torch.equal(out.sequences, alone) and out.spec_stats.steps
    finally:
        hf_specdec.disable(target)
    from hf_specdec import assisted
    assert assisted.transformers_only(target, kwargs) is None


def _deepseek_v3_with_mtp(path):
    """A tiny DeepSeek-V3 checkpoint with its MTP layer: Transformers finds MTP weights by the real
    checkpoint's layer number (61), so 61 tiny layers, and a 62nd saved as the MTP layer."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    def config(layers):
        return DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                first_k_dense_replace=61, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=8, num_mtp_layers=1, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config(62)).save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    projection = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 0.1
    weights.update({"model.layers.61.eh_proj.weight": projection, "model.layers.61.enorm.weight": torch.ones(32),
                    "model.layers.61.hnorm.weight": torch.ones(32),
                    "model.layers.61.shared_head.norm.weight": torch.ones(32)})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config(61).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_multi_token_prediction_is_transformers_own_untouched(tmp_path):
    """use_mtp=True (the target's own MTP layer drafts, read from its checkpoint): no drafter of
    ours is named, so the call is Transformers' own, before and after enable()."""
    target = _deepseek_v3_with_mtp(tmp_path)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    kwargs = dict(input_ids=ids, use_mtp=True, max_new_tokens=10, do_sample=False)
    alone = target.generate(**kwargs)
    assert torch.equal(alone, target.generate(input_ids=ids, max_new_tokens=10, do_sample=False))
    hf_specdec.enable(target)
    try:
        assert torch.equal(target.generate(**kwargs), alone)
    finally:
        hf_specdec.disable(target)


def test_dflash_is_transformers_own_at_batch_1_and_a_clear_error_batched():
    """speculation_type="dflash" (a block drafter conditioned on the target's hidden states): at
    batch 1 Transformers' own result under enable(); batched, an error naming it before any work."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    target = build("llama", 3, seed=0, vocab=VOCAB)
    torch.manual_seed(1)
    assistant = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(
        vocab_size=VOCAB, hidden_size=target.config.hidden_size, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=64, block_size=4,
        mask_token_id=VOCAB - 1, target_layer_ids=[0, 2], bos_token_id=1, eos_token_id=None, pad_token_id=0)).eval()
    ids = torch.randint(3, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(5))
    kwargs = dict(assistant_model=assistant, speculation_type="dflash", max_new_tokens=12, do_sample=False)
    alone = target.generate(input_ids=ids, **kwargs)
    assert torch.equal(alone, target.generate(input_ids=ids, max_new_tokens=12, do_sample=False))
    hf_specdec.enable(target)
    try:
        assert torch.equal(target.generate(input_ids=ids, **kwargs), alone)
        with pytest.raises(ValueError, match=r"speculation_type='dflash': only Transformers' own .* 3 rows"):
            target.generate(input_ids=ids.repeat(3, 1), **kwargs)
    finally:
        hf_specdec.disable(target)
