"""A draft model that proposes only the tokens most frequent in a corpus (FR-Spec, Zhao et al. 2025;
EAGLE-3's reduced draft vocabulary).

A small draft's head is a large share of its forward: Qwen2.5-0.5B's is 151,936 x 896, 136M of its
494M parameters, all read for every drafted token. `restrict_vocab` keeps the head's rows of
`kept` tokens only; the others get a logit of NEVER, so the draft never proposes them.

Lossless: every draft is verified by the target. Greedy, a token the draft cannot propose is a
rejected draft; sampling, the draft's distribution is zero on those tokens, and rejection sampling's
residual max(0, p - q) gives them exactly the target's probability.
"""
from __future__ import annotations

import collections
import json
import logging
import platform
import sysconfig
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NEVER = -1e30          # a logit no warper or softmax turns into a probability (finite: entropies stay numbers)
CORPUS_BYTES = 8 << 20  # of the corpus: enough for the counts of the top tens of thousands to settle
# the least share of it the default corpus may have (a Python installed without its .py sources has
# almost none: a vocabulary counted from it would be the special tokens and a few others)
MIN_CORPUS_SHARE = 1 / 8


class ReducedHead(torch.nn.Module):
    """A head over the `kept` tokens of an `out_features`-token vocabulary: hidden [..., H] -> logits
    [..., out_features], NEVER outside `kept`. `linear` computes the kept logits (any linear kernel)."""

    def __init__(self, linear: torch.nn.Module, kept: torch.Tensor, out_features: int):
        super().__init__()
        self.linear, self.out_features = linear, out_features
        self.register_buffer("kept", kept)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept_logits = self.linear(hidden)
        logits = kept_logits.new_full((*kept_logits.shape[:-1], self.out_features), NEVER)
        return logits.index_copy_(-1, self.kept, kept_logits)

    def extra_repr(self) -> str:
        return f"{self.kept.numel()} of {self.out_features} tokens"


def restrict_vocab(model, kept: torch.Tensor) -> int:
    """Replace `model`'s output head (an `nn.Linear`) by a `ReducedHead` over the token ids `kept`
    ([n] long, distinct), in place; returns n. Do it before the linear layers are swapped for a
    kernel (`kernels.swap_linears`): the kept rows become an `nn.Linear` of their own."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise TypeError(f"model's output head must be an nn.Linear, got {type(head).__name__}")
    kept = torch.as_tensor(kept, dtype=torch.long, device=head.weight.device).unique()
    if kept.numel() == 0 or int(kept.max()) >= head.out_features or int(kept.min()) < 0:
        raise ValueError(f"kept must be token ids in [0, {head.out_features}), got {kept.numel()} ids")
    linear = torch.nn.Linear(head.in_features, kept.numel(), bias=head.bias is not None,
                             dtype=head.weight.dtype, device=head.weight.device)
    with torch.no_grad():
        linear.weight.copy_(head.weight[kept])     # a copy: a tied head's embedding stays whole
        if head.bias is not None:
            linear.bias.copy_(head.bias[kept])
    model.set_output_embeddings(ReducedHead(linear, kept, head.out_features))
    return kept.numel()


def corpus_texts(limit: int | None = None):
    """Python's standard library sources, in a fixed order, up to `limit` characters (default
    CORPUS_BYTES): code and English prose that every machine with Python has (no download)."""
    limit, total = CORPUS_BYTES if limit is None else limit, 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= limit:
            return


def frequent_tokens(tokenizer, n: int, texts=None, cache: Path | None = None) -> torch.Tensor:
    """The `n` token ids most frequent in `texts` (default `corpus_texts()`) by `tokenizer`, with every
    special token added: [<= n + specials] long, sorted. cache: a JSON file that holds the counts'
    result for this tokenizer (read where it matches, else written)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    # the default corpus is this Python's standard library: another Python version, another corpus
    key = {"tokenizer": getattr(tokenizer, "name_or_path", ""), "vocab": len(tokenizer), "n": n,
           "corpus": "given" if texts is not None else f"stdlib:{CORPUS_BYTES}:python{platform.python_version()}"}
    if cache is not None and texts is None:
        try:
            saved = json.loads(cache.read_text())
            if saved["key"] == key:
                return torch.tensor(saved["ids"], dtype=torch.long)
        except (OSError, ValueError, KeyError):
            pass
    counts, read = collections.Counter(), 0
    for text in (corpus_texts() if texts is None else texts):
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
        read += len(text)
    if texts is None and read < MIN_CORPUS_SHARE * CORPUS_BYTES:
        raise ValueError(f"the draft vocabulary's corpus, this Python's standard library sources "
                         f"({sysconfig.get_paths()['stdlib']}), has {read} characters, fewer than "
                         f"{int(MIN_CORPUS_SHARE * CORPUS_BYTES)}: this Python was installed without them; "
                         "give texts= (a corpus of your own)")
    ids = {token for token, _ in counts.most_common(n)} | set(tokenizer.all_special_ids)
    ids |= {token for token in tokenizer.get_added_vocab().values()}
    kept = sorted(ids)
    logger.info("draft vocabulary: %d tokens (%d most frequent of %d seen, and the special tokens)",
                len(kept), min(n, len(counts)), len(counts))
    if cache is not None and texts is None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache.parent, suffix=".tmp", delete=False) as out:
            json.dump({"key": key, "ids": kept}, out)
        Path(out.name).replace(cache)
    return torch.tensor(kept, dtype=torch.long)
