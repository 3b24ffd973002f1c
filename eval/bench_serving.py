"""Speculation in Transformers' continuous batching under Poisson arrivals: plain against ours, on one request trace.

    python eval/bench_serving.py --env qwen-coder-cpu --rates 0.02,1 --requests 6 --max-new-tokens 32 \
        --out docs/results/bench_serving/qwen-coder

Per rate (requests/s): one Poisson trace of --requests HumanEval problems (the chat prompt; raw
prompts for smollm2), each request added to the manager at its arrival time (an open loop: the
requests in flight are what the rate and the service make them). A low rate leaves about one
request at a time; a saturating one queues them all. Methods, interleaved per round
(eval/harness.interleaved) on the same trace, each a fresh manager with the same
ContinuousBatchingConfig (eval/bench_continuous_batching.serve):
  plain       Transformers' own manager (`type(model).init_continuous_batching`, none of our code)
  draft       ours after enable(): init_continuous_batching(assistant_model=draft), policy "auto"
  lookup:k    ours, prompt lookup (--lookup)
Per method and rate: tokens/s (generated tokens / seconds from the first arrival to the last
result; median of rounds; at a low rate the arrivals set it) and its ratio to plain per round, time to first token and time per
output token (p50 / p99 over requests, Transformers' per-token timestamps; TPOT is the speed a
user sees at a low rate), forwards per token,
drafts accepted, requests identical to plain's. The simulator of the same schedule is
eval/bench_serving_sim.py. Writes <out>.json, .md and .png after each rate, stamped.
"""
from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

from transformers import ContinuousBatchingConfig, GenerationConfig

sys.path.insert(0, str(Path(__file__).parent))
from bench_continuous_batching import method_rows, method_table, plot, rescorer, serve, workload  # noqa: E402
from harness import Results, arguments, interleaved, ints, parse, speed  # noqa: E402
from methods import Method  # noqa: E402

logger = logging.getLogger("bench_serving")


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """`count` arrival times (seconds) of a Poisson process of `rate` requests/s, the first at 0."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def markdown(payload: dict) -> str:
    args = payload["args"]
    lines = [f"{args['env']}: {args['requests']} HumanEval prompts, at most {args['max_new_tokens']} new tokens each "
             "(greedy, EOS ends a request), added at Poisson arrival times (seed "
             f"{args['seed']}) to Transformers' continuous batching manager; plain: Transformers' own manager; draft: "
             "ours, the draft model, policy auto; lookup:k: ours, prompt lookup. x plain: median [min, max] of "
             f"per-round ratios over {args['rounds']} rounds, after a warm-up of each method on one short request. TTFT / TPOT: p50 / p99 over requests (seconds). Both managers: ContinuousBatchingConfig("
             f"max_batch_tokens={args['max_batch_tokens']}, num_blocks={args['num_blocks']}). fwd/token: forwards per "
             "generated token. identical: requests equal to plain's; (~n, ≠m): of the others, n first differ at a near-tie "
             "of the target's logits (eval/identity.py), m otherwise.", ""]
    for cell in payload["cells"]:
        lines += [f"**{cell['rate']} requests/s** (last arrival at {cell['last_arrival_s']:.0f} s)", "",
                  *method_table(cell["methods"], tpot_x_plain=True)]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--env", default="smollm2", choices=["smollm2", "qwen-coder", "qwen-coder-cpu"])
    parser.add_argument("--rates", default="0.05,2", help="Poisson arrival rates, requests/s")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookup", type=ints, default=[], help="prompt_lookup_num_tokens values")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=64, help="cache blocks of 256 tokens")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parse(parser, argv)
    env, prompts, config = workload(args)
    model = env.model
    methods = [Method("plain")] + ([Method("draft")] if env.draft is not None else []) + \
        [Method(f"lookup:{k}", k=k) for k in args.lookup]
    results = Results(Path(args.out), vars(args), markdown,
                      lambda payload, path: plot(payload, path, key="rate", xlabel="arrival rate (requests/s)"))
    for method in methods:      # a warm-up of each path (first-call costs), one short request
        serve(model, method, prompts[:1], GenerationConfig(**{**config.to_dict(), "max_new_tokens": 4}),
              ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks),
              env.draft, concurrency=1)
    for rate in [float(r) for r in args.rates.split(",")]:
        if results.done({"rate": rate}):
            continue
        arrivals = poisson_arrivals(rate, len(prompts), args.seed)
        runs, seconds = {}, {m.name: [] for m in methods}

        def run(method):
            cb_config = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks)
            runs[method.name] = serve(model, method, prompts, config, cb_config, env.draft, arrivals=arrivals)
            seconds[method.name].append(runs[method.name]["seconds"])
        interleaved(methods, run, args.rounds, warmup=False)
        ratios = speed(seconds, "plain")
        rows = method_rows(runs, ratios, f"rate {rate:g}", rescorer(model, prompts, config))
        logger.info("wrote %s", results.add({"rate": rate, "last_arrival_s": arrivals[-1], "methods": rows}))


if __name__ == "__main__":
    main()
