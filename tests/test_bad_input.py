"""Bad input: a clear ValueError/TypeError before any forward pass, models left as they were."""
import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

import hf_specdec
from helpers import assert_same, spec
from hf_specdec.kept import kept_for
from hf_specdec.testing import build, prompts


@pytest.fixture()
def models():
    target, draft = build("llama", 2, seed=0), build("llama", 1, seed=1)
    calls = []
    for m in (target, draft):
        m.register_forward_hook(lambda *a: calls.append(1))
    return target, draft, calls


def check_error(models, exc, match, drafters=None, policy="fixed:4", enabled=False, **kwargs):
    """enabled: the call through enable()'s generate() (else as a custom_generate callable, which
    Transformers calls once it prepared the call's cache)."""
    target, draft, calls = models
    ids, mask = prompts(3, seed=0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(exc, match=match):
        call = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 5, **kwargs}
        if enabled:
            hf_specdec.enable(target)
            try:
                target.generate(assistant_models=[draft] if drafters is None else drafters, spec_policy=policy, **call)
            finally:
                hf_specdec.disable(target)
        else:
            spec(target, [draft] if drafters is None else drafters, policy, **call)
    assert not calls, "work started before the error"
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    # and the model still generates normally, speculative or not
    assert_same(spec(target, [draft], "fixed:2", input_ids=ids, attention_mask=mask, max_new_tokens=5),
                target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5))


def test_vocabulary_mismatch_names_both_sizes(models):
    check_error(models, ValueError, r"vocabulary size 80 .* target has 96", drafters=[build("llama", 1, vocab=80)])


def test_empty_assistant_models(models):
    check_error(models, ValueError, "assistant_models is empty", drafters=[])


def test_assistant_models_not_a_list(models):
    check_error(models, TypeError, "must be a list", drafters=models[1])


@pytest.mark.parametrize("element", ["gpt2", torch.nn.Linear(3, 3), 42])
def test_element_neither_model_nor_drafter(models, element):
    check_error(models, TypeError, r"assistant_models\[1\] must be one Transformers causal LM or hf_specdec Drafter",
                drafters=[models[1], element])


def test_encoder_decoder_drafter(models):
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    check_error(models, TypeError, "encoder-decoder", drafters=[t5])


@pytest.mark.parametrize("policy,exc,match", [
    ("fast", ValueError, "unknown spec_policy 'fast'"),
    ("fixed:x", ValueError, "expected an integer"),
    ("fixed:\u00b2", ValueError, "expected an integer"),             # a superscript 2: isdigit(), not int()
    (3.5, TypeError, "spec_policy must be"),
])
def test_bad_policy(models, policy, exc, match):
    check_error(models, exc, match, policy=policy)


def test_bad_policy_objects():
    with pytest.raises(ValueError, match="k must be an integer >= 0"):
        hf_specdec.FixedLength(-1)
    with pytest.raises(TypeError, match="length must be a LengthPolicy"):
        hf_specdec.SpecPolicy(length=4)


def test_beam_search_refused(models):
    check_error(models, ValueError, "beam search", num_beams=2)


def test_unsupported_outputs_refused(models):
    check_error(models, ValueError, "output_scores", output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("setting", [dict(speculation_type="dflash"), dict(use_mtp=True), dict(assistant_early_exit=1)])
def test_transformers_own_drafting_kinds_are_not_dropped(models, setting):
    check_error(models, ValueError, f"{next(iter(setting))}=.* is Transformers' own drafting", **setting)


def test_drafter_index_out_of_range(models):
    check_error(models, ValueError, r"FixedDrafter\(3\)",
                policy=hf_specdec.SpecPolicy(selector=hf_specdec.FixedDrafter(3)))


def test_padding_without_attention_mask(models):
    target, draft, calls = models
    hf_specdec.enable(target)
    ids, _ = prompts(3, seed=0)
    with pytest.raises(ValueError, match="no attention_mask"):
        target.generate(input_ids=ids, max_new_tokens=5, assistant_models=[draft])
    assert not calls


def test_encoder_decoder_target():
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                             d_kv=8, decoder_start_token_id=0))
    hf_specdec.enable(t5)
    with pytest.raises(ValueError, match="decoder-only targets.*loop=.transformers."):
        t5.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=3, assistant_models=[t5])


