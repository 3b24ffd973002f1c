"""What a verification costs on this CPU, at the level of one matrix product.

    python eval/cpu_matmul.py --out docs/results/cpu_matmul/<name>

Speculative decoding pays when a forward over k + 1 tokens per row costs little more than one over
a single token: the weights are read once either way, so on a memory-bound device the extra rows
are almost free. Whether they are on a CPU depends on its matrix kernels. This times
`linear(x [m, 1536], w [8960, 1536])`, the 1.5B's MLP up-projection, for m = 1 (a decode step), the
m of a verification (3-9) and prefill-sized m, in float32 and bfloat16, and reports milliseconds,
GFLOPS and the cost relative to m = 1. Writes <out>.json, <out>.md, <out>.png, stamped.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from report import write_results  # eval/ is on sys.path when run as a script

ROWS = (1, 2, 3, 5, 8, 16, 64, 256)
IN_FEATURES, OUT_FEATURES = 1536, 8960


def time_linear(weight: torch.Tensor, rows: int, seconds: float = 0.5) -> float:
    """Median seconds of one linear() of `weight` [out, in] over `rows` rows, repeated for about `seconds`."""
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(weight.dtype)
    torch.nn.functional.linear(x, weight)                       # warm-up
    times = []
    while sum(times) < seconds or len(times) < 3:
        start = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/cpu_matmul/this-cpu")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    rows_out = []
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=torch.Generator().manual_seed(0)).to(dtype)
        one = time_linear(weight, 1)
        for m in ROWS:
            t = one if m == 1 else time_linear(weight, m)
            rows_out.append({"dtype": str(dtype).removeprefix("torch."), "rows": m, "ms": round(t * 1e3, 3),
                             "gflops": round(2 * m * IN_FEATURES * OUT_FEATURES / t / 1e9, 1),
                             "x_one_row": round(t / one, 2)})
    lines = [f"# linear([m, {IN_FEATURES}] x [{OUT_FEATURES}, {IN_FEATURES}]): the cost of m rows against one", "",
             "| dtype | m | ms | GFLOPS | x m=1 |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['dtype']} | {r['rows']} | {r['ms']:.2f} | {r['gflops']:.1f} | {r['x_one_row']:.2f} |" for r in rows_out]
    lines += ["", "A verification of k drafts feeds m = k + 1 rows per sequence: where x m=1 grows like m, "
              "verifying costs as much as decoding the tokens one by one and speculation cannot pay."]

    def plot(path: Path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for dtype in ("float32", "bfloat16"):
            pts = [r for r in rows_out if r["dtype"] == dtype]
            ax.plot([r["rows"] for r in pts], [r["x_one_row"] for r in pts], marker="o", label=dtype)
        ax.plot(ROWS, ROWS, ls=":", color="gray", label="m x (no reuse of the weights)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("rows m")
        ax.set_ylabel("time / time of one row")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    out = Path(args.out)
    md = write_results(out.parent, out.name, {"args": vars(args), "rows": rows_out}, "\n".join(lines) + "\n", plot)
    print(md.read_text())


if __name__ == "__main__":
    main()
