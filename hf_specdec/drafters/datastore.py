"""A retrieval drafter (REST-style): continuations of the longest matching suffix in a corpus."""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

from .base import LookupDrafter

logger = logging.getLogger(__name__)

_MULT = 1_000_003  # polynomial n-gram hash; int64 arithmetic wraps, collisions are checked


def _ngram_hashes(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """Hash of every n-gram of `tokens` [L] -> [L - n + 1] int64."""
    windows = tokens.unfold(0, n, 1)                                       # [L-n+1, n]
    powers = torch.tensor([_MULT ** (n - 1 - i) % (1 << 61) for i in range(n)], dtype=torch.long)
    return (windows * powers).sum(1)


class DatastoreDrafter(LookupDrafter):
    """Model-free drafter over a token corpus (e.g. Python source for code, documentation for prose).

    For n from `max_ngram` down to `min_ngram`, find the corpus positions where the row's last n
    tokens occur (a sorted n-gram hash index, binary search) and propose the most frequent
    k-token continuation among up to `max_candidates` of them. Point-mass proposals (q = None).
    """

    def __init__(self, corpus: torch.Tensor, max_ngram: int = 4, min_ngram: int = 2,
                 max_candidates: int = 64, name: str = "datastore"):
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                             f"max_ngram={max_ngram!r}")
        if not isinstance(corpus, torch.Tensor) or corpus.ndim != 1 or len(corpus) <= max_ngram:
            raise ValueError(f"corpus must be a 1-D tensor of more than max_ngram={max_ngram} token ids")
        self.corpus = corpus.to(torch.long).cpu()
        self.max_ngram, self.min_ngram, self.max_candidates = max_ngram, min_ngram, max_candidates
        self.name = name
        self.index = {}                                         # n -> (sorted hashes, their positions)
        for n in range(min_ngram, max_ngram + 1):
            hashes = _ngram_hashes(self.corpus[:-1], n)         # an n-gram needs a following token
            order = torch.argsort(hashes, stable=True)          # ties keep corpus order
            self.index[n] = (hashes[order], order)

    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer, **kwargs) -> "DatastoreDrafter":
        """Index the concatenation of `texts` tokenized by the target's tokenizer."""
        ids: list[int] = []
        for text in texts:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)              # documents do not run into each other
        logger.info("datastore: %d tokens", len(ids))
        return cls(torch.tensor(ids, dtype=torch.long), **kwargs)

    @classmethod
    def from_files(cls, paths: Iterable[str | Path], tokenizer, max_tokens: int | None = None,
                   **kwargs) -> "DatastoreDrafter":
        """Index text files (e.g. Python standard-library sources), up to `max_tokens` tokens."""
        paths = [Path(p) for p in paths]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing or not paths:
            raise ValueError(f"from_files: paths must be existing files; missing: {missing or 'no paths given'}")
        texts, total = [], 0
        for path in paths:
            text = path.read_text(encoding="utf-8", errors="replace")
            texts.append(text)
            total += len(text) // 3                             # rough tokens, to stop reading early
            if max_tokens is not None and total >= max_tokens:
                break
        store = cls.from_texts(texts, tokenizer, **kwargs)
        if max_tokens is not None and len(store.corpus) > max_tokens:
            store = cls(store.corpus[:max_tokens], **kwargs)
        return store

    def continuation(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        seq = seq.cpu()
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            hashes, positions = self.index[n]
            key = _ngram_hashes(seq[-n:], n)
            lo = int(torch.searchsorted(hashes, key, right=False))
            hi = int(torch.searchsorted(hashes, key, right=True))
            if lo == hi:
                continue
            counts: Counter = Counter()
            for start in positions[lo: min(hi, lo + self.max_candidates)].tolist():
                if torch.equal(self.corpus[start: start + n], seq[-n:]):    # not a hash collision
                    counts[tuple(self.corpus[start + n: start + n + k].tolist())] += 1
            if counts:
                best = max(counts.items(), key=lambda item: (item[1], len(item[0])))[0]
                return torch.tensor(best, dtype=torch.long)
        return seq[:0]
