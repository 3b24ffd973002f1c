"""The default policy against every fixed draft length, one generate() call at a time, in the
simulator (`hf_specdec.serving.Simulator.call`): GPU and CPU cost regimes, per-token acceptance
0.5 / 0.8 / 0.95, batch sizes 1 to 64; the default's first call (a fresh policy) and its steady
state (after --warm-calls calls of the same kind).

    python eval/bench_default_sim.py --out docs/results/bench_default_sim/regimes

Regimes (units: a batch-1 plain target step; docs/results/cuda_check and DESIGN's H200 table):
  gpu-eager        H200, eager: every forward host-bound; a draft forward 0.9 of a target's,
                   verifying 6 tokens 1.1 of one token, at every batch size
  gpu-graphs       H200, forwards replayed as CUDA graphs: a draft step 0.43 of a target step;
                   verifying 6 tokens 1.19x one at batch 1 and about 3x at batch 16 (a target
                   forward 0.962 + 0.038 B w); a catch-up wider than the graphs' 17 tokens runs
                   eager (3 units)
  gpu-graphs-cheap the same with a draft step of 0.15
  cpu-real-pair    the project's profiler on the real pair (Qwen2.5-Coder 1.5B + 0.5B, bf16, CPU):
                   docs/results/bench_serving_sim/qwen-coder-profile.json, in seconds
Each call: --prompt-len tokens, every row's output length drawn from --output-lens (a static batch
shrinks as its rows finish), step times with log-normal noise (--noise); each cell sums --seeds
calls. Every method of a cell sees the same seeds. A cell's target (the issue's): where no fixed k
beats plain by more than 5%, the default must run >= 0.95x plain; elsewhere >= 0.9x the best
fixed k. Methods are eval/methods.py names. Writes <out>.json, <out>.md and <out>.png after each
cell; a rerun with the same arguments resumes.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

from tqdm.auto import tqdm

from hf_specdec.costmodel import CostProfile
from hf_specdec.policies import auto_policy
from hf_specdec.serving import RelativeCosts, Simulator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, arguments, ints, parse  # noqa: E402
from methods import Method, spec_policy  # noqa: E402
from report import figure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REGIMES = {
    "gpu-eager": lambda: RelativeCosts(target_per_width=0.02, draft_base=0.9, draft_per_token=0.00015,
                                       prefill_per_token=0.002),
    "gpu-graphs": lambda: RelativeCosts(target_base=0.962, target_per_token=0.038, draft_base=0.41,
                                        draft_per_token=0.0027, catch_up=3.0, prefill_per_token=0.01),
    "gpu-graphs-cheap": lambda: RelativeCosts(target_base=0.962, target_per_token=0.038, draft_base=0.14,
                                              draft_per_token=0.001, catch_up=3.0, prefill_per_token=0.01),
    "cpu-real-pair": lambda: CostProfile.load(ROOT / "docs/results/bench_serving_sim/qwen-coder-profile.json"),
}
POLICIES = (Method("auto", "auto"), Method("nightjar", "nightjar", k=8))      # the default, the previous one
FIXED = tuple(auto_policy().length.arms)      # every draft length the default chooses among


def call_tokens_per_s(costs, policy, acceptance: float, batch: int, args, seed: int, sim=None) -> tuple[float, Simulator]:
    """One call's output tokens per second; `sim` (with its policy) is reused when given."""
    rng = random.Random(seed)
    lens = [rng.randint(*args.output_lens) for _ in range(batch)]
    if sim is None:
        sim = Simulator(costs, policy, acceptance, max_batch=batch, seed=seed, noise=args.noise)
    else:
        sim.rng, sim.acceptance = random.Random(seed), acceptance
    result = sim.call(args.prompt_len, lens)
    return sum(lens) / max(r.finish for r in result.requests), sim


def cell(costs, acceptance: float, batch: int, args) -> dict:
    """Tokens/s of every fixed k and of the policies (first call, steady state), summed over seeds."""
    seeds = [1000 * s + batch for s in range(args.seeds)]
    out = {}
    for k in FIXED:
        speeds = [call_tokens_per_s(costs, spec_policy("fixed", k), acceptance, batch, args, s)[0] for s in seeds]
        out[f"fixed:{k}"] = sum(speeds) / len(speeds)
    for method in POLICIES:
        first, steady = [], []
        for s in seeds:
            speed, sim = call_tokens_per_s(costs, spec_policy(method.policy, method.k), acceptance, batch, args, s)
            first.append(speed)
            for w in range(args.warm_calls):
                call_tokens_per_s(costs, None, acceptance, batch, args, s + 7 * (w + 1), sim)
            steady.append(call_tokens_per_s(costs, None, acceptance, batch, args, s, sim)[0])
        out[f"{method.name} first"], out[f"{method.name} steady"] = sum(first) / len(first), sum(steady) / len(steady)
    plain, best = out["fixed:0"], max((m for m in out if m.startswith("fixed:")), key=out.get)
    pays = out[best] > 1.05 * plain
    reference = best if pays else "fixed:0"
    ratios = {m: out[m] / out[reference] for m in out}
    floor = 0.9 if pays else 0.95
    return {"tokens_per_s": out, "best_fixed": best, "best_x_plain": out[best] / plain, "reference": reference,
            "floor": floor, "x_reference": ratios,
            "meets": {m: ratios[m] >= floor for m in out if not m.startswith("fixed:")}}


