"""The decoding loop on a CUDA device: greedy identity, host syncs per step, speed against plain.

    python eval/cuda_check.py --out docs/results/cuda_check/h200

The GPU machines reach no model hub, so the pair is synthetic: hf_specdec.testing.layer_skip_pair
at GPU width, a Llama target whose upper layers write a damped output into the residual stream and
a 1-layer draft holding the target's own lower weights. Its drafts agree often but not always, as a
real pair's do; its acceptance and speeds are this pair's, not a claim about real models.
For each method (eval/methods.py names) and batch size:
  - identity: every row against plain generate(), float32 and bfloat16 (eval/identity.py verdicts:
    identical, near_tie, other = a bug);
  - host syncs per step: CUDA operations that made the host wait (torch.cuda.set_sync_debug_mode),
    counted inside DecodingLoop.step, plus explicit synchronize() calls; plain generate()'s per token;
  - tokens/s against plain generate(), bfloat16, methods interleaved, --repeats rounds (the .json
    keeps each round's ratio to plain and mean k a step: whether a policy switched speculation off).
Every row decodes exactly --max-new-tokens (min_new_tokens), so tokens are the same for all.
Writes <out>.json, .md and .png. On a CPU it runs too (no sync counts), for tests.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import hf_specdec
from hf_specdec.generate import DecodingLoop
from hf_specdec.testing import layer_skip_pair, prompts
from identity import compare_rows, counts  # eval/ is on sys.path when run as a script
from methods import MethodFactory, parse_methods
from report import write_results

logger = logging.getLogger("cuda_check")
METHODS = "plain,fixed:4@draft,hf-heuristic@draft,confidence@draft,adaspec@draft,dsd@draft,nightjar@draft," \
          "hedgespec@pool,fixed:2@hier"


class SyncCounter:
    """Counts the host's waits on the device: operations CUDA's sync debug mode reports, and calls
    of torch.cuda.synchronize / Event.synchronize. `inside(fn)` wraps fn to count only in it."""

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

    def inside(self, fn):
        def wrapper(*args, **kwargs):
            with self.counting():
                return fn(*args, **kwargs)
        return wrapper


def call(model, factory, method, ids, mask, args):
    """One greedy generate() of `method`: (sequences [b, p + new], steps or None for plain)."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                         min_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True,
                         **({"custom_generate": hf_specdec.generate} if method.policy else {}),
                         **factory.generate_kwargs(method))
    return out.sequences, (out.spec_stats.steps if method.policy else None)


def batch_prompts(batch, args, device):
    """The same left-padded random prompts for every part: (input_ids, attention_mask) [batch, <= 48]."""
    return (t.to(device) for t in prompts(batch, seed=batch, min_len=8, max_len=48, vocab=args.vocab))


def check_identity(pair, methods, args, device) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        target, draft = (m.to(device, dtype) for m in pair)
        factory = MethodFactory(target, draft_model=draft, pool=("draft", "pld"))
        for batch in args.batch_sizes:
            ids, mask = batch_prompts(batch, args, device)
            plain, _ = call(target, factory, methods[0], ids, mask, args)
            for method in methods[1:]:
                spec, steps = call(target, factory, method, ids, mask, args)
                verdicts = counts(compare_rows(target, ids, mask, plain, spec))
                proposed = sum(sum(s.proposed) for s in steps)
                accepted = sum(sum(s.accepted) for s in steps) / proposed if proposed else None
                rows.append({"dtype": str(dtype).removeprefix("torch."), "batch": batch, "method": method.name,
                             **verdicts, "acceptance": accepted})
                logger.info("identity %s", rows[-1])
    return rows


def count_syncs(target, factory, methods, args, device) -> list[dict]:
    """Host syncs per decoding step of each method, and per new token of plain generate()."""
    rows = []
    for batch in args.batch_sizes:
        ids, mask = batch_prompts(batch, args, device)
        for method in methods:
            counter, step = SyncCounter(), DecodingLoop.step
            if method.policy:
                DecodingLoop.step = counter.inside(step)
                try:
                    _, steps = call(target, factory, method, ids, mask, args)
                finally:
                    DecodingLoop.step = step
                per, unit = counter.syncs / len(steps), "step"
            else:
                with counter.counting():
                    call(target, factory, method, ids, mask, args)
                per, unit = counter.syncs / args.max_new_tokens, "token"
            rows.append({"batch": batch, "method": method.name, "syncs": per, "per": unit})
            logger.info("syncs %s", rows[-1])
    return rows


