"""eval/bench_gpu.py's testbed and its run, at toy widths on the CPU: the built models' outputs are
the known continuation, the draft's acceptance is the one it was built with, and a run writes
every cell with identity, forward costs and the Leviathan bound, and resumes."""
import json
import sys
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec.testing import circle_continuation, circle_model, prompts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))
import bench_gpu  # noqa: E402


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 4)])
def test_circle_model_continues_last_plus_one_in_a_padded_batch(dtype, window):
    model = circle_model("toy", vocab=1024, dtype=dtype, sliding_window=window)
    ids, mask = prompts(4, seed=1, min_len=3, max_len=12, vocab=1024)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out[:, ids.shape[1]:], circle_continuation(ids, 12, 1024))
    assert sum(p.count_nonzero() for p in model.parameters()) > 0.5 * sum(p.numel() for p in model.parameters())


def test_circle_draft_agrees_with_the_target_on_the_built_share_of_tokens():
    vocab, alpha = 4096, 0.8
    draft = circle_model("toy", vocab=vocab, alpha=alpha, seed=0, dtype=torch.float32)
    tokens = torch.arange(vocab)[:, None]                              # every token as a one-token prompt
    agree = (draft(input_ids=tokens).logits[:, -1].argmax(-1) == (tokens[:, 0] + 1) % vocab).float().mean()
    assert abs(float(agree) - alpha) < 0.03
    # speculative decoding with it is exact and accepts about alpha per token
    target = circle_model("toy", vocab=vocab, dtype=torch.float32)
    ids = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    out = target.generate(input_ids=ids, max_new_tokens=200, do_sample=False, custom_generate=hf_specdec.generate,
                          assistant_models=[draft], spec_policy="fixed:4", return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, 16:], circle_continuation(ids, 200, vocab))
    steps = out.spec_stats.steps
    accepted = sum(sum(s.accepted) for s in steps)
    rejected = sum(a < p for s in steps for a, p in zip(s.accepted, s.proposed))
    assert abs(accepted / (accepted + rejected) - alpha) < 0.1


def test_leviathan_bound():
    assert bench_gpu.leviathan_bound(1.0, 4, 0.0, 1.0) == 5.0        # free perfect drafts: k + 1 tokens a step
    assert bench_gpu.leviathan_bound(0.8, 3, 0.5, 1.2) == pytest.approx((1 - 0.8 ** 4) / (0.2 * 2.7))
    assert bench_gpu.leviathan_bound(0.99999, 4, 0.1, 1.1) == pytest.approx(5 / 1.5, rel=1e-3)


def test_tiny_cpu_run_writes_every_cell_and_resumes(tmp_path, monkeypatch):
    argv = ["--device", "cpu", "--pairs", "toy/toy", "--vocab", "1024", "--alphas", "0.9", "--batch-sizes", "1,3",
            "--methods", "plain,hf-assisted:3@draft,fixed:3@draft,auto@draft", "--k", "3", "--max-new-tokens", "16",
            "--rounds", "1", "--forward-reps", "1", "--dtype", "float32", "--out", str(tmp_path / "tiny")]
    bench_gpu.main(argv)
    result = json.loads((tmp_path / "tiny.json").read_text())
    assert {"commit", "versions", "machine"} <= set(result["stamp"])
    cells = {c["batch"]: c for c in result["cells"]}
    assert set(cells) == {1, 3} and "hf-assisted:3@draft" not in cells[3]["methods"]
    assert set(cells[1]["methods"]) == {"plain", "hf-assisted:3@draft", "fixed:3@draft", "auto@draft"}
    for cell in cells.values():
        costs = cell["eager"]
        assert all(c > 0 for c in costs["costs_ms"].values()) and costs["bound"] > 0 and 0 < cell["alpha"] <= 1
        assert "static" not in cell                              # compiled costs: where Transformers compiles
        for name, row in cell["methods"].items():
            assert row["identical_rows"] == row["rows"] == cell["batch"], name
            assert (row["x_bound"] is None) == (name == "plain")
        assert cell["methods"]["fixed:3@draft"]["mat"] > 1
    assert (tmp_path / "tiny.md").read_text().startswith("_commit ")
    assert (tmp_path / "tiny.png").stat().st_size > 0
    monkeypatch.setattr(bench_gpu, "run_cell", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-ran")))
    bench_gpu.main(argv)                                               # resumed: nothing left to run


def test_bad_arguments_are_refused_before_any_model_is_built(capsys):
    for bad in (["--pairs", "7b"], ["--alphas", "1.5"], ["--methods", "fixed:4@draft"], ["--methods", "nope"]):
        with pytest.raises(SystemExit):
            bench_gpu.main(bad + ["--out", "/nonexistent/x"])


def test_compiled_forward_costs_are_measured_on_the_static_path():
    """On CUDA the bench times forwards as the static path runs them: compiled at a tier shape
    (here dynamo's eager backend on the CPU), the same slots rewritten each repetition."""
    from transformers import CompileConfig
    from hf_specdec import compiled
    model = circle_model("toy", vocab=1024, dtype=torch.float32)
    config = CompileConfig(fullgraph=True, backend="eager")
    ids = torch.randint(1, 1000, (2, 12))
    assert bench_gpu.forward_ms(model, ids, 5, reps=2, compile_config=config) > 0
    assert [key[:2] for key in compiled.compiled_forwards(model, config).calls] == [(2, 5)]
