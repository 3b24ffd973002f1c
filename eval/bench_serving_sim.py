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
prompts and outputs drawn from ShareGPT-like ranges. Policies (eval/methods.py names, the cost
models given the setting's profile): plain (k = 0), fixed k = 1..5 (k = 3 is Nightjar's "SD"
baseline), the default (auto), DSDGoodput, AdaSpec and Nightjar (also with the paper's one bandit
per batch size, `nightjar-exact`), each a fresh object per run. Then plain, the default, Nightjar and
AdaSpec again with the memory model, without and with `DraftOffload` (fixed k > 0 never switches
speculation off, so it never offloads). Reports output tokens/s, mean and p90 latency, mean TPOT and
SLO attainment; writes <out>.json, <out>.md and <out>.png (rate, batch size and k over time on the
phased stream), stamped, after each stream; a rerun with the same arguments resumes.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hf_specdec
from hf_specdec.costmodel import CostProfile, LatencyModel, SwitchCostTable
from hf_specdec.serving import MemoryModel, Simulator, phased, poisson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, arguments, interleaved, parse  # noqa: E402
from methods import Method, spec_policy  # noqa: E402
from report import figure  # noqa: E402

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


PLOTTED = ("plain", "fixed:3", "auto", "nightjar", "adaspec", "dsd")      # traced on the phased stream


def policies(max_len: int) -> list[Method]:
    """plain, fixed k = 1..5, the default, then the cost-model policies up to `max_len`."""
    return [Method("plain", "fixed", k=0), *(Method(f"fixed:{k}", "fixed", k=k) for k in range(1, 6)),
            Method("auto", "auto"), *(Method(n, n, k=max_len) for n in ("dsd", "adaspec", "nightjar", "nightjar-exact"))]


def offload(memory: MemoryModel) -> hf_specdec.DraftOffload:
    # persist longer than Nightjar's exploration bins: with persist_steps=8 its k = 0 bins alone
    # offloaded the draft where speculation pays (13b), and with the memory full it never came back
    return hf_specdec.DraftOffload(low_free_bytes=2 * memory.draft_bytes, persist_steps=64)


