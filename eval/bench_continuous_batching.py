"""Speculation inside Transformers' continuous batching against Transformers' own, on one request stream.

    python eval/bench_continuous_batching.py --env smollm2 --concurrency 1,4,8 --requests 16 \
        --max-new-tokens 128 --out docs/results/bench_continuous_batching/smollm2

A closed loop over the first --requests HumanEval problems (raw prompts for smollm2, the chat
prompt for qwen-coder): `concurrency` requests in flight, the next added as one finishes, through
the manager API that `generate_batch` and `transformers serve` use. Methods, interleaved per round
(eval/harness.interleaved), each a fresh manager with the same ContinuousBatchingConfig:
  plain       Transformers' own manager (`type(model).init_continuous_batching`: its
              ContinuousBatchingManager and ContinuousBatchProcessor, none of our code)
  lookup:k    ours after enable(): init_continuous_batching(prompt_lookup_num_tokens=k)
  draft       ours with the env's draft model (qwen-coder): init_continuous_batching(assistant_model=draft),
              the default policy ("auto")
  draft:equality  (with --temperature) the same, under the rule continuous batching ran before the
              shared `verify`: the draft model's argmax, kept when it equals the target's sample
              (`equality_rule`)
  generate    (--generate) our own generate() path, the same draft and policy, in static batches of
              `concurrency` prompts (left-padded; a batch ends with its longest request)
Per method and concurrency: tokens/s (median of rounds) and its ratio to plain per round, time to
first token and time per output token (p50 / p99 over requests, from Transformers' per-token
timestamps), forwards per generated token, drafts accepted (and per request per drafting step),
and requests identical to plain's (greedy: each other one re-scored at its first divergence, a near-tie
of the target's logits or not, eval/identity.py; with --temperature T the requests sample at T).
Writes <out>.json, .md and .png after each concurrency, stamped.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_specdec
from hf_specdec.request_rows import RequestSampler

sys.path.insert(0, str(Path(__file__).parent))
from envs import ENVS, humaneval_texts  # noqa: E402
import identity  # noqa: E402
from harness import Results, arguments, interleaved, ints, parse, speed  # noqa: E402
from methods import Method  # noqa: E402
from report import figure, method_bars  # noqa: E402

logger = logging.getLogger("bench_continuous_batching")


def serve(model, method: Method, prompts: list[list[int]], config: GenerationConfig,
          cb_config: ContinuousBatchingConfig, draft=None, concurrency: int | None = None,
          arrivals: list[float] | None = None) -> dict:
    """One run through a continuous batching manager: a closed loop of `concurrency` requests in
    flight, or an open loop adding prompt i `arrivals[i]` seconds after the start. Returns request
    id -> `Served`, the seconds from the start to the last result, and the speculating processor's
    counts (`SpecCounts`; None for plain)."""
    if method.name == "generate":
        return generate_batches(model, prompts, config, draft, concurrency)
    if method.name == "plain":
        manager = type(model).init_continuous_batching(model, config, cb_config)
    elif method.name.startswith("draft"):
        manager = model.init_continuous_batching(config, cb_config, assistant_model=draft)
    else:
        manager = model.init_continuous_batching(config, cb_config, prompt_lookup_num_tokens=method.k)
    pending, results, in_flight = list(enumerate(prompts)), {}, 0
    if method.name == "draft:equality":
        with equality_rule():
            manager.start()
            manager._processor_made.wait(60)      # the processor and its draft sampler: made in the loop's thread
    else:
        manager.start()
    start = time.perf_counter()
    try:
        while len(results) < len(prompts):
            while pending and (in_flight < concurrency if arrivals is None
                               else arrivals[pending[0][0]] <= time.perf_counter() - start):
                i, prompt = pending.pop(0)
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=config.max_new_tokens,
                                    record_timestamps=True)
                in_flight += 1
            due_in = None if arrivals is None or not pending else \
                max(0.0, arrivals[pending[0][0]] - (time.perf_counter() - start))
            result = manager.get_result(timeout=600 if due_in is None else max(due_in, 1e-3))
            if result is None and due_in is not None:
                continue                                     # the next arrival is due
            if result is None or result.error is not None:
                raise RuntimeError(f"{method.name}: {result.error if result else 'no result in 600 s'}")
            if result.is_finished():
                results[result.request_id] = Served.of(result)
                in_flight -= 1
        seconds = time.perf_counter() - start
        counts = getattr(manager.batch_processor, "counts", None)
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    return {"results": results, "seconds": seconds, "counts": counts}


@dataclass
class Served:
    """One request's output, and when its tokens came (None where the path does not say)."""
    tokens: list[int]
    ttft_s: float | None = None       # time to first token (from the request's arrival)
    tpot_s: float | None = None       # time per output token after the first

    @classmethod
    def of(cls, output) -> "Served":
        stamps = output.timestamps
        return cls(tokens=list(output.generated_tokens), ttft_s=stamps[0] - output.created_time,
                   tpot_s=(stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None)


@contextlib.contextmanager
def equality_rule():
    """Within it, a speculating manager's draft model proposes its argmax, judged as a point mass:
    accepted with probability p(draft), exactly the old rule of keeping a draft when it equals the
    target's own sample."""
    made = RequestSampler.__init__
    RequestSampler.__init__ = lambda sampler, processors, do_sample: made(sampler, processors, False)
    try:
        yield
    finally:
        RequestSampler.__init__ = made


def generate_batches(model, prompts: list[list[int]], config: GenerationConfig, draft, batch: int) -> dict:
    """Our own generate() path (`enable`d model, assistant_model=draft, policy auto) over the prompts
    in batches of `batch` (left-padded), as `serve` returns it: what continuous batching is
    compared with at the same batch size."""
    results, start = {}, time.perf_counter()
    pad = config.pad_token_id
    for first in range(0, len(prompts), batch):
        chunk = prompts[first:first + batch]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(input_ids, attention_mask=mask, generation_config=config, assistant_model=draft)
        for i, row in enumerate(out[:, width:].tolist(), start=first):
            ends = [j for j, t in enumerate(row) if t in _eos(config)]
            results[f"r{i}"] = Served(tokens=row[:ends[0] + 1] if ends else row)
    return {"results": results, "seconds": time.perf_counter() - start, "counts": None}


def _eos(config: GenerationConfig) -> set[int]:
    eos = config.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def method_rows(runs: dict, ratios: dict, cell: str, rescore=None) -> dict:
    """Per method (in `runs`): its `summary` against plain's outputs (`rescore`: as there), tokens/s
    over the median seconds and x plain (`ratios`: harness.speed's); logged."""
    rows = {}
    for name, run in runs.items():
        row = rows[name] = summary(run, runs["plain"]["results"], rescore)
        row["tokens_per_s"], row["x_plain"] = row["tokens"] / ratios[name]["seconds"], ratios[name]
        logger.info("%s %s: %.2f tok/s, %.2fx plain, %d/%d identical", cell, name, row["tokens_per_s"],
                    row["x_plain"]["x"], row["identical"], row["requests"])
    return rows


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    values = sorted(values)
    return {"p50": statistics.median(values), "p99": values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]}


