"""Latency models for length policies: forward time per model, and the switching cost table.

AdaSpec's model of one forward pass of a batch: T = alpha * N_context + gamma * N_batch_tokens +
delta (+ wide_extra when it feeds more than one token per row) seconds, N_context = context tokens
summed over the batch's rows, N_batch_tokens = new tokens fed in this forward. Nightjar's
switching cost C(L_max, B): the time of the catch-up forward that feeds a draft model the L_max
tokens it missed while speculation was off, for B rows. Both are measured by `profile()`
(`python -m hf_specdec profile ...`) and saved as JSON.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence


@dataclass
class LatencyModel:
    alpha: float   # seconds per context token (summed over rows)
    gamma: float   # seconds per new token in the forward (summed over rows)
    delta: float   # fixed seconds per forward
    # fixed seconds more when a forward feeds several tokens per row (a verification, a catch-up).
    # On a CPU such a forward takes a slower path: the tiny pair's target at B=1 takes 9.3 ms for
    # one token, 11.6 for two, then +0.3 ms a token (at B=2 and 4 alike); one line through widths
    # 1-8 read 0.7 ms a token, and long drafts looked twice as dear as they are.
    wide_extra: float = 0.0

    def __post_init__(self):
        for name in ("alpha", "gamma", "delta", "wide_extra"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LatencyModel.{name} must be a finite number >= 0, got {value!r}")

    def forward_time(self, context_tokens: float, batch_tokens: float, wide: bool = False) -> float:
        """wide: the forward feeds more than one token per row."""
        return self.alpha * context_tokens + self.gamma * batch_tokens + self.delta + self.wide_extra * wide

    @classmethod
    def fit(cls, samples: Sequence[tuple]) -> "LatencyModel":
        """Least squares of the relative error over (N_context, N_batch_tokens, seconds[, wide])
        samples (policies compare step times as ratios, and a batch-16 forward would otherwise
        swamp the fit of a batch-1 one); coefficients clipped at 0. wide_extra is fitted only if
        both one-token and wide forwards are among the samples."""
        if len(samples) < 3:
            raise ValueError(f"LatencyModel.fit needs at least 3 samples, got {len(samples)}")
        import torch
        wide = [len(s) > 3 and bool(s[3]) for s in samples]
        both = any(wide) and not all(wide)
        x = torch.tensor([[s[0], s[1], 1.0] + [float(w)] * both for s, w in zip(samples, wide)],
                         dtype=torch.float64)
        y = torch.tensor([[s[2]] for s in samples], dtype=torch.float64)
        weight = 1 / y.clamp(min=1e-9)
        coef = torch.linalg.lstsq(x * weight, y * weight).solution.flatten().clamp(min=0).tolist()
        return cls(*coef)


@dataclass
class SwitchCostTable:
    """C(L_max, B) in seconds on a grid, bilinear in between, clamped at the edges except beyond
    the longest lag, where the last segment's slope goes on (a catch-up of a whole prompt costs
    per token what the longest profiled one did, not nothing)."""

    lags: list[int]
    batch_sizes: list[int]
    seconds: list[list[float]]   # [len(lags)][len(batch_sizes)]

    def __post_init__(self):
        for name in ("lags", "batch_sizes"):
            axis = getattr(self, name)
            if not axis or sorted(set(axis)) != list(axis) or any(not isinstance(v, int) or v < 0 for v in axis):
                raise ValueError(f"SwitchCostTable.{name} must be strictly increasing integers >= 0, got {axis!r}")
        if len(self.seconds) != len(self.lags) or any(len(r) != len(self.batch_sizes) for r in self.seconds):
            raise ValueError(f"SwitchCostTable.seconds must be {len(self.lags)} x {len(self.batch_sizes)}")
        if any(not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 for r in self.seconds for v in r):
            raise ValueError("SwitchCostTable.seconds must hold finite numbers >= 0")

    def __call__(self, lag: float, batch_size: float) -> float:
        if lag <= 0:
            return 0.0
        (i0, i1, u), (j0, j1, v) = _bracket(self.lags, lag), _bracket(self.batch_sizes, batch_size)
        at = [(1 - v) * row[j0] + v * row[j1] for row in self.seconds]     # by lag, at this batch size
        value = (1 - u) * at[i0] + u * at[i1]
        if lag > self.lags[-1] and len(self.lags) > 1:
            slope = (at[-1] - at[-2]) / (self.lags[-1] - self.lags[-2])
            value += max(0.0, slope) * (lag - self.lags[-1])
        return value


def _bracket(axis: list[int], x: float) -> tuple[int, int, float]:
    """Indices around x on `axis` and the interpolation weight of the upper one (clamped)."""
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        last = len(axis) - 1
        return last, last, 0.0
    hi = bisect.bisect_right(axis, x)
    lo = hi - 1
    return lo, hi, (x - axis[lo]) / (axis[hi] - axis[lo])


@dataclass
class CostProfile:
    """What the profiler measured: the target's and the draft's latency models and the draft's
    switching-cost table."""

    target: LatencyModel
    draft: LatencyModel
    switch: SwitchCostTable
    meta: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        """Read a profile JSON; a malformed file raises ValueError naming what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read cost profile {path}: {e}") from e
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: dict, where: str = "dict") -> "CostProfile":
        """The inverse of `dataclasses.asdict(profile)`; ValueError naming what is missing."""
        try:
            return cls(LatencyModel(**data["target"]), LatencyModel(**data["draft"]),
                       SwitchCostTable(**data["switch"]), data.get("meta", {}))
        except (KeyError, TypeError) as e:
            raise ValueError(f"cost profile {where} is malformed ({e!r}); expected keys target, draft "
                             "(alpha, gamma, delta) and switch (lags, batch_sizes, seconds)") from e


