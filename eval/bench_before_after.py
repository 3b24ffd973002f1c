"""Length policies before and after a change, side by side on one machine and one real pair.

    python eval/bench_before_after.py --before 2038c08 --batch-sizes 1,8 \
        --out docs/results/before_after/qwen-coder-onednn

The package as it was at --before (a commit of this repository) is extracted and imported as
`hf_specdec_before`. Each version drives its own loop (`custom_generate=<version>.generate.generate`)
with its own policies, profiled by its own `costmodel.profile` at the batch sizes timed (or, with
--profile, both on one given profile: then only the policies differ), on the same real
pair (Qwen2.5-Coder-1.5B-Instruct, with the 0.5B as drafter; float32 on oneDNN linear layers) and
HumanEval chat prompts. After --learn-runs untimed runs of each policy, rounds of plain generate()
and every policy of both versions run interleaved (`bench_lengths.timed_rounds`), so a slow spell
of the machine hits all alike. Reports each method's speed over plain (median of per-round ratios,
bootstrap 90% interval), its drafting steps per run and whether its outputs equal plain's.
bench_lengths' before/after tables come from different machines; this separates the code from the
machine. Writes <out>.json, <out>.md and <out>.png (speed over plain per method and batch size),
after every batch size.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import io
import json
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

import hf_specdec
from hf_specdec.costmodel import CostProfile
from bench_lengths import paired_speed, qwen_coder_env, timed_rounds  # eval/ is on sys.path as a script
from identity import compare_rows, counts
from report import stamp, write_results

logger = logging.getLogger("bench_before_after")
REPO = Path(__file__).resolve().parent.parent
POLICIES = ("adaspec", "nightjar", "dsd")


def import_before(commit: str):
    """`hf_specdec/` at `commit`, importable beside this checkout's as `hf_specdec_before`."""
    archive = subprocess.run(["git", "archive", commit, "hf_specdec"], cwd=REPO, capture_output=True)
    if archive.returncode:
        raise ValueError(f"--before {commit!r}: not a commit of this repository with hf_specdec/ "
                         f"({archive.stderr.decode().strip()})")
    tar = archive.stdout
    root = Path(tempfile.mkdtemp(prefix="hf_specdec_before-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)    # its modules may import lazily until then
    tarfile.open(fileobj=io.BytesIO(tar)).extractall(root, filter="data")
    package = (root / "hf_specdec").rename(root / "hf_specdec_before")
    for path in package.rglob("*.py"):        # absolute self-imports; "_hf_specdec_..." names stay
        path.write_text(re.sub(r"\bhf_specdec\b", "hf_specdec_before", path.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module("hf_specdec_before")


def read_profile(path: str) -> dict:
    """A cost profile as a dict: a profile JSON (`python -m hf_specdec profile`), or the one a
    bench_lengths result holds (its first environment's)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--profile {path}: cannot read it as JSON ({e})") from e
    if "results" in data:
        data = next(iter(data["results"].values()))["profile"]
    # checked as this version reads it
    return asdict(CostProfile.from_dict(data, where=f"--profile {path}"))


def version_policies(package, target, draft, batch_sizes, context: int, max_len: int, names,
                     given: dict | None) -> tuple[dict, dict]:
    """{name: policy} of one version, on the `given` profile (a dict) or else its own profile of the
    pair at `batch_sizes`; and that profile's latency models."""
    costmodel = importlib.import_module(f"{package.__name__}.costmodel")
    if given is not None:     # the constructor every version has (later ones also have from_dict)
        latency = costmodel.LatencyModel
        prof = costmodel.CostProfile(latency(**given["target"]), latency(**given["draft"]),
                                     costmodel.SwitchCostTable(**given["switch"]), given.get("meta", {}))
    else:
        prof = costmodel.profile(target, draft, batch_sizes, widths=(1, 3, 5, 8),
                                 contexts=(context, 2 * context), lags=sorted({1, 4, 16, context}), repeats=2)
    make = {"adaspec": lambda: package.AdaSpec(prof, max_len=max_len),
            "nightjar": lambda: package.Nightjar(max_len=max_len, switch_cost=prof),
            "dsd": lambda: package.DSDGoodput(prof, max_len=max_len)}
    return {name: make[name]() for name in names}, {"target": vars(prof.target), "draft": vars(prof.draft)}


def markdown(results: dict, args) -> str:
    batches = sorted(results["batches"], key=int)
    lines = [f"# Before ({args.before}) and after ({results['stamp']['commit']}): greedy, {args.max_new_tokens} new "
             f"tokens, {args.repeats} interleaved rounds", "",
             "Speed over plain generate() [90% interval] (drafting steps per run); ≠n: n rows differ from plain.", "",
             "| method | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---|" + "---:|" * len(batches)]
    for m in results["batches"][batches[0]]["methods"]:
        cells = []
        for b in batches:
            r = results["batches"][b]["methods"][m]
            x, other = r["x_plain"], r["identity"]["other"]
            cells.append(f"{x['median']:.2f} [{x['ci90'][0]:.2f}, {x['ci90'][1]:.2f}] "
                         f"({', '.join(map(str, r['drafting_steps']))}){f' ≠{other}' if other else ''}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted(results["batches"], key=int)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(results["batches"][batches[0]]["methods"])
    policies = sorted({m.split("@")[0] for m in names})
    for m in names:          # a policy's colour, dashed before
        x = [results["batches"][b]["methods"][m]["x_plain"] for b in batches]
        ax.errorbar([int(b) for b in batches], [v["median"] for v in x], marker="o", capsize=3, label=m,
                    color=f"C{policies.index(m.split('@')[0])}", ls="--" if m.endswith("@before") else "-",
                    yerr=[[v["median"] - v["ci90"][0] for v in x], [v["ci90"][1] - v["median"] for v in x]])
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speed over plain generate()")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a commit of this repository")
    parser.add_argument("--batch-sizes", default="8", help="comma-separated")
    parser.add_argument("--policies", default="adaspec,nightjar", help=f"comma-separated subset of {POLICIES}")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=8, help="largest k of the policies")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--learn-runs", type=int, default=1)
    parser.add_argument("--profile", default=None,
                        help="a cost profile both versions use (a profile JSON, or a bench_lengths result JSON "
                             "holding one), so that only the policies differ; default: each version profiles")
    parser.add_argument("--out", default="results/before_after")
    args = parser.parse_args(argv)
    names = [p for p in args.policies.split(",") if p]
    if not names or any(p not in POLICIES for p in names):
        parser.error(f"--policies: expected a comma-separated subset of {POLICIES}, got {args.policies!r}")
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        batch_sizes = []
    if not batch_sizes or min(batch_sizes) < 1:
        parser.error(f"--batch-sizes: expected comma-separated integers >= 1, got {args.batch_sizes!r}")
    given = read_profile(args.profile) if args.profile else None
    before = import_before(args.before)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)
    results = {"args": vars(args), "stamp": stamp(), "batches": {}}   # the code that runs: stamped at the start

    model, drafter, make_inputs = qwen_coder_env(onednn=True)
    context = make_inputs(1)["input_ids"].shape[1]
    versions = {"after": (hf_specdec, drafter), "before": (before, before.ModelDrafter(drafter.model, name="qwen-0.5b"))}
    methods, results["profiles"] = {"plain": None}, {}
    for tag, (package, version_drafter) in versions.items():
        pols, results["profiles"][tag] = version_policies(package, model, drafter.model, batch_sizes, context,
                                                          args.max_len, names, given)
        # the loop itself: the package's `generate` attribute is the function, not the module
        loop = importlib.import_module(f"{package.__name__}.generate").generate
        methods.update({f"{name}@{tag}": dict(custom_generate=loop, assistant_models=[version_drafter], spec_policy=p)
                        for name, p in pols.items()})
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    out = Path(args.out)

    for batch in batch_sizes:
        inputs = make_inputs(batch)

        def run_one(m, inputs=inputs):
            start = time.perf_counter()
            result = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                    return_dict_in_generate=True, **(methods[m] or {}))
            return result, time.perf_counter() - start

        model.generate(**inputs, max_new_tokens=2, do_sample=False)       # warm-up
        for _ in range(args.learn_runs):            # each policy sees this batch size first, untimed
            for m in list(methods)[1:]:
                run_one(m)
        outs, times, drafting = timed_rounds(list(methods), args.repeats, f"batch={batch}", run_one)
        results["batches"][str(batch)] = {"methods": {m: {
            "seconds": [round(t, 4) for t in times[m]],
            "x_plain": paired_speed(times["plain"], times[m]),
            "drafting_steps": drafting[m],
            "k_over_time": [s.k for s in outs[m].spec_stats.steps] if m != "plain" else [],
            "identity": counts(compare_rows(model, inputs["input_ids"], inputs["attention_mask"],
                                            outs["plain"].sequences, outs[m].sequences, eos)),
        } for m in methods}}
        md = write_results(out.parent, out.name, results, markdown(results, args),     # after every batch size
                           lambda path: plot(results, path))
    logger.info("%s", md.read_text())
    bad = [(b, m) for b, r in results["batches"].items() for m, x in r["methods"].items() if x["identity"]["other"]]
    if bad:
        raise SystemExit(f"outputs differ from plain generate(): {bad}")


if __name__ == "__main__":
    main()
