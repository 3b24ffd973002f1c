"""Linear layers on oneDNN with their weights packed once: a verification at about one token's cost.

A forward of a few rows per sequence (a verification of k drafts feeds k + 1) reads every weight
once, as a one-token forward does; on a CPU it should cost about the same. Through `nn.Linear` it
does not: ATen hands oneDNN (or MKL) a plain row-major weight, which the library reorders into its
blocked layout again at every call with more than one row, reading and writing the whole weight
(docs/results/cpu_matmul/avx512-bf16.md: the 1.5B's up-projection, 6 rows against one, bf16
1.03x through `nn.Linear` and 0.80x packed; float32 2.06x (MKL), 1.31x (oneDNN, unpacked) and 0.86x
packed). `PackedLinear` keeps the weight in that layout, reordered once at load.
"""
from __future__ import annotations

import torch

# the rows a packed layout is chosen for: any number of rows runs on it, but a layout for one row
# is oneDNN's matrix-vector one, 1.4-1.7x dearer at 6 rows; layouts for 6 and 16 rows timed alike
PACKED_ROWS = 8


def reorder_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout for `rows`-row products. Raises a RuntimeError
    where oneDNN cannot (bf16 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT): `kernels.unavailable`
    probes it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


@torch.library.custom_op("hf_specdec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """x [..., in] -> [..., out_features]: oneDNN's product with a packed weight. An op of its own,
    so that torch.compile calls it as it is (inductor cannot lower a packed tensor itself)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(torch.nn.Module):
    """`linear` (an `nn.Linear` on the CPU, float32 or bfloat16) with its weight in oneDNN's layout
    for `PACKED_ROWS`-row products. x [..., in_features] -> [..., out_features], in x's dtype (the
    weight's). Outputs agree with `nn.Linear`'s to the dtype's rounding (another summation order)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = reorder_weight(linear.weight.detach(), PACKED_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def __deepcopy__(self, memo):
        """A copy packed anew (a packed tensor has no storage to copy)."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                                 device="meta")
        linear.weight = torch.nn.Parameter(self.packed_weight.to_dense(), requires_grad=False)
        if self.bias is not None:
            linear.bias = torch.nn.Parameter(self.bias.clone(), requires_grad=False)
        return PackedLinear(linear)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {PACKED_ROWS} rows"


def use_packed_linears(model: torch.nn.Module) -> int:
    """Swap every float32 or bfloat16 `nn.Linear` of `model` on the CPU for a `PackedLinear`, in
    place; returns how many were swapped. The swapped layers are not `nn.Linear`s any more: make
    copies of the model (e.g. `self_draft(model, "int8")`) first."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child.weight.device.type == "cpu" \
                    and child.weight.dtype in (torch.float32, torch.bfloat16):
                setattr(module, name, PackedLinear(child))
                swapped += 1
    return swapped
