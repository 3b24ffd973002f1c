"""The GPU benchmark: real Qwen2 architectures at real sizes with built weights, every method side by side.

    python eval/bench_gpu.py --out docs/results/bench_gpu/h200            # a GPU machine, < 8 minutes
    python eval/bench_gpu.py --device cpu --pairs toy/toy --vocab 1024 --out /tmp/tiny   # as the test runs it

The GPU machines reach no model hub, so target and draft are `hf_specdec.testing.circle_model`s:
the real architecture at its real size (every layer computes), with weights built so that greedy
decoding continues last+1, last+2, ... and the draft, built alike, agrees with a per-token
probability of about alpha. Outputs are known exactly and every cost is the real model's.

Per cell (target/draft pair, alpha, batch size), methods interleaved (eval/harness.py; round 0 is
an untimed warm-up, which also compiles the `/static` methods):
  - tokens/s, speed over plain eager `generate()` and over compiled plain (`plain/static`);
  - the measured forward costs: target at 1 and k+1 tokens, draft at 1 token over a cache of the
    prompt, eager and (on CUDA) compiled as the static path runs them; c = draft / target step,
    v = verification / target step;
  - the Leviathan bound (1 - a^(k+1)) / ((1 - a)(k c + v)) with the per-token acceptance a
    measured on fixed k, and each speculative method's speed over plain (eager costs) or over
    plain/static (compiled costs, the /static methods) as a fraction of it;
  - host syncs per step of our loop (CUDA only: operations that made the host wait, counted in an
    extra untimed call) and per token of plain generate();
  - identity: every row of every method against the known continuation.
`hf-assisted` (Transformers' own assisted generation) runs at batch 1 only: it refuses more.
Each cell is written as it finishes (JSON + markdown + PNG); a rerun with the same arguments
resumes; no cell starts once --budget-s has passed.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
import warnings
from pathlib import Path

import torch

from transformers import GenerationConfig

from hf_specdec._compat import generation, kv_cache
from hf_specdec.cached_model import CachedModel
from hf_specdec.loop import DecodingLoop
from hf_specdec.rows import RowInts
from hf_specdec.sequences import SequenceBatch
from hf_specdec.testing import (QWEN2_SIZES, QWEN2_VOCAB, circle_continuation, circle_model, prompts,
                                set_circle_alpha)
from harness import Results, arguments, generate, interleaved, parse, speed  # eval/ is on sys.path as a script
from methods import MethodFactory, parse_methods
from report import figure, method_bars

logger = logging.getLogger("bench_gpu")
# Transformers' assisted generation runs eager: with a static cache it compiles its target at fixed
# shapes (CompileConfig's dynamic=False), a whole compile per verification width
METHODS = "plain,plain/static,hf-assisted:4@draft,fixed:4@draft,auto@draft,fixed:4@draft/static,auto@draft/static"


class SyncCounter:
    """Counts the host's waits on the device: operations CUDA's sync debug mode reports, and calls
    of torch.cuda.synchronize / Event.synchronize, while `counting()` is open."""

    def __init__(self):
        self.syncs = 0

    @contextlib.contextmanager
    def counting(self):
        originals = torch.cuda.synchronize, torch.cuda.Event.synchronize

        def explicit(original):
            def wrapper(*args, **kwargs):
                self.syncs += 1
                return original(*args, **kwargs)
            return wrapper
        torch.cuda.synchronize, torch.cuda.Event.synchronize = explicit(originals[0]), explicit(originals[1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize, torch.cuda.Event.synchronize = originals
        self.syncs += sum("synchroniz" in str(w.message) for w in caught)


def syncs_per_step(target, factory, method, inputs, new_tokens) -> float:
    """Host syncs per decoding step of our loop (per new token for Transformers' methods)."""
    counter = SyncCounter()
    if not method.ours:
        with counter.counting():
            generate(target, factory, method, **inputs, max_new_tokens=new_tokens, do_sample=False)
        return counter.syncs / new_tokens
    steps, step = [], DecodingLoop.step

    def counted(loop):
        steps.append(1)
        with counter.counting():
            return step(loop)
    DecodingLoop.step = counted
    try:
        generate(target, factory, method, **inputs, max_new_tokens=new_tokens, do_sample=False)
    finally:
        DecodingLoop.step = step
    return counter.syncs / len(steps)


def forward_ms(model, ids: torch.Tensor, width: int, reps: int, compile_config=None) -> float:
    """Median milliseconds of one forward of `width` new tokens per row over a cache of ids [b, p]:
    eager over a dynamic cache, or (compile_config) as the static path runs it, compiled at its
    tier shape (the first calls, which compile and record CUDA graphs, untimed)."""
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    times = []
    if compile_config is None:
        for _ in range(reps + 1):
            cache = kv_cache.new_cache(model)
            model(input_ids=ids, use_cache=True, **kv_cache.cache_kwargs(model, cache))
            sync()
            start = time.perf_counter()
            model(input_ids=ids[:, -width:], use_cache=True, **kv_cache.cache_kwargs(model, cache))
            sync()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times[1:])
    batch = SequenceBatch(ids, None, ids.shape[1] + width, 0, static_cache=True, compile_config=compile_config)
    runner = CachedModel(model)
    runner.reset(batch)
    runner.forward(ids, None, keep=1)                      # the prefill allocates the cache
    nothing = RowInts.full(len(ids), 0, ids.device)
    for _ in range(reps + 3):
        region = runner.open_region(0, width)
        sync()
        start = time.perf_counter()
        runner.forward(ids[:, -width:], None, keep=width)
        sync()
        times.append(time.perf_counter() - start)
        runner.rollback(region, nothing, [width] * len(ids))     # the same slots again next time
    return 1e3 * statistics.median(times[3:])


