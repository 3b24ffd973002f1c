"""eval/cuda_check.py end to end on the CPU (no sync counts there): identity and speed rows, stamped."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))     # cuda_check imports its eval/ neighbours by name
import cuda_check  # noqa: E402


def test_tiny_cpu_run_writes_identity_and_speed(tmp_path):
    cuda_check.main(["--device", "cpu", "--hidden", "64", "--layers", "3", "--vocab", "512", "--max-new-tokens", "8",
                     "--batch-sizes", "1,3", "--repeats", "1", "--methods", "plain,fixed:4@draft,fixed:2@hier",
                     "--out", str(tmp_path / "tiny")])
    result = json.loads((tmp_path / "tiny.json").read_text())
    assert {"commit", "versions", "machine"} <= set(result["stamp"])
    assert {(r["dtype"], r["batch"], r["method"]) for r in result["identity"]} == {
        (d, b, m) for d in ("float32", "bfloat16") for b in (1, 3) for m in ("fixed:4@draft", "fixed:2@hier")}
    for row in result["identity"]:
        assert row["other"] == 0 and row["identical"] + row["near_tie"] == row["batch"]
    assert not result["syncs"]                                   # counted on a CUDA device only
    assert {(r["batch"], r["method"]) for r in result["speed"]} == {
        (b, m) for b in (1, 3) for m in ("plain", "fixed:4@draft", "fixed:2@hier")}
    assert all(r["tokens_per_s"] > 0 for r in result["speed"])
    assert (tmp_path / "tiny.md").read_text().startswith("_commit ")
    assert (tmp_path / "tiny.png").stat().st_size > 0
