"""Spec policies under a changing request rate on a real model, and the simulator checked against it.

    python eval/bench_serving.py --env qwen-coder --phases 30:0.05,30:0.6,30:0.05 --output-len 16,40 \
        --out docs/results/bench_serving/qwen-coder

Continuous batching (`hf_specdec.serving.Engine`), --env smollm2: SmolLM2-135M-Instruct with
prompt-lookup drafts on raw HumanEval prompts; --env qwen-coder: the real pair,
Qwen2.5-Coder-1.5B-Instruct (eval/envs.py; --onednn: float32 on oneDNN linear layers) with the 0.5B
as drafter, on HumanEval problems in the chat prompt. A phased Poisson stream (low / high / low rate)
whose output lengths are drawn per request (EOS ignored, as in trace replays). Policies
(eval/methods.py names): plain (fixed:0), fixed k, the default (auto), Nightjar and AdaSpec (given the
profile measured here), each a fresh object on the same stream, in the harness's order. Then the simulator
replays the same requests with latency models measured here (decode steps; prompt prefills apart)
and, per policy, what the engine measured of its drafts: acceptance rate, how often a row found any
(lookup matches), and seconds per draft token (a model drafter: its profiled latency model);
simulated / measured throughput shows how far the simulator can be trusted. Each request's output is
compared with the plain engine's (eval/identity.py: identical, first divergence at a near-tie of a
bf16 target, or other, which fails the run).
Writes <out>.json, <out>.md and <out>.png (rate, batch size and k over time per policy), stamped,
after each policy.
"""
from __future__ import annotations

import logging
import statistics
import sys
from pathlib import Path

import torch

import hf_specdec
from hf_specdec.costmodel import CostProfile, LatencyModel, profile, profile_prefill
from hf_specdec.serving import Engine, Request, Simulator, phased

sys.path.insert(0, str(Path(__file__).parent))
from envs import ENVS, humaneval_texts  # noqa: E402
from harness import Results, arguments, check_identity, interleaved, ints, parse  # noqa: E402
from identity import compare_tokens, counts  # noqa: E402
from methods import Method, spec_policy  # noqa: E402
from bench_serving_sim import plot_traces  # noqa: E402

logger = logging.getLogger("bench_serving")


def measured_acceptance(stats) -> float:
    """P(a draft is accepted | the ones before it were): accepted / judged drafts."""
    judged = sum(min(p, a + 1) for s in stats.steps if s.k for p, a in zip(s.proposed, s.accepted))
    accepted = sum(sum(s.accepted) for s in stats.steps if s.k)
    return accepted / judged if judged else 0.0


def measured_lookup(stats) -> tuple[float, float]:
    """Of the engine's speculative steps: the fraction of row-steps with any draft (a lookup finds
    no match in the others), and the drafting seconds per row and draft token."""
    spec = [s for s in stats.steps if s.k]
    row_steps = sum(s.batch_size for s in spec)
    if not row_steps:
        return 1.0, 0.0
    return (sum(p > 0 for s in spec for p in s.proposed) / row_steps,
            sum(s.draft_s for s in spec) / sum(s.batch_size * s.k for s in spec))


def lookup_profile(model, batch_sizes, context) -> CostProfile:
    """Target latency model; prompt lookup drafts cost (almost) nothing."""
    prof = profile(model, model, batch_sizes, (1, 3, 5), (context, 2 * context), (1, 4), repeats=2)
    return CostProfile(prof.target, LatencyModel(0.0, 0.0, 0.0), prof.switch, prof.meta)


