"""The speed budget of one decoding step on the real pair, per kernel choice: where the time goes.

    python eval/step_budget.py --kernels onednn,onednn+int8-draft,int8-per-token --problems 3 \
        --max-new-tokens 32

For each kernel choice (how the pair's linear layers compute, KERNELS) the pair is loaded once, then
  forwards  each model's forward time by width (1, 2, 3, 5, 6, 9 tokens, interleaved) after a chat prompt: what
            verifying k drafts costs next to a one-token step, and what a draft step costs;
  steps     plain generate() (Transformers' own) and our loop with fixed k = 0..8 drafts from the
            0.5B, prompt lookup, the hierarchy (lookup -> 0.5B -> 1.5B) and the default policy, on
            the same held-out HumanEval chat prompts, interleaved per prompt. Each of our steps is
            split into the phases the loop times: drafting (draft forwards and catch-ups),
            verification (the target's forward and `verify`) and the loop's own host work; with the
            tokens a step emits (MAT) and tokens/s against plain of the same kernels.
Greedy; every output is compared with plain generate() of the same kernels (eval/identity.py).
Writes docs/results/step_budget/<name>.{json,md,png} after each kernel choice; a rerun resumes.
"""
from __future__ import annotations

import logging
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_specdec.kernels import cpu_bf16_matmul, cpu_kind, load_arguments
from envs import encode, qwen_coder
from harness import Results, arguments, forward_ms, generate, over_chunks, parse  # eval/ is on sys.path
from humaneval_data import load_problems, prompt_text
from identity import counts
from methods import MethodFactory, parse_methods
from report import figure

logger = logging.getLogger("step_budget")

# name -> (target's load_model arguments, the draft's)
KERNELS = {
    "fp32": ({"dtype": torch.float32}, {"dtype": torch.float32}),
    "onednn": (load_arguments("onednn"), load_arguments("onednn")),
    "onednn+int8-draft": (load_arguments("onednn"), load_arguments("int8")),
    "int8-per-token": ({"int8": "per-token"}, {"int8": "per-token"}),
    "bf16": (load_arguments("bf16"), load_arguments("bf16")),
    "bf16+int8-draft": (load_arguments("bf16"), load_arguments("int8")),
    "bf16-packed+int8-draft": (load_arguments("bf16-packed"), load_arguments("int8")),
    "fp32-packed+int8-draft": (load_arguments("fp32-packed"), load_arguments("int8")),
    "bf16w+int8-draft": (load_arguments("bf16w"), load_arguments("int8")),
    "onednn+int4-draft": (load_arguments("onednn"), load_arguments("int4")),
    "onednn+int8-vocab-draft": (load_arguments("onednn"), {**load_arguments("int8"), "draft_vocab": 32768}),
}
SETTINGS = ("plain," + ",".join(f"fixed:{k}@draft" for k in range(9)) + ",fixed:4@pld,fixed:8@pld,fixed:4@hier,"
            "auto@draft,auto@hier")
# held out: not the demo's problems
PROBLEMS = ["HumanEval/15", "HumanEval/31", "HumanEval/52", "HumanEval/60", "HumanEval/101", "HumanEval/124"]
WIDTHS = (1, 2, 3, 5, 6, 9)


def step_phases(stats) -> dict:
    """Milliseconds per step of each phase our loop times, and tokens per step, over a call's
    steps after the first (whose verification is the target's prefill, and whose drafting the
    draft's: `prefill_ms` is that step's time)."""
    first, steps = stats.steps[0], stats.steps[1:]
    per = lambda f: 1e3 * sum(f(s) for s in steps) / len(steps)  # noqa: E731
    return {"steps": len(steps), "draft_ms": per(lambda s: s.draft_s or 0.0), "verify_ms": per(lambda s: s.verify_s),
            "host_ms": per(lambda s: s.overhead_s), "tokens": sum(sum(s.emitted) for s in steps),
            "prefill_ms": 1e3 * ((first.draft_s or 0.0) + first.verify_s + first.overhead_s)}


def run_kernel(kernel: str, args, results: Results) -> None:
    env = qwen_coder(*KERNELS[kernel])
    texts = [prompt_text(p, env.tokenizer, "chat") for p in load_problems(problems=PROBLEMS[:args.problems])]
    prompts = [encode(env.tokenizer, [t], chat=True) for t in texts]
    results.add(dict(kernel=kernel, cpu_bf16_matmul=cpu_bf16_matmul(), **budget(env.model, env.draft, prompts, args)))
    logger.info("%s: %s", kernel, {m: r["vs_plain"] for m, r in results.cells[-1]["methods"].items()})


