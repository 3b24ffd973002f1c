"""Length policies before and after a change, side by side on one machine and one real pair.

    python eval/bench_before_after.py --before 2038c08 --batch-size 8 \
        --out docs/results/before_after/qwen-coder-onednn-b8

The package as it was at --before (a commit of this repository) is extracted and imported as
`hf_specdec_before`. Each version drives its own loop (`custom_generate=<version>.generate.generate`)
with its own policies, profiled by its own `costmodel.profile` at this batch size, on the same real
pair (Qwen2.5-Coder-1.5B-Instruct, with the 0.5B as drafter; float32 on oneDNN linear layers) and
HumanEval chat prompts. After --learn-runs untimed runs of each policy, rounds of plain generate()
and every policy of both versions run interleaved (`bench_lengths.timed_rounds`), so a slow spell
of the machine hits all alike. Reports each method's speed over plain (median of per-round ratios,
bootstrap 90% interval), its drafting steps per run and whether its outputs equal plain's.
bench_lengths' before/after tables come from different machines; this separates the code from the
machine. Writes <out>.json, <out>.md and <out>.png (speed over plain per method).
"""
from __future__ import annotations

import argparse
import importlib
import io
import logging
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

import hf_specdec
from bench_lengths import paired_speed, qwen_coder_env, timed_rounds  # eval/ is on sys.path as a script
from identity import compare_rows, counts
from report import write_results

logger = logging.getLogger("bench_before_after")
REPO = Path(__file__).resolve().parent.parent
POLICIES = ("adaspec", "nightjar", "dsd")


def import_before(commit: str):
    """`hf_specdec/` at `commit`, importable beside this checkout's as `hf_specdec_before`."""
    tar = subprocess.run(["git", "archive", commit, "hf_specdec"], cwd=REPO, capture_output=True, check=True).stdout
    root = Path(tempfile.mkdtemp(prefix="hf_specdec_before-"))
    tarfile.open(fileobj=io.BytesIO(tar)).extractall(root, filter="data")
    package = (root / "hf_specdec").rename(root / "hf_specdec_before")
    for path in package.rglob("*.py"):        # absolute self-imports; "_hf_specdec_..." names stay
        path.write_text(re.sub(r"\bhf_specdec\b", "hf_specdec_before", path.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module("hf_specdec_before")


def version_policies(package, target, draft, batch_size: int, context: int, max_len: int, names) -> tuple[dict, dict]:
    """{name: policy} of one version, on its own profile of the pair at `batch_size`; and that profile."""
    costmodel = importlib.import_module(f"{package.__name__}.costmodel")
    prof = costmodel.profile(target, draft, [batch_size], widths=(1, 3, 5, 8), contexts=(context, 2 * context),
                                     lags=sorted({1, 4, 16, context}), repeats=2)
    make = {"adaspec": lambda: package.AdaSpec(prof, max_len=max_len),
            "nightjar": lambda: package.Nightjar(max_len=max_len, switch_cost=prof),
            "dsd": lambda: package.DSDGoodput(prof, max_len=max_len)}
    return {name: make[name]() for name in names}, {"target": vars(prof.target), "draft": vars(prof.draft)}


def markdown(results: dict, args) -> str:
    lines = [f"# Before ({args.before}) and after: batch {args.batch_size}, greedy, {args.max_new_tokens} new tokens, "
             f"{args.repeats} interleaved rounds", "",
             "| method | x plain [90%] | drafting steps per run | rows identical to plain |", "|---|---:|---|---:|"]
    for m, r in results["methods"].items():
        x = r["x_plain"]
        lines.append(f"| {m} | {x['median']:.2f} [{x['ci90'][0]:.2f}, {x['ci90'][1]:.2f}] | "
                     f"{', '.join(map(str, r['drafting_steps']))} | {r['identity']['identical']}/{args.batch_size} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results["methods"])
    x = [results["methods"][m]["x_plain"] for m in names]
    fig, ax = plt.subplots(figsize=(6, 0.5 * len(names) + 1))
    ax.barh(names, [v["median"] for v in x], color=["C0" if m.endswith("@after") else "C1" for m in names],
            xerr=[[v["median"] - v["ci90"][0] for v in x], [v["ci90"][1] - v["median"] for v in x]])
    ax.axvline(1.0, color="grey", lw=1)
    ax.invert_yaxis()
    ax.set_xlabel("speed over plain generate() (median, 90% interval)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a commit of this repository")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--policies", default="adaspec,nightjar", help=f"comma-separated subset of {POLICIES}")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=8, help="largest k of the policies")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--learn-runs", type=int, default=1)
    parser.add_argument("--out", default="results/before_after")
    args = parser.parse_args(argv)
    names = [p for p in args.policies.split(",") if p]
    if not names or any(p not in POLICIES for p in names):
        parser.error(f"--policies: expected a comma-separated subset of {POLICIES}, got {args.policies!r}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)
    before = import_before(args.before)

    model, drafter, make_inputs = qwen_coder_env(onednn=True)
    inputs = make_inputs(args.batch_size)
    context = inputs["input_ids"].shape[1]
    versions = {"after": (hf_specdec, drafter), "before": (before, before.ModelDrafter(drafter.model, name="qwen-0.5b"))}
    methods, profiles = {"plain": None}, {}
    for tag, (package, version_drafter) in versions.items():
        pols, profiles[tag] = version_policies(package, model, drafter.model, args.batch_size, context, args.max_len, names)
        methods.update({f"{name}@{tag}": (package, version_drafter, p) for name, p in pols.items()})

    def run_one(m):
        kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
        if methods[m] is not None:
            package, version_drafter, policy = methods[m]
            # the loop itself: the package's `generate` attribute is the function, not the module
            loop = importlib.import_module(f"{package.__name__}.generate").generate
            kwargs.update(custom_generate=loop, assistant_models=[version_drafter],
                          spec_policy=policy)
        start = time.perf_counter()
        out = model.generate(**kwargs)
        return out, time.perf_counter() - start

    model.generate(**inputs, max_new_tokens=2, do_sample=False)       # warm-up
    for _ in range(args.learn_runs):            # each policy sees this batch size first, untimed
        for m in list(methods)[1:]:
            run_one(m)
    outs, times, drafting = timed_rounds(list(methods), args.repeats, f"batch={args.batch_size}", run_one)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    results = {"args": vars(args), "profiles": profiles, "methods": {m: {
        "seconds": [round(t, 4) for t in times[m]],
        "x_plain": paired_speed(times["plain"], times[m]),
        "drafting_steps": drafting[m],
        "k_over_time": [s.k for s in outs[m].spec_stats.steps] if m != "plain" else [],
        "identity": counts(compare_rows(model, inputs["input_ids"], inputs["attention_mask"],
                                        outs["plain"].sequences, outs[m].sequences, eos)),
    } for m in methods}}
    md = write_results(Path(args.out).parent, Path(args.out).name, results, markdown(results, args),
                       lambda path: plot(results, path))
    logger.info("%s", md.read_text())
    bad = [m for m, r in results["methods"].items() if r["identity"]["other"]]
    if bad:
        raise SystemExit(f"outputs differ from plain generate(): {bad}")


if __name__ == "__main__":
    main()
