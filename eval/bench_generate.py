"""Side-by-side speed of plain generate(), Transformers' assisted generation and hf_specdec.

    python eval/bench_generate.py --envs qwen-coder-onednn --batch-sizes 1 --problems 10 \
        --methods plain,hf-assisted:5@draft,fixed:5@draft,auto@draft --max-new-tokens 96 --repeats 2

Environments:
  qwen-coder  Qwen2.5-Coder-1.5B-Instruct (target) with the 0.5B as drafter, bf16, on HumanEval
              problems in the chat prompt (the real pair; fetched once, see hf_specdec.embedded);
  qwen-coder-onednn  the same in float32 with oneDNN linear layers (for CPUs without bf16 matrix
              instructions: hf_specdec.embedded.use_onednn_linears);
  qwen-coder-cpu  the pair with the demo's kernels for this CPU (hf_specdec.embedded.cpu_kernels);
  smollm2     the embedded SmolLM2-135M-Instruct (fp32) on HumanEval prompts, drafters derived
              from it offline: bf16 copy, int8 copy, prompt lookup;
  gemma3      Gemma 3 270M (fp32; 5 of 6 layers a 512-token sliding window), a real model of that
              kind offline, on prompts that cross its window while decoding (consecutive HumanEval
              prompts joined to >= 448 tokens); drafters derived from it (@pld, @int8, ...);
  tiny-exact  an 8-layer Llama whose layers 2.. are zeroed and a 1-layer draft computing exactly
              its function (hf_specdec.testing.exact_cheap_pair): a perfect, cheap drafter.
Methods are eval/methods.py names run by eval/harness.py: `plain` and `hf-assisted` are
Transformers' own generate() (never our loop), the others hf_specdec's. Transformers' assisted
generation refuses batch > 1, so it runs at batch 1 only. The --problems prompts are taken `batch`
at a time; each chunk runs every method --repeats times, interleaved (order rotated per round and
chunk). Times are summed over chunks; the spread is that of the per-chunk ratios to plain. Also
per method: target forwards per call and milliseconds per target forward (the call's time over
its target forwards). Greedy; every row is compared with plain and a divergence is re-scored on
plain's prefix (eval/identity.py): identical, diverged at a near-tie, or other (a bug).
Writes docs/results/bench_generate/<name>.{json,md,png}, stamped with commit, versions and
machine, after each (env, batch) cell; a rerun with the same arguments resumes.
"""
from __future__ import annotations

import argparse
import logging
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_specdec.embedded import cpu_kernels
from hf_specdec.testing import exact_cheap_pair
from harness import ForwardCounter, Results, generate, interleaved  # eval/ is on sys.path as a script
from humaneval_data import load_problems, prompt_text
from identity import compare_rows, counts, until_eos
from methods import MethodFactory, parse_methods

logger = logging.getLogger("bench_generate")


def chunks(prompts: list, batch: int) -> list[list]:
    """`prompts` taken `batch` at a time (a last, shorter chunk is dropped unless it is the only one)."""
    out = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    return [c for c in out if len(c) == batch] or out[:1]


def qwen_coder_env(args, onednn=False, kernels=None):
    from hf_specdec.embedded import load_model
    target_load, draft_load = (kernels.target, kernels.draft) if kernels else ({"onednn": onednn},) * 2
    model, tokenizer = load_model("qwen2.5-coder-1.5b-instruct", **target_load)
    draft, _ = load_model("qwen2.5-coder-0.5b-instruct", **draft_load)
    texts = [prompt_text(p, tokenizer, "chat") for p in load_problems(limit=args.problems)]

    def inputs(batch):
        return [dict(tokenizer(c, return_tensors="pt", padding=True, add_special_tokens=False))
                for c in chunks(texts, batch)]
    return model, draft, inputs


def smollm2_env(args):
    from hf_specdec.embedded import load_smollm2
    model, tokenizer = load_smollm2()        # drafters derived from it: @bf16, @int8, @pld
    prompts = [p["prompt"] for p in load_problems(limit=max(args.batch_sizes))]

    def inputs(batch):
        return [dict(tokenizer(prompts[:batch], return_tensors="pt", padding=True))]
    return model, None, inputs