def _time_forwards(model, ids, context: int, widths: Sequence[int], repeats: int,
                   all_logits: bool = True) -> list[float]:
    """Median seconds of one forward feeding w tokens per row after `context` cached ones, for
    each w in `widths` (one prefill, cropped back after every timed forward; context 0: each
    forward is itself a prefill into an empty cache). all_logits: the forward computes logits at
    all w positions (a verification), else at the last only (a catch-up or prefill: the output
    head over a 150k vocabulary is a large share of a small model's forward)."""
    import statistics
    import time

    import torch

    from ._compat import kv_cache, modeling
    from .states import as_verification
    cache = kv_cache.new_cache(model)
    can_keep = modeling.accepts_logits_to_keep(model)

    def keep(width: int) -> dict:
        return {"logits_to_keep": width if all_logits else 1} if can_keep else {}
    out = []
    with torch.no_grad():
        if context:          # a forward's time depends on how many slots it attends to, not on their content:
            # one row's prefill, copied to every row (a CPU prefills a batch of long rows slowly)
            with as_verification(model, cache, 1, context):
                model(input_ids=ids[:1, :context], use_cache=True, **keep(1), **kv_cache.cache_kwargs(model, cache))
            kv_cache.repeat_rows(cache, ids.shape[0])
        for width in widths:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                with as_verification(model, cache, ids.shape[0], width):
                    model(input_ids=ids[:, context: context + width], use_cache=True, **keep(width),
                          **kv_cache.cache_kwargs(model, cache))
                if ids.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                kv_cache.crop(cache, width)
            out.append(statistics.median(times))
    return out


