"""Side-by-side speed of plain generate(), Transformers' assisted generation and hf_specdec.

    python eval/bench_generate.py --envs qwen-coder-onednn --batch-sizes 1 --problems 10 \
        --methods plain,hf-assisted:5@draft,fixed:5@draft,auto@draft --max-new-tokens 96 --repeats 2

Environments (eval/envs.py): qwen-coder, qwen-coder-onednn, qwen-coder-cpu, qwen-coder-bf16w (the real pair on
HumanEval problems in the chat prompt), smollm2 (drafters derived from it, on raw HumanEval prompts),
gemma3 (on prompts that cross its sliding window while decoding: consecutive HumanEval prompts
joined to >= 448 tokens; drafters derived from it), tiny-exact (a perfect, cheap drafter).
Methods are eval/methods.py names run by eval/harness.py: `plain` and `hf-assisted` are
Transformers' own generate() (never our loop), the others hf_specdec's. Transformers' assisted
generation refuses batch > 1, so it runs at batch 1 only. The --problems prompts are taken `batch`
at a time; each chunk runs every method --repeats times, interleaved (order rotated per round and
chunk). Times are summed over chunks; the spread is that of the per-chunk ratios to plain. Also
per method: target forwards per call and milliseconds per target forward (the call's time over
its target forwards). Greedy; every row is compared with plain and a divergence is re-scored on
plain's prefix (eval/identity.py): identical, diverged at a near-tie, or other (a bug).
With --plain-kernels (qwen-coder envs), the target is loaded once more with each named kernel
(hf_specdec.kernels.KERNELS) and Transformers' plain generate() on it runs as `plain-<kernel>`,
interleaved with the rest: plain at its fastest kernels, where those are not the ones the pair
runs with. Its rows are another model's numbers: compared with plain for information, not checked.
Writes docs/results/bench_generate/<name>.{json,md,png}, stamped with commit, versions and
machine, after each (env, batch) cell; a rerun with the same arguments resumes.
"""
from __future__ import annotations

import logging
from pathlib import Path

from tqdm.auto import tqdm

from hf_specdec.kernels import KERNELS, load_arguments
from envs import ENVS, QWEN, encode, humaneval_texts, random_ids
from harness import (ForwardCounter, Results, arguments, check_identity, generate, ints,  # eval/ is on sys.path
                     over_chunks, parse)
from identity import counts
from methods import Method, MethodFactory, parse_methods
from report import figure, method_bars

logger = logging.getLogger("bench_generate")


def chunks(prompts: list, batch: int) -> list[list]:
    """`prompts` taken `batch` at a time (a last, shorter chunk is dropped unless it is the only one)."""
    out = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    return [c for c in out if len(c) == batch] or out[:1]


def window_texts(tokenizer, problems: int, tokens: int = 448) -> list[str]:
    """`problems` prompts of consecutive HumanEval prompts joined to >= `tokens` tokens."""
    raw = humaneval_texts(tokenizer, "raw")
    texts = []
    for i in range(problems):
        text, j = "", i
        while len(tokenizer(text).input_ids) < tokens:
            text, j = text + raw[j % len(raw)], j + 1
        texts.append(text)
    return texts


def batches(name: str, env, args):
    """batch size -> the chunks of inputs environment `name` runs at that size."""
    if env.tokenizer is None:                    # tiny: random prompts, one chunk
        ids = random_ids(env.model.config.vocab_size, max(args.batch_sizes))
        return lambda batch: [{k: v[:batch] for k, v in ids.items()}]
    if name == "smollm2":                        # raw prompts (a base model's)
        texts = humaneval_texts(env.tokenizer, "raw", limit=args.problems)
        return lambda batch: [encode(env.tokenizer, c) for c in chunks(texts, batch)]
    gemma = name == "gemma3"
    texts = window_texts(env.tokenizer, args.problems) if gemma else humaneval_texts(env.tokenizer, "chat", args.problems)
    return lambda batch: [encode(env.tokenizer, c, chat=not gemma) for c in chunks(texts, batch)]


METHODS = "plain,hf-assisted:5@draft,fixed:5@draft,auto@draft"


