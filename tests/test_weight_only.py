"""Linear layers with narrow weights (hf_specdec.weight_only): the bf16-weight kernel computes each
row alone, bit for bit, at any width; a target on it speculates losslessly; int4 computes from its
own dequantised weights; a kernel that cannot be built is probed out with its reason."""
import copy

import pytest
import torch

from hf_specdec import kernels, weight_only
from helpers import greedy_against_plain
from hf_specdec.testing import build, noisy_copy, prompts

pytestmark = pytest.mark.skipif(kernels.unavailable("bf16w") is not None,
                                reason=f"bf16w cannot run here: {kernels.unavailable('bf16w')}")


@pytest.mark.parametrize("in_features, out_features", [(96, 71), (96, 64), (1536, 200)])
def test_bf16w_computes_each_row_alone_bit_for_bit_at_any_width(in_features, out_features):
    """Every width at once (a decode step, verifications of k + 1 at batches 1 and 2, prompts of 62
    and 70 tokens, one with 5 drafts, two requests packed into one row as continuous batching packs
    them): every row equals that row computed alone, exactly, and float32 products of the
    bf16-rounded weights to float32 rounding. An odd last weight row, pairs only, and (1536 inputs)
    rows over several of a wide forward's tiles and weights over several groups."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features)
    layer = weight_only.Bf16wLinear(linear)
    x = torch.randn(132, in_features)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    for rows in (1, 2, 5, 6, 7, 12, 13, 62, 67, 70, 132):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert torch.equal(layer(x.view(1, 132, in_features))[0], alone)        # [batch, width, in] as a model feeds it
    assert torch.equal(layer(x[:124].view(2, 62, in_features)).flatten(0, 1), alone[:124])
    reference = torch.nn.functional.linear(x, linear.weight.to(torch.bfloat16).float(), linear.bias)
    torch.testing.assert_close(alone, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(copy.deepcopy(layer)(x), layer(x))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("prompt_len", [9, 62, 70])
def test_a_target_on_bf16w_speculates_losslessly(batch, prompt_len):
    """Greedy, float32 activations: speculative output equals plain generate() on the same kernel,
    row by row, at k = 1, 3, 6; with short prompts and prompts of 62 and 70 tokens (a first step
    verifies the prompt and its drafts in one forward, wider than the prompt's own)."""
    target = build("qwen2", layers=2, seed=0)
    draft = noisy_copy(target, 0.03)
    assert weight_only.use_bf16w_linears(target) == 2 * 7 + 1         # every layer's 7 and the head
    target.generation_config.eos_token_id = None       # every call makes all its tokens
    ids, mask = prompts(batch, seed=batch, min_len=prompt_len if batch == 1 else max(3, prompt_len - 8), max_len=prompt_len)
    for out in greedy_against_plain(target, draft, ids, mask, max_new_tokens=16).values():
        assert out.spec_stats.acceptance_rate > 0.15       # (drafts accepted: verification is exercised)


def test_a_target_on_bf16w_in_continuous_batching_gives_each_request_its_own_output():
    """generate_batch with two requests of 62 and 70 tokens packed into the same forwards, drafted
    by a noisy copy: each request's tokens are plain generate()'s of that request alone."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    import hf_specdec
    target = build("qwen2", layers=2, seed=0)
    draft = noisy_copy(target, 0.03)
    weight_only.use_bf16w_linears(target)
    requests = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (62, 70)]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)
    alone = [target.generate(input_ids=torch.tensor([r]), generation_config=config)[0, len(r):].tolist()
             for r in requests]
    hf_specdec.enable(target)
    try:
        out = target.generate_batch(requests, config, ContinuousBatchingConfig(page_size=16, num_blocks=64,
                                                                               max_batch_tokens=256),
                                    assistant_model=draft, num_assistant_tokens=4,
                                    num_assistant_tokens_schedule="constant")
    finally:
        hf_specdec.disable(target)
    assert [out[f"req_{i}"].generated_tokens for i in range(2)] == alone


def test_int4_computes_from_its_dequantised_weights():
    """w = q * scale + low per group of 32 (q in 0..15), on x rounded to bf16."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    layer = weight_only.Int4Linear(linear)
    groups = linear.weight.detach().reshape(32, 2, 32)
    low, scale = groups.amin(-1, keepdim=True), (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    dequantised = (torch.round((groups - low) / scale) * scale + low).reshape(32, 64)
    x = torch.randn(3, 64)
    reference = torch.nn.functional.linear(x.to(torch.bfloat16).float(), dequantised, linear.bias)
    torch.testing.assert_close(layer(x), reference, rtol=0.02, atol=0.02)     # bf16 scales and output
    assert (layer(x) - linear(x)).abs().max() > 1e-3                          # not the float32 layer
    # a layer the kernel's packing cannot take (out_features % 16) stays as it was
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 24))
    assert weight_only.use_int4_linears(model) == 1 and type(model[1]) is torch.nn.Linear


def test_a_kernel_that_cannot_be_built_is_probed_out_with_its_reason(monkeypatch):
    """No C++ compiler (injected): the probe names the error, the choice goes on without bf16w, and
    asking for it is a ValueError that says why."""
    from hf_specdec import embedded

    def no_compiler():
        raise RuntimeError("Error building extension 'hf_specdec_bf16w': c++: command not found")
    kernels.unavailable.cache_clear()
    monkeypatch.setattr(weight_only, "_extension", no_compiler)
    try:
        assert "command not found" in kernels.unavailable("bf16w")
        assert "bf16w" in kernels.unrunnable() and kernels.unavailable("onednn") is None
        with pytest.raises(ValueError, match="bf16w=True .bf16w. cannot run on this CPU.*command not found"):
            embedded.load_model("smollm2-135m-instruct", bf16w=True, source="pypi")
    finally:
        kernels.unavailable.cache_clear()         # the verdicts under the injection are not this machine's


