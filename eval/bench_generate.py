"""Side-by-side speed of plain generate(), Transformers' assisted generation and hf_specdec.

    python eval/bench_generate.py --envs qwen-coder --batch-sizes 1,4,16 --problems 10 --k 5 \
        --max-new-tokens 128 --repeats 1

Environments:
  qwen-coder  Qwen2.5-Coder-1.5B-Instruct (target) with the 0.5B as drafter, bf16, on HumanEval
              problems in the chat prompt (the real pair; fetched once, see hf_specdec.embedded);
  qwen-coder-onednn  the same in float32 with oneDNN linear layers (for CPUs without bf16 matrix
              instructions: hf_specdec.embedded.use_onednn_linears);
  smollm2     the embedded SmolLM2-135M-Instruct (fp32) on HumanEval prompts, drafters derived
              from it offline: bf16 copy, int8 copy, prompt lookup;
  tiny-exact  an 8-layer Llama whose layers 2.. are zeroed and a 1-layer draft computing exactly
              its function (hf_specdec.testing.exact_cheap_pair): a perfect, cheap drafter.
Batch 1 compares all three, with hf_specdec at the fixed k and under the adaptive policy; larger
batches compare plain and hf_specdec (assisted generation in Transformers refuses batch > 1).
The --problems prompts are taken `batch` at a time; for each such chunk every method runs once,
interleaved, and each repeat goes over all chunks. Times are summed over chunks; the spread is
that of the per-chunk ratios to plain. Greedy; every row is compared with plain and a divergence is
re-scored on plain's prefix (eval/identity.py): identical, diverged at a near-tie, or other (a bug).
Writes docs/results/bench_generate/<name>.{json,md,png}, stamped with commit, versions and machine.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import hf_specdec
from hf_specdec.generate import ensure_profile
from hf_specdec.testing import exact_cheap_pair
from humaneval_data import load_problems, prompt_text  # eval/ is on sys.path when run as a script
from identity import compare_rows, counts, until_eos
from report import write_results

logger = logging.getLogger("bench_generate")


def chunks(prompts: list, batch: int) -> list[list]:
    """`prompts` taken `batch` at a time (a last, shorter chunk is dropped unless it is the only one)."""
    out = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    return [c for c in out if len(c) == batch] or out[:1]


def qwen_coder_env(args, onednn=False):
    from hf_specdec.embedded import load_model
    model, tokenizer = load_model("qwen2.5-coder-1.5b-instruct", onednn=onednn)
    draft, _ = load_model("qwen2.5-coder-0.5b-instruct", onednn=onednn)
    texts = [prompt_text(p, tokenizer, "chat") for p in load_problems(limit=args.problems)]

    def inputs(batch):
        return [dict(tokenizer(c, return_tensors="pt", padding=True, add_special_tokens=False))
                for c in chunks(texts, batch)]
    return model, {"qwen-0.5b": hf_specdec.ModelDrafter(draft, name="qwen-0.5b")}, inputs


def smollm2_env(args):
    from hf_specdec.embedded import load_smollm2
    model, tokenizer = load_smollm2()
    drafters = {"bf16": hf_specdec.self_draft(model, "bf16"), "int8": hf_specdec.self_draft(model, "int8"),
                "pld": hf_specdec.PromptLookupDrafter()}
    prompts = [p["prompt"] for p in load_problems(limit=max(args.batch_sizes))]

    def inputs(batch):
        return [dict(tokenizer(prompts[:batch], return_tensors="pt", padding=True))]
    return model, drafters, inputs


def tiny_exact_env(args):
    target, draft = exact_cheap_pair()
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, target.config.vocab_size, (max(args.batch_sizes), 32), generator=gen)

    def inputs(batch):
        ids = prompt_ids[:batch]
        return [dict(input_ids=ids, attention_mask=torch.ones_like(ids))]
    return target, {"exact-1layer": hf_specdec.ModelDrafter(draft, name="exact-1layer")}, inputs


ENVS = {"qwen-coder": qwen_coder_env, "qwen-coder-onednn": lambda args: qwen_coder_env(args, onednn=True),
        "smollm2": smollm2_env, "tiny-exact": tiny_exact_env}
ADAPTIVE = {"nightjar": lambda args: hf_specdec.Nightjar(max_len=max(args.k, 6)),
            "adaspec": lambda args: hf_specdec.AdaSpec(max_len=max(args.k, 8))}


def hf_assisted(model, drafter, k):
    """generate() kwargs for Transformers' built-in assisted generation with the same drafter and
    a constant k (no confidence-based early stop), or None if it has no equivalent."""
    if isinstance(drafter, hf_specdec.PromptLookupDrafter):
        return {"prompt_lookup_num_tokens": k}
    config = drafter.model.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
    config.assistant_confidence_threshold = 0.0
    return {"assistant_model": drafter.model}


def run_env(name, args):
    model, drafters, make_inputs = ENVS[name](args)
    hf_specdec.enable(model)
    eos = model.generation_config.eos_token_id
    policies = {p: ADAPTIVE[p](args) for p in args.adaptive}   # one object per env: it learns across calls
    for policy in policies.values():     # a profile a policy measures on first use: before any timing
        ensure_profile(hf_specdec.SpecPolicy(length=policy), model, list(drafters.values()), max(args.batch_sizes))
    rows = []
    for batch in args.batch_sizes:
        parts = make_inputs(batch)
        methods = {"plain": {}}
        for dname, drafter in drafters.items():
            if batch == 1:
                methods[f"hf-assisted/{dname}"] = hf_assisted(model, drafter, args.k)
            spec = dict(assistant_models=[drafter], return_dict_in_generate=True)
            methods[f"hf_specdec/{dname}"] = dict(spec, spec_policy=hf_specdec.FixedLength(args.k))
            methods.update({f"hf_specdec/{dname}/{p}": dict(spec, spec_policy=policy) for p, policy in policies.items()})
        seconds = {m: [[] for _ in parts] for m in methods}       # [chunk][repeat]
        tokens, mat, verdicts = [0] * len(parts), {m: [] for m in methods}, {m: [] for m in methods}
        model.generate(**parts[0], max_new_tokens=2, do_sample=False)  # warm-up
        for _ in range(args.repeats):
            for c, inputs in enumerate(tqdm(parts, desc=f"{name} batch={batch}", leave=False)):
                common = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
                plain = None
                for method, extra in methods.items():
                    start = time.perf_counter()
                    out = model.generate(**common, **extra)
                    seconds[method][c].append(time.perf_counter() - start)
                    sequences = out.sequences if hasattr(out, "sequences") else out
                    if plain is None:
                        plain = sequences
                        tokens[c] = sum(len(until_eos(row, eos)) for row in plain[:, inputs["input_ids"].shape[1]:])
                    stats = getattr(out, "spec_stats", None)
                    if stats is not None:
                        mat[method].append((stats.tokens_generated, sum(r.batch_size for r in stats.steps)))
                    for v in compare_rows(model, inputs["input_ids"], inputs["attention_mask"], plain, sequences, eos):
                        verdicts[method].append(dict(v, prompt=c * batch + v["row"]))  # index among --problems
        plain_chunk = [statistics.median(t) for t in seconds["plain"]]
        for method in methods:
            chunk = [statistics.median(t) for t in seconds[method]]
            ratios = [p / m for p, m in zip(plain_chunk, chunk)]
            rows.append({
                "env": name, "batch": batch, "method": method, "chunks": len(parts), "tokens": sum(tokens),
                "seconds": [round(t, 3) for t in chunk], "tokens_per_s": round(sum(tokens) / sum(chunk), 3),
                "vs_plain": round(sum(plain_chunk) / sum(chunk), 3),
                "vs_plain_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "mean_accepted_tokens": (round(sum(t for t, _ in mat[method]) / sum(n for _, n in mat[method]), 3)
                                         if mat[method] else None),
                "identity": counts(verdicts[method]),
                "divergences": [v for v in verdicts[method] if v["verdict"] != "identical"],
            })
            logger.info("%s", {k: v for k, v in rows[-1].items() if k != "divergences"})
    return rows


def with_assisted_ratio(rows):
    """hf_specdec tokens/s relative to Transformers' assisted generation, same env/drafter/batch."""
    by_key = {(r["env"], r["batch"], r["method"]): r for r in rows}
    for r in rows:
        if r["method"].startswith("hf_specdec/"):
            drafter = r["method"].split("/")[1]
            ref = by_key.get((r["env"], r["batch"], f"hf-assisted/{drafter}"))
            r["vs_hf_assisted"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3) if ref else None
    return rows