def budget(target, draft, prompts: list[dict], args) -> dict:
    """One kernel choice's cell: forward times by width and every method's steps, over `prompts`
    (each {"input_ids": [1, p], "attention_mask": [1, p]})."""
    forwards = {"target": forward_ms(target, prompts[0]["input_ids"], WIDTHS),
                "draft": forward_ms(draft, prompts[0]["input_ids"], WIDTHS)}
    logger.info("forwards (ms by width): %s", forwards)

    factory = MethodFactory(target, draft_model=draft)
    methods = args.methods
    phases = {m.name: [] for m in methods}
    for method in methods:                                   # warm: kernels, the default policy's profile
        generate(target, factory, method, **prompts[0], max_new_tokens=2, do_sample=False)

    def run(method, inputs):
        out = generate(target, factory, method, **inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                       return_dict_in_generate=True)
        if getattr(out, "spec_stats", None) is not None and len(out.spec_stats.steps) > 1:
            phases[method.name].append(step_phases(out.spec_stats))
        return out.sequences
    measured = over_chunks(target, methods, tqdm(prompts, desc="prompts", leave=False), run)
    seconds, verdicts, tokens = measured.seconds, measured.verdicts, measured.tokens
    rows = {}
    for method in methods:
        total = sum(seconds[method.name])
        row = {"tokens_per_s": round(tokens / total, 3),
               "vs_plain": round(sum(seconds["plain"]) / total, 3),
               "vs_plain_per_prompt": [round(p / s, 3) for p, s in zip(seconds["plain"], seconds[method.name])],
               "identity": counts(verdicts[method.name])}
        if phases[method.name]:
            calls = phases[method.name]
            steps = sum(c["steps"] for c in calls)
            mean = lambda key: round(sum(c[key] * c["steps"] for c in calls) / steps, 2)  # noqa: E731
            row.update(draft_ms=mean("draft_ms"), verify_ms=mean("verify_ms"), host_ms=mean("host_ms"),
                       tokens_per_step=round(sum(c["tokens"] for c in calls) / steps, 3),
                       prefill_ms=round(statistics.mean(c["prefill_ms"] for c in calls), 1))
        else:     # Transformers' plain generate(): one token a step
            row.update(step_ms=round(1e3 * total / tokens, 2))
        rows[method.name] = row
    return {"prompts": len(prompts), "prompt_tokens": [int(p["input_ids"].shape[1]) for p in prompts],
            "tokens": tokens, "forward_ms": forwards, "methods": rows}


def markdown(payload) -> str:
    args = payload["args"]
    lines = [f"The real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), batch 1, greedy, {args['max_new_tokens']} new "
             f"tokens on held-out HumanEval chat prompts, methods interleaved per prompt. Per step of our loop after "
             "the first (the prefill, its own column): milliseconds drafting, verifying (target forward + verify) "
             "and in the loop's host work, and tokens emitted; plain is Transformers' own generate() (its ms a "
             "token, prefill included).", ""]
    for cell in payload["cells"]:
        fwd = cell["forward_ms"]
        lines += [f"### {cell['kernel']}", "",
                  "forward ms by width: target " + ", ".join(f"{w}: {ms}" for w, ms in fwd["target"].items())
                  + "; draft " + ", ".join(f"{w}: {ms}" for w, ms in fwd["draft"].items()), "",
                  "| method | tokens/s | vs plain [per prompt] | prefill ms | draft ms | verify ms | host ms | tokens/step "
                  "| identical |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for name, r in cell["methods"].items():
            per = r["vs_plain_per_prompt"]
            i = r["identity"]
            step = [f"{r[k]:.1f}" if k in r else "-" for k in ("prefill_ms", "draft_ms", "verify_ms", "host_ms")]
            if "step_ms" in r:
                step = ["-", "-", f"{r['step_ms']:.1f} (a token)", "-"]
            lines.append(f"| {name} | {r['tokens_per_s']:.2f} | {r['vs_plain']:.2f}x [{min(per):.2f}, {max(per):.2f}] | "
                         f"{' | '.join(step)} | {r.get('tokens_per_step', 1.0):.2f} | "
                         f"{i['identical']} / {i['near_tie']} / {i['other']} |")
        lines.append("")
    return "\n".join(lines)


def plot(payload, path: Path) -> None:
    """Per kernel: ms per generated token of each fixed k after the prefill, stacked by phase, with
    a plain step's (one target forward) line."""
    cells = payload["cells"]
    with figure(path, cols=len(cells), size=(5 * len(cells), 4)) as axes:
        for ax, cell in zip(axes[0], cells):
            ks = [(int(n.split(":")[1].split("@")[0]), r) for n, r in cell["methods"].items()
                  if n.startswith("fixed:") and n.endswith("@draft")]
            bottom = [0.0] * len(ks)
            for phase, colour in (("verify_ms", "tab:blue"), ("draft_ms", "tab:orange"), ("host_ms", "tab:grey")):
                heights = [r[phase] / r["tokens_per_step"] for _, r in ks]
                ax.bar([k for k, _ in ks], heights, bottom=bottom, color=colour, label=phase.split("_")[0])
                bottom = [b + h for b, h in zip(bottom, heights)]
            one_token = cell["forward_ms"]["target"]
            ax.axhline(one_token.get(1, one_token.get("1")), color="black", lw=1, label="a one-token target forward")
            ax.set_xlabel("k (drafts a step, 0.5B)")
            ax.set_ylabel("ms per generated token")
            ax.set_title(cell["kernel"])
            ax.legend(fontsize=7)


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--kernels", default="onednn,onednn+int8-draft,int8-per-token")
    parser.add_argument("--problems", type=int, default=3, help=f"how many of {PROBLEMS}")
    parser.add_argument("--methods", default=SETTINGS, help="plain first, then eval/methods.py names")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--name", default=None, help="output name (default: the CPU's kind, kernels.cpu_kind)")
    parser.add_argument("--out-dir", default="docs/results/step_budget")
    args = parse(parser, argv)
    kernels = args.kernels.split(",")
    for kernel in kernels:
        if kernel not in KERNELS:
            parser.error(f"--kernels: unknown {kernel!r}; known: {sorted(KERNELS)}")
    if not 1 <= args.problems <= len(PROBLEMS):
        parser.error(f"--problems must be in [1, {len(PROBLEMS)}]")
    try:
        args.methods = parse_methods(args.methods, first="plain")
    except ValueError as e:
        parser.error(str(e))
    name = args.name or cpu_kind()       # one file per CPU kind (the AVX-512 Xeon's is no-bf16-matmul)
    results = Results(Path(args.out_dir) / name, dict(vars(args), kernels=kernels,
                                                      methods=[m.name for m in args.methods]), markdown, plot)
    for kernel in kernels:
        if not results.done({"kernel": kernel}):
            run_kernel(kernel, args, results)
    print(markdown(results.payload))


if __name__ == "__main__":
    main()