def summary(run: dict, reference: dict, rescore=None) -> dict:
    """rescore(request id, tokens, reference tokens): eval/identity.py's verdict on a request that
    differs from plain's (greedy: identical, near_tie or other), counted as near_tie / other."""
    results = run["results"]
    differ = [rid for rid, r in results.items() if r.tokens != reference[rid].tokens]
    row = {"tokens": sum(len(r.tokens) for r in results.values()),
           "ttft_s": percentiles([r.ttft_s for r in results.values() if r.ttft_s is not None]),
           "tpot_s": percentiles([r.tpot_s for r in results.values() if r.tpot_s is not None]),
           "identical": len(results) - len(differ), "requests": len(results)}
    if rescore is not None:
        verdicts = [rescore(rid, results[rid].tokens, reference[rid].tokens)["verdict"] for rid in differ]
        row.update(near_tie=verdicts.count("near_tie"), other=len(verdicts) - verdicts.count("near_tie"))
    if run["counts"] is not None:
        counts = run["counts"]
        row.update(forwards_per_token=counts.steps / row["tokens"], drafted=counts.drafted, accepted=counts.accepted,
                   accepted_per_request_step=counts.accepted / max(1, counts.drafting_requests))
    return row


def markdown(payload: dict) -> str:
    args = payload["args"]
    sampling = "greedy" if args.get("temperature") is None else f"sampling at temperature {args['temperature']}"
    lines = [f"{args['env']}: {args['requests']} HumanEval prompts, {args['max_new_tokens']} new tokens each ({sampling}, "
             "EOS ends a request), a closed loop of `concurrency` requests in flight through Transformers' continuous "
             "batching manager; plain: Transformers' own manager; lookup:k: ours, prompt lookup; draft: ours, the draft "
             "model, policy auto. x plain: median "
             f"[min, max] of per-round ratios over {args['rounds']} rounds after a warm-up. TTFT / TPOT: p50 / p99 "
             "over requests (seconds). Both managers: ContinuousBatchingConfig(max_batch_tokens="
             f"{args['max_batch_tokens']}, num_blocks={args['num_blocks']}) (Transformers' CPU defaults size a 10 GB "
             "cache and masks to match). fwd/token: forwards per generated token. accepted / drafted (per request per "
             "drafting step). draft:equality: the draft's argmax kept when it equals the target's sample (the rule "
             "before the shared verify). identical: requests equal to plain's; (~n, ≠m): of the others, n first "
             "differ at a near-tie of the target's logits (eval/identity.py), m otherwise.",
             ""]
    for cell in payload["cells"]:
        lines += [f"**concurrency {cell['concurrency']}**", "", *method_table(cell["methods"])]
    return "\n".join(lines)