def profile(target, draft, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16), widths: Sequence[int] = (1, 3, 5, 8),
            contexts: Sequence[int] = (32, 128, 256), lags: Sequence[int] = (1, 4, 16, 64),
            repeats: int = 3, progress: bool = True) -> CostProfile:
    """Measure forward times of `target` and `draft` (torch modules, same vocabulary; None: a
    drafter without a model, which costs nothing) over batch sizes x tokens per row x context
    lengths, fit a LatencyModel to each, and tabulate the draft's catch-up time C(L, B) at the
    shortest context. `meta` names the models (`model_key`)."""
    import torch
    from tqdm.auto import tqdm

    vocab = min(m.config.get_text_config().vocab_size for m in (target, draft) if m is not None)
    longest = max(contexts) + max(max(widths), max(lags))
    grid = [(b, c) for b in batch_sizes for c in contexts]
    samples = {"target": [], "draft": []}
    switch = {}
    device = next(target.parameters()).device
    for b, c in tqdm(grid, desc="profiling", disable=not progress):
        ids = torch.randint(3, vocab, (b, longest), generator=torch.Generator().manual_seed(b * 1000 + c)).to(device)
        for name, model in (("target", target), ("draft", draft)) if draft is not None else (("target", target),):
            measure = list(widths) + (list(lags) if name == "draft" and c == min(contexts) else [])
            # the target verifies (logits at every fed token); the draft drafts or catches up (the last)
            seconds = _time_forwards(model, ids, c, measure, repeats, all_logits=name == "target")
            samples[name] += [(b * c, b * w, t, w > 1) for w, t in zip(widths, seconds)]
            switch.update({(lag, b): t for lag, t in zip(lags, seconds[len(widths):])})
    table = SwitchCostTable(sorted(lags), sorted(batch_sizes),
                            [[switch.get((lag, b), 0.0) for b in sorted(batch_sizes)] for lag in sorted(lags)])
    meta = {"target": model_key(target), "draft": None if draft is None else model_key(draft),
            "batch_sizes": list(batch_sizes), "widths": list(widths), "contexts": list(contexts),
            "repeats": repeats, "device": str(device), "samples": samples}
    draft_model = LatencyModel.fit(samples["draft"]) if draft is not None else LatencyModel(0.0, 0.0, 0.0)
    return CostProfile(LatencyModel.fit(samples["target"]), draft_model, table, meta)


def model_key(model) -> str:
    """What a profile was measured on, as far as latency goes: class, dtype, device and a digest
    of the architecture (the config without where it was loaded from or by which release)."""
    import hashlib
    param = next(model.parameters())
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{type(model).__name__}|{param.dtype}|{param.device}|{digest}"


# part of the cache key: a profile measured by an earlier profiler is measured again
# (2: draft catch-ups and prefills compute the last token's logits only, as the loop does)
PROFILER_VERSION = 2


def cached_profile(target, draft, batch_size: int, cache_dir: str | Path | None = None, ranks=None) -> CostProfile:
    """The profile of `target` with `draft` (None: a drafter without a model) at batch sizes 1, 2,
    4, ... up to `batch_size`'s power of two: read from `cache_dir` (default
    <HF_SPECDEC_CACHE>/profiles) when measured before, else measured now (a few forwards per batch
    size and width) and saved there. ranks: a tensor-parallel target's `distributed.Ranks`: rank 0's
    file decides, every rank measures (the target's forwards are collectives), rank 0's numbers
    are kept."""
    import hashlib
    import logging

    from .embedded import cache_dir as default_cache
    sizes = [1 << i for i in range((max(batch_size, 1) - 1).bit_length() + 1)]
    key = "\n".join([model_key(target), "none" if draft is None else model_key(draft), str(sizes),
                     f"profiler {PROFILER_VERSION}"])
    path = Path(cache_dir or default_cache() / "profiles") / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    have = None
    if ranks is None or ranks.decides:
        try:
            have = CostProfile.load(path)
        except ValueError:      # not measured yet, or a file cut short: measure (again)
            pass
    if ranks is not None:
        have = ranks.share_object(have)
    if have is not None:
        return have
    logging.getLogger(__name__).info("profiling the target%s at batch sizes %s for the length policy (once: "
                                     "cached in %s)", "" if draft is None else " and the draft", sizes, path)
    prof = profile(target, draft, sizes, widths=(1, 3, 5, 8), contexts=(64, 256), lags=(1, 4, 16, 64),
                   repeats=2, progress=False)
    if ranks is not None:
        prof = ranks.share_object(prof)
        if not ranks.decides:
            return prof
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    prof.save(partial)
    os.replace(partial, path)      # a reader sees the whole file or none
    return prof


def profile_prefill(model, lengths: Sequence[int] = (16, 64, 128, 256), repeats: int = 3) -> LatencyModel:
    """A LatencyModel of prompt prefills: one row of L tokens into an empty cache, for L in
    `lengths`, fitted on samples (L, L, seconds). Decode-step profiles (a few tokens per row)
    extrapolate badly to hundreds: on a CPU a token costs less in a wide matrix-matrix product."""
    import torch
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    seconds = _time_forwards(model, ids.to(next(model.parameters()).device), 0, lengths, repeats, all_logits=False)
    return LatencyModel.fit([(length, length, t) for length, t in zip(lengths, seconds)])
