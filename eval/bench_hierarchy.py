"""Three-model hierarchy (draft -> intermediate -> target) against each two-model configuration.

    python eval/bench_hierarchy.py --envs tiny,tiny-distilled,smollm2 --batch-sizes 1,4 --max-new-tokens 48 \
        --repeats 3 --out results/bench_hierarchy

Environments (greedy; every output is checked against plain generate()):
  tiny, tiny-distilled  tiny Llamas: a target, a cheap nearly exact intermediate and a cheaper,
           less exact draft (eval/envs.py, tiny_hierarchy); vocabulary 2048
  smollm2  the embedded SmolLM2-135M-Instruct (fp32 target), its bf16 copy (intermediate) and
           its int8 copy (draft), on HumanEval prompts
  qwen-humaneval, qwen-rag  the real pair: Qwen2.5-Coder-1.5B-Instruct (bf16 target), the 0.5B
           (intermediate) and prompt lookup (draft, free), on HumanEval problems in the chat prompt
           or on Spec-Bench's retrieval-augmented questions (long contexts that answers copy from;
           --questions: its question.jsonl, eval/spec_bench.py); --onednn: both in float32 with
           oneDNN linear layers (for CPUs without bf16 matrix instructions)
Methods: plain; draft -> target and intermediate -> target at k = --two-model-k; the hierarchy at
(k_d, k_i) = drafts per inner cycle, inner cycles per target step (the target is offered up to
k_i (k_d + 1) tokens). Reported per method: tokens/s, MAT (tokens per target forward and row),
acceptance at each level, forwards per model, and per level the cost ratio c = (forward time of
the cheaper model) / (forward time of the one verifying it), measured on one-token forwards.
Methods run interleaved (eval/harness.py). Every row is compared with plain generate()
(eval/identity.py: identical, first divergence at a near-tie of a bf16 target, or other, which fails
the run). Writes <out>.json, <out>.md and <out>.png after each (env, batch) cell; a rerun resumes.
"""
from __future__ import annotations

import logging
from pathlib import Path

import hf_specdec
from hf_specdec._compat import modeling
from envs import ENVS as MODELS, encode, humaneval_texts, qwen_coder, random_ids  # eval/ is on sys.path as a script
from harness import Results, arguments, check_identity, forward_ms, identity_mark, ints, over_chunks, parse
from identity import counts
from methods import Method, spec_policy
from report import figure
from spec_bench import SOURCE as SPEC_BENCH

logger = logging.getLogger("bench_hierarchy")


def smollm2_env(args):
    env = MODELS["smollm2"]()
    texts = humaneval_texts(env.tokenizer, "raw", limit=4)
    return env.model, hf_specdec.self_draft(env.model, "bf16").model, hf_specdec.self_draft(env.model, "int8").model, \
        lambda b: encode(env.tokenizer, texts[:b])


def qwen_env(args, prompts: str):
    if prompts == "rag":
        from spec_bench import chat_text, load_questions
        rows = [q for q in load_questions(args.questions) if q["domain"] == "rag"][:4]   # before the slow loading
    env = qwen_coder({"onednn": True}, {"onednn": True}) if args.onednn else qwen_coder()
    texts = [chat_text(q, env.tokenizer) for q in rows] if prompts == "rag" else \
        humaneval_texts(env.tokenizer, "chat", limit=4)
    return env.model, env.draft, hf_specdec.PromptLookupDrafter, lambda b: encode(env.tokenizer, texts[:b], chat=True)


def tiny_env(name):
    env = MODELS[name]()
    ids = random_ids(2048, 4)
    return env.model, env.intermediate, env.draft, lambda b: {k: v[:b] for k, v in ids.items()}


ENVS = {"tiny": lambda args: tiny_env("tiny"), "tiny-distilled": lambda args: tiny_env("tiny-distilled"),
        "smollm2": smollm2_env, "qwen-humaneval": lambda args: qwen_env(args, "humaneval"),
        "qwen-rag": lambda args: qwen_env(args, "rag")}


