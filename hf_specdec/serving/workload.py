"""Request streams for serving experiments: Poisson arrivals, phased rates, trace files. Pure Python.

A trace file is a CSV with a header, one request per line, in arrival order, in one of two forms:
  TIMESTAMP,ContextTokens,GeneratedTokens    the Azure LLM inference trace (timestamps such as
                                             2023-11-16 18:15:46.6805900; arrivals relative to the first)
  arrival_s,prompt_len,output_len            seconds from the start
"""
from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

_AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_PLAIN = ("arrival_s", "prompt_len", "output_len")


@dataclass(frozen=True)
class Request:
    id: int
    arrival: float      # seconds after the start of the stream
    prompt_len: int     # tokens
    output_len: int     # tokens to generate (>= 1)


def _check_lengths(value, name: str) -> None:
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
        isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) and v >= 1 for v in value)
        and value[0] <= value[1])
    if not ok:
        raise ValueError(f"{name} must be an int >= 1 or a (lo, hi) tuple with 1 <= lo <= hi, got {value!r}")


def _draw(rng: random.Random, value) -> int:
    return value if isinstance(value, int) else rng.randint(*value)


def phased(phases: Sequence[tuple[float, float]], prompt_len=128, output_len=(16, 128), seed: int = 0) -> list[Request]:
    """Poisson arrivals whose rate changes: `phases` = [(duration s, rate req/s), ...] in order
    (e.g. low / high / low). Lengths: an int, or (lo, hi) drawn uniformly (inclusive)."""
    _check_lengths(prompt_len, "prompt_len")
    _check_lengths(output_len, "output_len")
    if not phases or any(len(p) != 2 or p[0] <= 0 or p[1] < 0 for p in phases):
        raise ValueError(f"phases must be a non-empty list of (duration > 0, rate >= 0), got {phases!r}")
    rng, out, start = random.Random(seed), [], 0.0
    for duration, rate in phases:
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= start + duration:
                break
            out.append(Request(len(out), t, _draw(rng, prompt_len), _draw(rng, output_len)))
        start += duration
    return out


def poisson(rate: float, duration: float, prompt_len=128, output_len=(16, 128), seed: int = 0) -> list[Request]:
    """Poisson arrivals at `rate` requests/s for `duration` seconds."""
    return phased([(duration, rate)], prompt_len, output_len, seed)


def _parse_time(text: str) -> datetime:
    # the Azure traces carry 7 fractional digits, more than datetime parses
    base, _, frac = text.strip().partition(".")
    return datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(microsecond=int((frac + "000000")[:6]) if frac else 0)


def load_trace(path, limit: int | None = None) -> list[Request]:
    """Requests from a trace CSV (see the module docstring); ValueError naming the line on bad input."""
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = tuple(h.strip() for h in next(reader, ()))
        if header[:3] not in (_AZURE, _PLAIN):
            raise ValueError(f"{path}: the header must start with {','.join(_AZURE)} (Azure trace) or "
                             f"{','.join(_PLAIN)}, got {','.join(header) or 'an empty file'}")
        azure = header[:3] == _AZURE
        out, first = [], None
        for line, row in enumerate(reader, start=2):
            if limit is not None and len(out) >= limit:
                break
            if not row or not "".join(row).strip():
                continue
            try:
                if len(row) < 3:
                    raise ValueError(f"expected 3 columns, got {len(row)}")
                when = _parse_time(row[0]) if azure else float(row[0])
                prompt_len, output_len = int(row[1]), int(row[2])
            except ValueError as e:
                raise ValueError(f"{path}:{line}: cannot parse {','.join(row)!r}: {e}") from None
            first = when if first is None else first
            arrival = (when - first).total_seconds() if azure else when
            if arrival < 0 or (out and arrival < out[-1].arrival):
                raise ValueError(f"{path}:{line}: arrival times must not decrease (got {arrival} after "
                                 f"{out[-1].arrival if out else 0.0})")
            if prompt_len < 1 or output_len < 1:
                raise ValueError(f"{path}:{line}: prompt and output lengths must be >= 1, got {prompt_len}, {output_len}")
            out.append(Request(len(out), arrival, prompt_len, output_len))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out
