"""Linear layers whose weights are stored narrower than their arithmetic.

A CPU decode step reads every weight once, so a narrower weight is a faster step; what a narrower
weight costs is the arithmetic of a forward of several rows (a verification of k + 1 tokens):

  Bf16wLinear  bfloat16 weights, float32 activations and products (our kernel, bf16w_linear.cpp, built
               on first use): half float32's bytes, float32's arithmetic on any CPU with AVX2, where
               torch's own bf16 product is emulated and costs about a token per row. Each row's result
               is bit-identical at any width: a verification computes what one-token steps would, and
               a prompt's positions what they compute beside drafts, other rows or other requests
               packed into one forward (continuous batching). Every forward, a prompt's too, runs the
               kernel (torch's float32 product sums in another order: a width rule between the two
               made a prompt's numbers depend on what was computed beside it). On a 2-core AVX2 EPYC
               a 150-row product costs about torch's float32 one (1536 -> 8960: 27 ms vs 32 ms).
               The model's numbers are its float32 ones with every linear weight rounded to bf16
               (exactly the weights of a GGUF loaded in bf16).
  Int4Linear   4-bit weights in groups of 32 (torch's CPU int4 kernel), activations rounded to bf16:
               a quarter of bf16's bytes at one row; for a draft model only (what it proposes is
               verified), since its numbers are not the model's.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

INT4_GROUP = 32        # Q4_K's sub-block: a GGUF's 4-bit weights keep their grouping
# seconds after which a build's lock is an interrupted build's (a build takes about 30 s): torch's
# extension loader waits on a lock for as long as it exists
STALE_LOCK_S = 600


def cannot_build() -> str | None:
    """Why the kernel cannot be built or run here (no AVX2 and FMA, no C++ compiler, no ninja), found
    without building it; None where it can be tried."""
    from torch.utils.cpp_extension import is_ninja_available

    from .kernels import cpu_flags
    flags = cpu_flags()
    if flags and not {"avx2", "fma"} <= set(flags):       # ([]: /proc/cpuinfo cannot tell; the kernel checks)
        return "this CPU has no AVX2 and FMA"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install one, or name it in CXX)"
    if not is_ninja_available():
        return "ninja is not on PATH (pip install ninja)"
    return None


@functools.cache
def _extension():
    """The compiled kernel (cached by torch in its extensions directory; about 30 s the first time).
    Raises where it cannot be built (`cannot_build`) or run: `kernels.unavailable` probes it. A lock
    older than STALE_LOCK_S (an interrupted build's) is removed first."""
    reason = cannot_build()
    if reason is not None:
        raise RuntimeError(f"the bf16-weight kernel cannot be built: {reason}")
    from torch.utils.cpp_extension import get_default_build_root, load
    directory = Path(get_default_build_root()) / f"hf_specdec_bf16w-torch{torch.__version__}"
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_lock(directory / "lock")
    logger.info("building the bf16-weight kernel (once per machine and torch version)")
    return load(name="hf_specdec_bf16w", sources=[str(Path(__file__).with_name("bf16w_linear.cpp"))],
                extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], build_directory=str(directory))


def remove_stale_lock(lock: Path, now: float | None = None) -> bool:
    """Remove `lock` if it is older than STALE_LOCK_S (now: the time, injectable); whether it did."""
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False
    logger.warning("removing %s, left %.0f s ago by an interrupted build of the bf16-weight kernel", lock, age)
    lock.unlink(missing_ok=True)
    return True


@torch.library.custom_op("hf_specdec::bf16w_linear", mutates_args=())
def bf16w_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32, packed [N, K] (`Bf16wLinear`) -> [M, N] float32. An op of its own, so that
    torch.compile calls the kernel as it is."""
    return _extension().linear(x, packed, bias)


@bf16w_linear.register_fake
def _(x, packed, bias):
    return x.new_empty((x.shape[0], packed.shape[0]))


class Bf16wLinear(torch.nn.Module):
    """`linear` (a float32 `nn.Linear`, in_features a multiple of 8) with its weight in bfloat16.
    x [..., in_features] float32 -> [..., out_features] float32."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = _extension().pack(linear.weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("packed_weight", packed)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        return bf16w_linear(rows, self.packed_weight, self.bias).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 weights"


class Int4Linear(torch.nn.Module):
    """`linear` (a float32 `nn.Linear`, in_features a multiple of INT4_GROUP, out_features of 16)
    with 4-bit weights:
    per group of 32 inputs, w = q * scale + low (q in 0..15, min-max). x [..., in_features] float32
    -> [..., out_features] float32, computed from x rounded to bf16 (the kernel's fast path)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            groups = linear.weight.detach().float().reshape(self.out_features, -1, INT4_GROUP)
            low, high = groups.amin(-1), groups.amax(-1)
            scale = ((high - low) / 15).clamp(min=1e-8)
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(self.out_features, -1), 1)
            # the kernel's convention: w = (q - 8) * scale + zero, [groups, out, 2]
            scale_zero = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("scale_zero", scale_zero)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed_weight, INT4_GROUP, self.scale_zero).float()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weights (groups of {INT4_GROUP})"


def _swap(model: torch.nn.Module, make, in_multiple: int, out_multiple: int = 1) -> int:
    """Swap the float32 CPU `nn.Linear`s of `model` whose sizes the kernel takes for `make(linear)`."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32 and child.in_features % in_multiple == 0 \
                    and child.out_features % out_multiple == 0:
                setattr(module, name, make(child))
                swapped += 1
    return swapped


def use_bf16w_linears(model: torch.nn.Module) -> int:
    """Swap every float32 CPU `nn.Linear` of `model` (in_features a multiple of 8) for a
    `Bf16wLinear`, in place; returns how many were swapped."""
    return _swap(model, Bf16wLinear, 8)


def use_int4_linears(model: torch.nn.Module) -> int:
    """Swap every float32 CPU `nn.Linear` of `model` (in_features a multiple of 32, out_features of
    16, as the kernel's packing needs) for an `Int4Linear`, in place; returns how many were swapped.
    For a draft model."""
    return _swap(model, Int4Linear, INT4_GROUP, 16)