def run_env(name, args, results: Results):
    env = ENVS[name]()
    model, make_inputs = env.model, batches(name, env, args)
    # drafters and policies live for the whole run
    factory = MethodFactory(model, draft_model=env.draft, drafters=env.drafters)
    others = {}                                                  # "plain-<kernel>" -> the target with that kernel
    if name.startswith("qwen-coder"):
        from hf_specdec.embedded import load_model
        others = {f"plain-{k}": load_model(QWEN[0], **load_arguments(k))[0] for k in args.plain_kernels}
    forwards = ForwardCounter(model)
    warm = False
    for batch in args.batch_sizes:
        if results.done({"env": name, "batch": batch}):
            continue
        parts = make_inputs(batch)
        # Transformers' assisted generation refuses batch > 1
        methods = [m for m in args.methods if batch == 1 or m.ours or m.policy is None] + [Method(o) for o in others]
        calls = {m.name: [] for m in methods}                    # per call: (target forwards, MAT numbers)
        chosen = {m.name: {} for m in methods}                   # ours: steps per draft length k
        if not warm:                                             # first use: caches, profiles, kernels
            for method in methods:
                generate(others.get(method.name, model), factory, method, **parts[0], max_new_tokens=2,
                         do_sample=False)
            warm = True

        def run(method, inputs):
            forwards.count = 0
            out = generate(others.get(method.name, model), factory, method, **inputs,
                           max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
            stats = getattr(out, "spec_stats", None)
            calls[method.name].append((forwards.count, (stats.tokens_generated, sum(r.batch_size for r in
                                                                                    stats.steps)) if stats else None))
            for r in stats.steps if stats else ():
                chosen[method.name][r.k] = chosen[method.name].get(r.k, 0) + 1
            return out.sequences
        measured = over_chunks(model, methods, tqdm(parts, desc=f"{name} batch={batch}", leave=False), run,
                               args.repeats)
        seconds, verdicts, tokens = measured.seconds, measured.verdicts, measured.tokens
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
        results.add({"env": name, "title": env.title, "batch": batch, "chunks": len(parts), "tokens": tokens,
                     "methods": rows})
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
    envs = sorted({c["env"] for c in payload["cells"]})
    with figure(path, cols=len(envs)) as axes:
        for ax, env in zip(axes[0], envs):
            method_bars(ax, sorted((c for c in payload["cells"] if c["env"] == env), key=lambda c: c["batch"]),
                        lambda r: r.get("vs_plain"), lambda r: r["vs_plain_range"])
            ax.set_title(env)
            ax.legend(fontsize=7)


def main(argv=None):
    parser = arguments(__doc__, "qwen-coder")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--problems", type=int, default=16, help="HumanEval prompts (qwen-coder, smollm2, gemma3)")
    parser.add_argument("--methods", default=METHODS, help="plain first, then eval/methods.py names")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--plain-kernels", default="", help=f"plain generate() also on the target loaded with "
                        f"these kernels ({', '.join(KERNELS)}; qwen-coder envs)")
    parser.add_argument("--name", default=None, help="output name (default: the envs)")
    parser.add_argument("--out-dir", default="docs/results/bench_generate")
    args = parse(parser, argv, ENVS)
    args.batch_sizes = ints(args.batch_sizes)
    args.plain_kernels = [k for k in args.plain_kernels.split(",") if k]
    if any(k not in KERNELS for k in args.plain_kernels):
        parser.error(f"--plain-kernels: names among {', '.join(KERNELS)}, got {args.plain_kernels}")
    try:
        args.methods = parse_methods(args.methods, first="plain")
    except ValueError as e:
        parser.error(f"--methods: {e}")

    results = Results(Path(args.out_dir) / (args.name or args.envs.replace(",", "+")),
                      dict(vars(args), methods=[m.name for m in args.methods]), markdown, plot)
    for env in args.envs.split(","):
        run_env(env, args, results)
    print(markdown(results.payload))
    check_identity({f"{c['env']} batch {c['batch']} {m}": r for c in results.cells for m, r in c["methods"].items()
                    if not m.startswith("plain-")})


if __name__ == "__main__":
    main()