def markdown(rows, args):
    lines = [f"greedy, fixed k={args.k}, max_new_tokens={args.max_new_tokens}, {args.repeats} repeat(s), "
             "prompts in chunks of `batch`, methods interleaved per chunk. vs plain: total time ratio "
             "[min, max over chunks]. identical: rows identical / diverged at a near-tie / other.", "",
             "| env | batch | chunks | method | tokens/s | vs plain | vs hf-assisted | MAT | identical |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        lo, hi = r["vs_plain_range"]
        i = r["identity"]
        lines.append(f"| {r['env']} | {r['batch']} | {r['chunks']} | {r['method']} | {r['tokens_per_s']:.2f} | "
                     f"{r['vs_plain']:.2f}x [{lo:.2f}, {hi:.2f}] | {fmt(r.get('vs_hf_assisted'))} | "
                     f"{fmt(r['mean_accepted_tokens'])} | {i['identical']} / {i['near_tie']} / {i['other']} |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    envs = sorted({r["env"] for r in rows})
    fig, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4), squeeze=False)
    for ax, env in zip(axes[0], envs):
        mine = [r for r in rows if r["env"] == env and r["method"] != "plain"]
        for method in sorted({r["method"] for r in mine}):
            pts = sorted((r["batch"], r["vs_plain"], r["vs_plain_range"]) for r in mine if r["method"] == method)
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            err = [[y - p[2][0] for y, p in zip(ys, pts)], [p[2][1] - y for y, p in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speed vs plain generate()")
        ax.set_title(env)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="qwen-coder")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--problems", type=int, default=16, help="HumanEval prompts (qwen-coder)")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--adaptive", default="nightjar", help=f"adaptive policies also run, of {sorted(ADAPTIVE)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--name", default=None, help="output name (default: the envs)")
    parser.add_argument("--out-dir", default="docs/results/bench_generate")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.adaptive = [a for a in args.adaptive.split(",") if a]
    for env in args.envs.split(","):
        if env not in ENVS:
            parser.error(f"--envs: unknown environment {env!r}; known: {sorted(ENVS)}")
    if any(a not in ADAPTIVE for a in args.adaptive):
        parser.error(f"--adaptive: known policies are {sorted(ADAPTIVE)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)

    rows = []
    for env in args.envs.split(","):
        rows += run_env(env, args)
    rows = with_assisted_ratio(rows)
    table = markdown(rows, args)
    write_results(Path(args.out_dir), args.name or args.envs.replace(",", "+"), {"args": vars(args), "rows": rows},
                  table, lambda path: plot(rows, path))
    print(table)
    if any(r["identity"]["other"] for r in rows):
        raise SystemExit("some output diverged from plain generate() other than at a near-tie")


if __name__ == "__main__":
    main()
