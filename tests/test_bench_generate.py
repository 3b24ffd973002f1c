"""eval/bench_generate.py end to end on the tiny exact pair: stamped JSON, markdown and plot, resumed."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))     # bench_generate imports its eval/ neighbours by name
import bench_generate  # noqa: E402


def test_chunks_take_prompts_batch_at_a_time():
    assert bench_generate.chunks(list(range(5)), 2) == [[0, 1], [2, 3]]
    assert bench_generate.chunks(list(range(3)), 4) == [[0, 1, 2]]


def test_tiny_run_writes_stamped_results_with_identity_verdicts_and_resumes(tmp_path, monkeypatch):
    argv = ["--envs", "tiny-exact", "--batch-sizes", "1,2", "--max-new-tokens", "8", "--out-dir", str(tmp_path),
            "--name", "tiny", "--methods", "plain,hf-assisted:4@draft,fixed:4@draft,auto@draft"]
    bench_generate.main(argv)
    result = json.loads((tmp_path / "tiny.json").read_text())
    assert {"commit", "versions", "machine"} <= set(result["stamp"])
    assert result["stamp"]["versions"]["transformers"]
    cells = {c["batch"]: c for c in result["cells"]}
    assert set(cells[1]["methods"]) == {"plain", "hf-assisted:4@draft", "fixed:4@draft", "auto@draft"}
    assert "hf-assisted:4@draft" not in cells[2]["methods"]     # Transformers refuses batch > 1
    for cell in cells.values():
        for name, row in cell["methods"].items():
            assert row["identity"] == {"identical": cell["batch"], "near_tie": 0, "other": 0}, name
            assert row["target_forwards"] > 0
    one = cells[1]["methods"]
    # the exact draft is always right: both speculative loops verify 4 + 1 tokens per target forward
    assert one["plain"]["target_forwards"] == 8
    assert one["hf-assisted:4@draft"]["target_forwards"] < 8 and one["fixed:4@draft"]["target_forwards"] < 8
    assert one["fixed:4@draft"]["vs_hf_assisted"] > 0 and one["plain"]["vs_hf_assisted"] is None
    assert (tmp_path / "tiny.md").read_text().startswith("_commit ")
    assert (tmp_path / "tiny.png").stat().st_size > 0

    # the same arguments again: every cell is there, nothing runs
    monkeypatch.setattr(bench_generate, "over_chunks", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    bench_generate.main(argv)
    assert json.loads((tmp_path / "tiny.json").read_text())["cells"] == result["cells"]


def test_plain_kernels_must_be_kernel_names(capsys):
    import pytest
    with pytest.raises(SystemExit):
        bench_generate.main(["--envs", "tiny-exact", "--plain-kernels", "fp8"])
    assert "--plain-kernels" in capsys.readouterr().err
