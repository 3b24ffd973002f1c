"""Sliding-window layers at their real memory: Gemma 3 270M (the embedded real model: 15 layers with a
512-token window, 3 full ones, float32) past its window, on this CPU.

    python eval/bench_window.py --out docs/results/bench_window/gemma3-cpu

Prompts: consecutive HumanEval prompts joined to at least --prompt-tokens tokens, greedy, prompt
lookup drafts. Methods, interleaved: plain generate() (Transformers' own code path: its sliding
layers keep window - 1 tokens), ours with fixed:5 and the default policy, and the same two with
every slot kept in the sliding layers ("/every-slot": the code before the window was trimmed,
`CachedModel.trims_window = False`). A method name may end in "/static" (before "/every-slot"):
cache_implementation="static", Transformers' and ours.

  - memory: the bytes of the target's cache (keys and values of every layer) after the last forward
    of a call that reaches a --context-tokens context, and the most after any forward but the first
    (the prefill holds its whole prompt in every kind of cache);
  - speed per batch size: s per call and speed over plain (median [min, max] of per-round ratios),
    rows compared with plain's (identical, or first diverging at a near-tie of the target's logits).
Cells are written as they finish; a rerun with the same arguments resumes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

import torch

from envs import encode
from bench_generate import window_texts
from harness import Results, arguments, generate, interleaved, ints, parse, speed
from identity import compare_rows, counts
from methods import MethodFactory, parse_method
from report import figure, method_bars

from hf_specdec._compat import kv_cache
from hf_specdec.cached_model import CachedModel
from hf_specdec.embedded import load_model

EVERY_SLOT = "/every-slot"
METHODS = f"plain,fixed:5@pld,auto@pld,fixed:5@pld{EVERY_SLOT},auto@pld{EVERY_SLOT}"


@contextlib.contextmanager
def every_slot():
    """Our loop's caches keep every slot of the sliding layers (the code before trimming them)."""
    init = CachedModel.__init__

    def keeping(self, model):
        init(self, model)
        self.trims_window = False
    CachedModel.__init__ = keeping
    try:
        yield
    finally:
        CachedModel.__init__ = init


class CacheBytes:
    """After each forward of `model`: the bytes of its cache's keys and values (every layer)."""

    def __init__(self, model):
        self.after: list[int] = []
        self._hook = model.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output):
        cache = kv_cache.cache_from_model_kwargs(kwargs)
        self.after.append(sum(t.nbytes for layer in cache.layers for t in (getattr(layer, "keys", None),
                                                                         getattr(layer, "values", None))
                              if isinstance(t, torch.Tensor)))

    def close(self):
        self._hook.remove()


def run(model, factory, name: str, inputs: dict):
    base = parse_method(name.removesuffix(EVERY_SLOT))
    with every_slot() if name.endswith(EVERY_SLOT) else contextlib.nullcontext():
        return generate(model, factory, base, **inputs)


def mib(n: int) -> float:
    return round(n / 2 ** 20, 1)


