"""The real-pair benchmark scripts' inputs: Spec-Bench questions by path (clear errors before any
model loads), and the hierarchy / serving / drafter-selection scripts end to end on small models."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))     # the scripts import their eval/ neighbours by name
import bench_hierarchy  # noqa: E402
import drafter_selection  # noqa: E402
import spec_bench  # noqa: E402


@pytest.fixture()
def questions(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [f"{cat} question {i}", "second turn"]}
            for i, cat in enumerate(["writing", "writing", "rag", "writing", "rag", "coding"])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_spec_bench_questions_by_category_first_turn_only(questions):
    every = spec_bench.load_questions(questions)
    assert [q["domain"] for q in every] == ["writing"] * 3 + ["rag"] * 2 + ["coding"]
    assert every[0] == {"id": 0, "domain": "writing", "text": "writing question 0", "style": "chat"}
    assert [q["id"] for q in spec_bench.load_questions(questions, per_category=1)] == [0, 2, 5]
    with pytest.raises(ValueError, match="per_category"):
        spec_bench.load_questions(questions, per_category=0)


def test_missing_question_file_names_the_argument_and_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="--questions.*Spec-Bench"):
        spec_bench.load_questions(tmp_path / "nope.jsonl")
    with pytest.raises(SystemExit):      # argparse: --env qwen-coder without --questions
        drafter_selection.main(["--env", "qwen-coder"])
    with pytest.raises(FileNotFoundError, match="--questions"):   # checked before loading any model
        drafter_selection.main(["--env", "qwen-coder", "--questions", str(tmp_path / "nope.jsonl")])
    with pytest.raises(SystemExit):
        bench_hierarchy.main(["--envs", "qwen-rag"])


def test_hierarchy_script_on_tiny_models_writes_stamped_results(tmp_path):
    out = tmp_path / "hier"
    bench_hierarchy.main(["--envs", "tiny", "--batch-sizes", "2", "--max-new-tokens", "8", "--repeats", "1",
                          "--two-model-k", "3", "--hierarchy", "2x2", "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    assert {"commit", "versions", "machine"} <= set(result["stamp"])
    (cell,) = [c for c in result["cells"] if (c["env"], c["batch"]) == ("tiny", 2)]
    rows = cell["methods"]
    assert set(rows) == {"plain", "draft->target k=3", "inter->target k=3", "hierarchy kd=2 ki=2"}
    assert all(r["identity"] == {"identical": 2, "near_tie": 0, "other": 0} for r in rows.values())
    assert out.with_suffix(".png").stat().st_size > 0


def test_selection_summary_compares_hedgespec_only_with_the_baselines_that_ran():
    methods = drafter_selection.methods_for({2: ["a", "b"]}, main=2, ablations=False)
    methods = [m for m in methods if m.name != "exp3"]          # as with --methods leaving it out
    prompts = [{"id": 0, "domain": "code", "text": "x", "style": "plain"}]
    runs = {m.name: [{"tokens": 8, "seconds": 1.0, "target_forwards": f}]
            for m, f in zip(methods, [8, 4, 2, 2, 4])}
    targets = drafter_selection.summarize(runs, prompts, methods)["targets"]
    assert targets == {"code: hedgespec MAT / best single (single:b)": 1.0,
                       "mixed: hedgespec MAT / best single (single:b)": 1.0,
                       "mixed: hedgespec MAT / ucb": 2.0}