def by_regime(cells: list[dict]) -> dict:
    """regime -> acceptance -> batch -> cell."""
    out: dict = {}
    for c in cells:
        out.setdefault(c["regime"], {}).setdefault(c["acceptance"], {})[c["batch"]] = c
    return out


def markdown(payload) -> str:
    args, results = payload["args"], by_regime(payload["cells"])
    lines = ["# The default policy against fixed draft lengths, simulated generate() calls", "",
             f"Prompt {args['prompt_len']} tokens, output lengths {args['output_lens'][0]}-{args['output_lens'][1]} "
             f"per row, step-time noise {args['noise']}, {args['seeds']} calls per cell, steady = after "
             f"{args['warm_calls']} calls. Cell: default first call / steady state as a fraction of the reference (the "
             "best fixed k where one beats plain by > 5%, else plain), then the best fixed k and its speed over plain; "
             "✗ marks a cell below the target (0.9 of the best fixed k; 0.95 of plain where nothing pays). nightjar: "
             "the previous default, first call / steady.", ""]
    for regime, by_alpha in results.items():
        batches = list(next(iter(by_alpha.values())))
        lines += [f"## {regime}", "", "| acceptance | policy | " + " | ".join(f"B={b}" for b in batches) + " |",
                  "|---|---|" + "---:|" * len(batches)]
        for alpha, by_batch in by_alpha.items():
            for method in POLICIES:
                row = []
                for c in by_batch.values():
                    f, s = c["x_reference"][f"{method.name} first"], c["x_reference"][f"{method.name} steady"]
                    ok = c["meets"][f"{method.name} first"] and c["meets"][f"{method.name} steady"]
                    row.append(f"{f:.2f} / {s:.2f}{'' if ok else ' ✗'}")
                lines.append(f"| {alpha} | {method.name} | " + " | ".join(row) + " |")
            lines.append(f"| {alpha} | best fixed | " + " | ".join(
                f"{c['best_fixed'][6:]} ({c['best_x_plain']:.2f}x)" for c in by_batch.values()) + " |")
        lines.append("")
    failing = [(c, m) for c in payload["cells"] for m, ok in c["meets"].items() if not ok and m.startswith("auto")]
    lines += [f"Cells where the default misses its target: {len(failing)} of {2 * len(payload['cells'])} "
              "(first calls and steady states)."]
    lines += [f"- {c['regime']}, acceptance {c['acceptance']}, B={c['batch']}: {m} {c['x_reference'][m]:.2f}"
              for c, m in failing]
    return "\n".join(lines) + "\n"


def plot(payload, path: Path) -> None:
    results = by_regime(payload["cells"])
    with figure(path, cols=len(results), size=(4.2 * len(results), 3.6), sharey=True) as axes:
        for ax, (regime, by_alpha) in zip(axes[0], results.items()):
            for i, (alpha, by_batch) in enumerate(by_alpha.items()):
                batches = list(by_batch)
                for name, style, label in (("auto", "-", "default"), ("nightjar", ":", "nightjar")):
                    ax.plot(range(len(batches)), [by_batch[b]["x_reference"][f"{name} first"] for b in batches],
                            ls=style, marker="o" if name == "auto" else None, color=f"C{i}",
                            label=f"{label}, first call, a={alpha}")
                ax.set_xticks(range(len(batches)), batches)
            ax.axhline(0.9, color="grey", ls="--", lw=0.8)
            ax.set_title(regime)
            ax.set_xlabel("batch size")
        axes[0][0].set_ylabel("x the best fixed k (plain where none pays)")
        axes[0][0].legend(fontsize=6)


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--acceptances", default="0.5,0.8,0.95")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-lens", default="32,256", help="lo,hi: each row's output length, uniform")
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--warm-calls", type=int, default=4)
    parser.add_argument("--out", default="results/bench_default_sim/regimes")
    args = parse(parser, argv)
    args.output_lens = tuple(ints(args.output_lens))
    regimes = args.regimes.split(",")
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        parser.error(f"--regimes: unknown {unknown}; known: {list(REGIMES)}")
    grid = [(r, str(float(a)), b) for r in regimes for a in args.acceptances.split(",") for b in ints(args.batch_sizes)]
    results = Results(Path(args.out), vars(args), markdown, plot)
    for regime, alpha, batch in tqdm(grid, desc="cells"):
        key = {"regime": regime, "acceptance": alpha, "batch": batch}
        if not results.done(key):
            results.add({**key, **cell(REGIMES[regime](), float(alpha), batch, args)})
    print(markdown(results.payload))


if __name__ == "__main__":
    main()
