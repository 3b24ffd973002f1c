"""Draft-length policies side by side across batch sizes: plain, fixed k = 0..8, Transformers'
heuristic and confidence schedules, the default (MeasuredGoodput: "auto" learning across runs,
"auto-first" a fresh one every run, i.e. a first call), DSD goodput, AdaSpec and Nightjar.

    python eval/bench_lengths.py --envs tiny-exact,tiny-useless,smollm2-bf16 --batch-sizes 1,2,4,8,16 \
        --max-new-tokens 48 --repeats 2 --out results/bench_lengths

Environments (greedy; every output is checked against plain generate()):
  tiny-exact      8-layer Llama with zeroed upper layers + its exact 1-layer draft (cheap, perfect)
  tiny-partial    the same with upper layers at 5% strength: the 1-layer draft agrees ~74% of the time
  tiny-useless    the same target with an unrelated random 1-layer draft (nothing pays)
  smollm2-<bf16|int8|pld>  the embedded SmolLM2-135M-Instruct on HumanEval prompts with that drafter
  qwen-coder      the real pair: Qwen2.5-Coder-1.5B-Instruct with the 0.5B as drafter (bf16), on
                  HumanEval problems in the chat prompt
  qwen-coder-onednn  the same in float32 with oneDNN linear layers (for CPUs without bf16 matrix
                  instructions: hf_specdec.embedded.use_onednn_linears)
Each environment is profiled first (`hf_specdec.costmodel.profile`, the `python -m hf_specdec
profile` measurement) for AdaSpec, DSD and Nightjar's switching cost, when one of them runs. Policy objects live for the
whole environment, so Nightjar learns per batch size across runs, as a server would; before the
timed runs of a batch size, the learning policies get --learn-runs untimed runs of it. Besides the
fixed batch sizes, a "changing" run starts --changing-rows rows whose output budgets range from 4
tokens to --max-new-tokens (--changing-spread: evenly, geometrically, or bimodal: a few long rows
among short ones), so the batch shrinks as rows finish. fixed:0 decodes plain in our
loop, which drops finished rows from the batch (Transformers' plain generate() keeps computing
them until the last row is done): the control for what speculation itself adds there.
The oracle (the best of plain and fixed k by median tokens/s) is the largest of ten noisy
numbers, so measured in the same runs that chose it, it is inflated by the luckiest one (winner's
curse: with ~10% run-to-run noise and near-tied k, ~10%), and every method looks worse than it is
against it. So a second, confirming round (--confirm-repeats) times plain, the chosen oracle and
the other methods again, interleaved, and reports each method's speed over the oracle's and over
plain's as the median of per-repeat ratios with a bootstrap 90% interval: those are the numbers
to judge a policy by.
Writes <out>.json, <out>.md (tokens/s per method and batch size, the oracle = best fixed k) and
<out>.png (k chosen over time in the changing run). The .json also holds, per method, each timed
run's drafting steps and, of the last run, k over time and `tail_share`: its time after the first
row finished (under speculation a static batch's rows drift apart: the call waits for the slowest).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec
from hf_specdec.costmodel import CostProfile, profile
from hf_specdec.testing import build, layer_skip_pair
from humaneval_data import load_problems, prompt_text  # eval/ is on sys.path when run as a script
from identity import compare_rows, counts, until_eos
from report import machine_line, stamp, stamp_line

logger = logging.getLogger("bench_lengths")
FIXED = range(0, 9)    # fixed:0: plain decoding in our loop
LEARNING = ("hf-heuristic", "auto", "dsd", "adaspec", "nightjar", "nightjar-exact")   # policies whose state improves with use
PROFILED = ("dsd", "adaspec", "nightjar", "nightjar-exact")     # policies that weigh the environment's profile
# plain-again: plain generate() timed a second time, a control whose ratio to plain is the noise floor;
# auto: the default policy (MeasuredGoodput), learning across runs; auto-first: a fresh one every run (a first call)
METHODS = ["plain", "plain-again", *(f"fixed:{k}" for k in FIXED), "hf-heuristic", "hf-confidence", "auto-first",
           *LEARNING[1:]]


class RowBudget(StoppingCriteria):
    """Stops row b once it has `budget[b]` new tokens (rows finish at very different times)."""

    def __init__(self, prompt_len: int, budget: list[int]):
        self.prompt_len, self.budget = prompt_len, torch.tensor(budget)

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.prompt_len) >= self.budget.to(input_ids.device)


def tiny_env(kind: str):
    # partial: the draft skips 7 layers that write 5% of their output: ~74% of drafts agree
    target, draft = layer_skip_pair({"exact": 0.0, "partial": 0.05, "useless": 0.0}[kind])
    if kind == "useless":
        draft = build("llama", 1, seed=99, vocab=target.config.vocab_size, hidden=384, init=0.05)
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = 0
    ids = torch.randint(3, target.config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(0))
    return target, hf_specdec.ModelDrafter(draft, name=f"{kind}-1layer"), \
        lambda b: {"input_ids": ids[:b], "attention_mask": torch.ones_like(ids[:b])}


_SMOLLM2 = {}


def smollm2_env(kind: str):
    if not _SMOLLM2:
        from hf_specdec.embedded import load_smollm2
        model, tokenizer = load_smollm2()
        prompts = [p["prompt"] for p in load_problems(limit=64)]
        _SMOLLM2.update(model=model, inputs=lambda b: dict(tokenizer(prompts[:b], return_tensors="pt", padding=True)))
    model = _SMOLLM2["model"]
    drafter = hf_specdec.PromptLookupDrafter() if kind == "pld" else hf_specdec.self_draft(model, kind)
    return model, drafter, _SMOLLM2["inputs"]


def qwen_coder_env(onednn=False):
    from hf_specdec.embedded import load_model
    model, tokenizer = load_model("qwen2.5-coder-1.5b-instruct", onednn=onednn)
    draft, _ = load_model("qwen2.5-coder-0.5b-instruct", onednn=onednn)
    texts = [prompt_text(p, tokenizer, "chat") for p in load_problems(limit=64)]
    return model, hf_specdec.ModelDrafter(draft, name="qwen-0.5b"), \
        lambda b: dict(tokenizer(texts[:b], return_tensors="pt", padding=True, add_special_tokens=False))


ENVS = {"qwen-coder": qwen_coder_env, "qwen-coder-onednn": lambda: qwen_coder_env(onednn=True),
        "tiny-exact": lambda: tiny_env("exact"), "tiny-partial": lambda: tiny_env("partial"),
        "tiny-useless": lambda: tiny_env("useless"),
        "smollm2-bf16": lambda: smollm2_env("bf16"), "smollm2-int8": lambda: smollm2_env("int8"),
        "smollm2-pld": lambda: smollm2_env("pld")}


def env_profile(target, drafter, batch_sizes, context) -> CostProfile:
    # switching lags up to a whole prompt: a call's first drafts catch up its prompt; a lookup
    # drafter has no model and costs (almost) nothing
    grid = dict(widths=(1, 3, 5, 8), contexts=(context, 2 * context), lags=sorted({1, 4, 16, context}), repeats=2)
    return profile(target, getattr(drafter, "model", None), batch_sizes, **grid)


def policies(prof: CostProfile | None, max_len: int) -> dict:
    """Policy objects by method (None: plain generate()); a callable: a fresh policy per run.
    prof: None leaves out the methods that weigh one."""
    out = {"plain": None, "plain-again": None}
    out.update({f"fixed:{k}": hf_specdec.FixedLength(k) for k in FIXED})
    out.update({"hf-heuristic": hf_specdec.HFHeuristic(), "hf-confidence": hf_specdec.ConfidenceThreshold(),
                "auto": hf_specdec.MeasuredGoodput(), "auto-first": hf_specdec.MeasuredGoodput})
    if prof is not None:
        out.update({"dsd": hf_specdec.DSDGoodput(prof, max_len=max_len),
                    "adaspec": hf_specdec.AdaSpec(prof, max_len=max_len),
                    "nightjar": hf_specdec.Nightjar(max_len=max_len, switch_cost=prof),
                    # the paper's one bandit per batch size, against the default's one per power of two
                    "nightjar-exact": hf_specdec.Nightjar(max_len=max_len, switch_cost=prof, buckets="exact")})
    return out


def run(model, drafter, policy, inputs, args, criteria=None):
    kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    if criteria is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([criteria])
    if policy is not None:
        kwargs.update(assistant_models=[drafter], spec_policy=policy() if isinstance(policy, type) else policy)
    start = time.perf_counter()
    out = model.generate(**kwargs)
    return out, time.perf_counter() - start


def timed_rounds(order: list[str], repeats: int, desc: str, run_one) -> tuple[dict, dict, dict]:
    """`repeats` rounds of `run_one(method) -> (output, seconds)` over `order`, each round starting
    one method later (a slow spell of the machine hits all methods alike). Returns the last output,
    the seconds and the drafting steps (k > 0: noise or policy?) of each run, per method."""
    outs, times, drafting = {}, {m: [] for m in order}, {m: [] for m in order}
    for repeat in tqdm(range(repeats), desc=desc, leave=False):
        for m in order[repeat % len(order):] + order[:repeat % len(order)]:
            outs[m], seconds = run_one(m)
            times[m].append(seconds)
            stats = getattr(outs[m], "spec_stats", None)
            drafting[m].append(sum(s.k > 0 for s in stats.steps) if stats else 0)
    return outs, times, drafting


def paired_speed(reference: list[float], seconds: list[float], resamples: int = 2000) -> dict:
    """Speed over a reference timed in the same rounds: the median of per-round ratios
    reference / seconds (> 1: faster), with a bootstrap 90% interval of that median."""
    ratios = [r / s for r, s in zip(reference, seconds)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {"median": round(statistics.median(ratios), 3),
            "ci90": [round(medians[int(0.05 * resamples)], 3), round(medians[int(0.95 * resamples) - 1], 3)]}


def new_tokens(out, prompt_len, eos):
    """New tokens of all rows, each up to and including its first EOS."""
    return sum(len(until_eos(row, eos)) for row in out.sequences[:, prompt_len:])


def changing_budgets(rows: int, longest: int, spread: str) -> list[int]:
    """New-token budgets of the changing run's rows: from 4 to `longest` spaced evenly ("linear":
    the batch shrinks steadily, so most of the time is spent at large batch sizes) or by a constant
    factor ("geometric": most rows short, a few long, as served output lengths are); or "bimodal":
    one row in 16 runs to `longest`, the others to a quarter of it (short answers beside a few long
    ones: about as much time at the full batch as at a sixteenth of it)."""
    if spread == "bimodal":
        return [longest if i % 16 == 15 else max(longest // 4, 1) for i in range(rows)]
    frac = [i / max(rows - 1, 1) for i in range(rows)]
    if spread == "linear":
        return [round(4 + (longest - 4) * f) for f in frac]
    return [round(4 * (longest / 4) ** f) for f in frac]


def run_env(name, args, save=lambda results: None, done: dict | None = None) -> dict:
    """Every method on every batch size of one environment; `save(results)` after each batch size.
    `done`: this environment's results of an interrupted run; its batch sizes are not run again."""
    model, drafter, make_inputs = ENVS[name]()
    hf_specdec.enable(model)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    changing = [("changing", args.changing_rows)] if args.changing_rows else []
    # profiled at every batch size timed, and at the powers of two the changing run shrinks through
    shrinking = {b for _, rows in changing for b in (rows, *(2 ** i for i in range(rows.bit_length())))}
    # a resumed run keeps the profile it measured, so every batch size's policies weigh the same one
    if not any(m in PROFILED for m in args.methods):
        prof = None                 # the profile alone takes minutes on a CPU
    elif done and "switch" in done.get("profile", {}):
        prof = CostProfile.from_dict(done["profile"])
    else:
        prof = env_profile(model, drafter, sorted({*args.batch_sizes, *shrinking}), make_inputs(1)["input_ids"].shape[1])
    methods = {m: p for m, p in policies(prof, args.max_len).items() if m in args.methods}
    results = {"batches": {}, **(done or {}), "profile": asdict(prof) if prof else {}}
    save(results)                 # the profile alone takes minutes on a CPU: a resumed run reuses it
    for batch, rows in [(b, b) for b in args.batch_sizes] + changing:
        if str(batch) in results["batches"]:
            continue
        inputs = make_inputs(rows)
        prompt_len = inputs["input_ids"].shape[1]
        criteria = None
        if batch == "changing":
            budget = changing_budgets(rows, args.max_new_tokens, args.changing_spread)
            criteria = RowBudget(prompt_len, budget)
        run(model, drafter, None, inputs, argparse.Namespace(max_new_tokens=2), None)          # warm-up
        for _ in range(args.learn_runs):          # learning policies see this batch size first, untimed
            for m in (m for m in LEARNING if m in methods):
                run(model, drafter, methods[m], inputs, args, criteria)
        def run_one(m, inputs=inputs, criteria=criteria):
            return run(model, drafter, methods[m], inputs, args, criteria)
        outs, times, drafting = timed_rounds(list(methods), args.repeats, f"{name} batch={batch}", run_one)
        plain = outs["plain"].sequences
        tokens = new_tokens(outs["plain"], prompt_len, eos)

        def identity(out):      # identical / first divergence at a near-tie of the dtype / other (a bug)
            return counts(compare_rows(model, inputs["input_ids"], inputs.get("attention_mask"), plain,
                                       out.sequences, eos))
        rows_out = {}
        for m, out in outs.items():
            stats = getattr(out, "spec_stats", None)
            rows_out[m] = {
                "tokens_per_s": round(tokens / statistics.median(times[m]), 2),
                "tokens_per_s_fastest": round(tokens / min(times[m]), 2),
                "seconds": [round(t, 4) for t in times[m]],
                "drafting_steps": drafting[m],
                "identity": identity(out),
                "mean_accepted_tokens": round(stats.mean_accepted_tokens, 3) if stats else 1.0,
                # the last run's time in steps after its first row finished: speculation drifts a
                # static batch's rows apart, and the call waits for the slowest at a smaller batch
                "tail_share": round(sum(s.seconds for s in stats.steps if s.batch_size < rows)
                                    / sum(s.seconds for s in stats.steps), 3) if stats else None,
                "k_over_time": [(s.batch_size, s.k, max(s.proposed, default=0)) for s in stats.steps] if stats else [],
            }
        plain_tps = rows_out["plain"]["tokens_per_s"]
        for r in rows_out.values():
            r["vs_plain"] = round(r["tokens_per_s"] / plain_tps, 3)
        fixed = {m: rows_out[m]["tokens_per_s"] for m in rows_out if m == "plain" or m.startswith("fixed:")}
        oracle = max(fixed, key=fixed.get)
        # by each method's fastest run too: on a shared CPU other work only ever adds time, so the
        # fastest run is the least disturbed one (the same for the oracle: its best fixed k's fastest)
        best_fastest = max(rows_out[m]["tokens_per_s_fastest"] for m in fixed)
        for r in rows_out.values():
            r["vs_oracle"] = round(r["tokens_per_s"] / fixed[oracle], 3)
            r["vs_oracle_fastest"] = round(r["tokens_per_s_fastest"] / best_fastest, 3)
        key = "changing" if batch == "changing" else str(batch)
        results["batches"][key] = {"oracle": oracle, "methods": rows_out}
        if args.confirm_repeats:
            # fresh runs of the chosen oracle beside plain and every method that is not a fixed k; on
            # the changing run every fixed k (the target there: above each of them)
            every_k = batch == "changing"
            confirm = ["plain"] + [m for m in methods if m != "plain" and (m == oracle or m not in fixed or every_k)]
            c_outs, c_times, c_drafting = timed_rounds(confirm, args.confirm_repeats,
                                                       f"{name} batch={batch} confirm", run_one)
            results["batches"][key]["confirm"] = {m: {
                "seconds": [round(t, 4) for t in c_times[m]],
                "drafting_steps": c_drafting[m],           # per run: is a slow run the policy's or the machine's?
                "x_oracle": paired_speed(c_times[oracle], c_times[m]),
                "x_plain": paired_speed(c_times["plain"], c_times[m]),
                **({"x_fixed": {k: paired_speed(c_times[k], c_times[m]) for k in confirm if k.startswith("fixed:")}}
                   if every_k and m not in fixed else {}),
                "identity": identity(c_outs[m]),
            } for m in confirm}
        logger.info("%s batch=%s oracle=%s %s", name, batch, oracle,
                    {m: r["tokens_per_s"] for m, r in rows_out.items()})
        save(results)
    return results