def markdown(payload: dict) -> str:
    args, memory = payload["args"], payload.get("memory")
    lines = [f"Gemma 3 270M float32 (15 sliding-window layers of 512 tokens, 3 full), greedy, prompt lookup. "
             f"`plain`: Transformers' own generate(); `{EVERY_SLOT}`: ours with every slot kept in the sliding "
             "layers (before this change).", ""]
    if memory:
        lines += [f"**Cache memory** at a {memory['context']}-token context (batch 1, {args['new_tokens_memory']} "
                  "new tokens): MiB of keys and values after the last forward, and the most after any forward "
                  "but the prefill.", "", "| method | MiB at the end | MiB most after the prefill |", "|---|---:|---:|"]
        lines += [f"| {name} | {m['end_mib']} | {m['most_mib']} |" for name, m in memory["methods"].items()]
        lines.append("")
    lines += [f"**Speed** past the window: prompts of >= {args['prompt_tokens']} tokens, {args['max_new_tokens']} "
              "new tokens. x plain: over the first method, median [min, max] of per-round ratios, "
              "interleaved. identical: rows equal to its / first diverging at a near-tie / other.", "",
              "| batch | prompt tokens | method | s per call | x plain | identical |", "|---:|---:|---|---:|---:|---|"]
    for cell in payload["cells"]:
        for name, row in cell["methods"].items():
            lines.append(f"| {cell['batch']} | {cell['prompt_tokens']} | {name} | {row['seconds']:.2f} | "
                         f"{row['x']:.2f} [{row['x_min']:.2f}, {row['x_max']:.2f}] | {cell['identity'].get(name, '-')} |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    memory = payload.get("memory")
    with figure(path, cols=2) as axes:
        if memory:
            names = list(memory["methods"])
            axes[0][0].bar(names, [memory["methods"][n]["end_mib"] for n in names])
            axes[0][0].set_ylabel(f"cache MiB at {memory['context']} tokens")
            axes[0][0].tick_params(axis="x", rotation=30)
        if payload["cells"]:
            method_bars(axes[0][1], payload["cells"], lambda r: r.get("x"), lambda r: [r["x_min"], r["x_max"]])
            axes[0][1].set_title("Gemma 3 270M past its window, CPU")
            axes[0][1].legend(fontsize=7)


def main(argv=None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--out", default="docs/results/bench_window/gemma3-cpu")
    parser.add_argument("--batches", default="1,3")
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens-memory", type=int, default=32)
    parser.add_argument("--memory-methods", default=f"plain,auto@pld,auto@pld{EVERY_SLOT}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", default=METHODS)
    args = parse(parser, argv)
    methods = [_named(m.strip()) for m in args.methods.split(",")]
    if methods[0].policy is not None:
        parser.error("--methods must start with plain or plain/static (the reference)")
    model, tokenizer = load_model("gemma-3-270m", dtype=torch.float32)
    results = Results(Path(args.out), vars(args), markdown, plot)
    factory = MethodFactory(model)
    if "memory" not in results.payload:
        text = window_texts(tokenizer, 1, args.context_tokens - args.new_tokens_memory)[0]
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.context_tokens - args.new_tokens_memory]
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens_memory,
                      do_sample=False)
        memory = {}
        for name in (m.strip() for m in args.memory_methods.split(",")):
            recorder = CacheBytes(model)
            try:
                run(model, factory, name, inputs)
            finally:
                recorder.close()
            memory[name] = dict(end_mib=mib(recorder.after[-1]), most_mib=mib(max(recorder.after[1:])))
            print(f"memory {name}: {memory[name]}", file=sys.stderr)
        results.payload["memory"] = dict(context=args.context_tokens, methods=memory)
        results.save()
    for batch in ints(args.batches):
        if results.done({"batch": batch}):
            continue
        texts = window_texts(tokenizer, batch, args.prompt_tokens)
        inputs = dict(**encode(tokenizer, texts), max_new_tokens=args.max_new_tokens, do_sample=False)
        timing = interleaved(methods, lambda m: run(model, factory, m.name, inputs), rounds=args.rounds)
        reference = methods[0].name          # plain generate() (or plain/static)
        plain = timing.outputs[reference]
        identity = {}
        for name, out in timing.outputs.items():
            verdicts = counts(compare_rows(model, inputs["input_ids"], inputs["attention_mask"], plain, out))
            identity[name] = f"{verdicts['identical']} / {verdicts['near_tie']} / {verdicts['other']}"
        results.add(dict(batch=batch, prompt_tokens=int(inputs["attention_mask"].sum(1).min()),
                         methods=speed(timing.seconds, reference), identity=identity))
        print(f"batch {batch}: {identity}", file=sys.stderr)


def _named(name: str):
    """A method of `name` (the suffix kept in its name: `run` reads it)."""
    return dataclasses.replace(parse_method(name.removesuffix(EVERY_SLOT)), name=name)


if __name__ == "__main__":
    main()