def methods(intermediate, draft, two_model_k, hierarchy) -> dict:
    """Method -> make its drafter (None: plain); drafters are made fresh per call (their stats are
    per call). draft: a causal LM, or a Drafter class (e.g. PromptLookupDrafter) made with no arguments."""
    make_draft = draft if isinstance(draft, type) else (lambda: hf_specdec.ModelDrafter(draft, name="draft"))
    make_inter = lambda: hf_specdec.ModelDrafter(intermediate, name="inter")  # noqa: E731
    out = {Method("plain"): None}
    for k in two_model_k:
        out[Method(f"draft->target k={k}", "fixed", "draft", k)] = make_draft
        out[Method(f"inter->target k={k}", "fixed", "inter", k)] = make_inter
    for kd, ki in hierarchy:      # the target is offered up to ki (kd + 1) tokens a step
        out[Method(f"hierarchy kd={kd} ki={ki}", "fixed", "hier", ki * (kd + 1))] = \
            lambda kd=kd, ki=ki: hf_specdec.HierarchicalDrafter(make_draft(), make_inter(), draft_len=kd, cycles=ki)
    return out


def run_env(name, args, results: Results) -> None:
    target, intermediate, draft, make_inputs = ENVS[name](args)
    hf_specdec.enable(target)
    for batch in args.batch_sizes:
        if results.done({"env": name, "batch": batch}):
            continue
        inputs = make_inputs(batch)
        models = (("target", target), ("inter", intermediate)) + (() if isinstance(draft, type) else (("draft", draft),))
        ids = random_ids(1000, batch, 64)["input_ids"]         # one-token forwards after a 64-token prefill
        seconds = {role: forward_ms(m, ids.to(modeling.execution_device(m)))[1] / 1e3 for role, m in models}
        seconds.setdefault("draft", 0.0)      # a lookup drafter: no forward
        table = methods(intermediate, draft, args.two_model_k, args.hierarchy)
        drafters, stats = {}, {}
        target.generate(**inputs, max_new_tokens=2, do_sample=False)                       # warm-up

        def run(method, inputs):
            kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
            if table[method] is not None:
                drafters[method.name] = table[method]()
                kwargs.update(assistant_models=[drafters[method.name]], spec_policy=spec_policy("fixed", method.k))
            out = target.generate(**kwargs)
            stats[method.name] = getattr(out, "spec_stats", None)
            return out.sequences
        measured = over_chunks(target, list(table), [inputs], run, args.repeats)
        rows = {}
        for m, (median,) in measured.seconds.items():
            d = drafters.get(m)
            row = {"tokens_per_s": round(measured.tokens / median, 2), "seconds": round(median, 3),
                   "identity": counts(measured.verdicts[m]),
                   "mat": round(stats[m].mean_accepted_tokens, 3) if stats[m] else 1.0}
            if stats[m]:
                proposed = sum(sum(s.proposed) for s in stats[m].steps)
                row["accept_outer"] = round(sum(sum(s.accepted) for s in stats[m].steps) / max(proposed, 1), 3)
                row["target_forwards"] = stats[m].target_forwards
            if isinstance(d, hf_specdec.HierarchicalDrafter):
                row["accept_inner"] = round(d.stats.acceptance, 3)
            if d is not None:
                row["forwards"] = dict(d.forwards())
            rows[m] = row
        for r in rows.values():
            r["vs_plain"] = round(r["tokens_per_s"] / rows["plain"]["tokens_per_s"], 3)
        results.add({"env": name, "batch": batch, "forward_seconds": seconds,
                     "cost_ratio": {"draft/target": round(seconds["draft"] / seconds["target"], 3),
                                    "inter/target": round(seconds["inter"] / seconds["target"], 3),
                                    "draft/inter": round(seconds["draft"] / seconds["inter"], 3)},
                     "methods": rows})
        logger.info("%s batch=%d %s", name, batch, {m: r["tokens_per_s"] for m, r in rows.items()})