def identity_mark(identity: dict) -> str:
    """"" when every row is identical to plain; else " ~n" (n rows first diverge at a near-tie) and/or
    " ≠n" (n rows diverge otherwise: a bug)."""
    return "".join(f" {sign}{identity[v]}" for v, sign in (("near_tie", "~"), ("other", "≠")) if identity[v])


def markdown(all_results: dict, args) -> str:
    changing = f"; changing run: {args.changing_rows} rows, {args.changing_spread} budgets" if args.changing_rows else ""
    lines = [f"# Draft-length policies: greedy, {args.max_new_tokens} new tokens, median of {args.repeats} runs{changing}", ""]
    for env, res in all_results.items():
        batches = list(res["batches"])
        if not batches:              # profiled, nothing timed yet
            continue
        methods = list(res["batches"][batches[0]]["methods"])
        lines += [f"## {env}: tokens/s (x oracle = best of plain and fixed k: by medians / by fastest runs)", "",
                  "| method | " + " | ".join(f"B={b}" for b in batches) + " |",
                  "|---|" + "---:|" * len(batches)]
        for m in methods:
            cells = []
            for b in batches:
                r = res["batches"][b]["methods"][m]
                mark = identity_mark(r["identity"])
                fastest = f" / {r['vs_oracle_fastest']:.2f}" if "vs_oracle_fastest" in r else ""
                cells.append(f"{r['tokens_per_s']:.1f} ({r['vs_oracle']:.2f}{fastest}){mark}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("| oracle | " + " | ".join(res["batches"][b]["oracle"] for b in batches) + " |")
        lines += ["", "plain-again is plain generate() timed a second time: its distance from plain's ratio is "
                  "the noise of this machine, not a method's merit. ~n: n rows first differ from plain at a "
                  "near-tie of the target's dtype (re-scored, eval/identity.py); ≠n: n rows differ otherwise.", ""]
        confirmed = [b for b in batches if "confirm" in res["batches"][b]]
        if confirmed:
            shown = list(dict.fromkeys(m for b in confirmed for m in res["batches"][b]["confirm"]))
            lines += [f"### {env}: confirming round, {args.confirm_repeats} fresh interleaved runs: speed "
                      "x oracle / x plain, medians of per-run ratios [bootstrap 90% interval of x oracle]", "",
                      "| method | " + " | ".join(f"B={b} ({res['batches'][b]['oracle']})"
                                               for b in confirmed) + " |",
                      "|---|" + "---:|" * len(confirmed)]
            for m in shown:
                cells = []
                for b in confirmed:
                    r = res["batches"][b]["confirm"].get(m)
                    if r is None:
                        cells.append("")
                        continue
                    (lo, hi), mark = r["x_oracle"]["ci90"], identity_mark(r["identity"])
                    cells.append(f"{r['x_oracle']['median']:.2f} / {r['x_plain']['median']:.2f} "
                                 f"[{lo:.2f}, {hi:.2f}]{mark}")
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
            lines.append("")
        against = {m: r["x_fixed"] for m, r in res["batches"].get("changing", {}).get("confirm", {}).items()
                   if "x_fixed" in r}
        if against:
            ks = list(next(iter(against.values())))
            lines += [f"### {env}: changing run, confirming round: speed x each fixed k [bootstrap 90% interval]", "",
                      "| method | " + " | ".join(ks) + " |", "|---|" + "---:|" * len(ks)]
            lines += [f"| {m} | " + " | ".join(f"{r[k]['median']:.2f} [{r[k]['ci90'][0]:.2f}, {r[k]['ci90'][1]:.2f}]"
                                               for k in ks) + " |" for m, r in against.items()]
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(all_results: dict, path: Path) -> None:
    """Per environment: speed x plain per batch size of the best fixed k and of each policy; and, when
    there is a changing run, the drafts per step of the policies there against the active batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    envs = list(all_results)
    cols = 2 if any("changing" in all_results[e]["batches"] for e in envs) else 1
    fig, axes = plt.subplots(len(envs), cols, figsize=(5.5 * cols, 3.4 * len(envs)), squeeze=False)
    for row, env in zip(axes, envs):
        batches = all_results[env]["batches"]
        sizes = [b for b in batches if b != "changing"]
        if sizes:
            speed = {m: [batches[b]["methods"][m]["vs_plain"] for b in sizes] for m in batches[sizes[0]]["methods"]
                     if not m.startswith(("fixed:", "plain"))}
            speed["oracle (best fixed k)"] = [batches[b]["methods"][batches[b]["oracle"]]["vs_plain"] for b in sizes]
            for m, ys in speed.items():
                row[0].plot(range(len(sizes)), ys, marker="o", label=m, lw=2.5 if m.startswith("oracle") else 1.2)
            row[0].axhline(1.0, color="grey", ls="--", lw=0.8)
            row[0].set_xticks(range(len(sizes)), [f"B={b}" for b in sizes])
            row[0].set_ylabel("speed x plain generate()")
            row[0].set_title(f"{env}: tokens/s over plain")
            row[0].legend(fontsize=7)
        if cols == 1:
            continue
        changing = batches.get("changing", {}).get("methods", {})
        shown = [m for m in ("auto", "auto-first", "nightjar", "adaspec", "dsd", "hf-heuristic") if m in changing]
        for m in shown:
            row[1].plot([s[2] for s in changing[m]["k_over_time"]], label=m, drawstyle="steps-post")
        if shown:
            twin = row[1].twinx()
            twin.plot([s[0] for s in changing[shown[0]]["k_over_time"]], color="grey", ls=":")
            twin.set_ylabel(f"active batch size ({shown[0]} run, dotted)")
            row[1].set_title(f"{env}: drafts per step as the batch shrinks")
            row[1].set_xlabel("step")
            row[1].legend(fontsize=7)
        else:
            row[1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_env_args(parser: argparse.ArgumentParser, argv, envs: dict) -> argparse.Namespace:
    """Parse; --batch-sizes to ints, --envs checked against `envs`; logging on, autograd off."""
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]   # "": the changing run only
    unknown = [e for e in args.envs.split(",") if e not in envs]
    if unknown:
        parser.error(f"--envs: unknown {unknown}; known: {sorted(envs)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)
    return args


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="tiny-exact,tiny-useless,smollm2-bf16")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=6, help="largest k of the adaptive policies")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--confirm-repeats", type=int, default=10,
                        help="fresh interleaved runs of plain, the chosen oracle and the non-fixed methods "
                             "(0: none)")
    parser.add_argument("--learn-runs", type=int, default=2,
                        help="untimed runs of the learning policies per batch size before timing (0: none)")
    parser.add_argument("--changing-rows", type=int, default=16,
                        help="rows of the run whose batch shrinks as rows finish (0: skip it; tiny envs: up to 64)")
    parser.add_argument("--changing-spread", choices=("linear", "geometric", "bimodal"), default="linear",
                        help="how the changing run's output budgets spread from 4 to --max-new-tokens")
    parser.add_argument("--out", default="results/bench_lengths")
    parser.add_argument("--methods", default=None, help="comma-separated subset (default: all; plain is always run)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the profile and the batch sizes already in <out>.json and run the others "
                             "(learning policies start afresh); refused for a run from another kind of machine")
    args = parse_env_args(parser, argv, ENVS)
    args.methods = ["plain"] + [m for m in (args.methods or ",".join(METHODS)).split(",") if m != "plain"]
    if any(m not in METHODS for m in args.methods):
        parser.error(f"--methods: unknown {[m for m in args.methods if m not in METHODS]}; known: {METHODS}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_stamp = stamp()
    all_results, runs = {}, [run_stamp]   # the code and machine of every start: a resumed run may span commits
    if args.resume and out.with_suffix(".json").exists():
        stored = json.loads(out.with_suffix(".json").read_text())
        # batch sizes timed on another kind of CPU, and a profile measured there, do not mix with these
        if machine_line(stored["stamp"]) != machine_line(run_stamp):
            parser.error(f"--resume: {out}.json was measured on another machine ({machine_line(stored['stamp'])}; "
                         f"this one: {machine_line(run_stamp)}); give a new --out")
        all_results, runs = stored["results"], stored.get("runs", [stored["stamp"]]) + runs

    def save(env, results):      # after every batch size, so a stopped run keeps what it measured
        all_results[env] = results
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "stamp": runs[0], "runs": runs,
                                                        "results": all_results}, indent=1))
        resumed = f" (resumed at commits {', '.join(r['commit'] for r in runs[1:])})" if len(runs) > 1 else ""
        out.with_suffix(".md").write_text(f"_{stamp_line(runs[0])}_{resumed}\n\n" + markdown(all_results, args))

    for env in args.envs.split(","):
        run_env(env, args, lambda results: save(env, results), all_results.get(env))
    plot(all_results, out.with_suffix(".png"))
    print(markdown(all_results, args))
    bad = [(e, b, m) for e, r in all_results.items() for b, x in r["batches"].items()
           for m, y in {**x["methods"], **x.get("confirm", {})}.items() if y["identity"]["other"]]
    if bad:
        raise SystemExit(f"outputs differ from plain generate(): {bad}")


if __name__ == "__main__":
    main()
