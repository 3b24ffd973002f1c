"""Greedy identity to plain generate(), up to near-ties of a reduced-precision target.

In bf16 a verification forward over k+1 tokens rounds differently from plain decoding's one-token
forward. Where the target's top two logits lie within a few ulps, the argmax can flip, in any
speculative implementation. So each row that differs from plain is re-scored at its first
divergence: one forward of the target over the prompt plus plain's tokens up to there gives the
logits of plain's token and of the speculative one. A gap within `ulps` ulps of the dtype (at the
logit's magnitude) is a near-tie, and so is a gap no larger than its own spread over evaluation
orders: the last j = 1..`orders` tokens of that prefix fed in one forward over a cache of the rest,
as plain decoding (j = 1) and a verification of j - 1 drafts do. That second rule is the one that
matters in float32, where 2 ulps are far below what a different split rounds away over many
layers. Anything else is a bug.

    verdicts = compare_rows(model, input_ids, attention_mask, plain, spec, eos_token_id)
    counts(verdicts)   # {"identical": 3, "near_tie": 1, "other": 0}
"""
from __future__ import annotations

import math

import torch

from hf_specdec._compat import kv_cache

VERDICTS = ("identical", "near_tie", "other")


def until_eos(row: torch.Tensor, eos) -> torch.Tensor:
    """New tokens up to and including the first EOS (what both decoders are committed to)."""
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    hits = [i for i, t in enumerate(row.tolist()) if t in eos_ids]
    return row[: hits[0] + 1] if hits else row


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at |value|."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        dtype = torch.float32
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(value), torch.finfo(dtype).tiny)))


@torch.no_grad()
def compare_rows(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, plain: torch.Tensor,
                 spec: torch.Tensor, eos_token_id=None, ulps: float = 2.0, orders: int = 5) -> list[dict]:
    """One verdict per row: {"row", "verdict": identical | near_tie | other, "position", "gap", "ulp",
    "order_spread"} (the last four None where the rows are identical).

    input_ids/attention_mask: the [batch, prompt] inputs (left padding allowed); plain/spec: the
    [batch, prompt + new] outputs of plain and speculative generate().
    """
    prompt_len = input_ids.shape[1]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    verdicts = []
    for b in range(input_ids.shape[0]):
        a, s = until_eos(plain[b, prompt_len:], eos_token_id), until_eos(spec[b, prompt_len:], eos_token_id)
        if torch.equal(a, s):
            verdicts.append({"row": b, "verdict": "identical", "position": None, "gap": None, "ulp": None,
                             "order_spread": None})
            continue
        n = min(len(a), len(s))
        diff = (a[:n] != s[:n]).nonzero()
        pos = int(diff[0]) if len(diff) else n
        if pos == n:  # one is a prefix of the other: a length difference, not a token choice
            verdicts.append({"row": b, "verdict": "other", "position": pos, "gap": None, "ulp": None,
                             "order_spread": None})
            continue
        prefix = torch.cat([input_ids[b][mask[b].bool()], a[:pos]])[None].to(model.device)
        logits = model(input_ids=prefix).logits[0, -1].float()
        gap = float(logits[a[pos]] - logits[s[pos]])
        step = ulp(float(logits[a[pos]]), model.dtype)
        gaps = [gap] + [_split_gap(model, prefix, j, int(a[pos]), int(s[pos]))
                        for j in range(1, min(orders, prefix.shape[1] - 1) + 1)]
        spread = max(gaps) - min(gaps)
        verdicts.append({"row": b, "verdict": "near_tie" if abs(gap) <= max(ulps * step, spread) else "other",
                         "position": pos, "gap": gap, "ulp": step, "order_spread": spread})
    return verdicts


def compare_tokens(model, prompt, plain, spec, eos_token_id=None) -> dict:
    """`compare_rows` for one row: new tokens `spec` against `plain` after `prompt` (lists or 1-d tensors)."""
    prompt = torch.as_tensor(prompt).reshape(1, -1)
    row = lambda new: torch.cat([prompt[0], torch.as_tensor(new, dtype=prompt.dtype)])[None]  # noqa: E731
    return compare_rows(model, prompt, None, row(plain), row(spec), eos_token_id)[0]


def _split_gap(model, prefix: torch.Tensor, j: int, plain_token: int, spec_token: int) -> float:
    """The logit gap at the end of prefix [1, n] when its last j tokens go in one forward over a cache."""
    cache = kv_cache.new_cache(model)
    model(input_ids=prefix[:, :-j], use_cache=True, **kv_cache.cache_kwargs(model, cache))
    logits = model(input_ids=prefix[:, -j:], use_cache=True, **kv_cache.cache_kwargs(model, cache)).logits
    logits = logits[0, -1].float()
    return float(logits[plain_token] - logits[spec_token])


def counts(verdicts: list[dict]) -> dict:
    return {v: sum(x["verdict"] == v for x in verdicts) for v in VERDICTS}
