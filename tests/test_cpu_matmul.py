"""eval/cpu_matmul.py: the cost of m rows against one, written as stamped results."""
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))     # the script imports its eval/ neighbours by name
import cpu_matmul  # noqa: E402


def test_writes_every_kernel_and_row_count(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "ROWS", (1, 4))
    monkeypatch.setattr(cpu_matmul, "COPIES", 2)
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    cpu_matmul.main(["--out", str(tmp_path / "m"), "--rounds", "1", "--shape", "64,96", "--threads", "1"])
    assert (torch.get_num_threads(), torch.is_grad_enabled()) == (threads, grad)     # the caller's, as they were
    result = json.loads((tmp_path / "m.json").read_text())
    rows = result["rows"]
    kernels = [k for k in ["float32", "float32, oneDNN", "float32, oneDNN packed", "bfloat16", "bfloat16, oneDNN packed",
                           "bf16 weights, float32 FMAs (bf16w)",
                           "int8 weights, bf16 activations (torch _weight_int8pack_mm)", "int8 dynamic (draft)",
                           "int4 weights, bf16 activations (int4)"]
               if k not in result["skipped"]]
    assert kernels[:3] == ["float32", "float32, oneDNN", "float32, oneDNN packed"]
    assert [(r["kernel"], r["rows"]) for r in rows] == [(k, m) for k in kernels for m in (1, 4)]
    assert all(r["ms"] > 0 for r in rows) and rows[0]["x_one_row"] == 1.0
    assert "cpu_matmul" in json.loads((tmp_path / "m.json").read_text())["stamp"]["machine"]
    markdown = (tmp_path / "m.md").read_text()
    assert (tmp_path / "m.png").stat().st_size > 0 and "| float32 | 4 |" in markdown
    assert "linear([m, 64] x [96, 64])" in markdown and "1 torch threads" in markdown
    assert result["stamp"]["machine"]["torch_threads"] == 1


def test_a_kernel_that_cannot_run_here_is_named_with_its_reason_and_the_rest_timed(tmp_path, monkeypatch):
    from hf_specdec import kernels
    monkeypatch.setattr(cpu_matmul, "ROWS", (1, 4))
    monkeypatch.setattr(cpu_matmul, "COPIES", 2)
    monkeypatch.setattr(cpu_matmul, "unavailable", lambda k: "RuntimeError: no bf16 path" if k == "bf16-packed"
                        else kernels.unavailable(k))
    cpu_matmul.main(["--out", str(tmp_path / "m"), "--rounds", "1", "--shape", "64,96"])
    result = json.loads((tmp_path / "m.json").read_text())
    own = {name: kernels.unavailable(k) for name, k in cpu_matmul.PROBED.items()      # this machine's refusals
           if k != "bf16-packed" and kernels.unavailable(k) is not None}
    assert result["skipped"] == {"bfloat16, oneDNN packed": "RuntimeError: no bf16 path", **own}
    assert "bfloat16, oneDNN packed" not in {r["kernel"] for r in result["rows"]}
    assert "Not run on this CPU: bfloat16, oneDNN packed (RuntimeError: no bf16 path)" in (tmp_path / "m.md").read_text()
