"""Drafter selection study: single drafters, HedgeSpec and the bandit baselines UCBSpec / EXP3Spec,
per domain and on the mixed stream of all prompts (each request has its own learner: selection is per
request). Greedy, batch 1, methods (eval/methods.py: a single drafter is `fixed:k` over it alone)
interleaved per prompt by the harness after one warm-up generation. Every output is compared with
plain generate() (eval/identity.py: identical, first divergence at a near-tie of a
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
drafter, per domain), stamped, after each prompt; a rerun with the same arguments resumes.
"""
from __future__ import annotations

import copy
import json
import logging
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

import hf_specdec
import envs  # eval/ is on sys.path when run as a script
from harness import Results, arguments, generate, interleaved, parse
from identity import compare_tokens, counts
from methods import Method, MethodFactory
from report import figure
from spec_bench import SOURCE as SPEC_BENCH, chat_text, load_questions

logger = logging.getLogger("drafter_selection")
HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "data" / "drafter_prompts.jsonl"
DOMAINS = ("code", "prose", "qa", "summarisation")
BASE = ("bf16", "int8", "pld", "code-ds", "prose-ds")
POOLS = {2: ["int8", "pld"], 4: ["int8", "pld", "code-ds", "prose-ds"], 5: list(BASE),
         8: list(BASE) + ["layers-2", "layers-4", "license-ds"]}
QWEN_POOL = ["qwen-0.5b", "pld", "code-ds", "prose-ds"]
HEDGESPEC_ABLATIONS = ("hedgespec-hedge", "hedgespec-adanormalhedge", "hedgespec-cost", "hedgespec-every2",
                       "hedgespec-every4")


@dataclass
class Setup:
    title: str                       # the markdown heading's description of target and prompts
    model: object
    tokenizer: object
    prompts: list[dict]              # {"id", "domain", "text", "style": "chat" | "plain"}
    drafters: dict                   # name -> Drafter
    pools: dict                      # N -> drafter names; pools[main] are also run one at a time
    main: int


def methods_for(pools: dict, main: int, ablations: bool, k: int = 4) -> list[Method]:
    """plain, each drafter of pools[main] alone (`fixed:k`), then per pool (@N<n>) HedgeSpec, UCB and
    EXP3, k drafts a step; `ablations`: HedgeSpec's cold start, other learners, cost-aware and
    skipped feedback too. One policy object per method serves every prompt: learners restart per
    request, measured timings carry over."""
    out = [Method("plain")] + [Method(f"single:{name}", "fixed", name, k) for name in pools[main]]
    for n in pools:
        tag = "" if n == main else f"@N{n}"
        names = ["hedgespec"] + (["hedgespec-cold"] if ablations and n in (5, 8) else []) \
            + (list(HEDGESPEC_ABLATIONS) if ablations and n == 5 else []) + ["ucb", "exp3"]
        out += [Method(name + ("" if name in HEDGESPEC_ABLATIONS else tag), name, f"N{n}", k) for name in names]
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


def smollm2_env(args) -> Setup:
    if not 1 <= args.per_domain <= 8:
        raise ValueError(f"--per-domain must be in 1..8 for --env smollm2, got {args.per_domain}")
    pools = [int(x) for x in args.pools.split(",")]
    if not set(pools) <= set(POOLS) or 5 not in pools:
        raise ValueError(f"--pools must be a subset of {sorted(POOLS)} that includes 5, got {args.pools!r}")
    target = envs.smollm2()
    model, tokenizer = target.model, target.tokenizer
    prompts = load_prompts(args.per_domain)
    return Setup(title="SmolLM2-135M fp32", model=model, tokenizer=tokenizer, prompts=prompts,
                 drafters=build_drafters(model, tokenizer, prompts, args.max_datastore_tokens),
                 pools={n: POOLS[n] for n in pools}, main=5)