def test_stateful_processors_refused(models):
    check_error(models, ValueError, "UnbatchedClassifierFreeGuidanceLogitsProcessor", guidance_scale=1.5)


def test_extra_model_inputs_refused():
    """GPT-2 accepts token_type_ids, so generate() passes them on; they must not be dropped silently."""
    target = build("gpt2", 2, seed=0)
    ids, mask = prompts(3, seed=0)
    with pytest.raises(ValueError, match=r"\['token_type_ids'\] are not supported"):
        spec(target, [target], input_ids=ids, attention_mask=mask, max_new_tokens=5,
             token_type_ids=torch.zeros_like(ids))


def test_int8_self_draft_of_a_model_without_linear_layers():
    with pytest.raises(ValueError, match="kind='int8'.*nn.Linear"):
        hf_specdec.self_draft(torch.nn.Sequential(torch.nn.Embedding(8, 4)), "int8")
    with pytest.raises(ValueError, match="kind must be one of"):
        hf_specdec.self_draft(build("llama", 1, seed=0), "int4")


def _stateful_model():
    from transformers import MambaConfig, MambaForCausalLM
    from hf_specdec.testing import VOCAB
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=1)
    return MambaForCausalLM(config).eval()


@pytest.mark.parametrize("setting,match", [
    # (through enable(): an offloaded cache that Transformers prepared would open a CUDA stream first)
    (dict(cache_implementation="offloaded", enabled=True), "cache_implementation='offloaded'"),
    (dict(cache_implementation="static", cache_config={"max_cache_len": 64}), "cache_config="),
    (dict(assistant="stateful"), r"assistant_models\[0\] \(MambaForCausalLM\) has stateful"),
    (dict(cache_implementation="static", assistant="stateful"), r"assistant_models\[0\] \(MambaForCausalLM\) has stateful"),
])
def test_cache_settings_the_static_path_cannot_honour(models, setting, match):
    setting = dict(setting)
    drafters = [_stateful_model()] if setting.pop("assistant", None) else None
    check_error(models, ValueError, match, drafters=drafters, **setting)


def test_right_padding_refused(models):
    """Plain generate() reads right-padded rows as they are; our loop would not: refused, naming the fix."""
    ids, mask = prompts(3, seed=0)
    check_error(models, ValueError, "right padding.*padding_side='left'", input_ids=ids, attention_mask=mask.flip(1))


def test_attention_mask_of_another_shape_refused(models):
    ids, mask = prompts(3, seed=0)
    check_error(models, ValueError, "attention_mask must be a tensor of input_ids' shape", attention_mask=mask[:2])


# more bad inputs, each refused before any forward with models (and kept caches) as they were
_ids, _mask = prompts(3, seed=0)
_empty_row = _mask.clone()
_empty_row[0] = 0
FUZZ = {
    "fixed:-1": (ValueError, "expected an integer", dict(policy="fixed:-1")),
    "nightjar:0": (ValueError, r"Nightjar\(max_len\) must be >= 1", dict(policy="nightjar:0")),
    "measured:0": (ValueError, r"MeasuredGoodput\(max_len\) must be >= 1", dict(policy="measured:0")),
    "empty policy name": (ValueError, "unknown spec_policy ''", dict(policy="")),
    "policy as a list": (TypeError, "spec_policy must be", dict(policy=["fixed"])),
    "spec_generator a str": (TypeError, "spec_generator must be a torch.Generator", dict(spec_generator="seed")),
    "draft_offload a str": (TypeError, "draft_offload must be", dict(draft_offload="yes")),
    "float input_ids": (TypeError, "input_ids must hold integer token ids", dict(input_ids=_ids.float())),
    "ids past the vocabulary": (ValueError, r"token ids in \[0, 96\)", dict(input_ids=_ids + 1000)),
    "negative ids": (ValueError, r"token ids in \[0, 96\)", dict(input_ids=_ids - 1000)),
    "a row without tokens": (ValueError, r"rows \[0\] have no real token", dict(attention_mask=_empty_row)),
    "max_new_tokens=0": (ValueError, "max_new_tokens", dict(max_new_tokens=0)),
    "streamer without put": (TypeError, r"streamer must have put\(\) and end\(\)", dict(spec_streamer=object())),
    "None as a drafter": (TypeError, r"assistant_models\[0\] must be one Transformers causal LM",
                          dict(drafters=[None])),
    "a draft on the meta device": (ValueError, "meta device", dict(drafters="meta")),
    "temperature 0 with sampling": (ValueError, "temperature", dict(do_sample=True, temperature=0.0)),
    "compile_config a str": (ValueError, "compile_config", dict(cache_implementation="static", compile_config="yes")),
}


