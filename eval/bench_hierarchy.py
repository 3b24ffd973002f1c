"""Three-model hierarchy (draft -> intermediate -> target) against each two-model configuration.

    python eval/bench_hierarchy.py --envs tiny,tiny-distilled,smollm2 --batch-sizes 1,4 --max-new-tokens 48 \
        --repeats 3 --out results/bench_hierarchy

Environments (greedy; every output is checked against plain generate()):
  tiny     a 12-layer Llama whose layers 2.. are zeroed and layer 1 weakened (target), a 4-layer
           copy of it with a little noise (intermediate: cheap, nearly exact) and its 1-layer copy
           (draft: cheaper still, less exact); vocabulary 2048
  tiny-distilled  a 24-layer target of that kind, an 8-layer noisier copy (intermediate) and a
           1-layer draft cut from the intermediate (closer to it than to the target)
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
Every row is compared with plain generate() (eval/identity.py: identical, first divergence at a
near-tie of a bf16 target, or other, which fails the run). Writes <out>.json, <out>.md and <out>.png.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import hf_specdec
from hf_specdec.testing import build, noisy_copy
from bench_lengths import identity_mark, new_tokens, parse_env_args  # eval/ is on sys.path when run as a script
from humaneval_data import load_problems, prompt_text
from identity import compare_rows, counts
from report import write_results
from spec_bench import SOURCE as SPEC_BENCH

logger = logging.getLogger("bench_hierarchy")


def _truncated(source, layers: int, seed: int):
    """The first `layers` layers of `source` (embeddings and head included) as a model of its own."""
    model = build("llama", layers=layers, seed=seed, vocab=2048, hidden=384, init=0.05)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in source.state_dict().items() if k in own})
    return model


def tiny_env(distilled: bool):
    # The target's effective network is layers 0-1 (layer 1 weakened); its other layers are zeroed
    # but still computed. tiny: a 4-layer noisy copy (intermediate) is nearly exact at a third of
    # the cost, and a 1-layer copy (draft) agrees with it on about two thirds of tokens.
    # tiny-distilled: a 24-layer target, an 8-layer copy with more noise (intermediate, ~0.8
    # agreement), and a draft cut from the *intermediate*: it agrees with the intermediate more
    # often (~0.82) than with the target (~0.68), the case a middle level is for.
    target = build("llama", layers=24 if distilled else 12, seed=0, vocab=2048, hidden=384, init=0.05)
    with torch.no_grad():
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        scale = 0.1 if distilled else 0.2
        target.model.layers[1].self_attn.o_proj.weight.mul_(scale)
        target.model.layers[1].mlp.down_proj.weight.mul_(scale)
    if distilled:
        intermediate = noisy_copy(_truncated(target, 8, 1), 0.03, seed=1)
        draft = _truncated(intermediate, 1, 2)
    else:
        intermediate = noisy_copy(_truncated(target, 4, 1), 0.01, seed=1)
        draft = _truncated(target, 1, 2)
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = 0
    ids = torch.randint(3, 2048, (4, 32), generator=torch.Generator().manual_seed(0))
    return target, intermediate, draft, lambda b: {"input_ids": ids[:b], "attention_mask": torch.ones_like(ids[:b])}


def smollm2_env():
    from hf_specdec.embedded import load_smollm2
    model, tokenizer = load_smollm2()
    prompts = [p["prompt"] for p in load_problems(limit=4)]
    return model, hf_specdec.self_draft(model, "bf16").model, hf_specdec.self_draft(model, "int8").model, \
        lambda b: dict(tokenizer(prompts[:b], return_tensors="pt", padding=True))


def qwen_env(prompts: str, questions=None, onednn=False):
    from hf_specdec.embedded import load_model
    if prompts == "rag":
        from spec_bench import chat_text, load_questions
        rows = [q for q in load_questions(questions) if q["domain"] == "rag"][:4]
    model, tokenizer = load_model("qwen2.5-coder-1.5b-instruct", onednn=onednn)
    intermediate, _ = load_model("qwen2.5-coder-0.5b-instruct", onednn=onednn)
    if prompts == "rag":
        texts = [chat_text(q, tokenizer) for q in rows]
    else:
        texts = [prompt_text(p, tokenizer, "chat") for p in load_problems(limit=4)]
    return model, intermediate, hf_specdec.PromptLookupDrafter, \
        lambda b: dict(tokenizer(texts[:b], return_tensors="pt", padding=True, add_special_tokens=False))


ENVS = {"tiny": lambda args: tiny_env(False), "tiny-distilled": lambda args: tiny_env(True),
        "smollm2": lambda args: smollm2_env(),
        "qwen-humaneval": lambda args: qwen_env("humaneval", onednn=args.onednn),
        "qwen-rag": lambda args: qwen_env("rag", args.questions, onednn=args.onednn)}


def forward_seconds(model, batch: int, repeats: int = 5) -> float:
    """Median seconds of a one-token forward after a 64-token prefill, `batch` rows (any device)."""
    from hf_specdec import _compat
    device = _compat.execution_device(model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(3, 1000, (batch, 65), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for _ in range(repeats):
        cache = _compat.new_cache(model)
        model(input_ids=ids[:, :64], use_cache=True, **_compat.cache_kwargs(model, cache))
        sync()
        start = time.perf_counter()
        model(input_ids=ids[:, 64:], use_cache=True, **_compat.cache_kwargs(model, cache))
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def methods(intermediate, draft, two_model_k, hierarchy) -> dict:
    """name -> (make drafter, outer k); drafters are made fresh per run (their stats are per call).
    draft: a causal LM, or a Drafter class (e.g. PromptLookupDrafter) made with no arguments."""
    make_draft = draft if isinstance(draft, type) else (lambda: hf_specdec.ModelDrafter(draft, name="draft"))
    out = {"plain": (None, 0)}
    for k in two_model_k:
        out[f"draft->target k={k}"] = (make_draft, k)
        out[f"inter->target k={k}"] = (lambda: hf_specdec.ModelDrafter(intermediate, name="inter"), k)
    for kd, ki in hierarchy:
        out[f"hierarchy kd={kd} ki={ki}"] = (
            lambda kd=kd, ki=ki: hf_specdec.HierarchicalDrafter(make_draft(), hf_specdec.ModelDrafter(intermediate, name="inter"),
                                                                 draft_len=kd, cycles=ki), ki * (kd + 1))
    return out


def run_env(name, args) -> dict:
    target, intermediate, draft, make_inputs = ENVS[name](args)
    hf_specdec.enable(target)
    eos = target.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    results = {}
    for batch in args.batch_sizes:
        inputs = make_inputs(batch)
        models = (("target", target), ("inter", intermediate)) + (() if isinstance(draft, type) else (("draft", draft),))
        seconds = {m: forward_seconds(m_model, batch) for m, m_model in models}
        seconds.setdefault("draft", 0.0)      # a lookup drafter: no forward
        table = methods(intermediate, draft, args.two_model_k, args.hierarchy)
        times, outs, drafters = {m: [] for m in table}, {}, {}
        target.generate(**inputs, max_new_tokens=2, do_sample=False)                       # warm-up
        for _ in tqdm(range(args.repeats), desc=f"{name} batch={batch}", leave=False):
            for m, (make, k) in table.items():
                kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
                if make is not None:
                    drafters[m] = make()
                    kwargs.update(assistant_models=[drafters[m]], spec_policy=hf_specdec.FixedLength(k))
                start = time.perf_counter()
                outs[m] = target.generate(**kwargs)
                times[m].append(time.perf_counter() - start)
        plain = outs["plain"].sequences
        tokens = new_tokens(outs["plain"], inputs["input_ids"].shape[1], eos)
        rows = {}
        for m, out in outs.items():
            stats = getattr(out, "spec_stats", None)
            d = drafters.get(m)
            row = {"tokens_per_s": round(tokens / statistics.median(times[m]), 2),
                   "seconds": [round(t, 3) for t in times[m]],
                   "identity": counts(compare_rows(target, inputs["input_ids"], inputs.get("attention_mask"), plain,
                                                   out.sequences, eos)),
                   "mat": round(stats.mean_accepted_tokens, 3) if stats else 1.0}
            if stats:
                proposed = sum(sum(s.proposed) for s in stats.steps)
                row["accept_outer"] = round(sum(sum(s.accepted) for s in stats.steps) / max(proposed, 1), 3)
                row["target_forwards"] = stats.target_forwards
            if isinstance(d, hf_specdec.HierarchicalDrafter):
                row["accept_inner"] = round(d.stats.acceptance, 3)
            if d is not None:
                row["forwards"] = dict(d.forwards())
            rows[m] = row
        for r in rows.values():
            r["vs_plain"] = round(r["tokens_per_s"] / rows["plain"]["tokens_per_s"], 3)
        results[str(batch)] = {"forward_seconds": seconds,
                               "cost_ratio": {"draft/target": round(seconds["draft"] / seconds["target"], 3),
                                              "inter/target": round(seconds["inter"] / seconds["target"], 3),
                                              "draft/inter": round(seconds["draft"] / seconds["inter"], 3)},
                               "methods": rows}
        logger.info("%s batch=%d %s", name, batch, {m: r["tokens_per_s"] for m, r in rows.items()})
    return results


def markdown(all_results: dict, args) -> str:
    lines = [f"# Hierarchy vs two models: greedy, {args.max_new_tokens} new tokens, median of {args.repeats} runs", "",
             "Cost ratio: one-token forward time of the cheaper model / the model verifying it. "
             "Accept: accepted / proposed drafts at that level. MAT: tokens per target forward and row. "
             "~n: n rows first differ from plain at a near-tie of the target's dtype; ≠n: n rows differ otherwise.", ""]
    for env, res in all_results.items():
        for batch, r in res.items():
            c = r["cost_ratio"]
            lines += [f"## {env}, batch {batch}", "",
                      f"cost ratios (one-token forward): draft/target {c['draft/target']}, inter/target "
                      f"{c['inter/target']}, draft/inter {c['draft/inter']}", "",
                      "| method | tokens/s | x plain | MAT | accept (-> target) | accept (draft -> inter) | forwards |",
                      "|---|---:|---:|---:|---:|---:|---|"]
            for m, x in r["methods"].items():
                mark = identity_mark(x["identity"])
                lines.append(f"| {m} | {x['tokens_per_s']:.1f}{mark} | {x['vs_plain']:.2f} | {x['mat']:.2f} | "
                             f"{x.get('accept_outer', '')} | {x.get('accept_inner', '')} | "
                             f"{', '.join(f'{k} {v}' for k, v in x.get('forwards', {}).items())} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(all_results: dict, path: Path) -> None:
    """Speed x plain of the best two-model setup and the best hierarchy, per environment and batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [(env, b, r["methods"]) for env, res in all_results.items() for b, r in res.items()]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(cells)), 3.6))
    for offset, (label, prefix) in enumerate((("best draft -> target", "draft->"), ("best inter -> target", "inter->"),
                                              ("best hierarchy", "hierarchy"))):
        ys = [max((x["vs_plain"] for m, x in rows.items() if m.startswith(prefix)), default=0) for _, _, rows in cells]
        ax.bar([i + 0.27 * (offset - 1) for i in range(len(cells))], ys, width=0.27, label=label)
    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax.set_xticks(range(len(cells)), [f"{env}\nB={b}" for env, b, _ in cells], fontsize=8)
    ax.set_ylabel("speed x plain generate()")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="tiny,tiny-distilled,smollm2")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--two-model-k", default="2,4,6", help="k of the two-model setups")
    parser.add_argument("--hierarchy", default="2x2,3x2,4x1,2x3", help="k_d x k_i of the hierarchies")
    parser.add_argument("--questions", default=None, help="Spec-Bench's question.jsonl (qwen-rag)")
    parser.add_argument("--onednn", action="store_true", help="qwen envs: float32 on oneDNN linear layers")
    parser.add_argument("--out", default="results/bench_hierarchy")
    parser.add_argument("--update", action="store_true",
                        help="keep the (env, batch) results already in <out>.json that this run does not redo")
    args = parse_env_args(parser, argv, ENVS)
    args.two_model_k = [int(k) for k in args.two_model_k.split(",")]
    args.hierarchy = [tuple(int(x) for x in h.split("x")) for h in args.hierarchy.split(",")]
    if "qwen-rag" in args.envs.split(",") and args.questions is None:
        parser.error(f"--envs qwen-rag needs --questions: Spec-Bench's question.jsonl, from {SPEC_BENCH}")
    out = Path(args.out)
    all_results = {}
    if args.update and out.with_suffix(".json").exists():
        all_results = json.loads(out.with_suffix(".json").read_text())["results"]
    for env in args.envs.split(","):
        all_results.setdefault(env, {}).update(run_env(env, args))
        md = write_results(out.parent, out.name, {"args": vars(args), "results": all_results},
                           markdown(all_results, args), lambda path: plot(all_results, path))
    print(md.read_text())
    bad = [(e, b, m) for e, r in all_results.items() for b, x in r.items()
           for m, y in x["methods"].items() if y["identity"]["other"]]
    if bad:
        raise SystemExit(f"outputs differ from plain generate(): {bad}")


if __name__ == "__main__":
    main()
