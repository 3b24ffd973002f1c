"""GPU probe: how a compiled static-cache forward behaves on CUDA graphs (one compile per width,
rows dynamic, row buckets as views of one allocation). Writes JSON lines to --out as it goes."""
from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from hf_specdec import _compat
from hf_specdec.testing import circle_model


def log(out, **rec):
    rec["t"] = round(time.perf_counter() - T0, 1)
    print(json.dumps(rec), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def fwd(model, input_ids, attention_mask, position_ids, cache_position, cache_kwargs):
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 cache_position=cache_position, use_cache=True, logits_to_keep=input_ids.shape[1],
                 **cache_kwargs).logits


def transformers_plain(model, out, size):
    ids = torch.randint(0, 1000, (1, 64), device=DEV)
    for impl in ("dynamic", "static"):
        kw = {} if impl == "dynamic" else {"cache_implementation": "static"}
        for new in (32, 32, 96):
            sync()
            s = time.perf_counter()
            model.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new, **kw)
            sync()
            log(out, what="hf_plain", size=size, impl=impl, new=new, s=time.perf_counter() - s)


def ours(model, out, size, widths, shapes, rows_max, capacity, dynamic_rows):
    cache = _compat.new_static_cache(model, capacity)
    ids = torch.randint(0, 1000, (rows_max, 32), device=DEV)
    model(input_ids=ids, use_cache=True, **_compat.cache_kwargs(model, cache))      # eager prefill allocates
    layers = _compat.static_layers(cache)
    full = [(l.keys, l.values) for l in layers]
    views = {}

    def use_rows(r):
        if r not in views:
            views[r] = [(k[:r], v[:r]) for k, v in full]
            for kv in views[r]:
                for t in kv:
                    torch._dynamo.mark_static_address(t)
                    if dynamic_rows and r > 1:
                        torch._dynamo.maybe_mark_dynamic(t, 0)
        for l, (k, v) in zip(layers, views[r]):
            l.keys, l.values = k, v
    funcs = {}
    for w in widths:
        import types
        f = types.FunctionType(fwd.__code__.replace(), fwd.__globals__, f"fwd_{w}")
        funcs[w] = torch.compile(f, fullgraph=True, dynamic=None, **COMPILE)
    before = dict(torch._dynamo.utils.counters["stats"])
    for r, w in shapes:
        use_rows(r)
        x = torch.randint(0, 1000, (r, w), device=DEV)
        mask = torch.zeros(r, capacity, dtype=torch.bool, device=DEV)
        mask[:, :32 + w] = True
        pos = torch.arange(32, 32 + w, device=DEV)[None].expand(r, -1).contiguous()
        cp = torch.arange(32, 32 + w, device=DEV)
        if dynamic_rows and r > 1:
            for t in (x, mask, pos):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        times = []
        for i in range(8):
            _compat.set_static_length(cache, 32)
            sync()
            s = time.perf_counter()
            logits = funcs[w](model, x, mask, pos, cp, _compat.cache_kwargs(model, cache))
            am = logits.argmax(-1)
            sync()
            times.append(time.perf_counter() - s)
        ok = bool((am == (x + 1) % model.config.vocab_size).all())
        stats = dict(torch._dynamo.utils.counters["stats"])
        log(out, what="ours", size=size, rows=r, width=w, dyn=dynamic_rows, first_s=times[0], second_s=times[1],
            steady_ms=1e3 * sorted(times[2:])[3], correct=ok,
            graphs=stats.get("unique_graphs", 0) - before.get("unique_graphs", 0),
            calls=stats.get("calls_captured", 0))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="hf,ours")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    log(args.out, torch=torch.__version__, transformers=transformers.__version__,
        device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu")
    target = circle_model(SIZES[0], device=DEV)
    if "ours" in args.parts:
        shapes = [(16, 5), (16, 5), (8, 5), (4, 5), (3, 5), (1, 5), (16, 1), (8, 1), (1, 1), (16, 5)]
        try:
            ours(target, args.out, "7b", (1, 5), shapes, 16, 256, True)
        except Exception as e:
            log(args.out, what="ours", error=repr(e)[:2000])
        draft = circle_model(SIZES[1], device=DEV)
        try:
            ours(draft, args.out, "0.5b", (1,), [(16, 1), (4, 1), (1, 1)], 16, 256, True)
        except Exception as e:
            log(args.out, what="ours-draft", error=repr(e)[:2000])
    if "hf" in args.parts:
        transformers_plain(target, args.out, "7b")


T0 = time.perf_counter()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
COMPILE = {"mode": "reduce-overhead"} if DEV == "cuda" else {"backend": "eager"}
SIZES = ("7b", "0.5b") if DEV == "cuda" else ("toy", "toy")


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()
if __name__ == "__main__":
    main()
