"""Drafter selection study: single drafters, HedgeSpec and the bandit baselines UCBSpec / EXP3Spec,
per domain and on the mixed stream of all prompts (each request has its own learner: selection is per
request). Greedy, batch 1, methods interleaved per prompt after one warm-up generation. Every output
is compared with plain generate() (eval/identity.py: identical, first divergence at a near-tie of a
bf16 target, or other, which fails the run).

    python eval/drafter_selection.py --env qwen-coder --questions question.jsonl --per-domain 1 \
        --max-new-tokens 48 --out docs/results/drafter_selection/qwen-coder

--env qwen-coder: the real pair's target, Qwen2.5-Coder-1.5B-Instruct (bf16; qwen-coder-onednn: float32
with oneDNN linear layers, for CPUs without bf16 matrix instructions), on Spec-Bench's
questions (--questions: its question.jsonl, eval/spec_bench.py says where to get it; --per-domain of
each of its 13 categories), with the pool (N = 4):
  qwen-0.5b       Qwen2.5-Coder-0.5B-Instruct (bf16)
  pld             prompt lookup
  code-ds         DatastoreDrafter over Python standard-library sources
  prose-ds        DatastoreDrafter over the Python reference documentation (pydoc_data.topics)
  (No int8 copy: the GGUF checkpoint's layers stay packed, so torch's dynamic int8 quantisation
  reaches only the output head, a drafter proposing what the 0.5B proposes.)
--env smollm2: the embedded SmolLM2-135M-Instruct (fp32) on eval/data/drafter_prompts.jsonl (code,
prose, qa, summarisation; provenance in each row), with the pool (N = 5):
  bf16, int8      copies of the target (hf_specdec.self_draft)
  pld             prompt lookup
  code-ds         DatastoreDrafter over Python standard-library sources (minus the summarised modules)
  prose-ds        DatastoreDrafter over the Python reference documentation (pydoc_data.topics,
                  minus the topics used as prompts)
  Pools by size: N=2 [int8, pld], N=4 [int8, pld, code-ds, prose-ds] (specialists), N=5 all,
  N=8 all + weak drafters (2- and 4-layer truncated copies, a datastore over the Python license
  text); HedgeSpec's learner and feedback ablations on N=5.

Writes <out>.json, <out>.md (tables) and <out>.png (extra target forwards vs the best single
drafter, per domain).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import hf_specdec
from hf_specdec.policies import EXP3Spec, UCBSpec
from identity import compare_rows, counts   # eval/ is on sys.path when run as a script
from report import stamp, write_results
from spec_bench import SOURCE as SPEC_BENCH, chat_text

logger = logging.getLogger("drafter_selection")
HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "data" / "drafter_prompts.jsonl"
DOMAINS = ("code", "prose", "qa", "summarisation")
BASE = ("bf16", "int8", "pld", "code-ds", "prose-ds")
POOLS = {2: ["int8", "pld"], 4: ["int8", "pld", "code-ds", "prose-ds"], 5: list(BASE),
         8: list(BASE) + ["layers-2", "layers-4", "license-ds"]}
QWEN_POOL = ["qwen-0.5b", "pld", "code-ds", "prose-ds"]


@dataclass
class Env:
    title: str                       # the markdown heading's description of target and prompts
    model: object
    tokenizer: object
    prompts: list[dict]              # {"id", "domain", "text", "style": "chat" | "plain"}
    drafters: dict                   # name -> Drafter
    pools: dict                      # N -> drafter names; pools[main] are also run one at a time
    main: int


@dataclass
class Method:
    name: str
    pool: int | None                 # N; None: plain generate()
    selector: object = None          # factory of a DrafterSelector
    instance: object = None          # one selector for all prompts: learners restart per request,
                                     # measured timings carry over

    def policy(self, k: int):
        self.instance = self.instance or self.selector()
        return hf_specdec.SpecPolicy(self.instance, hf_specdec.FixedLength(k))


def methods_for(pools: dict, main: int, ablations: bool) -> list[Method]:
    """plain, each drafter of pools[main] alone, then per pool HedgeSpec, UCB and EXP3; `ablations`:
    HedgeSpec's cold start, other learners, cost-aware and skipped feedback too."""
    out = [Method("plain", None)]
    for i, name in enumerate(pools[main]):
        out.append(Method(f"single:{name}", main, lambda i=i: hf_specdec.FixedDrafter(i)))
    for n in pools:
        tag = "" if n == main else f"@N{n}"
        out.append(Method(f"hedgespec{tag}", n, lambda: hf_specdec.HedgeSpec(seed=0)))
        if ablations and n in (5, 8):   # without our prompt warm start: the paper's cold start
            out.append(Method(f"hedgespec-cold{tag}", n, lambda: hf_specdec.HedgeSpec(prompt_positions=0, seed=0)))
        if ablations and n == 5:
            out += [Method("hedgespec-hedge", 5, lambda: hf_specdec.HedgeSpec(learner="hedge", seed=0)),
                    Method("hedgespec-adanormalhedge", 5, lambda: hf_specdec.HedgeSpec(learner="adanormalhedge", seed=0)),
                    Method("hedgespec-cost", 5, lambda: hf_specdec.HedgeSpec(cost_aware=True, seed=0)),
                    Method("hedgespec-every2", 5, lambda: hf_specdec.HedgeSpec(feedback_every=2, seed=0)),
                    Method("hedgespec-every4", 5, lambda: hf_specdec.HedgeSpec(feedback_every=4, seed=0))]
        out += [Method(f"ucb{tag}", n, lambda: UCBSpec()),
                Method(f"exp3{tag}", n, lambda: EXP3Spec(seed=0))]
    return out


