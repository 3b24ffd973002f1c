"""eval/bench_lengths.py: the confirming round's paired ratios, and a tiny run end to end."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))     # bench_lengths imports its eval/ neighbours by name
import bench_lengths  # noqa: E402


def test_paired_speed_is_the_median_of_per_round_ratios_with_an_interval_around_it():
    exact = bench_lengths.paired_speed([2.0] * 5, [1.0] * 5)
    assert exact == {"median": 2.0, "ci90": [2.0, 2.0]}
    # a slow spell hits both methods of a round alike: paired, it cancels
    spells = [1.0, 1.5, 0.8, 1.2, 1.0, 2.0, 0.9, 1.1]
    paired = bench_lengths.paired_speed([s * 1.1 for s in spells], spells)
    assert paired["median"] == 1.1 and paired["ci90"] == [1.1, 1.1]
    noisy = bench_lengths.paired_speed([1.0, 1.2, 0.9, 1.1, 1.05, 0.95], [1.0] * 6)
    lo, hi = noisy["ci90"]
    assert lo < noisy["median"] < hi and lo >= 0.9 and hi <= 1.2


def test_changing_run_budgets_spread_from_short_to_long():
    for spread in ("linear", "geometric"):
        budgets = bench_lengths.changing_budgets(64, 128, spread)
        assert budgets[0] == 4 and budgets[-1] == 128 and budgets == sorted(budgets)
    # geometric: most rows short (the batch halves within the first ~16 tokens of 128)
    assert bench_lengths.changing_budgets(64, 128, "geometric")[32] < 24 < bench_lengths.changing_budgets(64, 128, "linear")[32]
    bimodal = bench_lengths.changing_budgets(64, 128, "bimodal")
    assert sorted(set(bimodal)) == [32, 128] and bimodal.count(128) == 4


def test_confirming_round_times_plain_the_oracle_and_the_policies_again(tmp_path):
    """The confirming round times plain, the oracle and the policies again; on the changing run also
    every fixed k, with each policy's paired speed over each."""
    out = tmp_path / "bench"
    bench_lengths.main(["--envs", "tiny-useless", "--batch-sizes", "1", "--changing-rows", "3",
                        "--max-new-tokens", "6", "--repeats", "1", "--confirm-repeats", "2", "--learn-runs", "0",
                        "--methods", "fixed:1,fixed:2,nightjar", "--out", str(out)])
    batches = json.loads(out.with_suffix(".json").read_text())["results"]["tiny-useless"]["batches"]
    oracle, confirm = batches["1"]["oracle"], batches["1"]["confirm"]
    assert oracle in ("plain", "fixed:1", "fixed:2")
    assert set(confirm) == {"plain", oracle, "nightjar"}
    for row in confirm.values():
        assert len(row["seconds"]) == 2 and row["identity"] == {"identical": 1, "near_tie": 0, "other": 0}
        assert "x_fixed" not in row
        assert len(row["drafting_steps"]) == 2
    assert confirm["plain"]["drafting_steps"] == [0, 0]
    assert confirm[oracle]["x_oracle"] == {"median": 1.0, "ci90": [1.0, 1.0]}
    assert confirm["plain"]["x_plain"]["median"] == 1.0
    changing = batches["changing"]["confirm"]
    assert set(changing) == {"plain", "fixed:1", "fixed:2", "nightjar"}
    assert set(changing["nightjar"]["x_fixed"]) == {"fixed:1", "fixed:2"}
    text = out.with_suffix(".md").read_text()
    assert "confirming round" in text and "speed x each fixed k" in text
    assert out.with_suffix(".png").stat().st_size > 0


def test_resume_keeps_finished_batch_sizes(tmp_path):
    out = tmp_path / "bench"
    args = ["--envs", "tiny-useless", "--changing-rows", "0", "--max-new-tokens", "4", "--repeats", "1",
            "--confirm-repeats", "0", "--learn-runs", "0", "--methods", "fixed:1,nightjar", "--out", str(out)]
    bench_lengths.main([*args, "--batch-sizes", "1"])
    first = json.loads(out.with_suffix(".json").read_text())["results"]["tiny-useless"]
    bench_lengths.main([*args, "--batch-sizes", "1,2", "--resume"])
    resumed = json.loads(out.with_suffix(".json").read_text())["results"]["tiny-useless"]
    batches = resumed["batches"]
    assert set(batches) == {"1", "2"} and batches["1"] == first["batches"]["1"]     # B=1 kept as measured, B=2 run
    assert resumed["profile"] == first["profile"] and "switch" in first["profile"]  # measured once, reused
    stored = json.loads(out.with_suffix(".json").read_text())
    assert len(stored["runs"]) == 2 and stored["stamp"] == stored["runs"][0]     # the first start's stamp kept
    assert out.with_suffix(".md").read_text().startswith("_commit ") and "resumed at commits" in \
        out.with_suffix(".md").read_text()


def test_resume_refuses_a_run_from_another_machine(tmp_path, capsys):
    out = tmp_path / "bench"
    out.with_suffix(".json").write_text(json.dumps({"stamp": {"machine": {"cpu": "elsewhere", "cores": 2}},
                                                    "results": {}}))
    with pytest.raises(SystemExit):
        bench_lengths.main(["--envs", "tiny-useless", "--out", str(out), "--resume"])
    assert "another machine" in capsys.readouterr().err
