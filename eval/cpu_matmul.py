"""What a verification costs on this CPU, at the level of one matrix product.

    python eval/cpu_matmul.py --out docs/results/cpu_matmul/<name>

Speculative decoding pays when a forward over k + 1 tokens per row costs little more than one over
a single token: the weights are read once either way, so on a memory-bound device the extra rows
are almost free. Whether they are on a CPU depends on its matrix kernels. This times
`linear(x [m, 1536], w [8960, 1536])`, the 1.5B's MLP up-projection (or --shape IN,OUT: 384,384 is
the projection of the compiled benchmarks' cheap pair), for m = 1 (a decode step), the m of a
verification (3-9) and prefill-sized m, on --threads torch threads (all cores by default), per
kernel: torch's own in float32 and bfloat16 (MKL or oneDNN, or torch's own for bf16 without bf16
matrix instructions), float32 through oneDNN (`hf_specdec.kernels.use_onednn_linears`), oneDNN
with the weight packed once in float32 and bfloat16 (`hf_specdec.packed_linear`), and weights
narrower than their arithmetic: bf16 weights in float32 FMAs (`hf_specdec.weight_only`, our
kernel), torch's int8-weight product, the int8 dynamic kernel drafts use, and int4 weights. A model's layers each read their own weights from memory,
so each time is one call's share of a pass over `COPIES` copies of the weight (more than a
last-level cache holds); the kernels and widths are timed in rounds, interleaved, the median kept.
A kernel that cannot run on this CPU (`hf_specdec.kernels.unavailable`: oneDNN's bf16 packing needs
AVX-512 BW/VL/DQ) is left out and named with its reason. Reports milliseconds, GFLOPS and the cost
relative to m = 1. Writes <out>.json, <out>.md, <out>.png, stamped.
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import arguments, ints  # eval/ is on sys.path when run as a script
from report import figure, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_specdec.kernels import unavailable, use_int8_linears, use_onednn_linears  # noqa: E402
from hf_specdec.packed_linear import use_packed_linears  # noqa: E402
from hf_specdec.weight_only import use_bf16w_linears, use_int4_linears  # noqa: E402

ROWS = (1, 2, 3, 5, 6, 8, 16, 64, 256)
SHAPE = (1536, 8960)    # (in, out) features
COPIES = 8          # 8 x 27.5 MB in bf16 (55 MB in float32): beyond the 32 MB L3 of the CPUs here


def time_pass(layers: list, x: torch.Tensor) -> float:
    """Seconds of one call, over a pass through `layers` (each its own weight) with input `x`."""
    start = time.perf_counter()
    for layer in layers:
        layer(x)
    return (time.perf_counter() - start) / len(layers)


# each timed kernel -> hf_specdec.kernels' name for it (whose probe says whether it runs here)
PROBED = {"float32, oneDNN": "onednn", "float32, oneDNN packed": "fp32-packed", "bfloat16": "bf16",
          "bfloat16, oneDNN packed": "bf16-packed", "bf16 weights, float32 FMAs (bf16w)": "bf16w",
          "int8 dynamic (draft)": "int8", "int4 weights, bf16 activations (int4)": "int4"}


class Int8Weights(torch.nn.Module):
    """torch's `_weight_int8pack_mm` (int8 weights, a scale per output): a library candidate for
    weights narrower than float32, timed with bf16 activations (with float32 ones it has no fast path)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        scale = linear.weight.detach().abs().amax(1) / 127
        self.weight = torch.round(linear.weight.detach() / scale[:, None]).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)

    def forward(self, x):
        return torch._weight_int8pack_mm(x, self.weight, self.scale)