def load_prompts(per_domain: int) -> list[dict]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    return [r for d in DOMAINS for r in [r for r in rows if r["domain"] == d][:per_domain]]


def truncated_copy(model, layers: int) -> hf_specdec.ModelDrafter:
    """A weak drafter: the target's first `layers` layers (agreement well below 0.5 on SmolLM2)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    return hf_specdec.ModelDrafter(draft, name=f"layers-{layers}")


def stdlib_sources(exclude=()) -> list[Path]:
    return sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stem not in exclude)


def log_datastores(drafters: dict) -> None:
    for name, d in drafters.items():
        if isinstance(d, hf_specdec.DatastoreDrafter):
            logger.info("%s: %d tokens", name, len(d.corpus))


def prose_datastore(tokenizer, exclude=()) -> hf_specdec.DatastoreDrafter:
    from pydoc_data.topics import topics
    return hf_specdec.DatastoreDrafter.from_texts([t for name, t in sorted(topics.items()) if name not in exclude],
                                                  tokenizer, name="prose-ds")


def smollm2_env(args) -> Env:
    from hf_specdec.embedded import load_smollm2
    if not 1 <= args.per_domain <= 8:
        raise ValueError(f"--per-domain must be in 1..8 for --env smollm2, got {args.per_domain}")
    pools = [int(x) for x in args.pools.split(",")]
    if not set(pools) <= set(POOLS) or 5 not in pools:
        raise ValueError(f"--pools must be a subset of {sorted(POOLS)} that includes 5, got {args.pools!r}")
    model, tokenizer = load_smollm2()
    prompts = load_prompts(args.per_domain)
    return Env(title="SmolLM2-135M fp32", model=model, tokenizer=tokenizer, prompts=prompts,
               drafters=build_drafters(model, tokenizer, prompts, args.max_datastore_tokens),
               pools={n: POOLS[n] for n in pools}, main=5)


def qwen_coder_env(args, onednn=False) -> Env:
    from spec_bench import load_questions
    from hf_specdec.embedded import load_model
    prompts = load_questions(args.questions, args.per_domain)   # checked before the slow loading
    model, tokenizer = load_model("qwen2.5-coder-1.5b-instruct", onednn=onednn)
    draft, _ = load_model("qwen2.5-coder-0.5b-instruct", onednn=onednn)
    drafters = {"qwen-0.5b": hf_specdec.ModelDrafter(draft, name="qwen-0.5b"),
                "pld": hf_specdec.PromptLookupDrafter(),
                "code-ds": hf_specdec.DatastoreDrafter.from_files(stdlib_sources(), tokenizer,
                                                                   max_tokens=args.max_datastore_tokens, name="code-ds"),
                "prose-ds": prose_datastore(tokenizer)}
    log_datastores(drafters)
    kernels = "float32 on oneDNN" if onednn else "bf16"
    return Env(title=f"Qwen2.5-Coder-1.5B-Instruct {kernels}, Spec-Bench questions", model=model, tokenizer=tokenizer,
               prompts=prompts, drafters=drafters, pools={len(QWEN_POOL): QWEN_POOL}, main=len(QWEN_POOL))


def build_drafters(model, tokenizer, prompts: list[dict], max_datastore_tokens: int) -> dict:
    all_rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    held_topics = {r.get("topic") for r in all_rows}
    held_modules = {r.get("module") for r in all_rows}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = stdlib_sources(exclude=held_modules)
    license_text = next((p for p in (stdlib / "LICENSE.txt", Path(sys.prefix) / "LICENSE.txt") if p.is_file()), None)
    drafters = {
        "bf16": hf_specdec.self_draft(model, "bf16"),
        "int8": hf_specdec.self_draft(model, "int8"),
        "pld": hf_specdec.PromptLookupDrafter(),
        "code-ds": hf_specdec.DatastoreDrafter.from_files(sources, tokenizer, max_tokens=max_datastore_tokens,
                                                           name="code-ds"),
        "prose-ds": prose_datastore(tokenizer, exclude=held_topics),
        "layers-2": truncated_copy(model, 2),
        "layers-4": truncated_copy(model, 4),
    }
    drafters["license-ds"] = (hf_specdec.DatastoreDrafter.from_files([license_text], tokenizer, name="license-ds")
                              if license_text else truncated_copy(model, 1))
    log_datastores(drafters)
    return drafters


def encode(prompt: dict, tokenizer) -> dict:
    if prompt["style"] == "chat":
        return dict(tokenizer(chat_text(prompt, tokenizer), return_tensors="pt", add_special_tokens=False))
    return dict(tokenizer(prompt["text"], return_tensors="pt"))


def run_one(env: Env, inputs, method: Method, args) -> dict:
    kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    if method.pool is not None:
        pool = [env.drafters[name] for name in env.pools[method.pool]]
        kwargs.update(assistant_models=pool, spec_policy=method.policy(args.k))
    start = time.perf_counter()
    out = env.model.generate(**kwargs)
    seconds = time.perf_counter() - start
    new = out.sequences[0, inputs["input_ids"].shape[1]:]
    rec = {"tokens": len(new), "seconds": seconds, "sequence": new.tolist()}
    stats = getattr(out, "spec_stats", None)
    if stats is not None:
        rec.update(stats.summary())
        rec["emitted_per_step"] = [s.emitted[0] for s in stats.steps]
    else:
        rec.update(target_forwards=len(new), mean_accepted_tokens=1.0)
    return rec


def aggregate(records: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in records)
    forwards = sum(r["target_forwards"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    out = {"tokens": tokens, "target_forwards": forwards, "seconds": round(seconds, 3),
           "mat": round(tokens / forwards, 4), "tokens_per_s": round(tokens / seconds, 3)}
    if "scoring_seconds" in records[0]:
        out["scoring_share"] = round(sum(r["scoring_seconds"] for r in records) / seconds, 4)
        counts: dict = {}
        for r in records:
            for name, c in r["drafter_row_steps"].items():
                counts[name] = counts.get(name, 0) + c
        out["drafter_steps"] = counts
    return out


def extra_forwards_curve(records: list[dict], best: list[dict]) -> list[int]:
    """Summed over prompts: target forwards used to reach token t minus the best single drafter's."""
    def forwards_at(rec):
        if "emitted_per_step" not in rec:
            return list(range(1, rec["tokens"] + 1))
        out, step = [], 0
        for emitted in rec["emitted_per_step"]:
            step += 1
            out += [step] * emitted
        return out[: rec["tokens"]]
    length = max(r["tokens"] for r in records)
    total = [0] * length
    for rec, ref in zip(records, best):
        a, b = forwards_at(rec), forwards_at(ref)
        for t in range(length):
            total[t] += a[min(t, len(a) - 1)] - b[min(t, len(b) - 1)]
    return total


