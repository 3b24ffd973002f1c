"""Speculation on a hybrid model (Gated DeltaNet layers beside attention) on this CPU.

    python eval/bench_hybrid.py --out docs/results/bench_hybrid/qwen3_5-cpu

Target: a Qwen3.5-style hybrid at 0.30B parameters (`circle_model("hybrid-0.3b")`: 12 layers, three
Gated DeltaNet layers to one attention layer, Qwen3.5's own classes), whose built weights give a known
greedy continuation; draft: the same style at 49M ("hybrid-draft"), rewired for per-token acceptance
about --alpha. float32, greedy, random prompts of --prompt-len tokens. --kernels: the linear layers
of both models as built (torch's default, MKL here) or on oneDNN (`hf_specdec.kernels`: on this AVX2
CPU, MKL computes a product of a few rows at the speed of that many one-row products).

Per batch size:
  - verification cost: one target forward of k + 1 tokens against one token, over a cache of the
    prompt: Transformers' own (its DynamicCache; several tokens take its chunked rule) and ours (a
    forward that keeps each position's states, `hf_specdec/states.py`);
  - plain generate() (Transformers' own code path), ours fixed:4 and ours default (auto), interleaved
    for --rounds timed rounds after a warm-up; every row checked against the known continuation.
Cells are written as they finish; a rerun with the same arguments resumes.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import Results, arguments, generate, interleaved, ints, parse, speed
from methods import MethodFactory, parse_methods
from report import figure, method_bars

from hf_specdec._compat import kv_cache
from hf_specdec.kernels import use_onednn_linears
from hf_specdec.states import as_verification
from hf_specdec.testing import circle_continuation, circle_model

METHODS = "plain,fixed:4@draft,auto@draft"


def forward_ms(model, prompt: torch.Tensor, width: int, ours: bool, repeats: int = 5) -> float:
    """Median ms of a forward of `width` tokens after `prompt` [b, p] (a fresh cache each time):
    Transformers' own (its DynamicCache), or as our verification runs it (`as_verification`)."""
    times = []
    for _ in range(repeats + 1):
        cache = kv_cache.new_cache(model) if ours else kv_cache.DynamicCache(config=model.config)
        for ids in (prompt, prompt[:, -width:]):
            start = time.perf_counter()
            with as_verification(model, cache, len(ids), ids.shape[1]) if ours else contextlib.nullcontext():
                model(input_ids=ids, use_cache=True, **kv_cache.cache_kwargs(model, cache))
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times[1:]), 1)


def markdown(payload: dict) -> str:
    args = payload["args"]
    lines = [f"Qwen3.5-style hybrid target ({args['target']}, {payload.get('params', '?')}) and draft "
             f"({args['draft']}), built weights, float32 ({args.get('kernels', 'default')} linear layers), greedy, "
             f"acceptance about {args['alpha']}, "
             f"{args['max_new_tokens']} new tokens, prompts of {args['prompt_len']}. "
             "Verification: ms of one target forward of k + 1 = 5 tokens against one (Transformers' own cache; "
             "ours keeps each position's states). Speed: median [min, max] of per-round ratios to plain "
             "generate(), interleaved; identical: rows equal to the known continuation.", "",
             "| batch | forward 1 tok (Transformers) | 5 tok (Transformers) | 1 tok (ours) | 5 tok (ours) "
             "| method | s per call | x plain | identical |",
             "|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for cell in payload["cells"]:
        f = cell["forward_ms"]
        for name, row in cell["methods"].items():
            lines.append(f"| {cell['batch']} | {f['transformers'][0]} | {f['transformers'][1]} | {f['ours'][0]} "
                         f"| {f['ours'][1]} | {name} | {row['seconds']:.2f} | {row['x']:.2f} "
                         f"[{row['x_min']:.2f}, {row['x_max']:.2f}] | {cell['identical'][name]} |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    with figure(path) as axes:
        method_bars(axes[0][0], payload["cells"], lambda r: r.get("x"), lambda r: [r["x_min"], r["x_max"]])
        axes[0][0].set_title("hybrid target (Gated DeltaNet + attention), CPU")
        axes[0][0].legend()


def main(argv=None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--out", default="docs/results/bench_hybrid/qwen3_5-cpu")
    parser.add_argument("--target", default="hybrid-0.3b")
    parser.add_argument("--draft", default="hybrid-draft")
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--kernels", choices=("default", "onednn"), default="onednn")
    args = parse(parser, argv)
    target = circle_model(args.target, args.vocab, dtype=torch.float32)
    draft = circle_model(args.draft, args.vocab, alpha=args.alpha, dtype=torch.float32)
    params = f"{sum(p.numel() for p in target.parameters()) / 1e9:.2f}B"
    if args.kernels == "onednn":
        for model in (target, draft):
            use_onednn_linears(model)
    results = Results(Path(args.out), vars(args), markdown, plot)
    results.payload["params"] = params
    methods = parse_methods(args.methods)
    factory = MethodFactory(target, draft_model=draft)
    for batch in ints(args.batches):
        if results.done({"batch": batch}):
            continue
        ids = torch.randint(1, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        expected = torch.cat([ids, circle_continuation(ids, args.max_new_tokens, args.vocab)], 1)
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                      do_sample=False)
        forward = {kind: [forward_ms(target, ids, w, kind == "ours") for w in (1, 5)] for kind in ("transformers", "ours")}
        timing = interleaved(methods, lambda m: generate(target, factory, m, **inputs), rounds=args.rounds)
        identical = {name: f"{int((out == expected).all(1).sum())}/{batch}" for name, out in timing.outputs.items()}
        results.add(dict(batch=batch, forward_ms=forward, methods=speed(timing.seconds, "plain"), identical=identical))
        print(f"batch {batch}: {forward} {identical}", file=sys.stderr)


if __name__ == "__main__":
    main()
