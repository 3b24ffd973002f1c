"""What a verification costs on this CPU, at the level of one matrix product.

    python eval/cpu_matmul.py --out docs/results/cpu_matmul/<name>

Speculative decoding pays when a forward over k + 1 tokens per row costs little more than one over
a single token: the weights are read once either way, so on a memory-bound device the extra rows
are almost free. Whether they are on a CPU depends on its matrix kernels. This times
`linear(x [m, 1536], w [8960, 1536])`, the 1.5B's MLP up-projection, for m = 1 (a decode step), the
m of a verification (3-9) and prefill-sized m, in float32 and bfloat16 (torch's default kernels:
MKL, or torch's own for bf16 without bf16 matrix instructions) and in float32 through oneDNN
(`hf_specdec.embedded.use_onednn_linears`), and reports milliseconds, GFLOPS and the cost relative
to m = 1. Writes <out>.json, <out>.md, <out>.png, stamped.
"""
from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

from harness import arguments  # eval/ is on sys.path when run as a script
from report import figure, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_specdec.embedded import use_onednn_linears  # noqa: E402

ROWS = (1, 2, 3, 5, 8, 16, 64, 256)
IN_FEATURES, OUT_FEATURES = 1536, 8960


def time_layer(layer: torch.nn.Module, dtype: torch.dtype, rows: int, seconds: float = 0.5) -> float:
    """Median seconds of one `layer` call over `rows` rows of `dtype`, repeated for about `seconds`."""
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(1)).to(dtype)
    layer(x)                                                    # warm-up
    times = []
    while sum(times) < seconds or len(times) < 3:
        start = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def layers():
    """(kernel name, the up-projection as a layer running on it, its input dtype), one weight for all."""
    linear = torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(0))
    onednn = torch.nn.Sequential(copy.deepcopy(linear))
    use_onednn_linears(onednn)
    return [("float32", linear, torch.float32), ("float32, oneDNN", onednn, torch.float32),
            ("bfloat16", copy.deepcopy(linear).to(torch.bfloat16), torch.bfloat16)]


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--out", default="results/cpu_matmul/this-cpu")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    rows_out = []
    for kernel, layer, dtype in layers():
        one = time_layer(layer, dtype, 1)
        for m in ROWS:
            t = one if m == 1 else time_layer(layer, dtype, m)
            rows_out.append({"kernel": kernel, "rows": m, "ms": round(t * 1e3, 3),
                             "gflops": round(2 * m * IN_FEATURES * OUT_FEATURES / t / 1e9, 1),
                             "x_one_row": round(t / one, 2)})
    lines = [f"# linear([m, {IN_FEATURES}] x [{OUT_FEATURES}, {IN_FEATURES}]): the cost of m rows against one", "",
             "| kernel | m | ms | GFLOPS | x m=1 |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['rows']} | {r['ms']:.2f} | {r['gflops']:.1f} | {r['x_one_row']:.2f} |" for r in rows_out]
    lines += ["", "A verification of k drafts feeds m = k + 1 rows per sequence: where x m=1 grows like m, "
              "verifying costs as much as decoding the tokens one by one and speculation cannot pay."]

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
    md = write_results(out.parent, out.name, {"args": vars(args), "rows": rows_out}, "\n".join(lines) + "\n", plot)
    print(md.read_text())


if __name__ == "__main__":
    main()