def gemma3_env(args):
    from hf_specdec.embedded import load_model
    model, tokenizer = load_model("gemma-3-270m")
    problems = [p["prompt"] for p in load_problems()]
    texts = []
    for i in range(args.problems):
        text, j = "", i
        while len(tokenizer(text).input_ids) < 448:
            text, j = text + problems[j % len(problems)], j + 1
        texts.append(text)

    def inputs(batch):
        return [dict(tokenizer(c, return_tensors="pt", padding=True)) for c in chunks(texts, batch)]
    return model, None, inputs


def tiny_exact_env(args):
    target, draft = exact_cheap_pair()
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, target.config.vocab_size, (max(args.batch_sizes), 32), generator=gen)

    def inputs(batch):
        ids = prompt_ids[:batch]
        return [dict(input_ids=ids, attention_mask=torch.ones_like(ids))]
    return target, draft, inputs


ENVS = {"qwen-coder": qwen_coder_env, "qwen-coder-onednn": lambda args: qwen_coder_env(args, onednn=True),
        "qwen-coder-cpu": lambda args: qwen_coder_env(args, kernels=cpu_kernels()),
        "smollm2": smollm2_env, "gemma3": gemma3_env, "tiny-exact": tiny_exact_env}
METHODS = "plain,hf-assisted:5@draft,fixed:5@draft,auto@draft"


def run_env(name, args, results: Results):
    model, draft, make_inputs = ENVS[name](args)
    factory = MethodFactory(model, draft_model=draft)        # drafters and policies live for the whole run
    eos = model.generation_config.eos_token_id
    forwards = ForwardCounter(model)
    warm = False
    for batch in args.batch_sizes:
        if results.done({"env": name, "batch": batch}):
            continue
        parts = make_inputs(batch)
        # Transformers' assisted generation refuses batch > 1
        methods = [m for m in args.methods if batch == 1 or m.ours or m.policy is None]
        seconds = {m.name: [] for m in methods}                  # [chunk]: median over repeats
        calls = {m.name: [] for m in methods}                    # per call: (target forwards, MAT numbers)
        tokens, verdicts = 0, {m.name: [] for m in methods}
        chosen = {m.name: {} for m in methods}                   # ours: steps per draft length k
        if not warm:                                             # first use: caches, profiles, kernels
            for method in methods:
                generate(model, factory, method, **parts[0], max_new_tokens=2, do_sample=False)
            warm = True
        for c, inputs in enumerate(tqdm(parts, desc=f"{name} batch={batch}", leave=False)):
            def run(method):
                forwards.count = 0
                out = generate(model, factory, method, **inputs, max_new_tokens=args.max_new_tokens,
                               do_sample=False, return_dict_in_generate=True)
                stats = getattr(out, "spec_stats", None)
                calls[method.name].append((forwards.count, (stats.tokens_generated, sum(r.batch_size for r in
                                                                                        stats.steps)) if stats else None))
                if stats:
                    for r in stats.steps:
                        chosen[method.name][r.k] = chosen[method.name].get(r.k, 0) + 1
                return out.sequences
            timing = interleaved(methods, run, args.repeats, warmup=False, offset=c)
            plain = timing.outputs["plain"]
            tokens += sum(len(until_eos(row, eos)) for row in plain[:, inputs["input_ids"].shape[1]:])
            for method in methods:
                seconds[method.name].append(statistics.median(timing.seconds[method.name]))
                for v in compare_rows(model, inputs["input_ids"], inputs["attention_mask"], plain,
                                      timing.outputs[method.name], eos):
                    verdicts[method.name].append(dict(v, prompt=c * batch + v["row"]))  # index among --problems
        rows = {}
        for method in methods:
            chunk, fwd = seconds[method.name], sum(f for f, _ in calls[method.name])
            ratios = [p / m for p, m in zip(seconds["plain"], chunk)]
            mat = [m for _, m in calls[method.name] if m is not None]
            rows[method.name] = {
                "seconds": [round(t, 3) for t in chunk], "tokens_per_s": round(tokens / sum(chunk), 3),
                "vs_plain": round(sum(seconds["plain"]) / sum(chunk), 3),
                "vs_plain_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "mean_accepted_tokens": round(sum(t for t, _ in mat) / sum(n for _, n in mat), 3) if mat else None,
                "target_forwards": round(fwd / len(calls[method.name]), 2),
                "ms_per_target_forward": round(1e3 * sum(chunk) * args.repeats / fwd, 2) if fwd else None,
                "identity": counts(verdicts[method.name]),
                "steps_per_k": dict(sorted(chosen[method.name].items())),
                "divergences": [v for v in verdicts[method.name] if v["verdict"] != "identical"]}
        for method in methods:                                   # ours against Transformers' assisted
            ref = rows.get(f"hf-assisted:{method.k or 5}@{method.drafter}") if method.ours else None
            rows[method.name]["vs_hf_assisted"] = round(rows[method.name]["tokens_per_s"] / ref["tokens_per_s"], 3) \
                if ref else None
        results.add({"env": name, "batch": batch, "chunks": len(parts), "tokens": tokens, "methods": rows})
        logger.info("%s batch %d: %s", name, batch, {m: r["vs_plain"] for m, r in rows.items()})
    forwards.close()


