"""eval/harness.py: the Transformers baselines run Transformers' own code, never our loop; the
rounds are interleaved; results resume."""
import sys
from pathlib import Path

import pytest
import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator, PromptLookupCandidateGenerator

import hf_specdec
from hf_specdec.loop import DecodingLoop
from hf_specdec.testing import exact_cheap_pair

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval"))
import harness  # noqa: E402
from methods import MethodFactory, parse_method  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    return exact_cheap_pair(layers=3, hidden=64, vocab=256)


def _count(monkeypatch, cls, name):
    calls, original = [], getattr(cls, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("name,transformers_class", [("hf-assisted:3@draft", AssistedCandidateGenerator),
                                                     ("hf-assisted:3@pld", PromptLookupCandidateGenerator)])
def test_transformers_baseline_runs_transformers_code_and_never_our_loop(monkeypatch, pair, enabled, name,
                                                                         transformers_class):
    """The baseline a comparison calls "Transformers' assisted generation" must be Transformers'
    candidate generator, not ours reached through enable()'s mapping of assistant_model=."""
    target, draft = pair
    if enabled:
        hf_specdec.enable(target)                 # enable() maps assistant_model= onto our loop
    try:
        ours = _count(monkeypatch, DecodingLoop, "step")
        theirs = _count(monkeypatch, transformers_class, "get_candidates")
        factory = MethodFactory(target, draft_model=draft)
        ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
        out = harness.generate(target, factory, parse_method(name), input_ids=ids, max_new_tokens=8,
                               do_sample=False)
        assert len(ours) == 0 and len(theirs) > 0
        plain = harness.generate(target, factory, parse_method("plain"), input_ids=ids, max_new_tokens=8,
                                 do_sample=False)
        assert torch.equal(out, plain)
        assert len(ours) == 0
        # and ours, by the same harness, is ours
        harness.generate(target, factory, parse_method("fixed:3@draft"), input_ids=ids, max_new_tokens=8,
                         do_sample=False)
        assert len(ours) > 0
    finally:
        hf_specdec.disable(target)


def test_method_names_for_transformers_paths():
    m = parse_method("hf-assisted:5@draft/static")
    assert m.static and m.k == 5 and not m.ours
    assert not parse_method("plain/static").ours and parse_method("auto@draft").ours
    assert parse_method("fixed:4@draft/static").ours and parse_method("fixed:4@draft/static").static
    with pytest.raises(ValueError, match="@draft, @draft-vocab or @pld"):
        parse_method("hf-assisted@int8")
    assert MethodFactory(None).generate_kwargs(parse_method("plain/static")) == {"cache_implementation": "static"}


def test_interleaved_rotates_the_order_each_round():
    methods = [parse_method(n) for n in ("plain", "fixed:2@draft", "auto@draft")]
    order = []
    timing = harness.interleaved(methods, lambda m: order.append(m.name) or m.name, rounds=3, warmup=True)
    assert order[:3] == ["plain", "fixed:2@draft", "auto@draft"]            # the warm-up round
    assert order[3:6] == ["fixed:2@draft", "auto@draft", "plain"]
    assert order[6:9] == ["auto@draft", "plain", "fixed:2@draft"]
    rounds_timed = {name: len(times) for name, times in timing.seconds.items()}     # how many, not how long
    assert rounds_timed == dict.fromkeys(rounds_timed, 3) and timing.outputs["plain"] == "plain"
    speed = harness.speed({"plain": [2.0, 2.0, 4.0], "x": [1.0, 2.0, 1.0]}, "plain")
    assert speed["x"]["x"] == 2.0 and speed["x"]["x_min"] == 1.0 and speed["x"]["x_max"] == 4.0


def test_warm_up_rounds_repeat_until_nothing_compiles():
    """With `settled`, untimed rounds go on until one leaves the count unmoved (here a method
    compiles in its first two calls: 3 untimed rounds), then the timed rounds run."""
    methods = [parse_method(n) for n in ("plain", "fixed:2@draft")]
    graphs, calls = [0], []

    def run(method):
        calls.append(method.name)
        if method.name == "fixed:2@draft" and calls.count(method.name) <= 2:
            graphs[0] += 1                                     # this call compiled
    timing = harness.interleaved(methods, run, rounds=2, settled=lambda: graphs[0])
    assert len(calls) == 2 * (3 + 2) and {len(t) for t in timing.seconds.values()} == {2}
    assert set(timing.warmup_seconds) == {"plain", "fixed:2@draft"}
    harness.interleaved(methods, run, rounds=1, settled=lambda: len(calls))        # never settles: bounded
    assert len(calls) == 10 + 2 * (harness.SETTLE_ROUNDS + 1)


def test_results_resume_only_with_the_same_arguments(tmp_path):
    results = harness.Results(tmp_path / "r", {"a": 1}, lambda p: f"{len(p['cells'])} cells\n")
    results.add({"batch": 1, "x": 1.0})
    assert (tmp_path / "r.md").read_text().endswith("1 cells\n") and (tmp_path / "r.json").exists()
    again = harness.Results(tmp_path / "r", {"a": 1}, lambda p: "")
    assert again.done({"batch": 1}) and not again.done({"batch": 4})
    assert not harness.Results(tmp_path / "r", {"a": 2}, lambda p: "").done({"batch": 1})


def test_a_failing_method_is_recorded_and_dropped_only_when_asked():
    methods = [parse_method(n) for n in ("plain", "fixed:2@draft")]

    def run(method):
        if method.name == "fixed:2@draft":
            raise RuntimeError("boom")
        return 1
    timing = harness.interleaved(methods, run, rounds=2, keep_going=True)
    rounds_timed = len(timing.seconds["plain"])          # (a count of rounds, not a time)
    assert timing.errors == {"fixed:2@draft": "RuntimeError: boom"} and rounds_timed == 2
    assert "fixed:2@draft" not in timing.seconds
    with pytest.raises(RuntimeError):
        harness.interleaved(methods, run, rounds=1)


def test_ours_does_the_same_model_work_as_transformers_assisted_generation(pair):
    """Batch 1, the same exact draft and k: both loops run the same forwards, matrix products and
    attention calls (what costs time); ours adds at most a few percent of small tensor ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))
    target, draft = pair
    factory = MethodFactory(target, draft_model=draft)
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    counts = {}
    for name in ("hf-assisted:4@draft", "fixed:4@draft"):
        harness.generate(target, factory, parse_method(name), input_ids=ids, max_new_tokens=4, do_sample=False)
        with Ops() as ops:
            harness.generate(target, factory, parse_method(name), input_ids=ids, max_new_tokens=40, do_sample=False)
        counts[name] = ops.counts
    theirs, ours = counts["hf-assisted:4@draft"], counts["fixed:4@draft"]
    heavy = [n for n in theirs if n in ("mm", "addmm", "bmm") or "attention" in n]
    assert heavy and all(ours.get(n, 0) == theirs[n] for n in heavy), {n: (theirs[n], ours.get(n)) for n in heavy}
    assert sum(ours.values()) <= 1.1 * sum(theirs.values()), (sum(ours.values()), sum(theirs.values()))
