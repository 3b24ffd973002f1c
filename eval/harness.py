"""One harness for the benchmarks: methods by name, interleaved rounds, identity, stamps, resume.

    factory = MethodFactory(target, draft_model=draft)
    results = Results(Path("docs/results/bench_gpu/h200"), vars(args), markdown, plot)
    for cell in cells:
        if results.done(cell):                        # resumed: already measured
            continue
        timing = interleaved(methods, lambda m: generate(target, factory, m, **inputs), rounds=3)
        results.add(dict(cell, speed=speed(timing.seconds, "plain")))   # written at once

`generate` runs a Transformers method (plain, `hf-assisted`) through Transformers' own
`generate()` (the class's, so `hf_specdec.enable` cannot reroute it) and ours through the
`custom_generate` hook. `interleaved` runs every method once a round, the order rotated by one
each round, after an untimed warm-up round; speed is the median of per-round ratios to a
reference method, with the min and max beside it. `over_chunks` runs them interleaved over chunks of
prompts and checks every row against plain (eval/identity.py); `forward_ms` times a model's forward
by width. `arguments`, `parse` and `ints` are the scripts' shared command-line pieces, `check_identity`
their verdict; plots go through `report.figure`.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import hf_specdec
from identity import compare_rows, until_eos
from methods import Method, MethodFactory
from report import write_results

logger = logging.getLogger(__name__)


def generate(model, factory: MethodFactory, method: Method, **kwargs):
    """One generate() call of `method` with `kwargs` (inputs, max_new_tokens, ...)."""
    extra = factory.generate_kwargs(method)
    if method.ours:
        return model.generate(custom_generate=hf_specdec.generate, **kwargs, **extra)
    return type(model).generate(model, **kwargs, **extra)      # Transformers' own, even on an enabled model


@dataclass
class Timing:
    """What `interleaved` measured: seconds[method] per timed round, the seconds of its untimed
    warm-up call (compiling, on an accelerator), each method's last output, and the error of each
    method that raised (it runs no more rounds and has no seconds)."""
    seconds: dict[str, list[float]] = field(default_factory=dict)
    warmup_seconds: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, object] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


SETTLE_ROUNDS = 4     # warm-up rounds at most, waiting for compiles to stop (`interleaved`)


def interleaved(methods: list[Method], run: Callable[[Method], object], rounds: int, warmup: bool = True,
                device: torch.device | None = None, offset: int = 0, keep_going: bool = False,
                settled: Callable[[], int] | None = None) -> Timing:
    """Each method once per round, the order rotated by one each round (no method always runs
    after the same neighbour; `offset` shifts the first round's order, e.g. by the prompt chunk);
    round 0 is an untimed warm-up when `warmup`. With `settled` (a count such as the graphs
    compiled so far) warm-up rounds repeat, up to SETTLE_ROUNDS, until one leaves it unmoved: a
    compile that comes after a call's first (a one-token graph compiled once hot) is not timed.
    On a CUDA device the device is synchronised around each timed call. With `keep_going`, a method
    that raises is logged and dropped (its error in `Timing.errors`): a long run on a lent GPU keeps
    its other methods."""
    timing = Timing(seconds={m.name: [] for m in methods})
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    if warmup and settled is not None:
        for settle in range(SETTLE_ROUNDS):
            before = settled()
            seconds = interleaved(methods, run, 0, True, device, offset, keep_going).warmup_seconds
            if not settle:
                timing.warmup_seconds = seconds            # the first round's: the compiling one
            if settled() == before:
                break
        warmup = False
    for r in range(rounds + warmup):
        shift = (r + offset) % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if method.name in timing.errors:
                continue
            sync()
            start = time.perf_counter()
            try:
                timing.outputs[method.name] = run(method)
            except Exception as e:       # noqa: BLE001 - recorded, the run goes on
                if not keep_going:
                    raise
                logger.exception("%s failed", method.name)
                timing.errors[method.name] = f"{type(e).__name__}: {e}"
                del timing.seconds[method.name]
                continue
            sync()
            if r >= warmup:
                timing.seconds[method.name].append(time.perf_counter() - start)
            else:
                timing.warmup_seconds[method.name] = time.perf_counter() - start
    return timing


@dataclass
class Chunked:
    """What `over_chunks` measured: per method the median seconds of each chunk and every row's
    verdict against plain (`prompt`: the row's index over all chunks); plain's new tokens."""
    seconds: dict[str, list[float]]
    verdicts: dict[str, list[dict]]
    tokens: int = 0


def over_chunks(model, methods: list[Method], chunks, run: Callable[[Method, dict], torch.Tensor],
                rounds: int = 1) -> Chunked:
    """Every method on each chunk of inputs ({"input_ids", "attention_mask"}), `interleaved` for
    `rounds` timed rounds a chunk (the order shifted by the chunk's index); run(method, inputs) ->
    the output sequences. Every row is compared with plain's (identity.compare_rows)."""
    eos = model.generation_config.eos_token_id
    out = Chunked({m.name: [] for m in methods}, {m.name: [] for m in methods})
    first = 0
    for c, inputs in enumerate(chunks):
        timing = interleaved(methods, lambda method: run(method, inputs), rounds, warmup=False, offset=c)
        plain = timing.outputs["plain"]
        out.tokens += sum(len(until_eos(row, eos)) for row in plain[:, inputs["input_ids"].shape[1]:])
        for m in methods:
            out.seconds[m.name].append(statistics.median(timing.seconds[m.name]))
            out.verdicts[m.name] += [dict(v, prompt=first + v["row"]) for v in compare_rows(
                model, inputs["input_ids"], inputs.get("attention_mask"), plain, timing.outputs[m.name], eos)]
        first += len(plain)
    return out


def speed(seconds: dict[str, list[float]], reference: str) -> dict[str, dict]:
    """Per method: median seconds and speed over `reference` (median [min, max] of per-round ratios)."""
    out = {}
    for name, times in seconds.items():
        ratios = [r / t for r, t in zip(seconds[reference], times)]
        out[name] = {"seconds": statistics.median(times), "x": statistics.median(ratios), "x_min": min(ratios),
                     "x_max": max(ratios), "x_per_round": [round(x, 3) for x in ratios]}
    return out


class Results:
    """A benchmark's cells, written as JSON + markdown (+ plot) after each one, and resumed: a run
    with the same arguments finds the cells it already has (`done`). markdown(payload) -> str;
    plot(payload, path) draws the PNG."""

    def __init__(self, out: Path, args: dict, markdown: Callable[[dict], str],
                 plot: Callable[[dict, Path], None] | None = None, resume: bool = True):
        self.out, self.markdown, self.plot = Path(out), markdown, plot
        args = json.loads(json.dumps(args, default=str))     # as it reads back (tuples as lists), to compare
        path = self.out.with_suffix(".json")
        old = json.loads(path.read_text()) if resume and path.exists() else None
        if old is not None and old.get("args") == args:
            self.payload = old
            self.payload.pop("stamp", None)        # stamped anew: the commit and date of this run
        else:
            self.payload = {"args": args, "cells": []}

    @property
    def cells(self) -> list[dict]:
        return self.payload["cells"]

    def done(self, key: dict) -> bool:
        return any(all(c.get(k) == v for k, v in key.items()) for c in self.cells)

    def add(self, cell: dict) -> Path:
        self.cells.append(cell)
        return self.save()

    def save(self) -> Path:
        self.payload.pop("stamp", None)
        plot = (lambda path: self.plot(self.payload, path)) if self.plot else None
        return write_results(self.out.parent, self.out.name, self.payload, self.markdown(self.payload), plot)


def forward_ms(model, input_ids: torch.Tensor, widths=(1,), repeats: int = 5) -> dict[int, float]:
    """Median milliseconds of one forward of `w` tokens over a cache of `input_ids` [b, p], per width
    w, the widths interleaved in `repeats` rounds after one warm-up round (a machine's drift then
    moves every width alike); the device is synchronised around each."""
    from hf_specdec._compat import kv_cache
    sync = torch.cuda.synchronize if input_ids.device.type == "cuda" else (lambda: None)
    cache = kv_cache.new_cache(model)
    model(input_ids=input_ids, use_cache=True, **kv_cache.cache_kwargs(model, cache))
    times = {w: [] for w in widths}
    for _ in range(repeats + 1):
        for w in widths:
            sync()
            start = time.perf_counter()
            model(input_ids=input_ids[:, -w:], use_cache=True, **kv_cache.cache_kwargs(model, cache))
            sync()
            times[w].append(time.perf_counter() - start)
            kv_cache.crop(cache, w)
    return {w: round(1e3 * statistics.median(t[1:]), 2) for w, t in times.items()}


class ForwardCounter:
    """Counts a model's forward calls (hooks on the module), e.g. target forwards per generate()."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self._hook = model.register_forward_pre_hook(self._tick)

    def _tick(self, module, args):
        self.count += 1

    def close(self) -> None:
        self._hook.remove()


def arguments(doc: str, envs: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's argument parser, `doc` (its module docstring) as the help; with `envs`, an
    --envs option (comma-separated environment names) defaulting to it."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if envs:
        parser.add_argument("--envs", default=envs, help="comma-separated environment names (above)")
    return parser


def parse(parser: argparse.ArgumentParser, argv, envs=(), log_format: str = "%(message)s") -> argparse.Namespace:
    """Parse `argv`, --envs checked against `envs`; logging on, autograd off (a benchmark's start)."""
    args = parser.parse_args(argv)
    unknown = [e for e in getattr(args, "envs", "").split(",") if envs and e not in envs]
    if unknown:
        parser.error(f"--envs: unknown {unknown}; known: {sorted(envs)}")
    logging.basicConfig(level=logging.INFO, format=log_format)
    torch.set_grad_enabled(False)
    return args


def ints(text: str) -> list[int]:
    """A comma-separated list of integers ("" -> [])."""
    return [int(x) for x in text.split(",") if x.strip()]


def identity_mark(identity: dict) -> str:
    """"" when every row is identical to plain; else " ~n" (n rows first diverge at a near-tie) and/or
    " ≠n" (n rows diverge otherwise: a bug)."""
    return "".join(f" {sign}{identity[v]}" for v, sign in (("near_tie", "~"), ("other", "≠")) if identity[v])


def check_identity(rows: dict[str, dict], reference: str = "plain generate()") -> None:
    """Fail the run (after its results are written) if a row of `rows` (name -> {"identity": counts})
    diverged from the reference other than at a near-tie."""
    bad = [name for name, row in rows.items() if row["identity"]["other"]]
    if bad:
        raise SystemExit(f"outputs differ from {reference} other than at a near-tie: {bad}")