def summarize(runs: dict, prompts: list[dict], methods: list[Method]) -> dict:
    domains = dict.fromkeys(p["domain"] for p in prompts)
    groups = {d: [i for i, p in enumerate(prompts) if p["domain"] == d] for d in domains}
    groups["mixed"] = list(range(len(prompts)))
    table = {}
    for group, idx in groups.items():
        if not idx:
            continue
        rows = {m.name: aggregate([runs[m.name][i] for i in idx]) for m in methods}
        plain = rows["plain"]["tokens_per_s"]
        for r in rows.values():
            r["vs_plain"] = round(r["tokens_per_s"] / plain, 3)
        singles = {n: r for n, r in rows.items() if n.startswith("single:")}
        best = max(singles, key=lambda n: singles[n]["mat"])
        table[group] = {"methods": rows, "best_single": best}
    targets = {}
    for group, entry in table.items():
        rows, best = entry["methods"], entry["best_single"]
        targets[f"{group}: hedgespec MAT / best single ({best})"] = round(
            rows["hedgespec"]["mat"] / rows[best]["mat"], 3)
    if "mixed" in table:
        rows = table["mixed"]["methods"]
        for tag in ("@N8", "@N4", "@N2", ""):
            for baseline in ("ucb", "exp3"):
                if f"hedgespec{tag}" in rows and f"{baseline}{tag}" in rows:   # --methods may leave one out
                    targets[f"mixed: hedgespec{tag} MAT / {baseline}{tag}"] = round(
                        rows[f"hedgespec{tag}"]["mat"] / rows[f"{baseline}{tag}"]["mat"], 3)
    return {"groups": table, "targets": targets}


