"""The real-pair benchmark scripts' inputs: Spec-Bench questions by path (clear errors before any
model loads), and the hierarchy / serving / drafter-selection scripts end to end on small models."""
import json
import sys
from pathlib import Path

import pytest
import torch

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
    rows = result["results"]["tiny"]["2"]["methods"]
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


def test_before_after_imports_the_old_package_beside_this_one():
    import bench_before_after
    import hf_specdec
    from hf_specdec.testing import layer_skip_pair
    before = bench_before_after.import_before("HEAD")
    assert before.__name__ == "hf_specdec_before" and before.FixedLength is not hf_specdec.FixedLength
    # every module of the old package is its own copy: none resolves to this checkout's files
    old = {name: m.__file__ for name, m in sys.modules.items() if name.startswith("hf_specdec_before")}
    assert len(old) > 10 and not any(f.startswith(str(ROOT)) for f in old.values())
    target, draft = layer_skip_pair(0.0)
    ids = torch.tensor([[1, 5, 9, 2]])
    plain = target.generate(ids, max_new_tokens=8, do_sample=False)
    loop = sys.modules["hf_specdec_before.generate"].generate
    out = target.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=loop,
                          assistant_models=[before.ModelDrafter(draft)], spec_policy=before.FixedLength(3))
    assert torch.equal(out, plain)


def test_before_after_profile_is_read_from_a_profile_or_a_bench_lengths_result(tmp_path):
    import bench_before_after
    from hf_specdec.costmodel import CostProfile, LatencyModel, SwitchCostTable
    from dataclasses import asdict
    prof = asdict(CostProfile(LatencyModel(1e-6, 1e-3, 1e-2), LatencyModel(1e-7, 1e-4, 1e-3),
                              SwitchCostTable([1], [1], [[0.1]])))
    (tmp_path / "p.json").write_text(json.dumps(prof))
    (tmp_path / "r.json").write_text(json.dumps({"results": {"env": {"profile": prof, "batches": {}}}}))
    (tmp_path / "bad.json").write_text(json.dumps({"target": {}}))
    assert bench_before_after.read_profile(tmp_path / "p.json") == bench_before_after.read_profile(tmp_path / "r.json")
    for bad in ("bad.json", "missing.json"):
        with pytest.raises(ValueError, match="--profile"):
            bench_before_after.read_profile(tmp_path / bad)
    with pytest.raises(ValueError, match="--before"):      # before any model loads
        bench_before_after.main(["--before", "no-such-commit"])