@pytest.mark.parametrize("name", FUZZ)
def test_fuzz_table_of_bad_calls(models, name):
    exc, match, kwargs = FUZZ[name]
    kwargs = dict(kwargs)
    if kwargs.get("drafters") == "meta":
        kwargs["drafters"] = [build("llama", 1, seed=1).to("meta")]
    target = models[0]
    spec(target, [models[1]], "fixed:2", input_ids=_ids, attention_mask=_mask, max_new_tokens=3,
         cache_implementation="static")                      # a kept static cache, to see it unchanged
    models[2].clear()
    kept = dict(kept_for(target).storages.table)
    check_error(models, exc, match, **kwargs)
    assert dict(kept_for(target).storages.table) == kept


@pytest.mark.parametrize("make,exc,match", [
    (lambda d: hf_specdec.ModelDrafter("gpt2"), TypeError, r"ModelDrafter\(model\) takes one Transformers causal LM"),
    (lambda d: hf_specdec.PromptLookupDrafter(max_ngram=0), ValueError, "1 <= min_ngram <= max_ngram"),
    (lambda d: hf_specdec.PromptLookupDrafter(max_ngram=2, min_ngram=3), ValueError, "1 <= min_ngram <= max_ngram"),
    (lambda d: hf_specdec.HierarchicalDrafter(d, d, draft_len=0), ValueError, r"HierarchicalDrafter\(draft_len\)"),
    (lambda d: hf_specdec.HierarchicalDrafter(d, d, cycles=-1), ValueError, r"HierarchicalDrafter\(cycles\)"),
    (lambda d: hf_specdec.chain([d]), ValueError, "at least 2 models"),
    (lambda d: hf_specdec.enable([d]), TypeError, "enable each model of a list in turn"),
    (lambda d: hf_specdec.enable(d, loop="fast"), ValueError, "loop must be one of"),
    (lambda d: hf_specdec.self_draft(d, "int4"), ValueError, "kind must be one of"),
])
def test_bad_drafters_and_enable_arguments(models, make, exc, match):
    draft = models[1]
    with pytest.raises(exc, match=match):
        make(draft)
    assert not hasattr(draft, "_hf_specdec_originals")


def _word_tokenizer(directory, words: list[str]):
    """A real fast tokenizer over `words` (ids in order), saved to `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=inner, unk_token=words[0]).save_pretrained(directory)
    return str(directory)


def test_a_draft_with_another_tokenizer_of_the_same_size_gets_a_warning(tmp_path):
    """Equal vocabulary sizes, other token tables (as Llama 2 and Mistral): the call runs, exact (every
    draft is verified), with a TokenizerMismatchWarning naming the drafter; the same table (another
    directory) and models without a tokenizer get none."""
    import warnings
    target, draft = build("llama", 2, seed=0), build("llama", 1, seed=1)
    words = [f"w{i}" for i in range(target.config.vocab_size)]
    target.config.name_or_path = _word_tokenizer(tmp_path / "target", words)
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = target.generate(ids, max_new_tokens=6, do_sample=False, custom_generate=hf_specdec.generate,
                                  assistant_models=[draft], spec_policy="fixed:3")
        assert torch.equal(out, plain)
        return [w for w in caught if issubclass(w.category, hf_specdec.TokenizerMismatchWarning)]
    assert not run()                                              # the draft names no tokenizer
    draft.config.name_or_path = _word_tokenizer(tmp_path / "same", words)
    assert not run()
    draft.config.name_or_path = _word_tokenizer(tmp_path / "other", words[:10] + words[10:][::-1])
    caught = run()
    assert len(caught) == 1 and "assistant_models[0]" in str(caught[0].message) and \
        f"{target.config.vocab_size - 10} token ids" in str(caught[0].message)
