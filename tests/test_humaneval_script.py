"""eval/humaneval.py end to end on a tiny random model: methods side by side, resume, bad input."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from eval import humaneval, methods  # noqa: E402

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


def test_target_copy_as_draft_with_onednn_layers(tmp_path):
    """--draft int8: the target's int8 copy drafts, the hierarchy's middle included; --onednn swaps
    the float32 target's linear layers after the copies are made, and outputs stay plain's."""
    summary = humaneval.main(["--target", "tiny-random", "--limit", "1", "--n", "1", "--k", "1",
                              "--temperature", "0", "--max-new-tokens", "10", "--out", str(tmp_path),
                              "--methods", "plain,fixed:3@draft,hedgespec:2@pool,fixed:4@hier", "--draft", "int8",
                              "--onednn"])
    for name in ("fixed:3@draft", "hedgespec:2@pool", "fixed:4@hier"):
        assert summary["methods"][name]["identity"]["other"] == 0, name
        assert summary["methods"][name]["mean_accepted_tokens"] > 1, name   # an int8 copy of the target agrees often
    assert "draft: the target's int8 copy" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--methods", "plain", "--onednn", "--dtype", "bfloat16"], "--onednn swaps float32 linear layers"),
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


EVERY_METHOD = ("plain,fixed:2@int8,hf-heuristic@int8,confidence@int8,nightjar:3@int8,adaspec:3@int8,dsd:3@pld,"
                "hedgespec:2@pool,ucb:2@pool,exp3:2@pool,fixed:4@hier")


def test_every_method_by_name_is_greedy_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "cache"))
    summary = humaneval.main(["--target", "tiny-random", "--limit", "1", "--n", "1", "--k", "1", "--temperature", "0",
                              "--max-new-tokens", "10", "--out", str(tmp_path), "--methods", EVERY_METHOD])
    assert list(summary["methods"]) == EVERY_METHOD.split(",")
    for name, row in summary["methods"].items():
        if name != "plain":
            assert row["identity"] == {"identical": 1, "near_tie": 0, "other": 0}, name
            assert row["mean_accepted_tokens"] is not None, name
    assert len(list((tmp_path / "cache" / "profiles").glob("*.json"))) == 2   # adaspec@int8, dsd@pld: measured once each


@pytest.mark.parametrize("text,message", [
    ("plain,fixed@nowhere", "drafter one of draft, pld"),
    ("turbo@draft", "policy one of hf-assisted, auto, fixed, measured"),
    ("fixed:x@pld", "':k' takes an integer >= 1"),
    ("confidence:3@pld", "':k' takes an integer >= 1"),
    ("hedgespec@pld", "choose among the drafters of @pool"),
    ("nightjar@pool", "choose among the drafters of @pool"),
    ("plain,plain", "listed twice"),
    (" , ", "no method given"),
])
def test_method_names_are_checked(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        methods.parse_methods(text)


def test_method_names_parse():
    parsed = methods.parse_methods("plain, fixed:5@draft,nightjar@draft,hedgespec:3@pool")
    assert [(m.policy, m.drafter, m.k) for m in parsed] == [
        (None, None, None), ("fixed", "draft", 5), ("nightjar", "draft", None), ("hedgespec", "pool", 3)]
    assert methods.parse_pool("draft, pld") == ("draft", "pld")
    for bad in ("pld", "pld,pld", "pld,hier"):
        with pytest.raises(ValueError, match="--pool"):
            methods.parse_pool(bad)


def test_kill_9_loses_no_finished_sample(tmp_path):
    """A run killed with SIGKILL mid-write keeps every finished sample; the rerun completes the rest
    with the same seeded samples."""
    argv = [*TINY, "--limit", "6", "--out", str(tmp_path), "--methods", "plain,fixed@pld"]
    samples = tmp_path / "samples.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "eval" / "humaneval.py"), *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and \
            (not samples.exists() or samples.read_bytes().count(b"\n") < 3):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = lambda: [json.loads(x) for x in samples.read_text().splitlines()  # noqa: E731
                        if x.startswith("{") and x.endswith("}")]
    before = complete()
    assert 3 <= len(before) < 24, "the kill should land mid-run"
    humaneval.main(argv)
    after = {(r["method"], r["task_id"], r["sample"]): r for r in complete()}
    assert len(after) == 24 and len(complete()) == 24     # nothing lost, nothing twice
    for r in before:
        assert after[(r["method"], r["task_id"], r["sample"])]["completion"] == r["completion"]


def test_detectable_drop_is_flagged_with_80_percent_power():
    """Paired per-problem pass rates whose true difference is the reported detectable drop: the
    bootstrap interval lies below 0 (DROP) in about 80% of runs; with no true difference, rarely."""
    import random
    rng, problems = random.Random(0), 40
    noise = lambda: [rng.gauss(0, 0.3) for _ in range(problems)]  # noqa: E731
    lo, hi = humaneval.bootstrap_diff(noise(), [0.0] * problems, resamples=400)
    drop = humaneval.detectable_drop(lo, hi)
    flagged = {0.0: 0, drop: 0}
    for true_drop in flagged:
        for trial in range(150):
            lo, hi = humaneval.bootstrap_diff([x - true_drop for x in noise()], [0.0] * problems,
                                              resamples=400, seed=trial)
            flagged[true_drop] += hi < 0
    assert flagged[0.0] / 150 < 0.07
    assert 0.65 < flagged[drop] / 150 < 0.92
