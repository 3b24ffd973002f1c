"""`python -m hf_specdec serve` against `transformers serve --continuous-batching`, over HTTP.

    python eval/bench_serve.py --concurrency 1,16 --requests 32 --max-tokens 64 \
        --out docs/results/bench_serve/smollm2

Both servers run the same checkpoint as a user starts them (SmolLM2-135M-Instruct, float32, saved
from the embedded weights; ours with a draft of its first --draft-layers layers, policy "auto"),
each in its own process with the same flags (`--device cpu --cb-num-blocks 64`). The `openai`
client sends the first --requests HumanEval problems as chat completions (greedy, --max-tokens),
--concurrency at a time (a closed loop). Rounds interleave the servers (eval/harness.interleaved),
after a warm-up round. Per server and concurrency: completion tokens/s (median of rounds) and its
ratio to `transformers serve` per round, answers identical to Transformers'. Writes <out>.json,
.md and .png after each concurrency, stamped. Needs the [serve] extra.
"""
from __future__ import annotations

import copy
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_continuous_batching import plot  # noqa: E402
from harness import Results, arguments, interleaved, ints, parse, speed  # noqa: E402
from humaneval_data import load_problems  # noqa: E402
from methods import Method  # noqa: E402

logger = logging.getLogger("bench_serve")
THEIRS, OURS = "plain", "hf_specdec serve"      # (plain: the reference every ratio is over)


def save_float32(model, tokenizer, layers: int, where: Path) -> str:
    """A plain (not quantized) checkpoint of `model`'s first `layers` layers."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    config.__dict__.pop("quantization_config", None)
    copied = type(model)(config)
    copied.load_state_dict(model.state_dict(), strict=False)     # (the layers past `layers` are left out)
    copied.generation_config = model.generation_config
    copied.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return str(where)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free port (offline, one thread per op, a paged cache of `num_blocks`
    blocks); its output in `log`."""

    def __init__(self, command: list[str], log: Path, num_blocks: int = 64):
        import openai
        self.port, self.log = free_port(), log
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        options = ["--port", str(self.port), "--device", "cpu", "--cb-num-blocks", str(num_blocks)]
        self.process = subprocess.Popen([*command, *options], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=f"http://localhost:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=600)

    def wait(self, seconds: float = 600) -> "Server":
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()
            try:
                with urllib.request.urlopen(f"http://localhost:{self.port}/health") as health:
                    if health.status == 200:
                        return self
            except OSError:      # (not listening yet)
                pass
            time.sleep(1)
        raise AssertionError(f"no server on port {self.port} after {seconds} s:\n{self.output()}")

    def output(self) -> str:
        return open(self.log).read()[-3000:]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def servers(where: Path, draft_layers: int, num_blocks: int) -> tuple[dict[str, Server], str]:
    """Transformers' server and ours on checkpoints saved under `where`, both started and healthy."""
    from hf_specdec.embedded import load_smollm2
    model, tokenizer = load_smollm2()
    target = save_float32(model, tokenizer, model.config.num_hidden_layers, where / "target")
    draft = save_float32(model, tokenizer, draft_layers, where / "draft")
    started = {THEIRS: Server([sys.executable, "-m", "transformers.cli.transformers", "serve", target,
                               "--continuous-batching"], where / "transformers.log", num_blocks),
               OURS: Server([sys.executable, "-m", "hf_specdec", "serve", target, "--draft", draft],
                            where / "ours.log", num_blocks)}
    for server in started.values():
        server.wait()
    return started, target


def ask(server: Server, model: str, questions: list[str], concurrency: int, max_tokens: int) -> dict:
    """Every question as a chat completion, `concurrency` at a time: answers and completion tokens."""
    def one(question):
        out = server.client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                    max_tokens=max_tokens, temperature=0)
        return out.choices[0].message.content, out.usage.completion_tokens
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, questions))
    return {"answers": [a for a, _ in answers], "tokens": sum(t for _, t in answers)}


def markdown(payload: dict) -> str:
    args = payload["args"]
    lines = [f"SmolLM2-135M-Instruct float32 on the CPU: `python -m hf_specdec serve` (a draft of its first "
             f"{args['draft_layers']} layers, policy auto) against `transformers serve --continuous-batching`, both "
             f"with `--cb-num-blocks {args['num_blocks']}`; {args['requests']} HumanEval chat completions of up to "
             f"{args['max_tokens']} tokens (greedy) through the `openai` client, `concurrency` at a time. x: median "
             f"[min, max] of per-round ratios over {args['rounds']} rounds after a warm-up. identical: answers equal "
             "to Transformers'.", "",
             "| concurrency | server | tokens/s | x transformers serve | identical |", "|---:|---|---:|---|---:|"]
    for cell in payload["cells"]:
        for name, row in cell["methods"].items():
            x = row["x_plain"]
            lines.append(f"| {cell['concurrency']} | {'transformers serve' if name == THEIRS else name} | "
                         f"{row['tokens_per_s']:.1f} | {x['x']:.2f} [{x['x_min']:.2f}, {x['x_max']:.2f}] | "
                         f"{row['identical']}/{row['requests']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--concurrency", type=ints, default=[1, 16])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=64, help="paged cache blocks of 256 tokens")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after a warm-up round")
    parser.add_argument("--out", required=True)
    args = parse(parser, argv)
    questions = [problem["prompt"] for problem in load_problems(limit=args.requests)]
    results = Results(Path(args.out), vars(args), markdown,
                      lambda payload, path: plot(payload, path, xlabel="concurrent requests"))
    with tempfile.TemporaryDirectory() as where:
        started, model = servers(Path(where), args.draft_layers, args.num_blocks)
        try:
            for concurrency in args.concurrency:
                if results.done({"concurrency": concurrency}):
                    continue
                runs = {}

                def run(method, concurrency=concurrency):
                    runs[method.name] = ask(started[method.name], model, questions, concurrency, args.max_tokens)
                timing = interleaved([Method(THEIRS), Method(OURS)], run, args.rounds)
                ratios = speed(timing.seconds, THEIRS)
                rows = {name: {"tokens": run["tokens"], "tokens_per_s": run["tokens"] / ratios[name]["seconds"],
                               "x_plain": ratios[name], "requests": len(questions),
                               "identical": sum(a == b for a, b in zip(run["answers"], runs[THEIRS]["answers"]))}
                        for name, run in runs.items()}
                logger.info("concurrency %d: ours %.2fx transformers serve (%s)", concurrency, rows[OURS]["x_plain"]["x"],
                            rows[OURS]["x_plain"]["x_per_round"])
                logger.info("wrote %s", results.add({"concurrency": concurrency, "methods": rows}))
        finally:
            for server in started.values():
                server.stop()


if __name__ == "__main__":
    main()