def markdown(summary: dict, args, title: str) -> str:
    identity = summary["identity"]
    lines = [f"# Drafter selection: {title}, greedy, k={args.k}, {args.max_new_tokens} new tokens, "
             f"{args.per_domain} prompt(s) per domain", "",
             f"Outputs against plain generate(), all methods and prompts: {identity['identical']} identical, "
             f"{identity['near_tie']} first differing at a near-tie of the target's dtype, {identity['other']} "
             "otherwise (eval/identity.py).", ""]
    for group, entry in summary["groups"].items():
        lines += [f"## {group} (best single drafter by MAT: {entry['best_single']})", "",
                  "| method | MAT | tok/s | vs plain | target fwd | scoring share | drafter row-steps |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, r in entry["methods"].items():
            steps = ", ".join(f"{k}:{v}" for k, v in sorted(r.get("drafter_steps", {}).items(), key=lambda x: -x[1]))
            share = f"{r['scoring_share']:.2f}" if "scoring_share" in r else ""
            lines.append(f"| {name} | {r['mat']:.2f} | {r['tokens_per_s']:.2f} | {r['vs_plain']:.2f}x | "
                         f"{r['target_forwards']} | {share} | {steps} |")
        lines.append("")
    lines += ["## Targets", "", "| check | ratio |", "|---|---:|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in summary["targets"].items()]
    return "\n".join(lines) + "\n"


def plot(runs: dict, prompts: list[dict], methods: list[Method], summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = list(summary["groups"])
    cols = min(len(groups), 5)
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.axis("off")
    for ax, group in zip(axes.flat, groups):
        idx = [i for i, p in enumerate(prompts) if group == "mixed" or p["domain"] == group]
        best = summary["groups"][group]["best_single"]
        for m in methods:
            if m.name.removesuffix("@N8") in ("hedgespec", "hedgespec-cold", "ucb", "exp3"):
                curve = extra_forwards_curve([runs[m.name][i] for i in idx], [runs[best][i] for i in idx])
                ax.plot(range(1, len(curve) + 1), curve, label=m.name, linestyle="-" if "@N8" in m.name else "--")
        ax.set_title(f"{group} (vs {best})")
        ax.set_xlabel("tokens generated (per prompt)")
        ax.axhline(0, color="grey", linewidth=0.5)
    for row in axes:
        row[0].set_ylabel("extra target forwards (summed)")
    axes.flat[len(groups) - 1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cost_case(k: int = 4, new_tokens: int = 64, prompts: int = 4) -> dict:
    """Where time, not acceptance, decides: an exact-but-expensive drafter (a full copy of the
    target) against a cheap, slightly noisy one (the 1-layer exact draft of
    hf_specdec.testing.exact_cheap_pair plus noise). MAT-HedgeSpec prefers the copy; cost-aware
    HedgeSpec, weighing measured cost, the cheap drafter. Greedy, batch 1, interleaved."""
    from hf_specdec.testing import exact_cheap_pair, noisy_copy
    target, cheap = exact_cheap_pair()
    pool = [hf_specdec.ModelDrafter(copy.deepcopy(target), name="exact-copy"),
            hf_specdec.ModelDrafter(noisy_copy(cheap, 0.015), name="cheap-noisy")]
    ids = torch.randint(3, target.config.vocab_size, (prompts, 32), generator=torch.Generator().manual_seed(0))
    methods = {"plain": None, "single:exact-copy": hf_specdec.FixedDrafter(0),
               "single:cheap-noisy": hf_specdec.FixedDrafter(1),
               "hedgespec": hf_specdec.HedgeSpec(seed=0), "hedgespec-cost": hf_specdec.HedgeSpec(cost_aware=True, seed=0),
               "hedgespec-cost-every4": hf_specdec.HedgeSpec(cost_aware=True, feedback_every=4, seed=0),
               "hedgespec-cost-every8": hf_specdec.HedgeSpec(cost_aware=True, feedback_every=8, seed=0)}
    totals = {m: {"tokens": 0, "seconds": 0.0, "forwards": 0, "steps": {}} for m in methods}
    for i in range(prompts):
        for name, sel in methods.items():
            kwargs = dict(input_ids=ids[i:i + 1], max_new_tokens=new_tokens, do_sample=False,
                          return_dict_in_generate=True, custom_generate=hf_specdec.generate if sel else None)
            if sel is not None:
                kwargs.update(assistant_models=pool, spec_policy=hf_specdec.SpecPolicy(sel, hf_specdec.FixedLength(k)))
            start = time.perf_counter()
            out = target.generate(**{k_: v for k_, v in kwargs.items() if v is not None})
            t = totals[name]
            t["seconds"] += time.perf_counter() - start
            tokens = out.sequences.shape[1] - ids.shape[1]
            t["tokens"] += tokens
            stats = getattr(out, "spec_stats", None)
            t["forwards"] += stats.target_forwards if stats else tokens
            for d, c in (stats.drafter_row_steps() if stats else {}).items():
                t["steps"][d] = t["steps"].get(d, 0) + c
    plain = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    return {name: {"mat": round(t["tokens"] / t["forwards"], 3), "tokens_per_s": round(t["tokens"] / t["seconds"], 1),
                   "vs_plain": round(t["tokens"] / t["seconds"] / plain, 3), "drafter_steps": t["steps"]}
            for name, t in totals.items()}


def cost_markdown(case: dict) -> str:
    lines = ["## Cost-aware case (tiny exact-and-cheap models: exact full copy vs cheap noisy 1-layer drafter)", "",
             "| method | MAT | tok/s | vs plain | drafter row-steps |", "|---|---:|---:|---:|---|"]
    for name, r in case.items():
        steps = ", ".join(f"{k}:{v}" for k, v in sorted(r["drafter_steps"].items(), key=lambda x: -x[1]))
        lines.append(f"| {name} | {r['mat']:.2f} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x | {steps} |")
    return "\n".join(lines) + "\n"


ENVS = {"qwen-coder": qwen_coder_env, "qwen-coder-onednn": lambda args: qwen_coder_env(args, onednn=True),
        "smollm2": smollm2_env}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=sorted(ENVS), default="smollm2")
    parser.add_argument("--questions", default=None,
                        help="Spec-Bench's question.jsonl (--env qwen-coder; see eval/spec_bench.py)")
    parser.add_argument("--per-domain", type=int, default=2, help="prompts per domain (smollm2: <= 8)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4, help="draft length for every method")
    parser.add_argument("--pools", default="2,4,5,8", help="smollm2: pool sizes N to run HedgeSpec/UCB/EXP3 on")
    parser.add_argument("--methods", default=None, help="comma-separated subset of method names")
    parser.add_argument("--max-datastore-tokens", type=int, default=1_000_000)
    parser.add_argument("--out", default="results/drafter_selection")
    parser.add_argument("--resume", action="store_true",
                        help="keep the prompts already finished in <out>.partial.json")
    parser.add_argument("--only-cost-case", action="store_true",
                        help="run only the cost-aware case on tiny models (seconds) and write <out>-cost.{json,md}")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only_cost_case:
        case = cost_case(args.k)
        Path(f"{out}-cost.json").write_text(json.dumps(case, indent=1))
        Path(f"{out}-cost.md").write_text(cost_markdown(case))
        print(cost_markdown(case))
        return case
    if args.env.startswith("qwen-coder") and args.questions is None:
        parser.error(f"--env {args.env} needs --questions: Spec-Bench's question.jsonl, from {SPEC_BENCH}")

    starts = [stamp()]   # the code and machine of every start: a resumed run may span commits
    env = ENVS[args.env](args)
    methods = methods_for(env.pools, env.main, ablations=args.env == "smollm2")
    if args.methods:
        wanted = set(args.methods.split(",")) | {"plain", "hedgespec"} | {f"single:{b}" for b in env.pools[env.main]}
        methods = [m for m in methods if m.name in wanted]
    model, tokenizer = env.model, env.tokenizer
    hf_specdec.enable(model)
    eos = model.generation_config.eos_token_id
    encoded = [encode(p, tokenizer) for p in env.prompts]
    run_one(env, encoded[0], methods[-1], argparse.Namespace(max_new_tokens=8, k=args.k))  # warm-up

    partial = Path(f"{out}.partial.json")
    runs, verdicts = {m.name: [] for m in methods}, []
    if args.resume and partial.exists():
        saved = json.loads(partial.read_text())
        runs, verdicts, starts = saved["runs"], saved["verdicts"], saved.get("starts", []) + starts
        logger.info("resuming after %d finished prompts", len(runs["plain"]))
    for i, inputs in enumerate(tqdm(encoded, desc="prompts")):
        if i < len(runs["plain"]):
            continue
        for m in methods:
            rec = run_one(env, inputs, m, args)
            runs[m.name].append(rec)
            if m.name != "plain":
                plain_row, spec_row = (torch.cat([inputs["input_ids"][0], torch.tensor(r["sequence"])])[None]
                                       for r in (runs["plain"][i], rec))
                (v,) = compare_rows(model, inputs["input_ids"], None, plain_row, spec_row, eos)
                verdicts.append({"method": m.name, "prompt": env.prompts[i]["id"], **v})
        partial.write_text(json.dumps({"runs": runs, "verdicts": verdicts, "starts": starts}))
    summary = summarize(runs, env.prompts, methods)
    summary.update(args=vars(args), prompts=[p["id"] for p in env.prompts], identity=counts(verdicts))
    payload = {"stamp": starts[0], "starts": starts, "summary": summary,
               "divergences": [v for v in verdicts if v["verdict"] != "identical"], "runs": {
        name: [{k: v for k, v in r.items() if k != "sequence"} for r in recs] for name, recs in runs.items()}}
    md = write_results(out.parent, out.name, payload, markdown(summary, args, env.title),
                       lambda path: plot(runs, env.prompts, methods, summary, path))
    partial.unlink()
    logger.info("wrote %s.{json,md,png}", out)
    print(md.read_text())
    if summary["identity"]["other"]:
        raise SystemExit(f"outputs differ from plain generate(): {payload['divergences']}")
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