def markdown(payload) -> str:
    args = payload["args"]
    lines = [f"greedy, max_new_tokens={args['max_new_tokens']}, {args['repeats']} repeat(s), prompts in chunks of "
             "`batch`, methods interleaved per chunk. `plain` and `hf-assisted` are Transformers' own generate(). "
             "vs plain: total time ratio [min, max over chunks]. fwd: target forwards per call; ms/fwd: time per "
             "target forward. identical: rows identical / diverged at a near-tie / other.", "",
             "| env | batch | chunks | method | tokens/s | vs plain | vs hf-assisted | MAT | fwd | ms/fwd | identical |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for cell in payload["cells"]:
        for method, r in cell["methods"].items():
            lo, hi = r["vs_plain_range"]
            i = r["identity"]
            lines.append(f"| {cell['env']} | {cell['batch']} | {cell['chunks']} | {method} | {r['tokens_per_s']:.2f} | "
                         f"{r['vs_plain']:.2f}x [{lo:.2f}, {hi:.2f}] | {fmt(r['vs_hf_assisted'])} | "
                         f"{fmt(r['mean_accepted_tokens'])} | {r['target_forwards']:.1f} | "
                         f"{fmt(r['ms_per_target_forward'])} | {i['identical']} / {i['near_tie']} / {i['other']} |")
    return "\n".join(lines) + "\n"


def plot(payload, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = payload["cells"]
    envs = sorted({c["env"] for c in cells})
    fig, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4), squeeze=False)
    for ax, env in zip(axes[0], envs):
        mine = sorted((c for c in cells if c["env"] == env), key=lambda c: c["batch"])
        names = [n for n in dict.fromkeys(n for c in mine for n in c["methods"]) if n != "plain"]
        width = 0.8 / max(len(names), 1)
        for j, name in enumerate(names):
            pts = [(i, c["methods"][name]) for i, c in enumerate(mine) if name in c["methods"]]
            ys = [r["vs_plain"] for _, r in pts]
            err = [[y - r["vs_plain_range"][0] for y, (_, r) in zip(ys, pts)],
                   [r["vs_plain_range"][1] - y for y, (_, r) in zip(ys, pts)]]
            ax.bar([i + j * width for i, _ in pts], ys, width, yerr=err, capsize=3, label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(mine))], [f"batch {c['batch']}" for c in mine])
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
    parser.add_argument("--problems", type=int, default=16, help="HumanEval prompts (qwen-coder, gemma3)")
    parser.add_argument("--methods", default=METHODS, help="plain first, then eval/methods.py names")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--name", default=None, help="output name (default: the envs)")
    parser.add_argument("--out-dir", default="docs/results/bench_generate")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for env in args.envs.split(","):
        if env not in ENVS:
            parser.error(f"--envs: unknown environment {env!r}; known: {sorted(ENVS)}")
    try:
        args.methods = parse_methods(args.methods)
    except ValueError as e:
        parser.error(f"--methods: {e}")
    if args.methods[0].name != "plain":
        parser.error("--methods must start with plain (the reference)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)

    results = Results(Path(args.out_dir) / (args.name or args.envs.replace(",", "+")),
                      dict(vars(args), methods=[m.name for m in args.methods]), markdown, plot)
    for env in args.envs.split(","):
        run_env(env, args, results)
    print(markdown(results.payload))
    if any(r["identity"]["other"] for c in results.cells for r in c["methods"].values()):
        raise SystemExit("some output diverged from plain generate() other than at a near-tie")


if __name__ == "__main__":
    main()