def markdown(payload) -> str:
    args = payload["args"]
    lines = [f"# Hierarchy vs two models: greedy, {args['max_new_tokens']} new tokens, median of {args['repeats']} "
             "runs (interleaved)", "",
             "Cost ratio: one-token forward time of the cheaper model / the model verifying it. "
             "Accept: accepted / proposed drafts at that level. MAT: tokens per target forward and row. "
             "~n: n rows first differ from plain at a near-tie of the target's dtype; ≠n: n rows differ otherwise.", ""]
    for cell in payload["cells"]:
        c = cell["cost_ratio"]
        lines += [f"## {cell['env']}, batch {cell['batch']}", "",
                  f"cost ratios (one-token forward): draft/target {c['draft/target']}, inter/target "
                  f"{c['inter/target']}, draft/inter {c['draft/inter']}", "",
                  "| method | tokens/s | x plain | MAT | accept (-> target) | accept (draft -> inter) | forwards |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for m, x in cell["methods"].items():
            lines.append(f"| {m} | {x['tokens_per_s']:.1f}{identity_mark(x['identity'])} | {x['vs_plain']:.2f} | "
                         f"{x['mat']:.2f} | {x.get('accept_outer', '')} | {x.get('accept_inner', '')} | "
                         f"{', '.join(f'{k} {v}' for k, v in x.get('forwards', {}).items())} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(payload, path: Path) -> None:
    """Speed x plain of the best two-model setup and the best hierarchy, per environment and batch size."""
    cells = payload["cells"]
    with figure(path, size=(max(5, 1.6 * len(cells)), 3.6)) as axes:
        ax = axes[0][0]
        for offset, (label, prefix) in enumerate((("best draft -> target", "draft->"),
                                                  ("best inter -> target", "inter->"), ("best hierarchy", "hierarchy"))):
            ys = [max((x["vs_plain"] for m, x in c["methods"].items() if m.startswith(prefix)), default=0)
                  for c in cells]
            ax.bar([i + 0.27 * (offset - 1) for i in range(len(cells))], ys, width=0.27, label=label)
        ax.axhline(1.0, color="grey", ls="--", lw=0.8)
        ax.set_xticks(range(len(cells)), [f"{c['env']}\nB={c['batch']}" for c in cells], fontsize=8)
        ax.set_ylabel("speed x plain generate()")
        ax.legend(fontsize=8)


def main(argv=None):
    parser = arguments(__doc__, "tiny,tiny-distilled,smollm2")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--two-model-k", default="2,4,6", help="k of the two-model setups")
    parser.add_argument("--hierarchy", default="2x2,3x2,4x1,2x3", help="k_d x k_i of the hierarchies")
    parser.add_argument("--questions", default=None, help="Spec-Bench's question.jsonl (qwen-rag)")
    parser.add_argument("--onednn", action="store_true", help="qwen envs: float32 on oneDNN linear layers")
    parser.add_argument("--out", default="results/bench_hierarchy")
    args = parse(parser, argv, ENVS)
    args.batch_sizes, args.two_model_k = ints(args.batch_sizes), ints(args.two_model_k)
    args.hierarchy = [tuple(int(x) for x in h.split("x")) for h in args.hierarchy.split(",")]
    if "qwen-rag" in args.envs.split(",") and args.questions is None:
        parser.error(f"--envs qwen-rag needs --questions: Spec-Bench's question.jsonl, from {SPEC_BENCH}")
    results = Results(Path(args.out), vars(args), markdown, plot)     # a rerun with the same arguments resumes
    for env in args.envs.split(","):
        run_env(env, args, results)
    print(markdown(results.payload))
    check_identity({f"{c['env']} batch {c['batch']} {m}": r for c in results.cells for m, r in c["methods"].items()})


if __name__ == "__main__":
    main()
