"""The real pair under Transformers' tensor parallelism: the target sharded over the ranks, the
draft replicated on each, methods interleaved (eval/harness.py).

    torchrun --nproc-per-node 2 eval/bench_tp.py --problems 3 --max-new-tokens 32 --rounds 2 \
        --methods plain,hf-assisted:5@draft,fixed:4@draft,auto@draft --out docs/results/bench_tp/qwen-coder-tp2

Target: Qwen2.5-Coder-1.5B-Instruct (the GGUF dequantised to float32), loaded with
`DistributedConfig(tp_plan="auto")`; draft: the 0.5B in float32 with oneDNN linear layers, whole
on every rank (`hf_specdec.embedded.load_model`). One HumanEval problem (chat prompt) per cell,
batch 1 (Transformers' assisted generation runs batch 1 only), greedy. Every rank runs every call;
rank 0 times them and writes <out>.json/.md/.png, resumable per problem. Also measured: the time
of one agreement broadcast (`distributed.Ranks.share`, a step's plan) and the broadcasts a call
made, i.e. what the ranks' agreement costs a call.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

from hf_specdec import distributed
from hf_specdec.embedded import gguf_path, load_model
from harness import Results, arguments, generate, interleaved, speed        # eval/ is on sys.path as a script
from humaneval_data import load_problems, prompt_text
from methods import MethodFactory, parse_methods
from report import figure


def broadcast_seconds(ranks: distributed.Ranks, repeats: int = 200) -> float:
    """Median seconds of one step's plan broadcast (3 ints: k, feedback, one row's drafter)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ranks.share([4, 0, 0] if ranks.decides else None, 3)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown(payload: dict) -> str:
    cells = payload["cells"]
    methods = list(cells[0]["speed"]) if cells else []
    lines = ["Speed over Transformers' plain generate() on the same sharded target (median of per-round "
             "ratios [min, max]); identical: greedy output equal to plain's.", "",
             "| problem | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for c in cells:
        lines.append(f"| {c['problem']} | " + " | ".join(
            f"{s['x']:.2f}x [{s['x_min']:.2f}, {s['x_max']:.2f}]" + ("" if c["identical"][m] else " (differs)")
            for m, s in c["speed"].items()) + " |")
    if cells:
        lines += ["", "| method | median speed | identical to plain | tokens a target forward (MAT) | "
                  "steps a call (one broadcast each) |", "|---|---|---|---|---|"]
        for m in methods:
            x = statistics.median(c["speed"][m]["x"] for c in cells)
            same = f"{sum(c['identical'][m] for c in cells)}/{len(cells)}"
            mat = [c["mat"][m] for c in cells if m in c["mat"]]
            calls = [c["broadcasts"][m] for c in cells if m in c["broadcasts"]]
            lines.append(f"| {m} | {x:.2f}x | {same} | {statistics.mean(mat):.2f} | {statistics.mean(calls):.0f} |"
                         if mat else f"| {m} | {x:.2f}x | {same} | - | - |")
        b = payload.get("broadcast_us")
        lines += ["", f"One agreement broadcast (gloo, {payload['world_size']} ranks): {b:.0f} us median."]
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    cells = payload["cells"]
    methods = list(cells[0]["speed"])
    with figure(path, size=(6, 3.2), dpi=120) as ((ax,),):
        for c in cells:
            ax.plot(range(len(methods)), [c["speed"][m]["x"] for m in methods], "o-", label=c["problem"], alpha=0.8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(methods)), methods, rotation=15)
        ax.set_ylabel("speed over plain TP generate()")
        ax.set_title(f"Qwen2.5-Coder 1.5B sharded over {payload['world_size']} ranks, 0.5B draft replicated")
        ax.legend(fontsize=7)


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--problems", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", default="plain,hf-assisted:5@draft,fixed:4@draft,auto@draft")
    parser.add_argument("--out", default="docs/results/bench_tp/qwen-coder-tp2")
    args = parser.parse_args(argv)
    for name in ("problems", "max_new_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        methods = parse_methods(args.methods)
    except ValueError as e:
        parser.error(str(e))
    if "RANK" not in os.environ:
        parser.error("run it under torchrun, e.g. torchrun --nproc-per-node 2 eval/bench_tp.py ...")

    path = gguf_path("qwen2.5-coder-1.5b-instruct")
    target = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                  distributed_config=DistributedConfig(tp_plan="auto")).eval()
    draft, tokenizer = load_model("qwen2.5-coder-0.5b-instruct", onednn=True)
    ranks = distributed.ranks_of(target)
    factory = MethodFactory(target, draft_model=draft)
    results = Results(Path(args.out), vars(args), markdown, plot) if ranks.decides else None
    broadcast = broadcast_seconds(ranks)           # every rank takes part in the broadcasts
    if results is not None:
        results.payload.update(world_size=dist.get_world_size(), broadcast_us=broadcast * 1e6)
    for problem in load_problems(limit=args.problems):
        done = ranks.share([int(results.done({"problem": problem["task_id"]}))] if ranks.decides else None, 1)[0]
        if done:
            continue
        inputs = tokenizer([prompt_text(problem, tokenizer, "chat")], return_tensors="pt", add_special_tokens=False)
        kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                      return_dict_in_generate=True)
        timing = interleaved(methods, lambda m: generate(target, factory, m, **kwargs), rounds=args.rounds)
        if not ranks.decides:
            continue
        plain = timing.outputs["plain"].sequences
        stats = {m: timing.outputs[m].spec_stats for m in timing.outputs if hasattr(timing.outputs[m], "spec_stats")}
        results.add({"problem": problem["task_id"], "speed": speed(timing.seconds, "plain"),
                     "identical": {m: bool(torch.equal(o.sequences, plain)) for m, o in timing.outputs.items()},
                     "mat": {m: s.summary()["mean_accepted_tokens"] for m, s in stats.items()},
                     "broadcasts": {m: len(s.steps) for m, s in stats.items()}})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