def run_stream(name: str, requests, prof: CostProfile, memory: MemoryModel | None, args) -> dict:
    """Every policy on one stream; with `memory`, the policies that switch speculation off again,
    without and with draft offload (the same memory)."""
    rows, traces, offloads = {}, {}, {}

    def simulate(method):
        res = Simulator(prof, spec_policy(method.policy, method.k, prof), args.acceptance, max_batch=args.max_batch,
                        seed=args.seed).run(requests)
        rows[method.name] = {k: round(v, 5) for k, v in res.summary(args.slo_tpot).items()}
        if method.name in PLOTTED:                 # at most ~2000 points a trace
            thin = max(1, len(res.steps) // 2000)
            traces[method.name] = [(round(s.time, 3), s.batch_size, s.k) for s in res.steps[::thin]]

    def simulate_memory(method):
        for tag, draft_offload in (("", None), ("+offload", offload(memory))):
            res = Simulator(prof, spec_policy(method.policy, method.k, prof), args.acceptance,
                            max_batch=args.max_batch, seed=args.seed, memory=memory,
                            draft_offload=draft_offload).run(requests)
            row = offloads[method.name + tag] = {k: round(v, 5) for k, v in res.summary(args.slo_tpot).items()}
            row["max_batch_seen"] = max(s.batch_size for s in res.steps)
            if draft_offload is not None:
                row["offloads"] = sum(e.action == "offload" for e in draft_offload.events)
    methods = policies(args.max_len)
    interleaved(methods, simulate, rounds=1, warmup=False)
    if memory is not None:
        interleaved([m for m in methods if m.name in ("plain", "auto", "nightjar", "adaspec")], simulate_memory,
                    rounds=1, warmup=False)
    best_fixed = max((m for m in rows if m.startswith("fixed:")), key=lambda m: rows[m]["tokens_per_s"])
    logger.info("%s: %s", name, {m: r["tokens_per_s"] for m, r in rows.items()})
    return {"stream": name, "requests": len(requests), "best_fixed": best_fixed, "methods": rows,
            "offload": offloads, **({"traces": traces} if name == "phased" else {})}


def main(argv=None):
    parser = arguments(__doc__)
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
    args = parse(parser, argv)
    prof = CostProfile.load(args.profile) if args.profile else setting_profile(args.setting)
    _, _, acceptance, max_batch = SETTINGS[args.setting]
    args.acceptance = acceptance if args.acceptance is None else args.acceptance
    args.max_batch = max_batch if args.max_batch is None else args.max_batch
    lengths = {k: tuple(int(v) for v in getattr(args, k).split(",")) for k in ("prompt_len", "output_len")}
    streams = {f"poisson {r}/s": lambda r=r: poisson(float(r), args.duration, seed=args.seed, **lengths)
               for r in args.rates.split(",")}
    phases = [tuple(float(x) for x in p.split(":")) for p in args.phases.split(",")]
    streams["phased"] = lambda: phased(phases, seed=args.seed, **lengths)
    memory = None if args.profile else MEMORY[args.setting]
    results = Results(Path(args.out), vars(args), markdown, lambda payload, path: plot_traces(
        path, phases, next((c["traces"] for c in payload["cells"] if "traces" in c), {})))
    results.payload.update(profile={"target": vars(prof.target), "draft": vars(prof.draft)},
                           memory=vars(memory) if memory else None)
    for name, make in streams.items():
        if not results.done({"stream": name}):
            results.add(run_stream(name, make(), prof, memory, args))
    print(markdown(results.payload))


def markdown(payload) -> str:
    args, cells = payload["args"], payload["cells"]
    name = f"profile {args['profile']}" if args["profile"] else f"setting {args['setting']}"
    lines = [f"# Serving simulator: {name}, acceptance {args['acceptance']}, max batch {args['max_batch']}", "",
             "tokens/s (mean latency s / p90 latency s / mean TPOT ms / SLO attainment at "
             f"{args['slo_tpot'] * 1e3:.0f} ms TPOT)", ""]
    methods = list(cells[0]["methods"])
    lines += ["| stream | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for c in cells:
        row = []
        for m in methods:
            x, mark = c["methods"][m], "**" if m == c["best_fixed"] else ""
            row.append(f"{mark}{x['tokens_per_s']:.0f}{mark} ({x['mean_latency_s']:.1f} / {x['p90_latency_s']:.1f} / "
                       f"{x['mean_tpot_s'] * 1e3:.1f} / {x.get('slo_attainment', 0):.2f})")
        lines.append(f"| {c['stream']} ({c['requests']} req) | " + " | ".join(row) + " |")
    lines += ["", "Bold: the best fixed k on that stream."]
    if cells[0]["offload"]:
        methods = list(cells[0]["offload"])
        lines += ["", "## With the memory model: without / with draft offload", "",
                  "tokens/s (largest running batch; offloads)", "",
                  "| stream | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
        for c in cells:
            row = [f"{x['tokens_per_s']:.0f} ({x['max_batch_seen']}" + (f"; {x['offloads']})" if "offloads" in x else ")")
                   for x in c["offload"].values()]
            lines.append(f"| {c['stream']} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_traces(path: Path, phases, traces: dict) -> None:
    """Arrival rate, running batch and the adaptive policies' k over time (traces: name -> [(time,
    batch size, k)]); phases: the stream's (duration, rate)."""
    if not traces:          # the phased stream not run yet
        return
    with figure(path, rows=3, size=(9, 7.5), sharex=True) as axes:
        (rate,), (batch,), (chosen,) = axes
        start = 0.0
        for duration, r in phases:
            rate.plot([start, start + duration], [r, r], color="k")
            start += duration
        rate.set_ylabel("arrival rate (req/s)")
        for name, trace in traces.items():
            t, b, k = zip(*trace)
            batch.plot(t, b, label=name, lw=0.8)
            if not name.startswith(("plain", "fixed")):
                chosen.plot(t, k, label=name, lw=0.6, alpha=0.8)
        batch.set_ylabel("running batch")
        chosen.set_ylabel("chosen k")
        chosen.set_xlabel("time (s)")
        batch.legend(fontsize=7, ncol=3)
        chosen.legend(fontsize=7)


if __name__ == "__main__":
    main()
