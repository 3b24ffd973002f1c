"""Linear layers with narrow weights (hf_specdec.weight_only): the bf16-weight kernel computes each
row alone, bit for bit, at any width; a target on it speculates losslessly; int4 computes from its
own dequantised weights; a kernel that cannot be built is probed out with its reason."""
import copy
import os
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

from hf_specdec import kernels, weight_only
from helpers import greedy_against_plain
from hf_specdec.testing import build, noisy_copy, prompts

# each test that runs the kernel (the injected refusals run on any machine)
needs_bf16w = pytest.mark.skipif(kernels.unavailable("bf16w") is not None,
                                 reason=f"bf16w cannot run here: {kernels.unavailable('bf16w')}")


@needs_bf16w
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


@needs_bf16w
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


@needs_bf16w
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


@pytest.mark.skipif(kernels.unavailable("int4") is not None,
                    reason=f"int4 cannot run here: {kernels.unavailable('int4')}")
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


@pytest.mark.parametrize("missing", ["compiler", "ninja", "build"])
def test_a_kernel_that_cannot_be_built_is_probed_out_with_its_reason(monkeypatch, tmp_path, missing):
    """No C++ compiler on PATH, no ninja (both found before any build), or a build that fails (all
    injected): the probe names the reason, the choice goes on without bf16w, and asking for it is a
    ValueError that says why."""
    from torch.utils import cpp_extension

    from hf_specdec import embedded
    if missing == "compiler":
        monkeypatch.setenv("PATH", str(tmp_path))          # nothing on it
        monkeypatch.delenv("CXX", raising=False)
        reason = "no C++ compiler: 'c++' is not on PATH"
    elif missing == "ninja":
        monkeypatch.setenv("CXX", sys.executable)           # a compiler on PATH, as far as the check sees
        monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
        reason = "ninja is not on PATH"
    else:
        def failing_build(**kwargs):
            raise RuntimeError("Error building extension 'hf_specdec_bf16w': c++: command not found")
        monkeypatch.setattr(weight_only, "cannot_build", lambda: None)
        monkeypatch.setattr(cpp_extension, "load", failing_build)
        reason = "command not found"
    kernels.unavailable.cache_clear()
    weight_only._extension.cache_clear()
    try:
        assert reason in (kernels.unavailable("bf16w") or "")
        assert "bf16w" in kernels.unrunnable()
        with pytest.raises(ValueError, match="bf16w=True .bf16w. cannot run on this CPU.*" + re.escape(reason)):
            embedded.load_model("smollm2-135m-instruct", bf16w=True, source="pypi")
    finally:
        kernels.unavailable.cache_clear()         # the verdicts under the injection are not this machine's
        weight_only._extension.cache_clear()


def test_an_interrupted_build_s_lock_is_removed_and_a_live_one_kept(tmp_path, caplog):
    """torch's extension loader waits on its build lock for as long as the file exists: one older
    than STALE_LOCK_S (an interrupted build's) is removed, with a warning; a fresh one is kept."""
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (1000.0, 1000.0))
    assert not weight_only.remove_stale_lock(lock, now=1000.0 + weight_only.STALE_LOCK_S)
    assert lock.exists()
    assert weight_only.remove_stale_lock(lock, now=1001.0 + weight_only.STALE_LOCK_S)
    assert not lock.exists() and "interrupted build" in caplog.text
    assert not weight_only.remove_stale_lock(lock)


@needs_bf16w
def test_the_kernel_loads_past_a_stale_lock_in_its_build_directory():
    """A lock left in the real build directory by an interrupted build: the kernel still loads (in
    a thread, so that a wait forever fails the test instead of hanging the suite)."""
    from torch.utils.cpp_extension import get_default_build_root
    lock = Path(get_default_build_root()) / f"hf_specdec_bf16w-torch{torch.__version__}" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    old = lock.stat().st_mtime - 2 * weight_only.STALE_LOCK_S
    os.utime(lock, (old, old))
    weight_only._extension.cache_clear()
    loaded = []
    thread = threading.Thread(target=lambda: loaded.append(weight_only._extension()), daemon=True)
    thread.start()
    thread.join(timeout=600)
    try:
        assert loaded and hasattr(loaded[0], "linear"), "the kernel's load waited on the stale lock"
    finally:
        lock.unlink(missing_ok=True)        # (lets a waiting thread go on)
