"""Greedy identity to plain generate(), up to near-ties of a reduced-precision target.

In bf16 a verification forward over k+1 tokens rounds differently from plain decoding's one-token
forward. Where the target's top two logits lie within a few ulps, the argmax can flip, in any
speculative implementation. So each row that differs from plain is re-scored at its first
divergence: one forward of the target over the prompt plus plain's tokens up to there gives the
logits of plain's token and of the speculative one. A gap within `ulps` ulps of the dtype (at the
logit's magnitude) is a near-tie; anything else is a bug.

    verdicts = compare_rows(model, input_ids, attention_mask, plain, spec, eos_token_id)
    counts(verdicts)   # {"identical": 3, "near_tie": 1, "other": 0}
"""
from __future__ import annotations

import math

import torch

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
                 spec: torch.Tensor, eos_token_id=None, ulps: float = 2.0) -> list[dict]:
    """One verdict per row: {"row", "verdict": identical | near_tie | other, "position", "gap", "ulp"}.

    input_ids/attention_mask: the [batch, prompt] inputs (left padding allowed); plain/spec: the
    [batch, prompt + new] outputs of plain and speculative generate().
    """
    prompt_len = input_ids.shape[1]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    verdicts = []
    for b in range(input_ids.shape[0]):
        a, s = until_eos(plain[b, prompt_len:], eos_token_id), until_eos(spec[b, prompt_len:], eos_token_id)
        if torch.equal(a, s):
            verdicts.append({"row": b, "verdict": "identical", "position": None, "gap": None, "ulp": None})
            continue
        n = min(len(a), len(s))
        diff = (a[:n] != s[:n]).nonzero()
        pos = int(diff[0]) if len(diff) else n
        if pos == n:  # one is a prefix of the other: a length difference, not a token choice
            verdicts.append({"row": b, "verdict": "other", "position": pos, "gap": None, "ulp": None})
            continue
        prefix = torch.cat([input_ids[b][mask[b].bool()], a[:pos]])[None]
        logits = model(input_ids=prefix.to(model.device)).logits[0, -1].float()
        gap = float(logits[a[pos]] - logits[s[pos]])
        step = ulp(float(logits[a[pos]]), model.dtype)
        verdicts.append({"row": b, "verdict": "near_tie" if abs(gap) <= ulps * step else "other",
                         "position": pos, "gap": gap, "ulp": step})
    return verdicts


def counts(verdicts: list[dict]) -> dict:
    return {v: sum(x["verdict"] == v for x in verdicts) for v in VERDICTS}