def method_table(methods: dict, tpot_x_plain: bool = False) -> list[str]:
    """One cell's markdown table: per method tokens/s, x plain, TTFT and TPOT, (TPOT p50 as x
    plain's), forwards per token, drafts accepted, requests identical to plain's."""
    lines = ["| method | tokens/s | x plain | TTFT p50 / p99 | TPOT p50 / p99 |" + (" TPOT p50 x plain |" if tpot_x_plain else "")
             + " fwd/token | accepted / drafted (per step) | identical |",
             "|---|---:|---|---|---|" + ("---:|" if tpot_x_plain else "") + "---:|---:|---:|"]
    plain_tpot = methods["plain"]["tpot_s"]
    for name, row in methods.items():
        x = row["x_plain"]
        spec = f"{row['accepted']} / {row['drafted']} ({row.get('accepted_per_request_step', 0):.2f})" \
            if "drafted" in row else "-"
        fwd = f"{row['forwards_per_token']:.2f}" if "forwards_per_token" in row else "-"
        tpot_x = f" {plain_tpot['p50'] / row['tpot_s']['p50']:.2f} |" if tpot_x_plain else ""
        rescored = f" (~{row['near_tie']}, ≠{row['other']})" if row.get("near_tie") or row.get("other") else ""
        lines.append(f"| {name} | {row['tokens_per_s']:.2f} | {x['x']:.2f} [{x['x_min']:.2f}, {x['x_max']:.2f}] | "
                     f"{latencies(row)} |{tpot_x} {fwd} | {spec} | {row['identical']}/{row['requests']}{rescored} |")
    return lines + [""]