def kernels(in_features: int, out_features: int) -> tuple[list[tuple[str, list, torch.dtype]], dict]:
    """([(kernel name, COPIES copies of the layer running on it, its input dtype)],
    {kernel name: why it cannot run here})."""
    generator = torch.Generator().manual_seed(0)
    linears = []
    for _ in range(COPIES):
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        torch.nn.init.normal_(linear.weight, std=0.02, generator=generator)
        linears.append(linear)

    def swapped(dtype, swap):
        out = []
        for linear in linears:
            layer = torch.nn.Sequential(copy.deepcopy(linear).to(dtype))
            swap(layer)
            out.append(layer)
        return out
    skipped = {name: unavailable(probed) for name, probed in PROBED.items() if unavailable(probed)}
    built = [("float32", lambda: linears, torch.float32),
             ("float32, oneDNN", lambda: swapped(torch.float32, use_onednn_linears), torch.float32),
             ("float32, oneDNN packed", lambda: swapped(torch.float32, use_packed_linears), torch.float32),
             ("bfloat16", lambda: [copy.deepcopy(linear).to(torch.bfloat16) for linear in linears], torch.bfloat16),
             ("bfloat16, oneDNN packed", lambda: swapped(torch.bfloat16, use_packed_linears), torch.bfloat16),
             ("bf16 weights, float32 FMAs (bf16w)", lambda: swapped(torch.float32, use_bf16w_linears), torch.float32),
             ("int8 weights, bf16 activations (torch _weight_int8pack_mm)",
              lambda: [Int8Weights(linear) for linear in linears], torch.bfloat16),
             ("int8 dynamic (draft)", lambda: swapped(torch.float32, lambda m: use_int8_linears(m, "dynamic")),
              torch.float32),
             ("int4 weights, bf16 activations (int4)", lambda: swapped(torch.float32, use_int4_linears), torch.float32)]
    return [(name, build(), dtype) for name, build, dtype in built if name not in skipped], skipped


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--out", default="docs/results/cpu_matmul/this-cpu")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (each kernel and width once a round)")
    parser.add_argument("--shape", type=ints, default=list(SHAPE), help="IN,OUT: the layer's features")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    args = parser.parse_args(argv)
    if len(args.shape) != 2:
        parser.error(f"--shape takes IN,OUT, got {args.shape}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)         # (stamped with the page)
    try:
        with torch.no_grad():
            print(measure(args).read_text())
    finally:
        torch.set_num_threads(threads)          # (a caller's, as a test's, goes on with its own)


def measure(args) -> Path:
    """Times the kernels at every width and writes the page; returns its markdown's path."""
    in_features, out_features = args.shape
    timed, skipped = kernels(in_features, out_features)
    inputs = {(m, dtype): torch.randn(m, in_features, generator=torch.Generator().manual_seed(m)).to(dtype)
              for m in ROWS for dtype in (torch.float32, torch.bfloat16)}
    seconds = {(name, m): [] for name, _, _ in timed for m in ROWS}
    for _ in range(args.rounds + 1):                 # the first round warms every kernel and width up
        for name, layers, dtype in timed:
            for m in ROWS:
                seconds[name, m].append(time_pass(layers, inputs[m, dtype]))
    rows_out = []
    for name, _, _ in timed:
        one = statistics.median(seconds[name, 1][1:])
        for m in ROWS:
            t = statistics.median(seconds[name, m][1:])
            rows_out.append({"kernel": name, "rows": m, "ms": round(t * 1e3, 3),
                             "gflops": round(2 * m * in_features * out_features / t / 1e9, 1),
                             "x_one_row": round(t / one, 2)})
    lines = [f"# linear([m, {in_features}] x [{out_features}, {in_features}]): the cost of m rows against one", "",
             f"Each time: one call's share of a pass over {COPIES} copies of the weight (read from memory, as a "
             f"model's layers are), median of {args.rounds} rounds, kernels and widths interleaved; "
             f"{args.threads} torch threads.", "",
             "| kernel | m | ms | GFLOPS | x m=1 |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['rows']} | {r['ms']:.2f} | {r['gflops']:.1f} | {r['x_one_row']:.2f} |" for r in rows_out]
    lines += ["", "A verification of k drafts feeds m = k + 1 rows per sequence: where x m=1 grows like m, "
              "verifying costs as much as decoding the tokens one by one and speculation cannot pay."]
    lines += [f"Not run on this CPU: {name} ({why})." for name, why in skipped.items()]

    def plot(path: Path):
        with figure(path) as ((ax,),):
            for kernel in dict.fromkeys(r["kernel"] for r in rows_out):
                pts = [r for r in rows_out if r["kernel"] == kernel]
                ax.plot([r["rows"] for r in pts], [r["x_one_row"] for r in pts], marker="o", label=kernel)
            ax.plot(ROWS, ROWS, ls=":", color="gray", label="m x (no reuse of the weights)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("rows m")
            ax.set_ylabel("time / time of one row")
            ax.legend()
    out = Path(args.out)
    payload = {"args": vars(args), "rows": rows_out, "skipped": skipped}
    return write_results(out.parent, out.name, payload, "\n".join(lines) + "\n", plot)


if __name__ == "__main__":
    main()