def qwen_coder_env(args, onednn=False) -> Setup:
    prompts = load_questions(args.questions, args.per_domain)   # checked before the slow loading
    pair = envs.ENVS["qwen-coder-onednn" if onednn else "qwen-coder"]()
    model, tokenizer = pair.model, pair.tokenizer
    drafters = {"qwen-0.5b": hf_specdec.ModelDrafter(pair.draft, name="qwen-0.5b"),
                "pld": hf_specdec.PromptLookupDrafter(),
                "code-ds": hf_specdec.DatastoreDrafter.from_files(stdlib_sources(), tokenizer,
                                                                   max_tokens=args.max_datastore_tokens, name="code-ds"),
                "prose-ds": prose_datastore(tokenizer)}
    log_datastores(drafters)
    return Setup(title=f"{pair.title}, Spec-Bench questions", model=model, tokenizer=tokenizer,
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
        return envs.encode(tokenizer, [chat_text(prompt, tokenizer)], chat=True)
    return envs.encode(tokenizer, [prompt["text"]])


def record(out, prompt_len: int, seconds: float) -> dict:
    """One call's tokens, seconds and new tokens; with its SpecStats summary and tokens per step."""
    new = out.sequences[0, prompt_len:]
    rec = {"tokens": len(new), "seconds": seconds, "sequence": new.tolist()}
    stats = getattr(out, "spec_stats", None)
    if stats is not None:
        rec.update(stats.summary())
        rec["emitted_per_step"] = [s.emitted[0] for s in stats.steps]
    else:
        rec.update(target_forwards=len(new), mean_accepted_tokens=1.0)
    return rec


def timed(model, factory, inputs: dict, max_new_tokens: int):
    """run(method) for the harness: one greedy call's `record`."""
    def run(method):
        start = time.perf_counter()
        out = generate(model, factory, method, **inputs, max_new_tokens=max_new_tokens, do_sample=False,
                       return_dict_in_generate=True)
        return record(out, inputs["input_ids"].shape[1], time.perf_counter() - start)
    return run


def aggregate(records: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in records)
    forwards = sum(r["target_forwards"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    out = {"tokens": tokens, "target_forwards": forwards, "seconds": round(seconds, 3),
           "mat": round(tokens / forwards, 4), "tokens_per_s": round(tokens / seconds, 3)}
    if "scoring_seconds" in records[0]:
        out["scoring_share"] = round(sum(r["scoring_seconds"] for r in records) / seconds, 4)
        steps: dict = {}
        for r in records:
            for name, c in r["drafter_row_steps"].items():
                steps[name] = steps.get(name, 0) + c
        out["drafter_steps"] = steps
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


def runs_of(payload) -> tuple[dict, list[dict]]:
    """The finished prompts' records by method name, and those prompts."""
    cells = payload["cells"]
    return {name: [c["runs"][name] for c in cells] for name in cells[0]["runs"]}, [c["prompt"] for c in cells]


def markdown(payload) -> str:
    args = payload["args"]
    runs, prompts = runs_of(payload)
    summary = summarize(runs, prompts, [Method(name) for name in runs])
    verdicts = [v for c in payload["cells"] for v in c["verdicts"]]
    identity = counts(verdicts)
    lines = [f"# Drafter selection: {payload['title']}, greedy, k={args['k']}, {args['max_new_tokens']} new tokens, "
             f"{len(prompts)} of {payload['prompts']} prompt(s) ({args['per_domain']} per domain)", "",
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


def plot(payload, path: Path) -> None:
    runs, prompts = runs_of(payload)
    summary = summarize(runs, prompts, [Method(name) for name in runs])
    groups = list(summary["groups"])
    cols = min(len(groups), 5)
    rows = -(-len(groups) // cols)
    with figure(path, rows, cols, size=(4 * cols, 3.4 * rows), dpi=120) as axes:
        for ax in axes.flat[len(groups):]:
            ax.axis("off")
        for ax, group in zip(axes.flat, groups):
            idx = [i for i, p in enumerate(prompts) if group == "mixed" or p["domain"] == group]
            best = summary["groups"][group]["best_single"]
            for name in runs:
                if name.removesuffix("@N8") in ("hedgespec", "hedgespec-cold", "ucb", "exp3"):
                    curve = extra_forwards_curve([runs[name][i] for i in idx], [runs[best][i] for i in idx])
                    ax.plot(range(1, len(curve) + 1), curve, label=name, linestyle="-" if "@N8" in name else "--")
            ax.set_title(f"{group} (vs {best})")
            ax.set_xlabel("tokens generated (per prompt)")
            ax.axhline(0, color="grey", linewidth=0.5)
        for row in axes:
            row[0].set_ylabel("extra target forwards (summed)")
        axes.flat[len(groups) - 1].legend(fontsize=7)


def cost_case(k: int = 4, new_tokens: int = 64, prompts: int = 4) -> dict:
    """Where time, not acceptance, decides: an exact-but-expensive drafter (a full copy of the
    target) against a cheap, slightly noisy one (the 1-layer exact draft of
    hf_specdec.testing.exact_cheap_pair plus noise). MAT-HedgeSpec prefers the copy; cost-aware
    HedgeSpec, weighing measured cost, the cheap drafter. Greedy, batch 1, interleaved."""
    from hf_specdec.testing import noisy_copy
    pair = envs.tiny_exact()
    drafters = {"exact-copy": hf_specdec.ModelDrafter(copy.deepcopy(pair.model), name="exact-copy"),
                "cheap-noisy": hf_specdec.ModelDrafter(noisy_copy(pair.draft, 0.015), name="cheap-noisy")}
    factory = MethodFactory(pair.model, drafters=drafters, pools={"pair": tuple(drafters)})
    methods = [Method("plain"), *(Method(f"single:{d}", "fixed", d, k) for d in drafters),
               *(Method(name, name, "pair", k) for name in ("hedgespec", "hedgespec-cost", "hedgespec-cost-every4",
                                                            "hedgespec-cost-every8"))]
    ids = envs.random_ids(pair.model.config.vocab_size, prompts)
    records = {m.name: [] for m in methods}
    for i in range(prompts):
        inputs = {key: v[i:i + 1] for key, v in ids.items()}
        timing = interleaved(methods, timed(pair.model, factory, inputs, new_tokens), rounds=1, warmup=False, offset=i)
        for name, rec in timing.outputs.items():
            records[name].append(rec)
    rows = {name: aggregate(recs) for name, recs in records.items()}
    return {name: {"mat": round(r["mat"], 3), "tokens_per_s": round(r["tokens_per_s"], 1),
                   "vs_plain": round(r["tokens_per_s"] / rows["plain"]["tokens_per_s"], 3),
                   "drafter_steps": r.get("drafter_steps", {})} for name, r in rows.items()}


def cost_markdown(payload) -> str:
    lines = ["## Cost-aware case (tiny exact-and-cheap models: exact full copy vs cheap noisy 1-layer drafter)", "",
             "| method | MAT | tok/s | vs plain | drafter row-steps |", "|---|---:|---:|---:|---|"]
    for name, r in payload["cells"][0]["methods"].items():
        steps = ", ".join(f"{k}:{v}" for k, v in sorted(r["drafter_steps"].items(), key=lambda x: -x[1]))
        lines.append(f"| {name} | {r['mat']:.2f} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x | {steps} |")
    return "\n".join(lines) + "\n"


ENVS = {"qwen-coder": qwen_coder_env, "qwen-coder-onednn": lambda args: qwen_coder_env(args, onednn=True),
        "smollm2": smollm2_env}


def main(argv=None) -> dict:
    parser = arguments(__doc__)
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
    parser.add_argument("--only-cost-case", action="store_true",
                        help="run only the cost-aware case on tiny models (seconds) and write <out>-cost.{json,md}")
    args = parse(parser, argv)
    if args.only_cost_case:
        results = Results(Path(f"{args.out}-cost"), vars(args), cost_markdown, resume=False)
        results.add({"methods": cost_case(args.k)})
        print(cost_markdown(results.payload))
        return results.cells[0]["methods"]
    if args.env.startswith("qwen-coder") and args.questions is None:
        parser.error(f"--env {args.env} needs --questions: Spec-Bench's question.jsonl, from {SPEC_BENCH}")

    env = ENVS[args.env](args)
    methods = methods_for(env.pools, env.main, ablations=args.env == "smollm2", k=args.k)
    if args.methods:
        wanted = set(args.methods.split(",")) | {"plain", "hedgespec"} | {f"single:{b}" for b in env.pools[env.main]}
        methods = [m for m in methods if m.name in wanted]
    model, eos = env.model, env.model.generation_config.eos_token_id
    factory = MethodFactory(model, drafters=env.drafters, pools={f"N{n}": tuple(names) for n, names in env.pools.items()})
    encoded = [encode(p, env.tokenizer) for p in env.prompts]
    timed(model, factory, encoded[0], 8)(methods[-1])                              # warm-up
    results = Results(Path(args.out), vars(args), markdown, plot)
    results.payload.update(title=env.title, prompts=len(env.prompts))
    for i, inputs in enumerate(tqdm(encoded, desc="prompts")):
        if results.done({"index": i}):
            continue
        timing = interleaved(methods, timed(model, factory, inputs, args.max_new_tokens), rounds=1, warmup=False,
                             offset=i)
        runs = timing.outputs
        verdicts = [{"method": m.name, "prompt": env.prompts[i]["id"], **compare_tokens(
            model, inputs["input_ids"][0], runs["plain"]["sequence"], runs[m.name]["sequence"], eos)} for m in methods[1:]]
        results.add({"index": i, "prompt": env.prompts[i], "verdicts": verdicts,
                     "runs": {m.name: {k: v for k, v in runs[m.name].items() if k != "sequence"} for m in methods}})
    print(markdown(results.payload))
    divergences = [v for c in results.cells for v in c["verdicts"] if v["verdict"] == "other"]
    if divergences:
        raise SystemExit(f"outputs differ from plain generate(): {divergences}")
    return summarize(*runs_of(results.payload), methods)


if __name__ == "__main__":
    main()
