"""Speculative generate() on a target sharded by Transformers' tensor parallelism: 2 processes
under torchrun with gloo (tests/tp_worker.py runs the cases; these tests read what each rank saw)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_specdec.testing import build, noisy_copy
from test_sampling import N, SAMPLING, TV_BOUND, VOCAB, exact_distribution

WORKER = Path(__file__).with_name("tp_worker.py")
GREEDY_CASES = ["fixed:3", "auto", "adaspec", "hedgespec", "lookup", "sharded draft", "sharded draft, auto"]
SKEWED = ["skewed auto", "skewed nightjar", "skewed adaspec", "skewed hedgespec"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """target; near: a close copy (most drafts accepted); other: an unrelated 1-layer draft;
    wide_vocab: a draft with another vocabulary; small / small_draft: the sampling test's pair."""
    root = tmp_path_factory.mktemp("tp_models")
    target = build("llama", layers=2, seed=0, hidden=64)
    target.save_pretrained(root / "target")
    noisy_copy(target, 0.05).save_pretrained(root / "near")
    build("llama", layers=1, seed=5, hidden=64).save_pretrained(root / "other")
    build("llama", layers=1, seed=5, hidden=64, vocab=128).save_pretrained(root / "wide_vocab")
    small = build("llama", layers=2, seed=0, vocab=VOCAB, hidden=32, init=0.6)
    small.save_pretrained(root / "small")
    noisy_copy(small, 0.3).save_pretrained(root / "small_draft")
    return root


def run_job(models, out: Path, job: str, timeout: int) -> tuple[int | None, list[dict]]:
    """Run the worker on 2 ranks; (exit code, None if killed at `timeout`; each rank's results)."""
    out.mkdir()
    env = dict(os.environ, HF_SPECDEC_CACHE=str(out / "cache"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
               "--models", str(models), "--out", str(out), "--job", job, "--samples", str(N)]
    try:
        rc = subprocess.run(command, env=env, timeout=timeout, capture_output=True).returncode
    except subprocess.TimeoutExpired:
        rc = None
    ranks = [json.loads(p.read_text()) if p.exists() else {} for p in (out / "rank0.json", out / "rank1.json")]
    return rc, ranks


@pytest.fixture(scope="module")
def agreed(models, tmp_path_factory):
    rc, ranks = run_job(models, tmp_path_factory.mktemp("tp") / "agree", "agree", timeout=240)
    assert rc == 0, f"the tensor-parallel job failed (exit code {rc}); finished cases: {sorted(ranks[0])}"
    return ranks


def drafted(case: dict) -> bool:
    return any(k > 0 for k, _ in case["steps"])


@pytest.mark.parametrize("name", GREEDY_CASES)
def test_greedy_matches_plain_tensor_parallel_generate_on_every_rank(agreed, name):
    """Padded batch of 3; the reference is Transformers' own generate() on the sharded target."""
    for rank, results in enumerate(agreed):
        assert "error" not in results[name], results[name]["error"]
        assert results[name]["tokens"] == results["plain"]["tokens"], f"rank {rank}: {name} differs from plain"
    assert agreed[0][name]["steps"] == agreed[1][name]["steps"]
    assert drafted(agreed[0][name]), f"{name} never drafted: the test would not exercise speculation"


@pytest.mark.parametrize("name", ["sampled", "sampled, generator"])
def test_sampling_gives_every_rank_the_same_tokens(agreed, name):
    """The ranks seed torch (and their spec_generator) differently: rank 0's draws hold everywhere."""
    assert agreed[0][name]["tokens"] == agreed[1][name]["tokens"]
    assert agreed[0][name]["steps"] == agreed[1][name]["steps"] and drafted(agreed[0][name])


def test_sampling_distribution_holds_under_tensor_parallelism(agreed, models):
    """The first two new tokens of N seeded rows through the sharded target and a replicated draft
    at k=1 follow the target's exact distribution (the bound that catches broken samplers in
    test_sampling.py)."""
    new = torch.tensor(agreed[0]["distribution"]["tokens"])
    assert agreed[1]["distribution"]["tokens"] == new.tolist()
    counts = torch.zeros(VOCAB, VOCAB)
    counts.index_put_((new[:, 0], new[:, 1]), torch.ones(len(new)), accumulate=True)
    from transformers import AutoModelForCausalLM
    small = AutoModelForCausalLM.from_pretrained(models / "small", dtype=torch.float32).eval()
    exact = exact_distribution(small, torch.tensor([[3, 5, 4, 3]]), 2, SAMPLING)
    tv = 0.5 * (counts / len(new) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"


@pytest.mark.parametrize("name", SKEWED + ["skewed transformers loop"])
def test_decisions_agree_when_the_ranks_clocks_disagree(agreed, name):
    """Rank 1's clock runs 3x fast and its drafts sleep 20 ms a forward: policies that read times
    (the default, Nightjar exploring every bin, AdaSpec's profile, cost-aware HedgeSpec) still take
    rank 0's decisions on both ranks, and the outputs stay plain generate()'s."""
    plain = agreed[0]["plain"]["tokens"]
    for results in agreed:
        assert "error" not in results[name], results[name]["error"]
        assert results[name]["tokens"] == (plain[:1] if "transformers" in name else plain)
    assert agreed[0][name]["steps"] == agreed[1][name]["steps"]


def test_negative_control_without_agreement_ranks_diverge_or_fail(models, tmp_path):
    """The same skewed cases with every rank deciding on its own: some case must diverge, fail or
    hang (killed by the timeout), or the agreement test above could not fail."""
    rc, ranks = run_job(models, tmp_path / "unsynced", "unsynced", timeout=120)
    same = [name for name in SKEWED if name in ranks[0] and ranks[0][name] == ranks[1].get(name)
            and "error" not in ranks[0][name]]
    assert rc != 0 or same != SKEWED, "every rank decided alike without the agreement: the test shows nothing"


def test_criteria_that_read_more_than_tokens_are_rank_zeros(agreed):
    """A criterion that stops rank 1 at length 12 and rank 0 at 20: every rank stops at 20."""
    for results in agreed:
        assert {len(row) for row in results["criteria"]["tokens"]} == {20}


@pytest.mark.parametrize("name, words", [("bad: vocabulary", "vocabulary size"),
                                         ("bad: sharded logits", "output head is not gathered"),
                                         ("bad: offload", "draft_offload"),
                                         ("bad: inputs", "input_ids differ")])
def test_bad_setups_fail_clearly_on_every_rank(agreed, name, words):
    """The same ValueError on both ranks, and the job goes on (no rank left waiting)."""
    errors = [results[name].get("error", "") for results in agreed]
    assert errors[0] == errors[1] and errors[0].startswith("ValueError") and words in errors[0], errors
    assert "distribution" in agreed[0] and "distribution" in agreed[1]