def _compile_seconds() -> float:
    """Seconds dynamo has spent compiling frames so far (tracing and the backend's compile)."""
    from torch._dynamo.utils import compilation_time_metrics
    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def leviathan_bound(alpha: float, k: int, c: float, v: float) -> float:
    """Expected speed over plain decoding of k drafts a step at per-token acceptance alpha, a draft
    step costing c and a verification v target steps (Leviathan et al. 2023, Theorem 3.8 with v)."""
    if alpha >= 1.0:
        return (k + 1) / (k * c + v)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + v))


def run_cell(target, draft, methods, batch: int, alpha: float, args, device) -> dict:
    factory = MethodFactory(target, draft_model=draft)
    ids, mask = (t.to(device) for t in prompts(batch, seed=batch, min_len=args.prompt_len // 2,
                                                max_len=args.prompt_len, vocab=args.vocab))
    inputs = dict(input_ids=ids, attention_mask=mask)
    expected = circle_continuation(ids, args.max_new_tokens, args.vocab)
    methods = [m for m in methods if batch == 1 or m.ours or m.policy is None]   # hf-assisted: batch 1
    steps = {}

    def run(method):
        out = generate(target, factory, method, **inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                       return_dict_in_generate=True)
        steps[method.name] = out.spec_stats.steps if method.ours else None
        return out.sequences
    compiling = _compile_seconds()
    timing = interleaved(methods, run, args.rounds, device=device, keep_going=True)
    compiling = _compile_seconds() - compiling
    tokens = batch * args.max_new_tokens
    rows = {name: {"error": error} for name, error in timing.errors.items()}
    methods = [m for m in methods if m.name not in timing.errors]
    vs_plain = speed(timing.seconds, "plain")
    vs_static = speed(timing.seconds, "plain/static") if "plain/static" in timing.seconds else {}
    for method in methods:
        new = timing.outputs[method.name][:, ids.shape[1]:]
        row = {"tokens_per_s": tokens / vs_plain[method.name]["seconds"], "x_plain": vs_plain[method.name],
               "first_call_s": timing.warmup_seconds.get(method.name),
               "x_static": vs_static.get(method.name, {}).get("x"),
               "identical_rows": int((new == expected).all(1).sum()), "rows": batch, "x_bound": None}
        if steps[method.name]:
            recs = steps[method.name]
            proposed, accepted = sum(sum(s.proposed) for s in recs), sum(sum(s.accepted) for s in recs)
            rejections = sum(a < p for s in recs for a, p in zip(s.accepted, s.proposed))
            row.update(mean_k=statistics.mean(s.k for s in recs),
                       mat=sum(sum(s.emitted) for s in recs) / sum(s.batch_size for s in recs),
                       # per-token acceptance: accepted drafts over accepted + rejected (geometric MLE)
                       alpha=accepted / (accepted + rejections) if proposed else None)
        if device.type == "cuda":
            row["syncs"] = syncs_per_step(target, factory, method, inputs, args.max_new_tokens)
        rows[method.name] = row
        logger.info("batch %d %s: %.0f tok/s, %.2fx plain", batch, method.name, row["tokens_per_s"],
                    row["x_plain"]["x"])
    measured = next((rows[m.name]["alpha"] for m in methods if m.name.startswith(f"fixed:{args.k}@")), None)
    a = measured if measured is not None else alpha
    # dynamo's own account of the cell's compiles (every method's, Transformers' included)
    cell = {"alpha_built": alpha, "batch": batch, "alpha": measured, "methods": rows, "compile_s": compiling}
    # eager costs bound eager methods (over plain); compiled costs bound /static ones (over plain/static)
    compiled = generation.compile_config(target, GenerationConfig(cache_implementation="static"))
    for kind, config, ratio in (("eager", None, "x_plain"), ("static", compiled, "x_static")):
        if kind == "static" and config is None:
            continue                             # Transformers compiles on CUDA-like devices only
        costs = {"target_1": forward_ms(target, ids, 1, args.forward_reps, config),
                 "target_k1": forward_ms(target, ids, args.k + 1, args.forward_reps, config),
                 "draft_1": forward_ms(draft, ids, 1, args.forward_reps, config)}
        c, v = costs["draft_1"] / costs["target_1"], costs["target_k1"] / costs["target_1"]
        bound = leviathan_bound(a, args.k, c, v)
        cell[kind] = {"costs_ms": costs, "c": c, "v": v, "bound": bound}
        for method in methods:                   # speculative methods against what their costs allow
            if method.policy and method.static == (kind == "static") and rows[method.name].get(ratio) is not None:
                x = rows[method.name][ratio]
                rows[method.name]["x_bound"] = (x["x"] if isinstance(x, dict) else x) / bound
    return cell


