"""Whether a draft model speaks its target's tokens: an equal vocabulary size is not enough
(Llama 2 and Mistral both have 32000 tokens, mostly different ones), so where both models name
a tokenizer that is on this machine, their token tables are compared.

A draft with another token table runs (the output stays the target's: every draft is verified),
but its drafts are nearly all rejected, so each step costs a draft for nothing: a
`TokenizerMismatchWarning`, which `warnings.filterwarnings("ignore", category=...)` silences.
"""
from __future__ import annotations

import functools
import logging
import warnings

logger = logging.getLogger(__name__)


class TokenizerMismatchWarning(UserWarning):
    """A drafter's tokenizer maps token ids to other strings than the target's."""


def check_same_tokens(target, draft, name: str) -> None:
    """Warn when `draft` (a model; `name`: how the call named it) names a tokenizer whose token
    table differs from `target`'s. Nothing is said where either cannot be loaded from local files."""
    paths = tuple(getattr(m.config, "name_or_path", "") or "" for m in (target, draft))
    if not all(paths) or paths[0] == paths[1]:
        return
    differ = _differing_tokens(*paths)
    if differ:
        warnings.warn(f"{name} ({paths[1]}) has the target's vocabulary size but another tokenizer than the target "
                      f"({paths[0]}): {differ} token ids mean other strings, so its drafts will rarely be accepted",
                      TokenizerMismatchWarning, stacklevel=4)


@functools.lru_cache(maxsize=64)
def _differing_tokens(target_path: str, draft_path: str) -> int:
    """How many token ids the two tokenizers map to different strings (0: the same, or unknown)."""
    tables = [_token_table(p) for p in (target_path, draft_path)]
    if None in tables:
        return 0
    target, draft = tables
    return sum(target.get(i) != draft.get(i) for i in set(target) | set(draft))


def _token_table(path: str) -> dict[int, str] | None:
    """id -> token string of the tokenizer at `path` (a directory, or a hub id already cached)."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:    # noqa: BLE001 - no tokenizer there (a model built from a config): nothing to compare
        logger.debug("no tokenizer to compare at %r: %s", path, e)
        return None
    return {i: token for token, i in tokenizer.get_vocab().items()}
