"""eval/bench_generate.py end to end on the tiny exact pair: stamped JSON, markdown and plot."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))     # bench_generate imports its eval/ neighbours by name
import bench_generate  # noqa: E402


def test_chunks_take_prompts_batch_at_a_time():
    assert bench_generate.chunks(list(range(5)), 2) == [[0, 1], [2, 3]]
    assert bench_generate.chunks(list(range(3)), 4) == [[0, 1, 2]]


def test_tiny_run_writes_stamped_results_with_identity_verdicts(tmp_path):
    bench_generate.main(["--envs", "tiny-exact", "--batch-sizes", "1,2", "--max-new-tokens", "8",
                         "--out-dir", str(tmp_path), "--name", "tiny"])
    result = json.loads((tmp_path / "tiny.json").read_text())
    assert {"commit", "versions", "machine"} <= set(result["stamp"])
    assert result["stamp"]["versions"]["transformers"]
    methods = {(r["batch"], r["method"]) for r in result["rows"]}
    assert (1, "hf-assisted/exact-1layer") in methods and (2, "hf_specdec/exact-1layer/nightjar") in methods
    assert (2, "hf-assisted/exact-1layer") not in methods   # Transformers refuses batch > 1
    for row in result["rows"]:
        assert row["identity"] == {"identical": row["batch"], "near_tie": 0, "other": 0}
    assert (tmp_path / "tiny.md").read_text().startswith("_commit ")
    assert (tmp_path / "tiny.png").stat().st_size > 0