def markdown(payload) -> str:
    args = payload["args"]
    lines = [f"Qwen2 architectures at real sizes with built weights (`circle_model`), {args['dtype']}, greedy, "
             f"{args['max_new_tokens']} new tokens a row, prompts up to {args['prompt_len']} tokens, k = {args['k']} "
             f"for the bound; {args['rounds']} interleaved rounds after a warm-up. x plain / x static: median "
             "[min, max] of per-round speed ratios to eager and compiled plain generate(). x bound: x plain over "
             "the Leviathan bound from the measured a, c, v. syncs: host syncs per step (plain and hf-assisted: "
             "per token). identical: rows equal to the known continuation. /static methods are bounded by the "
             "compiled forwards' costs, over plain/static. first call: the cell's untimed warm-up call (the first "
             "cell's compiles; later cells' new shapes).", ""]
    for cell in payload["cells"]:
        alpha = f"{cell['alpha']:.2f}" if cell["alpha"] is not None else "-"
        costs = "; ".join(f"{kind}: target 1 / {args['k'] + 1} tokens {c['costs_ms']['target_1']:.1f} / "
                          f"{c['costs_ms']['target_k1']:.1f} ms, draft {c['costs_ms']['draft_1']:.1f} ms (c = "
                          f"{c['c']:.2f}, v = {c['v']:.2f}), bound {c['bound']:.2f}x plain {kind}"
                          for kind, c in ((kind, cell[kind]) for kind in ("eager", "static") if kind in cell))
        lines += [f"**{cell['pair']}, built a = {cell['alpha_built']}, batch {cell['batch']}**: measured a = "
                  f"{alpha}; forwards {costs}; compiling in the cell (every method) {cell.get('compile_s', 0):.0f} s", "",
                  "| method | tokens/s | x plain | x static | x bound | mean k | MAT | syncs | identical | first call s |",
                  "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
        for name, r in cell["methods"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:120]} |")
                continue
            x = r["x_plain"]
            fmt = lambda v, f=".2f": "-" if v is None else format(v, f)  # noqa: E731
            lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {x['x']:.2f} [{x['x_min']:.2f}, {x['x_max']:.2f}] | "
                         f"{fmt(r['x_static'])} | {fmt(r['x_bound'])} | {fmt(r.get('mean_k'))} | {fmt(r.get('mat'))} | "
                         f"{fmt(r.get('syncs'), '.1f')} | {r['identical_rows']}/{r['rows']} | "
                         f"{fmt(r.get('first_call_s'), '.1f')} |")
        lines.append("")
    return "\n".join(lines)


