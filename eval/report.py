"""What every benchmark writes: a stamp (commit, versions, machine), and JSON + markdown + PNG.

    from report import figure, stamp, write_results
    write_results(Path("docs/results/bench_generate"), "qwen-coder", payload, table_md, plot_fn)
    with figure(path, cols=2) as axes:      # a headless matplotlib figure, saved and closed on exit
        axes[0][0].plot(...)
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Callable

# kernels: with it Transformers keeps GGUF weights packed and multiplies them with its own kernels
PACKAGES = ("hf-specdec", "torch", "transformers", "accelerate", "tokenizers", "gguf", "kernels", "numpy")


def _cpuinfo(field: str) -> str | None:
    """The first `field` line of /proc/cpuinfo (None where there is none)."""
    try:
        return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith(field)), None)
    except OSError:
        return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _cpu_matmul() -> str:
    """The CPU's widest vector ISA as torch dispatches to it (e.g. AVX2, AVX512) and whether it
    multiplies bf16 matrices in hardware: without it a bf16 forward over many tokens (a
    verification, a prefill) is several times slower, which moves every speed ratio here."""
    import torch
    from hf_specdec.kernels import cpu_bf16_matmul
    bf16 = cpu_bf16_matmul()
    return f"{torch.backends.cpu.get_cpu_capability()}, {'bf16 matmul' if bf16 else 'no bf16 matmul'}"


def _cpu_kind() -> str:
    """The CPU's kind as results are filed by ("avx2", "avx512", "avx512-bf16", "amx"; `kernels.cpu_kind`)."""
    from hf_specdec.kernels import cpu_kind
    return cpu_kind()


def _commit() -> str:
    if os.environ.get("HF_SPECDEC_COMMIT"):     # a copy whose git history is stale (a lent GPU machine's)
        return os.environ["HF_SPECDEC_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp() -> dict:
    """Commit, package versions, machine and time of a benchmark run."""
    import torch
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"commit": _commit(), "versions": versions, "python": platform.python_version(),
            "machine": {"cpu": _cpu_model(), "cpu_kind": _cpu_kind(), "cpu_matmul": _cpu_matmul(), "cores": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(), "device": device},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def stamp_line(s: dict) -> str:
    v = s["versions"]
    return (f"commit {s['commit']}, {s['date']}; torch {v['torch']}, transformers {v['transformers']}; "
            f"{machine_line(s)}, {s['machine']['torch_threads']} torch threads, "
            f"device {s['machine']['device']}")


def machine_line(s: dict) -> str:
    """The stamp's machine in words (stamps written before `cpu_matmul` or `cpu_kind` existed lack them)."""
    m = s["machine"]
    return (f"{m['cpu']}" + (f" ({m['cpu_matmul']})" if "cpu_matmul" in m else "")
            + (f", kind {m['cpu_kind']}" if "cpu_kind" in m else "") + f", {m['cores']} cores")


def write_results(directory: Path, name: str, payload: dict, table: str,
                  plot: Callable[[Path], None] | None = None) -> Path:
    """Write `directory/name.{json,md,png}`; the markdown starts with the stamp. Returns the .md path."""
    directory.mkdir(parents=True, exist_ok=True)
    s = payload.setdefault("stamp", stamp())
    (directory / f"{name}.json").write_text(json.dumps(payload, indent=1))
    md = directory / f"{name}.md"
    md.write_text(f"_{stamp_line(s)}_\n\n{table}")
    if plot is not None:
        plot(directory / f"{name}.png")
    return md


@contextlib.contextmanager
def figure(path: Path, rows: int = 1, cols: int = 1, size: tuple[float, float] | None = None, dpi: int = 110,
           **subplots):
    """Headless matplotlib subplots, `axes[row][col]`, saved to `path` (tight layout) and closed on exit.
    size: inches (default 6 x 4 a panel); subplots: more plt.subplots arguments (sharex, ...)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(rows, cols, figsize=size or (6 * cols, 4 * rows), squeeze=False, **subplots)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def method_bars(ax, cells: list[dict], value: Callable[[dict], float | None],
                spread: Callable[[dict], list[float]] | None = None, ylabel: str = "speed vs plain generate()") -> float:
    """Grouped bars on `ax`: a group per cell (`batch` and `methods` keys, in order), a bar per method
    but plain of value(row) (None: no bar), whiskers at spread(row) = [low, high]. Returns the bar width."""
    names = [n for n in dict.fromkeys(n for c in cells for n in c["methods"]) if n != "plain"]
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        rows = [(i, c["methods"][name]) for i, c in enumerate(cells) if value(c["methods"].get(name, {})) is not None]
        ys = [value(r) for _, r in rows]
        whiskers = None if spread is None else [[y - spread(r)[0] for y, (_, r) in zip(ys, rows)],
                                                [spread(r)[1] - y for y, (_, r) in zip(ys, rows)]]
        ax.bar([i + j * width for i, _ in rows], ys, width, yerr=whiskers, capsize=3, label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], [f"batch {c['batch']}" for c in cells])
    ax.set_ylabel(ylabel)
    return width
