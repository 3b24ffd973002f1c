"""Ours on the compiled static path against Transformers' compiled plain generate(), step for step.

    python eval/bench_compiled.py --pair cheap --out docs/results/bench_compiled/cheap-cpu
    python eval/bench_compiled.py --pair smollm2 --out docs/results/bench_compiled/smollm2-cpu
    python eval/bench_compiled.py --pair 7b/0.5b --alpha 0.8 --batches 1 --out $RESULTS/h100-compiled  # make gpu-check

Every call compiles as a user who compiles does: `cache_implementation="static"` with
`CompileConfig(fullgraph=True)` (and `_compile_all_devices`, Transformers' own switch, on a CPU).
Methods, interleaved in one process after untimed rounds until one compiles nothing:
  plain/static  Transformers' own compiled plain generate() (its code path: the class's generate())
  fixed:0       ours, every step plain (the draft never runs)
  fixed:4       ours, k = 4 with the draft
  auto          ours, the default policy (no `spec_policy`); its first call is the untimed one
Pairs: `cheap` = `hf_specdec.testing.exact_cheap_pair()` (8-layer 384-wide target, a 1-layer draft
that computes exactly its function; 16 random prompt tokens); `smollm2` = the embedded
SmolLM2-135M (30 layers) with its first 4 layers as the draft, HumanEval prompts; `<target>/<draft>`
(sizes of `hf_specdec.testing.QWEN2_SIZES`) = circle models of real Qwen2 sizes, the draft accepted
about --alpha a token, built on --device in bfloat16 (float32 on a CPU), 32-token prompts: the GPU
check's first cell (`make gpu-check`, with TORCH_LOGS=recompiles).

Per call of ours (the compiling round too) it keeps: wall seconds, the steps' seconds, seconds
outside the steps (set-up, prefill, close), compiled warm-up steps, graphs compiled, and per k the
steps and median draft / verify / overhead ms; on CUDA the CUDA-graph skips (inductor's count);
the default's learnt step costs after the call (ms per arm k, per batch bucket). Every output is
checked against plain generate() (eager). Cells (one per batch size) are written as they finish;
a rerun resumes.
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import Results, arguments, interleaved, ints, parse, speed
from report import figure

logger = logging.getLogger("bench_compiled")
METHODS = ("plain/static", "fixed:0", "fixed:4", "auto")


def models(pair: str, alpha: float, device: torch.device):
    """(target, draft, inputs(batch) -> generate()'s input dict)."""
    if "/" in pair:
        from hf_specdec.testing import QWEN2_VOCAB, circle_model, prompts
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        target_size, draft_size = pair.split("/")
        target = circle_model(target_size, device=device, dtype=dtype)
        draft = circle_model(draft_size, alpha=alpha, device=device, dtype=dtype)

        def circle_inputs(batch):
            ids, mask = prompts(batch, seed=batch, min_len=32, max_len=32, vocab=QWEN2_VOCAB)
            return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        return target, draft, circle_inputs
    if pair == "cheap":
        from envs import random_ids
        from hf_specdec.testing import exact_cheap_pair
        target, draft = exact_cheap_pair()
        return target, draft, lambda batch: random_ids(target.config.vocab_size, batch, length=16)
    from bench_first_call import models as smollm2
    from envs import encode, humaneval_texts
    target, tokenizer, draft = smollm2()
    return target, draft, lambda batch: encode(tokenizer, humaneval_texts(tokenizer, style="raw", limit=batch))


def compile_kwargs() -> dict:
    from transformers import CompileConfig
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    return dict(cache_implementation="static", compile_config=config)


def learnt_costs(policy) -> dict:
    """The default's step costs as learnt so far: per batch bucket, ms per arm k."""
    buckets = getattr(policy.length, "buckets", {})
    return {bucket: {k: round(1e3 * s, 3) for k, s in costs.measured().items()} for bucket, costs in buckets.items()}


def call_record(stats, wall: float, graphs: int, skips: int) -> dict:
    """What one call of ours did: wall and step seconds, warm-ups, graphs, CUDA-graph skips, and
    per k its steps."""
    steps = stats.steps
    per_k = {}
    for k in sorted({s.k for s in steps}):
        mine = [s for s in steps if s.k == k and not s.warmup]
        per_k[k] = {"steps": len([s for s in steps if s.k == k]),
                    "draft_ms": 1e3 * statistics.median([s.draft_s for s in mine]) if mine else None,
                    "verify_ms": 1e3 * statistics.median([s.verify_s for s in mine]) if mine else None,
                    "overhead_ms": 1e3 * statistics.median([s.overhead_s for s in mine]) if mine else None}
    step_s = sum(s.seconds for s in steps)
    return {"wall_s": wall, "steps_s": step_s, "outside_steps_s": wall - step_s,
            "warmups": sum(s.warmup for s in steps), "graphs": graphs, "cudagraph_skips": skips,
            "tokens": sum(sum(s.emitted) for s in steps), "per_k": per_k, "learnt_ms": learnt_costs(stats.policy)}


def measure(target, draft, inputs: dict, new_tokens: int, rounds: int) -> dict:
    """One batch size: the methods interleaved; speed over plain/static, ours' per-call records."""
    import hf_specdec
    from methods import Method
    from torch._dynamo.utils import counters
    kwargs = dict(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  **compile_kwargs())
    calls: dict[str, list[dict]] = {m: [] for m in METHODS}

    def run(method: Method):
        graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
        start = time.perf_counter()
        if method.name == "plain/static":
            out = type(target).generate(target, **kwargs)
            calls[method.name].append({"wall_s": time.perf_counter() - start,
                                       "graphs": counters["stats"]["unique_graphs"] - graphs})
            return out
        policy = {} if method.name == "auto" else {"spec_policy": method.name}
        out = target.generate(custom_generate=hf_specdec.generate, assistant_models=[draft],
                              return_dict_in_generate=True, **policy, **kwargs)
        record = call_record(out.spec_stats, time.perf_counter() - start, counters["stats"]["unique_graphs"] - graphs,
                             counters["inductor"]["cudagraph_skips"] - skips)
        calls[method.name].append(record)
        logger.info("%s call %d: %s", method.name, len(calls[method.name]) - 1, record)
        return out.sequences

    timing = interleaved([Method(m) for m in METHODS], run, rounds, device=inputs["input_ids"].device,
                         settled=lambda: counters["stats"]["unique_graphs"])
    plain = type(target).generate(target, **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False)
    return {"speed": speed(timing.seconds, "plain/static"), "warmup_s": timing.warmup_seconds, "calls": calls,
            "identical": {m: bool(torch.equal(out, plain)) for m, out in timing.outputs.items()}}


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(payload: dict) -> str:
    from hf_specdec.policies.base import pow2_bucket
    args = payload["args"]
    pair = {"cheap": "`exact_cheap_pair()` (8 layers, 384 wide, fp32; a 1-layer exact draft), 16-token prompts",
            "smollm2": "SmolLM2-135M (30 layers, fp32) with its first 4 layers as the draft, HumanEval prompts"}.get(
        args["pair"], f"Circle models {args['pair']} (real Qwen2 sizes; the draft accepted about {args['alpha']} "
                      f"a token) on {args['device']}, 32-token prompts")
    lines = [f"{pair}, {args['max_new_tokens']} new tokens, greedy; every call compiled with "
             "`cache_implementation=\"static\"`, `CompileConfig(fullgraph=True)` + `_compile_all_devices` "
             f"(inductor). Methods interleaved in one process, {args['rounds']} timed rounds after untimed ones "
             "until one compiles nothing; x = speed over Transformers' compiled plain (median [min, max] of "
             "per-round ratios); first = the first untimed round's seconds; = : output identical to plain "
             "generate() (eager)."]
    for cell in payload["cells"]:
        lines += ["", f"### Batch {cell['batch']}", "",
                  "| method | s per call | x plain/static | first call s | = |", "|---|---:|---:|---:|:-:|"]
        for method, row in cell["speed"].items():
            lines.append(f"| {method} | {row['seconds']:.3f} | {row['x']:.2f} [{row['x_min']:.2f}, {row['x_max']:.2f}] "
                         f"| {cell['warmup_s'][method]:.1f} | {'yes' if cell['identical'][method] else 'NO'} |")
        plain_ms = 1e3 * cell["speed"]["plain/static"]["seconds"] / (args["max_new_tokens"] * cell["batch"])
        lines += ["", f"Each call of ours (the first one compiles; plain/static: {plain_ms:.2f} ms per token "
                  "steady): wall s, s in steps, s outside them, warm-up steps, graphs compiled, CUDA-graph skips; "
                  "per k: steps, median draft / verify / overhead ms (steady steps); the default's learnt ms per "
                  "arm k (this batch's bucket).", "",
                  "| method | call | wall s | steps s | outside s | warm-ups | graphs | skips | per k | learnt |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        for method in METHODS[1:]:
            for i, c in enumerate(cell["calls"][method]):
                per_k = "; ".join(f"k={k}: {v['steps']} x {_ms(v['draft_ms'])}/{_ms(v['verify_ms'])}/"
                                  f"{_ms(v['overhead_ms'])}" for k, v in c["per_k"].items())
                mine = {int(b): arms for b, arms in c.get("learnt_ms", {}).items()}.get(pow2_bucket(cell["batch"]), {})
                learnt = "; ".join(f"{k}: {ms:.1f}" for k, ms in mine.items())
                lines.append(f"| {method} | {i} | {c['wall_s']:.3f} | {c['steps_s']:.3f} | {c['outside_steps_s']:.3f} "
                             f"| {c['warmups']} | {c['graphs']} | {c.get('cudagraph_skips', 0)} | {per_k} | {learnt or '-'} |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    cells = payload["cells"]
    with figure(path, size=(7, 3.5)) as axes:
        ax = axes[0][0]
        width = 0.8 / max(len(cells), 1)
        for i, cell in enumerate(cells):
            values = [cell["speed"][m]["x"] for m in METHODS]
            bars = ax.bar([x + width * i for x in range(len(METHODS))], values, width=width * 0.95,
                          label=f"batch {cell['batch']}")
            ax.bar_label(bars, fmt="%.2f")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([x + width * (len(cells) - 1) / 2 for x in range(len(METHODS))], METHODS)
        ax.set_ylabel("x Transformers' compiled plain")
        ax.set_title(f"Compiled static path, {payload['args']['pair']} pair")
        ax.legend()


def main(argv=None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--pair", default="cheap", help="cheap, smollm2 or <target>/<draft> (circle models)")
    parser.add_argument("--alpha", type=float, default=0.8, help="a circle draft's acceptance a token")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="docs/results/bench_compiled/cheap-cpu")
    parser.add_argument("--batches", type=ints, default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parse(parser, argv)
    torch.set_num_threads(os.cpu_count() or 1)
    if args.pair not in ("cheap", "smollm2") and not args.pair.count("/") == 1:
        parser.error(f"--pair must be cheap, smollm2 or <target>/<draft>, got {args.pair!r}")
    target, draft, inputs = models(args.pair, args.alpha, torch.device(args.device))
    results = Results(Path(args.out), vars(args), markdown, plot)
    for batch in args.batches:
        if results.done({"batch": batch}):
            continue
        cell = measure(target, draft, inputs(batch), args.max_new_tokens, args.rounds)
        logger.info("batch %d: %s", batch, {m: round(v["x"], 2) for m, v in cell["speed"].items()})
        results.add({"batch": batch, **cell})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