def plot(payload, path: Path) -> None:
    groups = list(dict.fromkeys((c["pair"], c["alpha_built"]) for c in payload["cells"]))
    with figure(path, cols=len(groups)) as axes:
        for ax, (pair, alpha) in zip(axes[0], groups):
            cells = sorted((c for c in payload["cells"] if (c["pair"], c["alpha_built"]) == (pair, alpha)),
                           key=lambda c: c["batch"])
            width = method_bars(ax, cells, lambda r: r["x_plain"]["x"] if "x_plain" in r else None,
                                ylabel="speed / plain eager generate()")
            for i, c in enumerate(cells):
                ax.hlines(c["eager"]["bound"], i - width / 2, i + 0.8 - width / 2, colors="black", linestyles="dashed",
                          label="Leviathan bound (eager costs)" if i == 0 else None)
            ax.set_title(f"{pair}, a = {alpha}")
            ax.legend(fontsize=7)
        ax.figure.suptitle(payload["stamp"]["machine"]["device"])


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pairs", default="7b/0.5b", help=f"target/draft sizes among {sorted(QWEN2_SIZES)}")
    parser.add_argument("--alphas", default="0.8", help="built per-token acceptance of the draft")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--methods", default=METHODS, help="plain first, then eval/methods.py names")
    parser.add_argument("--k", type=int, default=4, help="draft length of the bound (and of fixed:k)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--forward-reps", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=QWEN2_VOCAB)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="Gemma 3's layer pattern (5 sliding-window layers of this many tokens to 1 full)")
    parser.add_argument("--budget-s", type=float, default=400, help="start no cell after this many seconds")
    parser.add_argument("--out", required=True, help="path prefix: <out>.json, .md, .png")
    args = parse(parser, argv, log_format="%(asctime)s %(message)s")   # timed against --budget-s
    try:
        methods = parse_methods(args.methods, first="plain")
        pairs = [tuple(p.split("/")) for p in args.pairs.split(",")]
        alphas = [float(a) for a in args.alphas.split(",")]
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError as e:
        parser.error(str(e))
    if any(len(p) != 2 or not set(p) <= set(QWEN2_SIZES) for p in pairs):
        parser.error(f"--pairs: target/draft sizes among {sorted(QWEN2_SIZES)}, got {args.pairs!r}")
    if any(not 0 < a <= 1 for a in alphas):
        parser.error(f"--alphas must lie in (0, 1], got {args.alphas!r}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    began = time.perf_counter()

    results = Results(Path(args.out), vars(args), markdown, plot)
    for target_size, draft_size in pairs:
        pair = f"{target_size}/{draft_size}" + (f", window {args.sliding_window}" if args.sliding_window else "")
        target = draft = None
        for alpha in alphas:
            for batch in batch_sizes:
                if results.done({"pair": pair, "alpha_built": alpha, "batch": batch}):
                    continue
                if time.perf_counter() - began > args.budget_s:
                    logger.warning("budget of %.0f s spent: stopping before %s a=%s batch %d", args.budget_s,
                                   pair, alpha, batch)
                    return
                built = dict(device=device, dtype=dtype, sliding_window=args.sliding_window)
                target = target or circle_model(target_size, args.vocab, **built)
                if draft is None:      # one draft model for every alpha: its compiled forward is kept
                    draft = circle_model(draft_size, args.vocab, **built)
                set_circle_alpha(draft, alpha)
                cell = run_cell(target, draft, methods, batch, alpha, args, device)
                logger.info("wrote %s", results.add({"pair": pair, **cell}))


if __name__ == "__main__":
    main()
