"""Spec-Bench's questions (Xia et al., 2024): 480 first-turn prompts in 13 categories, the standard
mixed workload of speculative-decoding papers.

The file is not shipped with this project: get `data/spec_bench/question.jsonl` from the Spec-Bench
project (https://github.com/hemingkx/Spec-Bench, Apache-2.0) and pass its path.

    questions = load_questions("question.jsonl", per_category=2)
    # [{"id": 81, "domain": "writing", "text": "Compose an engaging ...", "style": "chat"}, ...]
"""
from __future__ import annotations

import json
from pathlib import Path

SOURCE = "https://github.com/hemingkx/Spec-Bench (data/spec_bench/question.jsonl)"


def load_questions(path, per_category: int | None = None) -> list[dict]:
    """The first turn of each question, the first `per_category` of each category (all when None),
    grouped by category in the file's order of first appearance."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--questions: no Spec-Bench question file at {str(path)!r}; "
                                f"download it from {SOURCE}")
    if per_category is not None and per_category < 1:
        raise ValueError(f"per_category must be >= 1 or None, got {per_category!r}")
    by_category: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_category.setdefault(row["category"], []).append(
                {"id": row["question_id"], "domain": row["category"], "text": row["turns"][0], "style": "chat"})
    return [q for rows in by_category.values() for q in rows[:per_category]]


def chat_text(question: dict, tokenizer) -> str:
    """The question as the user's turn of `tokenizer`'s chat template, the assistant's turn opened."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question["text"]}], tokenize=False,
                                         add_generation_prompt=True)
