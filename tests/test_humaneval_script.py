"""eval/humaneval.py end to end on a tiny random model: methods side by side, resume, bad input."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from eval import humaneval  # noqa: E402

TINY = ["--target", "tiny-random", "--limit", "2", "--n", "2", "--k", "1,2", "--max-new-tokens", "12",
        "--batch-size", "2", "--timeout", "3"]


def run(tmp_path, *extra):
    return humaneval.main([*TINY, "--out", str(tmp_path), *extra])


def test_end_to_end_and_resume(tmp_path):
    summary = run(tmp_path, "--methods", "plain,fixed@pld,fixed@int8")
    assert set(summary["methods"]) == {"plain", "fixed@pld", "fixed@int8"}
    for name, row in summary["methods"].items():
        assert row["samples"] == 4 and row["tokens_per_s"] > 0 and 0 <= row["pass@1"] <= row["pass@2"] <= 1
    assert summary["methods"]["fixed@int8"]["mean_accepted_tokens"] > 1
    assert "pass@1_diff_ci95" in summary["methods"]["fixed@pld"]
    for name in ("samples.jsonl", "summary.json", "summary.md", "summary.png"):
        assert (tmp_path / name).stat().st_size > 0
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 12

    # interrupted run: only the first 5 samples made it, the 6th line was cut mid-write
    (tmp_path / "samples.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    resumed = run(tmp_path, "--methods", "plain,fixed@pld,fixed@int8")
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()
               if line.startswith("{") and line.endswith("}")]
    assert len({(r["method"], r["task_id"], r["sample"]) for r in records}) == 12
    for name in summary["methods"]:
        for key in ("pass@1", "pass@2", "samples"):
            assert resumed["methods"][name][key] == summary["methods"][name][key]
    completions = lambda recs: sorted((r["method"], r["task_id"], r["sample"], r["completion"]) for r in recs)  # noqa
    assert completions(records) == completions(json.loads(line) for line in lines)  # seeded: same samples


def test_greedy_counts_identical_completions(tmp_path):
    summary = humaneval.main(["--target", "tiny-random", "--limit", "2", "--n", "1", "--k", "1",
                              "--temperature", "0", "--max-new-tokens", "12", "--out", str(tmp_path),
                              "--methods", "plain,fixed:3@int8"])
    assert summary["methods"]["fixed:3@int8"]["identity"]["identical"] == 2


def test_draft_by_embedded_name(tmp_path):
    """--draft takes hf_specdec.embedded names (here SmolLM2, which shares tiny-random's tokenizer)."""
    summary = humaneval.main(["--target", "tiny-random", "--limit", "1", "--n", "1", "--k", "1",
                              "--temperature", "0", "--max-new-tokens", "8", "--out", str(tmp_path),
                              "--methods", "plain,fixed:2@draft", "--draft", "smollm2-135m-instruct"])
    assert summary["methods"]["fixed:2@draft"]["identity"]["identical"] == 1


@pytest.mark.parametrize("argv,message", [
    (["--methods", "plain,spec-turbo"], "unknown method 'spec-turbo'"),
    (["--methods", "plain", "--k", "1,5"], "--k must lie in 1..n=2"),
    (["--methods", "plain", "--data", "/nonexistent/HumanEval.jsonl.gz"], "nonexistent"),
    (["--methods", "fixed@draft"], "needs --draft"),
])
def test_bad_input_fails_before_generation(tmp_path, capsys, argv, message):
    with pytest.raises((SystemExit, FileNotFoundError)) as info:
        humaneval.main([*TINY, "--out", str(tmp_path), *argv])
    text = capsys.readouterr().err + str(info.value)
    assert message in text
    assert not (tmp_path / "samples.jsonl").exists()