def latencies(row: dict) -> str:
    """TTFT and TPOT p50 / p99 as two table cells ("-" where the path does not time tokens)."""
    ttft, tpot = row["ttft_s"], row["tpot_s"]
    return " | ".join(["-" if ttft is None else f"{ttft['p50']:.2f} / {ttft['p99']:.2f}",
                       "-" if tpot is None else f"{tpot['p50'] * 1e3:.0f} / {tpot['p99'] * 1e3:.0f} ms"])


def plot(payload: dict, path: Path, key: str = "concurrency", xlabel: str = "requests in flight") -> None:
    """x plain per method, one group of bars per cell (`key`: what the cells vary)."""
    cells = [{"batch": c[key], "methods": c["methods"]} for c in payload["cells"]]
    with figure(path) as axes:
        ax = axes[0][0]
        method_bars(ax, cells, lambda row: row["x_plain"]["x"], lambda row: [row["x_plain"]["x_min"], row["x_plain"]["x_max"]],
                    ylabel="tokens/s vs Transformers' plain continuous batching")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel(xlabel)


def rescorer(model, prompts: list[list[int]], config: GenerationConfig):
    """Greedy: a request that differs from plain's, re-scored at its first divergence on the
    target (eval/identity.py; request id "r<i>": prompt i). Sampling: None."""
    if config.do_sample:
        return None
    return lambda rid, tokens, reference: identity.compare_tokens(model, prompts[int(rid[1:])], reference, tokens,
                                                                  config.eos_token_id)


def workload(args):
    """The env (its target `enable`d), the first --requests HumanEval prompts as token ids (raw for
    smollm2, the chat prompt otherwise), and the greedy generation config."""
    env = ENVS[args.env]()
    model, tokenizer = env.model, env.tokenizer
    style = "raw" if args.env == "smollm2" else "chat"
    prompts = [tokenizer(text, add_special_tokens=style == "raw").input_ids
               for text in humaneval_texts(tokenizer, style, limit=args.requests)]
    temperature = getattr(args, "temperature", None)
    sampling = {"do_sample": False} if temperature is None else \
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=model.generation_config.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, **sampling)
    hf_specdec.enable(model)
    return env, prompts, config


def main(argv=None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--env", default="smollm2", choices=["smollm2", "qwen-coder", "qwen-coder-cpu"])
    parser.add_argument("--concurrency", type=ints, default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--lookup", type=ints, default=[3], help="prompt_lookup_num_tokens values")
    parser.add_argument("--no-draft", action="store_true", help="leave out the env's draft model")
    parser.add_argument("--generate", action="store_true",
                        help="also our generate() with the draft in batches of `concurrency` requests")
    parser.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=64, help="cache blocks of 256 tokens")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds, after a warm-up round")
    parser.add_argument("--out", required=True)
    args = parse(parser, argv)
    env, prompts, config = workload(args)
    model = env.model
    methods = [Method("plain")] + [Method(f"lookup:{k}", k=k) for k in args.lookup] + \
        ([Method("draft")] if env.draft is not None and not args.no_draft else []) + \
        ([Method("draft:equality")] if env.draft is not None and not args.no_draft and args.temperature else []) + \
        ([Method("generate")] if env.draft is not None and args.generate else [])
    results = Results(Path(args.out), vars(args), markdown, plot)
    for concurrency in args.concurrency:
        if results.done({"concurrency": concurrency}):
            continue
        runs, seconds = {}, {m.name: [] for m in methods}

        def run(method):     # timed from the first request in to the last result out (not the manager's set-up)
            cb_config = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks)
            runs[method.name] = serve(model, method, prompts, config, cb_config, env.draft, concurrency=concurrency)
            seconds[method.name].append(runs[method.name]["seconds"])
        interleaved(methods, run, args.rounds)
        ratios = speed({name: values[1:] for name, values in seconds.items()}, "plain")    # round 0: a warm-up
        rows = method_rows(runs, ratios, f"concurrency {concurrency}", rescorer(model, prompts, config))
        logger.info("wrote %s", results.add({"concurrency": concurrency, "methods": rows}))


if __name__ == "__main__":
    main()
