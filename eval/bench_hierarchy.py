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
Methods: plain; draft -> target and intermediate -> target at k = 2, 4, 6; the hierarchy at
(k_d, k_i) = drafts per inner cycle, inner cycles per target step (the target is offered up to
k_i (k_d + 1) tokens). Reported per method: tokens/s, MAT (tokens per target forward and row),
acceptance at each level, forwards per model, and per level the cost ratio c = (forward time of
the cheaper model) / (forward time of the one verifying it), measured on one-token forwards.
Writes <out>.json and <out>.md.
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
from bench_lengths import new_tokens, parse_env_args  # eval/ is on sys.path when run as a script
from humaneval_data import load_problems

logger = logging.getLogger("bench_hierarchy")
TWO_MODEL_K = (2, 4, 6)
HIERARCHY = ((2, 2), (3, 2), (4, 1), (2, 3))


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


ENVS = {"tiny": lambda: tiny_env(False), "tiny-distilled": lambda: tiny_env(True), "smollm2": smollm2_env}


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


def methods(intermediate, draft) -> dict:
    """name -> (make drafter, outer k); drafters are made fresh per run (their stats are per call)."""
    out = {"plain": (None, 0)}
    for k in TWO_MODEL_K:
        out[f"draft->target k={k}"] = (lambda: hf_specdec.ModelDrafter(draft, name="draft"), k)
        out[f"inter->target k={k}"] = (lambda: hf_specdec.ModelDrafter(intermediate, name="inter"), k)
    for kd, ki in HIERARCHY:
        out[f"hierarchy kd={kd} ki={ki}"] = (
            lambda kd=kd, ki=ki: hf_specdec.HierarchicalDrafter(hf_specdec.ModelDrafter(draft, name="draft"),
                                                                 hf_specdec.ModelDrafter(intermediate, name="inter"),
                                                                 draft_len=kd, cycles=ki), ki * (kd + 1))
    return out


def run_env(name, args) -> dict:
    target, intermediate, draft, make_inputs = ENVS[name]()
    hf_specdec.enable(target)
    results = {}
    for batch in args.batch_sizes:
        inputs = make_inputs(batch)
        seconds = {m: forward_seconds(m_model, batch) for m, m_model in
                   (("target", target), ("inter", intermediate), ("draft", draft))}
        table = methods(intermediate, draft)
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
        eos = target.generation_config.eos_token_id
        tokens = new_tokens(outs["plain"], inputs["input_ids"].shape[1], eos[0] if isinstance(eos, list) else eos)
        rows = {}
        for m, out in outs.items():
            stats = getattr(out, "spec_stats", None)
            d = drafters.get(m)
            row = {"tokens_per_s": round(tokens / statistics.median(times[m]), 2),
                   "identical_to_plain": bool(torch.equal(out.sequences, plain)),
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
             "Accept: accepted / proposed drafts at that level. MAT: tokens per target forward and row.", ""]
    for env, res in all_results.items():
        for batch, r in res.items():
            c = r["cost_ratio"]
            lines += [f"## {env}, batch {batch}", "",
                      f"cost ratios (one-token forward): draft/target {c['draft/target']}, inter/target "
                      f"{c['inter/target']}, draft/inter {c['draft/inter']}", "",
                      "| method | tokens/s | x plain | MAT | accept (-> target) | accept (draft -> inter) | forwards |",
                      "|---|---:|---:|---:|---:|---:|---|"]
            for m, x in r["methods"].items():
                mark = "" if x["identical_to_plain"] else " ≠"
                lines.append(f"| {m} | {x['tokens_per_s']:.1f}{mark} | {x['vs_plain']:.2f} | {x['mat']:.2f} | "
                             f"{x.get('accept_outer', '')} | {x.get('accept_inner', '')} | "
                             f"{', '.join(f'{k} {v}' for k, v in x.get('forwards', {}).items())} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="tiny,tiny-distilled,smollm2")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/bench_hierarchy")
    parser.add_argument("--update", action="store_true",
                        help="keep the (env, batch) results already in <out>.json that this run does not redo")
    args = parse_env_args(parser, argv, ENVS)
    out = Path(args.out)
    all_results = {}
    if args.update and out.with_suffix(".json").exists():
        all_results = json.loads(out.with_suffix(".json").read_text())["results"]
    for env in args.envs.split(","):
        all_results.setdefault(env, {}).update(run_env(env, args))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "results": all_results}, indent=1))
    out.with_suffix(".md").write_text(markdown(all_results, args))
    print(markdown(all_results, args))
    bad = [(e, b, m) for e, r in all_results.items() for b, x in r.items()
           for m, y in x["methods"].items() if not y["identical_to_plain"]]
    if bad:
        raise SystemExit(f"outputs differ from plain generate(): {bad}")


if __name__ == "__main__":
    main()
