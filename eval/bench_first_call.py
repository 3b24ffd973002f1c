"""The first compiled generate() call on the CPU, ours against Transformers' own; and the compiled
path's steady speed.

    python eval/bench_first_call.py --out docs/results/bench_first_call/smollm2-cpu

Target: the embedded SmolLM2-135M-Instruct (30 layers, float32); draft: its first 4 layers (with its
embeddings, final norm and head: a smaller model of the same architecture). One HumanEval chat
prompt, greedy, --max-new-tokens. Every call is compiled as Transformers compiles on any device:
`CompileConfig(fullgraph=True)` with `_compile_all_devices` (its own switch; the default config but
for the device rule).

First call: each method in a process of its own, twice in a row:
  cold  a fresh process with empty compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR: a new
        directory);
  warm  a second process on the caches the first one left (torch's on-disk caches).
Per process: the first call's seconds (compiling included), the second call's, the graphs dynamo
compiled, and whether the output is plain generate()'s (eager, float32).

Steady: the methods interleaved in this process after untimed rounds until one compiles nothing;
seconds per call and speed over Transformers' compiled plain.

Methods: plain/static (Transformers' own compiled plain generate(), its code path), ours (fixed:4
with the draft, static cache: whole forwards compiled, one-token ones with every layer inlined as
Transformers' once they are hot, wider ones with the decoder layers as nested compile regions,
`hf_specdec/compiled.py`, `hf_specdec/regions.py`) and default (ours with no `spec_policy`).
Cells are written as they finish; a rerun with the same arguments resumes.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import Results, arguments, interleaved, parse, speed
from report import figure

logger = logging.getLogger("bench_first_call")
METHODS = ("plain/static", "ours", "default")
MARK = "FIRST-CALL "


def models():
    """The target, its tokenizer and the draft (the target's first 4 layers)."""
    from hf_specdec.embedded import load_smollm2
    target, tokenizer = load_smollm2()
    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = 4
    draft = type(target)(config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)          # the layers past 4 are left out
    return target, tokenizer, draft


def inputs(tokenizer) -> dict:
    from envs import encode, humaneval_texts
    return encode(tokenizer, humaneval_texts(tokenizer, limit=1), chat=True)


def call(method: str, target, draft, prompt: dict, new_tokens: int) -> torch.Tensor:
    """One generate() call of `method` (Transformers' own generate() for plain)."""
    import hf_specdec
    from transformers import CompileConfig
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    kwargs = dict(**prompt, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                  compile_config=config)
    if method == "plain/static":
        return type(target).generate(target, **kwargs)
    policy = "fixed:4" if method == "ours" else None         # default: no spec_policy
    return target.generate(custom_generate=hf_specdec.generate, assistant_models=[draft], spec_policy=policy,
                           **kwargs)


def child(method: str, new_tokens: int) -> None:
    """A process's first and second call of `method`, printed as one JSON line after MARK."""
    from torch._dynamo.utils import counters
    target, tokenizer, draft = models()
    prompt = inputs(tokenizer)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        out = call(method, target, draft, prompt, new_tokens)
        seconds.append(time.perf_counter() - start)
    graphs = counters["stats"]["unique_graphs"]
    plain = type(target).generate(target, **prompt, max_new_tokens=new_tokens, do_sample=False)
    print(MARK + json.dumps({"first_s": seconds[0], "second_s": seconds[1], "graphs": graphs,
                             "identical": bool(torch.equal(out, plain))}), flush=True)


def first_call(method: str, cache_dir: str, new_tokens: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TRITON_CACHE_DIR=f"{cache_dir}/triton")
    done = subprocess.run([sys.executable, __file__, "--child", method, "--max-new-tokens", str(new_tokens)],
                          env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"{method}: the child process failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len(MARK):])


def steady(methods: list[str], rounds: int, new_tokens: int) -> dict:
    from methods import Method
    from torch._dynamo.utils import counters
    target, tokenizer, draft = models()
    prompt = inputs(tokenizer)
    timing = interleaved([Method(m) for m in methods], lambda m: call(m.name, target, draft, prompt, new_tokens),
                         rounds, settled=lambda: counters["stats"]["unique_graphs"])
    plain = type(target).generate(target, **prompt, max_new_tokens=new_tokens, do_sample=False)
    return {"speed": speed(timing.seconds, "plain/static"), "warmup_s": timing.warmup_seconds,
            "identical": {m: bool(torch.equal(out, plain)) for m, out in timing.outputs.items()}}


def markdown(payload: dict) -> str:
    args = payload["args"]
    first = [c for c in payload["cells"] if c["phase"] == "first"]
    lines = [f"SmolLM2-135M (30 layers, fp32) with a 4-layer draft, batch 1, {args['max_new_tokens']} new tokens, "
             "greedy; compiled with `CompileConfig(fullgraph=True)` + `_compile_all_devices` (inductor on the CPU). "
             "First call: a fresh process each, cold (empty compile caches) then warm (the caches it left); "
             "x = the method's first call over Transformers' compiled plain first call (same round). "
             "= : output identical to plain generate()'s (eager).", "",
             "| method | cache | first call s (median) | x plain/static | second call s | graphs | = |",
             "|---|---|---:|---:|---:|---:|:-:|"]
    for method in METHODS:
        for cache in ("cold", "warm"):
            cells = [c for c in first if c["method"] == method and c["cache"] == cache]
            if not cells:
                continue
            ratios = [c["first_s"] / p["first_s"] for c in cells for p in first
                      if p["method"] == "plain/static" and p["cache"] == cache and p["round"] == c["round"]]
            x = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]" if ratios else "-"
            lines.append(f"| {method} | {cache} | {statistics.median(c['first_s'] for c in cells):.1f} | {x} | "
                         f"{statistics.median(c['second_s'] for c in cells):.2f} | {cells[-1]['graphs']} | "
                         f"{'yes' if all(c['identical'] for c in cells) else 'NO'} |")
    for cell in payload["cells"]:
        if cell["phase"] != "steady":
            continue
        lines += ["", f"Steady, one process, methods interleaved over {args['rounds']} timed rounds after untimed "
                  "ones until a round compiled nothing: seconds per call, speed over plain/static (median "
                  "[min, max] of per-round ratios).", "",
                  "| method | s per call | x plain/static | = | first untimed round s |",
                  "|---|---:|---:|:-:|---:|"]
        for method, row in cell["speed"].items():
            lines.append(f"| {method} | {row['seconds']:.2f} | {row['x']:.2f} [{row['x_min']:.2f}, {row['x_max']:.2f}] "
                         f"| {'yes' if cell['identical'][method] else 'NO'} | {cell['warmup_s'][method]:.1f} |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    first = [c for c in payload["cells"] if c["phase"] == "first"]
    with figure(path, size=(7, 3.5)) as axes:
        ax = axes[0][0]
        for i, cache in enumerate(("cold", "warm")):
            values = [statistics.median([c["first_s"] for c in first if c["method"] == m and c["cache"] == cache]
                                        or [0.0]) for m in METHODS]
            bars = ax.bar([x + 0.38 * i for x in range(len(METHODS))], values, width=0.36, label=cache)
            ax.bar_label(bars, fmt="%.0f")
        ax.set_xticks([x + 0.19 for x in range(len(METHODS))], METHODS)
        ax.set_ylabel("first call, s")
        ax.set_title("First compiled generate() call, SmolLM2-135M on the CPU")
        ax.legend()


def main(argv=None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--out", default="docs/results/bench_first_call/smollm2-cpu")
    parser.add_argument("--rounds", type=int, default=2, help="first-call rounds; and timed rounds of the steady part")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--child", help="(internal) run one process's calls of this method")
    args = parse(parser, argv)
    torch.set_num_threads(os.cpu_count() or 1)
    if args.child:
        child(args.child, args.max_new_tokens)
        return
    methods = args.methods.split(",")
    results = Results(Path(args.out), {k: v for k, v in vars(args).items() if k != "child"}, markdown, plot)
    for r in range(args.rounds):
        for method in methods:
            if results.done({"phase": "first", "round": r, "method": method, "cache": "warm"}):
                continue
            with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache_dir:
                for cache in ("cold", "warm"):
                    cell = first_call(method, cache_dir, args.max_new_tokens)
                    logger.info("round %d %s %s: first call %.1f s", r, method, cache, cell["first_s"])
                    results.add({"phase": "first", "round": r, "method": method, "cache": cache, **cell})
    if not results.done({"phase": "steady"}):
        results.add({"phase": "steady", **steady(methods, args.rounds, args.max_new_tokens)})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
