"""Spec policies under request streams, in the latency-model simulator (`hf_specdec.serving`).

    python eval/bench_serving_sim.py --setting 7b --out results/serving_sim_7b
    python eval/bench_serving_sim.py --setting 13b --out results/serving_sim_13b
    python eval/bench_serving_sim.py --profile profile.json --acceptance 0.6 --rates 0.5,1,2 ...

Settings give latency models for a GPU and model size, after Nightjar's evaluation;
`--profile` uses a profiler JSON (`python -m hf_specdec profile`) instead. Built-in coefficients
(fp16, T = alpha N_context + gamma N_tokens + delta), estimated from the hardware: delta = the
weights streamed once per forward plus launch overhead, gamma = 2 x params FLOPs per fed token
at ~60% of peak, alpha = KV bytes read per context token / memory bandwidth:
  7b   RTX 4090 (1 TB/s, 165 TFLOPs): DeepSeek-R1-Distill-Qwen-7B (GQA: 57 KB KV per token)
       and a Qwen2.5-0.5B draft; acceptance 0.65; at most 128 running requests
  13b  A100-40GB (1.5 TB/s, 312 TFLOPs): vicuna-13b (MHA: 0.8 MB KV per token) and
       vicuna-68m (launch-bound); acceptance 0.55; at most 48 running requests (KV memory)
Memory (the offload comparison): the card's memory less the target's fp16 weights and ~1.5-2 GB of
activations holds the KV caches and the draft; each request reserves prompt + output tokens of KV
(`serving.MemoryModel`); reloading the draft copies its weights over PCIe 4 (~25 GB/s).

Workloads: Poisson arrivals at each `--rates` value, and a phased stream (low / high / low);
prompts and outputs drawn from ShareGPT-like ranges. Policies: plain (k = 0), fixed k = 1..5
(k = 3 is Nightjar's "SD" baseline), DSDGoodput, AdaSpec and Nightjar (also with the paper's one
bandit per batch size, `nightjar-exact`), each a fresh object per run. Then plain, Nightjar and AdaSpec again with the memory model, without and with
`DraftOffload` (fixed k > 0 never switches speculation off, so it never offloads). Reports output tokens/s, mean and p90 latency, mean TPOT and SLO attainment; writes
<out>.json, <out>.md and <out>.png (rate, batch size and k over time on the phased stream).
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import hf_specdec
from hf_specdec.costmodel import CostProfile, LatencyModel, SwitchCostTable
from hf_specdec.serving import MemoryModel, Simulator, phased, poisson

logger = logging.getLogger("bench_serving_sim")

SETTINGS = {  # (target alpha, gamma, delta), (draft alpha, gamma, delta), acceptance, max batch
    "7b": ((0.06e-6, 0.15e-3, 15e-3), (0.012e-6, 0.01e-3, 4e-3), 0.65, 128),
    "13b": ((0.55e-6, 0.14e-3, 20e-3), (0.004e-6, 0.001e-3, 2e-3), 0.55, 48),
}
MEMORY = {  # bytes: KV + draft capacity, target KV per token, draft weights, draft KV per token; reload s
    "7b": MemoryModel(int(7.3e9), 57344, int(0.99e9), 12288, 0.04),       # 24 GB - 15.2 GB weights
    "13b": MemoryModel(int(12e9), 819200, int(0.136e9), 6144, 0.005),     # 40 GB - 26 GB weights
}


def setting_profile(name: str) -> CostProfile:
    target, draft = (LatencyModel(*c) for c in SETTINGS[name][:2])
    lags, batches = [1, 16, 256], [1, 16, 256]
    switch = SwitchCostTable(lags, batches, [[draft.forward_time(0, lag * b) for b in batches] for lag in lags])
    return CostProfile(target, draft, switch, {"setting": name})


def policies(prof: CostProfile, max_len: int) -> dict:
    out = {"plain": lambda: hf_specdec.FixedLength(0)}
    out.update({f"fixed:{k}": (lambda k=k: hf_specdec.FixedLength(k)) for k in range(1, 6)})
    out.update({"dsd": lambda: hf_specdec.DSDGoodput(prof, max_len=max_len),
                "adaspec": lambda: hf_specdec.AdaSpec(prof, max_len=max_len),
                "nightjar": lambda: hf_specdec.Nightjar(max_len=max_len, switch_cost=prof, seed=0),
                # the paper's one bandit per batch size, against the default's one per power of two
                "nightjar-exact": lambda: hf_specdec.Nightjar(max_len=max_len, switch_cost=prof, buckets="exact",
                                                              seed=0)})
    return out


def offload_policies(prof: CostProfile, max_len: int, memory: MemoryModel) -> dict:
    """Policies that switch speculation off, without and with draft offload (the same memory)."""
    def offload():
        # persist longer than Nightjar's exploration bins: with persist_steps=8 its k = 0 bins alone
        # offloaded the draft where speculation pays (13b), and with the memory full it never came back
        return hf_specdec.DraftOffload(low_free_bytes=2 * memory.draft_bytes, persist_steps=64)
    lengths = {"plain": lambda: hf_specdec.FixedLength(0),
               "nightjar": lambda: hf_specdec.Nightjar(max_len=max_len, switch_cost=prof, seed=0),
               "adaspec": lambda: hf_specdec.AdaSpec(prof, max_len=max_len)}
    out = {}
    for name, make in lengths.items():       # (length policy, its DraftOffload or None)
        out[name] = lambda make=make: (make(), None)
        out[f"{name}+offload"] = lambda make=make: (make(), offload())
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="7b")
    parser.add_argument("--profile", default=None, help="a profiler JSON instead of --setting")
    parser.add_argument("--acceptance", type=float, default=None, help="default: the setting's")
    parser.add_argument("--rates", default="1,5,10,20", help="Poisson rates, requests/s")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per stream")
    parser.add_argument("--phases", default="60:2,60:20,60:2", help="duration:rate,... of the phased stream")
    parser.add_argument("--prompt-len", default="32,512")
    parser.add_argument("--output-len", default="32,512")
    parser.add_argument("--max-batch", type=int, default=None, help="default: the setting's")
    parser.add_argument("--max-len", type=int, default=6)
    parser.add_argument("--slo-tpot", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/serving_sim")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prof = CostProfile.load(args.profile) if args.profile else setting_profile(args.setting)
    _, _, acceptance, max_batch = SETTINGS[args.setting]
    args.acceptance = acceptance if args.acceptance is None else args.acceptance
    args.max_batch = max_batch if args.max_batch is None else args.max_batch
    lengths = {k: tuple(int(v) for v in getattr(args, k).split(",")) for k in ("prompt_len", "output_len")}
    streams = {f"poisson {r}/s": poisson(float(r), args.duration, seed=args.seed, **lengths)
               for r in args.rates.split(",")}
    phases = [tuple(float(x) for x in p.split(":")) for p in args.phases.split(",")]
    streams["phased"] = phased(phases, seed=args.seed, **lengths)
    memory = None if args.profile else MEMORY[args.setting]
    results = {"args": vars(args), "profile": {"target": vars(prof.target), "draft": vars(prof.draft)},
               "memory": vars(memory) if memory else None, "streams": {}, "offload": {}}
    traces = {}
    for name, requests in streams.items():
        rows = {}
        for method, make in policies(prof, args.max_len).items():
            sim = Simulator(prof, make(), args.acceptance, max_batch=args.max_batch, seed=args.seed)
            res = sim.run(requests)
            rows[method] = {k: round(v, 5) for k, v in res.summary(args.slo_tpot).items()}
            if name == "phased":
                traces[method] = [(s.time, s.batch_size, s.k) for s in res.steps]
        best_fixed = max((m for m in rows if m.startswith("fixed:")), key=lambda m: rows[m]["tokens_per_s"])
        results["streams"][name] = {"requests": len(requests), "best_fixed": best_fixed, "methods": rows}
        logger.info("%s: %s", name, {m: r["tokens_per_s"] for m, r in rows.items()})
        if memory is None:
            continue
        rows = {}
        for method, make in offload_policies(prof, args.max_len, memory).items():
            policy, offload = make()
            res = Simulator(prof, policy, args.acceptance, max_batch=args.max_batch, seed=args.seed,
                            memory=memory, draft_offload=offload).run(requests)
            rows[method] = {k: round(v, 5) for k, v in res.summary(args.slo_tpot).items()}
            rows[method]["max_batch_seen"] = max(s.batch_size for s in res.steps)
            if offload is not None:
                rows[method]["offloads"] = sum(e.action == "offload" for e in offload.events)
        results["offload"][name] = rows
        logger.info("%s with memory: %s", name, {m: r["tokens_per_s"] for m, r in rows.items()})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(markdown(results, args))
    plot(traces, phases, out.with_suffix(".png"))
    print(markdown(results, args))


def markdown(results, args) -> str:
    name = f"profile {args.profile}" if args.profile else f"setting {args.setting}"
    lines = [f"# Serving simulator: {name}, acceptance {args.acceptance}, max batch {args.max_batch}", "",
             "tokens/s (mean latency s / p90 latency s / mean TPOT ms / SLO attainment at "
             f"{args.slo_tpot * 1e3:.0f} ms TPOT)", ""]
    methods = list(next(iter(results["streams"].values()))["methods"])
    lines += ["| stream | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for stream, r in results["streams"].items():
        cells = []
        for m in methods:
            x = r["methods"][m]
            mark = "**" if m == r["best_fixed"] else ""
            cells.append(f"{mark}{x['tokens_per_s']:.0f}{mark} ({x['mean_latency_s']:.1f} / {x['p90_latency_s']:.1f} / "
                         f"{x['mean_tpot_s'] * 1e3:.1f} / {x.get('slo_attainment', 0):.2f})")
        lines.append(f"| {stream} ({r['requests']} req) | " + " | ".join(cells) + " |")
    lines += ["", "Bold: the best fixed k on that stream."]
    if results["offload"]:
        methods = list(next(iter(results["offload"].values())))
        lines += ["", "## With the memory model: without / with draft offload", "",
                  "tokens/s (largest running batch; offloads)", "",
                  "| stream | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
        for stream, rows in results["offload"].items():
            cells = [f"{x['tokens_per_s']:.0f} ({x['max_batch_seen']}" + (f"; {x['offloads']})" if "offloads" in x else ")")
                     for x in rows.values()]
            lines.append(f"| {stream} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(traces, phases, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    start = 0.0
    for duration, rate in phases:
        axes[0].plot([start, start + duration], [rate, rate], color="k")
        start += duration
    axes[0].set_ylabel("arrival rate (req/s)")
    for method in ("plain", "fixed:3", "nightjar", "adaspec", "dsd"):
        t, b, k = zip(*traces[method])
        axes[1].plot(t, b, label=method, lw=0.8)
        if method != "plain":
            axes[2].plot(t, k, label=method, lw=0.6, alpha=0.8)
    axes[1].set_ylabel("batch size")
    axes[2].set_ylabel("k")
    axes[2].set_xlabel("time (s)")
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