def time_methods(target, factory, methods, args, device) -> list[dict]:
    """tokens/s of each method and its ratio to plain, methods interleaved (order rotated per round)."""
    rows = []
    for batch in args.batch_sizes:
        ids, mask = batch_prompts(batch, args, device)
        seconds = {m.name: [] for m in methods}
        overhead = {m.name: [] for m in methods}
        drafts = {m.name: [] for m in methods}                # mean k run a step, per round
        for r in range(args.repeats + 1):                      # round 0 warms up (and measures profiles)
            for method in methods[r % len(methods):] + methods[:r % len(methods)]:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                _, steps = call(target, factory, method, ids, mask, args)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if r:
                    seconds[method.name].append(time.perf_counter() - t0)
                    if steps:
                        overhead[method.name].append(statistics.mean(s.overhead_s for s in steps))
                        drafts[method.name].append(round(statistics.mean(s.k for s in steps), 2))
        tokens = batch * args.max_new_tokens
        plain = seconds[methods[0].name]
        for method in methods:
            ratios = [p / s for p, s in zip(plain, seconds[method.name])]
            rows.append({"batch": batch, "method": method.name, "tokens_per_s": tokens / statistics.median(
                seconds[method.name]), "x_plain": statistics.median(ratios), "x_min": min(ratios),
                "x_max": max(ratios), "overhead_ms": 1e3 * statistics.mean(overhead[method.name])
                if overhead[method.name] else None, "x_per_round": [round(x, 3) for x in ratios],
                "k_per_round": drafts[method.name]})
            logger.info("speed %s", rows[-1])
    return rows


def markdown(payload, args) -> str:
    lines = [f"Synthetic pair (`layer_skip_pair`, target {args.hidden} wide x {args.layers} layers, "
             f"1-layer draft, upper scale {args.upper_scale}, vocab {args.vocab}); greedy, "
             f"{args.max_new_tokens} new tokens a row.", "",
             "**Identity with plain generate()** (rows: identical / near-tie / other)", "",
             "| dtype | batch | method | identical | near-tie | other | acceptance |", "|---|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['dtype']} | {r['batch']} | {r['method']} | {r['identical']} | {r['near_tie']} | {r['other']} | "
              + (f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-") + " |" for r in payload["identity"]]
    if payload["syncs"]:
        lines += ["", "**Host syncs** (per decoding step; plain generate(): per new token)", "",
                  "| method | " + " | ".join(f"batch {b}" for b in args.batch_sizes) + " |",
                  "|---|" + "---:|" * len(args.batch_sizes)]
        for name in dict.fromkeys(r["method"] for r in payload["syncs"]):
            cells = [f"{r['syncs']:.2f}" for r in payload["syncs"] if r["method"] == name]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"**Speed**, bfloat16 (median of {args.repeats} interleaved rounds; x plain: median "
              "[min, max] of the per-round ratios; overhead: host time of a step outside drafting and "
              "verifying)", "", "| batch | method | tokens/s | x plain | overhead ms/step |",
              "|---:|---|---:|---|---:|"]
    lines += [f"| {r['batch']} | {r['method']} | {r['tokens_per_s']:.0f} | {r['x_plain']:.2f} "
              f"[{r['x_min']:.2f}, {r['x_max']:.2f}] | "
              + (f"{r['overhead_ms']:.2f}" if r["overhead_ms"] is not None else "-") + " |" for r in payload["speed"]]
    return "\n".join(lines) + "\n"


def plot(payload, args, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in dict.fromkeys(r["method"] for r in payload["speed"]) if n != "plain"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(args.batch_sizes)
    for i, batch in enumerate(args.batch_sizes):
        rows = {r["method"]: r for r in payload["speed"] if r["batch"] == batch}
        ax.bar([j + i * width for j in range(len(names))], [rows[n]["x_plain"] for n in names], width,
               label=f"batch {batch}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("speed / plain generate()")
    ax.set_title(f"{payload['stamp']['machine']['device']}: synthetic pair, bfloat16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", default=METHODS, help="plain first, then eval/methods.py names")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--upper-scale", type=float, default=0.05)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True, help="path prefix: <out>.json, .md, .png")
    args = parser.parse_args(argv)
    methods = parse_methods(args.methods)
    if methods[0].policy is not None:
        parser.error("--methods must start with plain (the reference)")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_grad_enabled(False)

    out = Path(args.out)
    payload = {"args": dict(vars(args)), "identity": [], "syncs": [], "speed": []}

    def save():                                        # after each part: a failed part keeps the others
        return write_results(out.parent, out.name, payload, markdown(payload, args),
                             (lambda path: plot(payload, args, path)) if payload["speed"] else None)
    with tempfile.TemporaryDirectory() as cache:       # cost profiles of this pair on this device
        os.environ.setdefault("HF_SPECDEC_CACHE", cache)
        pair = layer_skip_pair(args.upper_scale, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
        payload["identity"] = check_identity(pair, methods, args, device)
        save()
        target, draft = (m.to(device, torch.bfloat16) for m in pair)
        factory = MethodFactory(target, draft_model=draft, pool=("draft", "pld"))
        if device.type == "cuda":
            payload["syncs"] = count_syncs(target, factory, methods, args, device)
            save()
        payload["speed"] = time_methods(target, factory, methods, args, device)
        md = save()
    logger.info("wrote %s", md)


if __name__ == "__main__":
    main()