def policies(args) -> list[Method]:
    """plain (k = 0), each fixed k, the default, then Nightjar and AdaSpec up to --max-len."""
    return [Method("plain", "fixed", k=0), *(Method(f"fixed:{k}", "fixed", k=k) for k in args.fixed),
            Method("auto", "auto"), Method("nightjar", "nightjar", k=args.max_len),
            Method("adaspec", "adaspec", k=args.max_len)]


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--phases", default="15:0.3,15:3,15:0.3", help="duration:rate,... (s, requests/s)")
    parser.add_argument("--output-len", default="16,48")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--fixed", default="1,2,3", help="fixed draft lengths to compare")
    parser.add_argument("--max-len", type=int, default=4)
    parser.add_argument("--slo-tpot", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env", choices=("smollm2", "qwen-coder"), default="smollm2")
    parser.add_argument("--onednn", action="store_true",
                        help="qwen-coder: float32 on oneDNN linear layers (CPUs without bf16 matrix instructions)")
    parser.add_argument("--out", default="results/serving_smollm2")
    args = parse(parser, argv)
    args.fixed = ints(args.fixed)

    env = ENVS["qwen-coder-onednn" if args.env == "qwen-coder" and args.onednn else args.env]()
    model, tokenizer, draft = env.model, env.tokenizer, env.draft
    if draft is not None:
        make_drafter = lambda: hf_specdec.ModelDrafter(draft, name="qwen-0.5b")  # noqa: E731
        problems = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in humaneval_texts(tokenizer, "chat", 32)]
    else:
        make_drafter = hf_specdec.PromptLookupDrafter
        problems = [tokenizer(t)["input_ids"] for t in humaneval_texts(tokenizer, "raw")]
    phases = [tuple(float(x) for x in p.split(":")) for p in args.phases.split(",")]
    lo, hi = ints(args.output_len)
    stream = phased(phases, prompt_len=1, output_len=(lo, hi), seed=args.seed)
    prompts = [problems[r.id % len(problems)] for r in stream]
    requests = [Request(r.id, r.arrival, len(p), r.output_len) for r, p in zip(stream, prompts)]
    longest = max(len(p) for p in prompts)
    logger.info("%d requests, prompts of %d..%d tokens", len(requests), min(map(len, prompts)), longest)

    sizes = [b for b in (1, 2, 4, 8, 16) if b <= args.max_batch]
    prof = lookup_profile(model, sizes, 128) if draft is None else \
        profile(model, draft, sizes, (1, 3, 5), (longest, 2 * longest), (1, 4), repeats=2)
    prefill = profile_prefill(model, lengths=sorted({16, longest // 4, longest // 2, longest}))
    Engine(model, [make_drafter()], hf_specdec.FixedLength(2), max_batch=args.max_batch,
           max_prompt_len=longest).run(requests[:2], prompts[:2])          # warm-up
    results = Results(Path(args.out), vars(args), markdown, lambda payload, path: plot_traces(
        path, phases, {c["policy"]: c["steps"] for c in payload["cells"]}),
                      resume=False)      # each policy's outputs are checked against plain's of the same run
    results.payload.update(title=env.title, requests=len(requests), profile={"target": vars(prof.target), "prefill": vars(prefill)})
    plain_outputs = {}

    def run(method) -> None:
        policy = lambda: spec_policy(method.policy, method.k, prof)  # noqa: E731 - a fresh object per run
        engine = Engine(model, [make_drafter()], policy(), max_batch=args.max_batch, max_prompt_len=longest)
        with torch.inference_mode():
            served = engine.run(requests, prompts)
        alpha = measured_acceptance(engine.stats)
        proposal_rate, draft_per_token = measured_lookup(engine.stats)
        if draft is None:   # lookup: drafts cost what was measured, and are certain when found
            calibrated, confidence = CostProfile(prof.target, LatencyModel(0.0, draft_per_token, 0.0), prof.switch,
                                                 prof.meta), 1.0
        else:
            calibrated, confidence = prof, None
        sim = Simulator(calibrated, policy(), acceptance=alpha, max_batch=args.max_batch, seed=args.seed,
                        prefill=prefill, proposal_rate=proposal_rate, confidence=confidence).run(requests)
        if not plain_outputs:           # plain runs first
            plain_outputs.update(served.outputs)
        verdicts = [compare_tokens(model, p, plain_outputs[r.id], served.outputs[r.id]) for r, p in zip(requests, prompts)]
        real, simulated = served.summary(args.slo_tpot), sim.summary(args.slo_tpot)
        results.add({"policy": method.name, "engine": real, "simulator": simulated, "identity": counts(verdicts),
                     "acceptance": round(alpha, 3), "proposal_rate": round(proposal_rate, 3),
                     "draft_s_per_token": draft_per_token,
                     "sim_over_real": round(simulated["tokens_per_s"] / real["tokens_per_s"], 3),
                     "steps": [(round(s.time, 3), s.batch_size, s.k) for s in served.steps],
                     "mean_k_by_batch": k_by_batch(served.steps)})
        logger.info("%s: engine %.1f tok/s, simulator %.1f tok/s (acceptance %.2f), mean k %.2f", method.name,
                    real["tokens_per_s"], simulated["tokens_per_s"], alpha, real["mean_k"])
    interleaved(policies(args), run, rounds=1, warmup=False)      # plain first: the others are checked against it
    print(markdown(results.payload))
    check_identity({c["policy"]: c for c in results.cells}, "the plain engine's")


def k_by_batch(steps) -> dict[int, float]:
    groups: dict[int, list[int]] = {}
    for s in steps:
        groups.setdefault(s.batch_size, []).append(s.k)
    return {b: round(statistics.fmean(ks), 2) for b, ks in sorted(groups.items())}


def markdown(payload) -> str:
    args, cells = payload["args"], payload["cells"]
    setup = payload["title"] + (", 0.5B drafts" if args["env"] == "qwen-coder" else ", prompt lookup drafts")
    lines = [f"# Serving, {setup}: phased stream {args['phases']} ({payload['requests']} requests), max batch "
             f"{args['max_batch']}\n",
             "identity: requests identical to the plain engine's output / first differing at a near-tie of the "
             "target's dtype / otherwise.\n",
             f"| policy | tokens/s | mean / p90 latency s | mean TPOT ms | SLO {args['slo_tpot'] * 1000:.0f} ms | "
             "mean k | acceptance | rows drafting | simulated tokens/s | sim / real | identity |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in cells:
        e = r["engine"]
        lines.append(f"| {r['policy']} | {e['tokens_per_s']:.1f} | {e['mean_latency_s']:.1f} / {e['p90_latency_s']:.1f} | "
                     f"{e['mean_tpot_s'] * 1000:.0f} | {e['slo_attainment']:.2f} | {e['mean_k']:.2f} | "
                     f"{r['acceptance']:.2f} | {r['proposal_rate']:.2f} | {r['simulator']['tokens_per_s']:.1f} | "
                     f"{r['sim_over_real']:.2f} | {'/'.join(str(v) for v in r['identity'].values())} |")
    lines += ["", "Mean k by running batch size:", ""]
    sizes = sorted({int(b) for r in cells for b in r["mean_k_by_batch"]})
    lines += ["| policy | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for r in cells:
        d = {int(b): k for b, k in r["mean_k_by_batch"].items()}
        lines.append(f"| {r['policy']} | " + " | ".join(f"{d[b]:.2f}" if b in d else "" for b in sizes) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
