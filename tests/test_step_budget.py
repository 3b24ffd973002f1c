"""eval/step_budget.py's cell on the tiny exact pair: steps split into phases, every output checked
against plain generate(), and its markdown and plot written."""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))     # step_budget imports its eval/ neighbours by name
import step_budget  # noqa: E402
from harness import Results  # noqa: E402
from methods import parse_methods  # noqa: E402

from hf_specdec.testing import exact_cheap_pair  # noqa: E402


def test_budget_splits_each_step_into_phases_and_writes_its_table_and_plot(tmp_path):
    target, draft = exact_cheap_pair()
    ids = torch.randint(3, target.config.vocab_size, (2, 1, 24), generator=torch.Generator().manual_seed(0))
    prompts = [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]
    args = argparse.Namespace(methods=parse_methods("plain,fixed:0@draft,fixed:4@draft,auto@draft"), max_new_tokens=16)
    cell = step_budget.budget(target, draft, prompts, args)
    rows = cell["methods"]
    assert set(rows) == {"plain", "fixed:0@draft", "fixed:4@draft", "auto@draft"}
    for name, row in rows.items():
        assert row["identity"] == {"identical": 2, "near_tie": 0, "other": 0}, name
    assert "step_ms" in rows["plain"] and "draft_ms" not in rows["plain"]       # Transformers' own
    assert rows["fixed:0@draft"]["draft_ms"] < 0.5 and rows["fixed:0@draft"]["tokens_per_step"] == 1   # no drafts
    fixed = rows["fixed:4@draft"]        # the exact draft: 5 tokens a step but where the limit cuts one
    assert fixed["draft_ms"] > 0 and fixed["verify_ms"] > 0 and fixed["tokens_per_step"] > 3
    assert fixed["prefill_ms"] > 0
    assert set(cell["forward_ms"]["target"]) == set(step_budget.WIDTHS)
    results = Results(tmp_path / "budget", {"max_new_tokens": 16}, step_budget.markdown, step_budget.plot)
    results.add(dict(kernel="tiny", cpu_bf16_matmul=False, **cell))
    text = (tmp_path / "budget.md").read_text()
    assert "### tiny" in text and "| fixed:4@draft |" in text
    assert (tmp_path / "budget.png").stat().st_size > 0
