"""Device ops a decoding step launches outside the model forwards (the loop's own overhead).

    python eval/step_ops.py --name after

A 28-layer target and a 24-layer draft (Llama architecture, 64 wide: op counts do not depend on
width), greedy, fixed k on the static cache with the compiled path's shapes (row buckets, width
tiers; `torch.compile` replaced by the plain function: the ops outside the forwards are the same,
and nothing compiles). Every aten op dispatched inside `DecodingLoop.step` is counted, except
those inside either model's forward (the models' own work, which plain `generate()` runs too)
and those that launch nothing (views, allocations, detach). On a GPU each counted op is a kernel
launch or a copy. Also the dynamic cache, for comparison. Writes
docs/results/step_ops/<name>.{json,md}: ops per step, and the ten most frequent ops.
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig

import hf_specdec
from hf_specdec.loop import DecodingLoop
from hf_specdec.testing import build, layer_skip_pair, prompts
from harness import Results, arguments, ints, parse       # eval/ is on sys.path

NO_LAUNCH = {"empty.memory_format", "empty_strided.default", "empty_like.default", "detach.default",
             "lift_fresh.default", "alias.default"}


class StepOps(TorchDispatchMode):
    """Counts ops dispatched while `counting`, outside any forward of `models` (hooks keep the depth)."""

    def __init__(self, models):
        super().__init__()
        self.ops, self.depth, self.counting = collections.Counter(), 0, False
        self.hooks = []
        for model in models:
            self.hooks.append(model.register_forward_pre_hook(lambda *a: self._enter(1)))
            self.hooks.append(model.register_forward_hook(lambda *a: self._enter(-1)))

    def _enter(self, step: int) -> None:
        self.depth += step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and not self.depth and not func.is_view and func._overloadname is not None \
                and f"{func._opname}.{func._overloadname}" not in NO_LAUNCH:
            self.ops[func._opname] += 1
        return func(*args, **(kwargs or {}))


def pair():
    """(target 28 layers, draft: its first 24): layers 2.. of the target are weak, so most drafts pass."""
    target, _ = layer_skip_pair(0.05, layers=28, hidden=64, vocab=512)
    draft = build("llama", layers=24, vocab=512, hidden=64, init=0.05)
    own = draft.state_dict()
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in own})
    return target, draft.eval()


def count(target, draft, batch: int, k: int, cache: str, tokens: int) -> dict:
    counter, steps, step = StepOps([target, draft]), [], DecodingLoop.step

    def counted(loop):
        counter.counting = True
        try:
            return step(loop)
        finally:
            counter.counting = False
            steps.append(1)
    ids, mask = prompts(batch, seed=batch, min_len=12, max_len=20, vocab=512)
    config = None
    if cache == "static":
        config = CompileConfig()
        config._compile_all_devices = True       # the compiled path's shapes (its compiler replaced below)
    compile_ = torch.compile
    DecodingLoop.step, torch.compile = counted, (lambda function, **options: function)
    try:
        with counter:
            target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                            custom_generate=hf_specdec.generate, assistant_models=[hf_specdec.ModelDrafter(draft)],
                            spec_policy=f"fixed:{k}", cache_implementation=cache, compile_config=config)
    finally:
        DecodingLoop.step, torch.compile = step, compile_
        for hook in counter.hooks:
            hook.remove()
    total = sum(counter.ops.values())
    return dict(batch=batch, k=k, cache=cache or "dynamic", steps=len(steps), ops=total,
                ops_per_step=round(total / len(steps), 1), top=counter.ops.most_common(10))


def markdown(payload: dict) -> str:
    lines = ["Device ops per step outside the model forwards (28-layer target, 24-layer draft, greedy, fixed k)",
             "", "| cache | batch | k | steps | ops per step | most frequent |", "|---|---:|---:|---:|---:|---|"]
    for c in payload["cells"]:
        top = ", ".join(f"{name} {n}" for name, n in c["top"][:5])
        lines.append(f"| {c['cache']} | {c['batch']} | {c['k']} | {c['steps']} | {c['ops_per_step']} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--name", default="step_ops")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "docs/results/step_ops"))
    args = parse(parser, argv)
    results = Results(Path(args.out_dir) / args.name, vars(args), markdown, resume=False)
    target, draft = pair()
    for cache in ("static", None):
        for batch in ints(args.batch_sizes):
            results.add(count(target, draft, batch, args.k, cache, args.max_new_tokens))
    print(markdown(results.payload))


if __name__ == "__main__":
    sys.exit(main())
