"""enable/disable, policy shortcuts, stats, and the shared verify() on hand-made inputs."""
import importlib
import time

import pytest
import torch

import hf_specdec
from hf_specdec.policies import UCBSpec, resolve_policy
from hf_specdec.verify import verify
from helpers import HostReads, assert_same
from hf_specdec import compiled
from hf_specdec.loop import DecodingLoop
from hf_specdec.testing import build, layer_skip_pair, prompts


def test_enable_disable_roundtrip():
    model = build("gpt2", 2, seed=0)
    ids, mask = prompts(2, seed=1)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)
    assert hf_specdec.enable(model) is model
    hf_specdec.enable(model)  # idempotent
    assert_same(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8), plain)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, assistant_models=[model],
                         spec_policy="fixed:3", return_dict_in_generate=True)
    assert_same(out.sequences, plain)
    assert isinstance(out.spec_stats, hf_specdec.SpecStats)
    assert out.spec_stats.acceptance_rate == 1.0
    assert hf_specdec.disable(model) is model
    assert "generate" not in model.__dict__
    assert_same(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8), plain)
    with pytest.raises(ValueError):  # transformers itself refuses the unknown kwarg again
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, assistant_models=[model])


def test_output_types_follow_generate():
    model = build("llama", 2, seed=0)
    ids, mask = prompts(2, seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, custom_generate=hf_specdec.generate,
              assistant_models=[hf_specdec.PromptLookupDrafter()])
    assert isinstance(model.generate(**kw), torch.Tensor)
    out = model.generate(return_dict_in_generate=True, **kw)
    from transformers.generation.utils import GenerateDecoderOnlyOutput
    assert isinstance(out, GenerateDecoderOnlyOutput)
    s = out.spec_stats
    assert s.target_forwards == len(s.steps) > 0
    assert s.tokens_generated == 12
    assert s.mean_accepted_tokens == pytest.approx(s.tokens_generated / sum(r.batch_size for r in s.steps))
    assert set(s.summary()) >= {"target_forwards", "tokens_generated", "mean_accepted_tokens", "acceptance_rate"}


def test_policy_shortcuts():
    for auto in (resolve_policy(None), resolve_policy("auto")):
        assert isinstance(auto.length, hf_specdec.MeasuredGoodput) and isinstance(auto.selector, hf_specdec.FixedDrafter)
    assert isinstance(resolve_policy(None, num_drafters=3).selector, hf_specdec.HedgeSpec)
    assert isinstance(resolve_policy(None, num_drafters=3, full_information=False).selector, hf_specdec.FixedDrafter)
    assert resolve_policy("fixed").length.k == 4
    named = {"nightjar:5": (hf_specdec.Nightjar, "max_len", 5), "measured:6": (hf_specdec.MeasuredGoodput, "max_len", 6), "adaspec:6": (hf_specdec.AdaSpec, "max_len", 6),
             "dsd": (hf_specdec.DSDGoodput, "max_len", 8), "hf-heuristic:3": (hf_specdec.HFHeuristic, "k", 3),
             "confidence": (hf_specdec.ConfidenceThreshold, "threshold", 0.4)}
    for name, (cls, attr, value) in named.items():
        length = resolve_policy(name).length
        assert isinstance(length, cls) and getattr(length, attr) == value, name
    assert isinstance(resolve_policy("ucb").selector, UCBSpec)
    for bad, message in (("turbo", "known: auto, fixed"), ("confidence:3", "takes no"), ("fixed:x", "integer")):
        with pytest.raises(ValueError, match=message):
            resolve_policy(bad)
    assert resolve_policy("fixed:7").length.k == 7
    assert resolve_policy(hf_specdec.FixedLength(2)).length.k == 2
    p = hf_specdec.SpecPolicy(selector=hf_specdec.FixedDrafter(1), length=hf_specdec.FixedLength(0))
    assert resolve_policy(p) is p


def test_zero_length_policy_is_plain_decoding():
    model = build("qwen2", 2, seed=0)
    ids, mask = prompts(3, seed=2)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, custom_generate=hf_specdec.generate,
                         assistant_models=[model], spec_policy="fixed:0", return_dict_in_generate=True)
    assert_same(out.sequences, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7))
    assert all(s.drafters == [-1] * s.batch_size and s.k == 0 for s in out.spec_stats.steps)


def scores_from(tokens, vocab=5):
    """Scores [1, len, vocab] whose argmax at position j is tokens[j]."""
    return torch.nn.functional.one_hot(torch.tensor([tokens]), vocab).float() * 10


def test_verify_greedy():
    drafts = torch.tensor([[1, 2, 3], [1, 4, 3]])
    scores = torch.cat([scores_from([1, 2, 3, 4]), scores_from([1, 2, 3, 0])])
    res = verify(drafts, torch.tensor([3, 3]), scores, None, do_sample=False)
    assert res.num_accepted.tolist() == [3, 1] and res.next_tokens.tolist() == [4, 2]
    res = verify(drafts, torch.tensor([2, 0]), scores, None, do_sample=False)
    assert res.num_accepted.tolist() == [2, 0] and res.next_tokens.tolist() == [3, 1]


def test_verify_sampling_edge_cases():
    gen = torch.Generator().manual_seed(0)
    target = torch.log(torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]]).clamp(min=1e-30))  # [1, 2, 3]
    for _ in range(50):
        # p(draft)=1: point-mass draft always accepted, bonus never token 1
        res = verify(torch.tensor([[1]]), torch.tensor([1]), target, None, True, gen)
        assert res.num_accepted.item() == 1 and res.next_tokens.item() in (0, 2)
        # p(draft)=0: always rejected, and the replacement is never the rejected token
        res = verify(torch.tensor([[0]]), torch.tensor([1]), target, None, True, gen)
        assert res.num_accepted.item() == 0 and res.next_tokens.item() == 1
        # q == p: everything accepted
        q = target[:, :1].softmax(-1)
        res = verify(torch.tensor([[1]]), torch.tensor([1]), target, q, True, gen)
        assert res.num_accepted.item() == 1


def test_public_surface_is_what_users_call():
    assert all(hasattr(hf_specdec, name) for name in hf_specdec.__all__)
    for internal in ("UCBSpec", "EXP3Spec", "VerifyResult", "LatencyModel", "SwitchCostTable", "StepRecord"):
        assert internal not in hf_specdec.__all__ and not hasattr(hf_specdec, internal), internal
    from hf_specdec.costmodel import LatencyModel  # noqa: F401  (still importable from their modules)
    from hf_specdec.policies import EXP3Spec, UCBSpec  # noqa: F401
    assert callable(verify)


@pytest.mark.parametrize("policy", ["fixed:3", "hf-heuristic:3", "confidence", hf_specdec.HedgeSpec(), "dsd",
                                    "adaspec", "nightjar", "auto", hf_specdec.HedgeSpec(cost_aware=True)])
def test_steps_are_timed_with_events_never_a_device_sync(monkeypatch, tmp_path, policy):
    """On a GPU a timed phase is two CUDA events, read after the step's own host reads of its
    results: never a device sync. Counted here on CPU with stand-in events, the clock set up as on
    a GPU."""
    marks, syncs = [], []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = time.perf_counter()
            marks.append(self)

        def query(self):
            return True

        def elapsed_time(self, end):
            return (end.at - self.at) * 1000.0
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: syncs.append(args))
    timing = importlib.import_module("hf_specdec.timing")
    monkeypatch.setattr(timing.PhaseClock, "__init__", lambda self, device: setattr(self, "events", True))
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    model = build("llama", 2, seed=0)
    ids, mask = prompts(2, seed=3)
    drafters = [hf_specdec.PromptLookupDrafter(), hf_specdec.self_draft(model, "bf16")]
    if not isinstance(policy, hf_specdec.HedgeSpec):
        drafters = drafters[1:]
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, custom_generate=hf_specdec.generate,
                         assistant_models=drafters, spec_policy=policy, return_dict_in_generate=True)
    steps = out.spec_stats.steps
    assert not syncs            # before drafting, after drafting, after verifying (+2 per drafter that drafted)
    assert len(marks) >= 3 * len(steps) > 0 and all(s.verify_s > 0 for s in steps)


def test_reading_times_costs_no_host_sync_per_step(monkeypatch):
    """On a GPU, a CUDA event's time can be read without waiting only once a host read has passed
    it. Emulated here on CPU: a stand-in event completes at the next of hf_specdec's host reads
    (HostReads: what would sync on a GPU). The same draft lengths take the same host reads per step
    timed with events as with host clocks, and no step waits on an event: a step's times are read
    one step later (the last step's at the end of the call)."""
    from helpers import Scripted
    reads = HostReads()
    waits = []

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            self.at, self.reads = time.perf_counter(), reads.count

        def query(self):
            return reads.count > self.reads

        def synchronize(self):
            waits.append(in_step[0])
            self.reads = -1

        def elapsed_time(self, end):
            assert self.query() and end.query(), "reading an event still queued on the device fails on a GPU"
            return (end.at - self.at) * 1000.0
    monkeypatch.setattr(torch.cuda, "Event", Event)
    timing = importlib.import_module("hf_specdec.timing")
    events = [False]
    monkeypatch.setattr(timing.PhaseClock, "__init__", lambda self, device: setattr(self, "events", events[0]))
    in_step, step = [False], DecodingLoop.step

    def counted(loop):
        in_step[0] = True
        with reads:
            try:
                return step(loop)
            finally:
                in_step[0] = False
    monkeypatch.setattr(DecodingLoop, "step", counted)
    target, draft = layer_skip_pair(0.05, layers=3, hidden=64, vocab=512)
    target.generation_config.eos_token_id = None     # no EOS check: a plain step then reads nothing after verifying
    ids, mask = prompts(3, seed=2, min_len=6, max_len=12, vocab=512)
    per_step, observed = {}, {}
    for timed in (False, True):
        events[0] = timed
        policy = Scripted(lambda step: [0, 3, 0, 2, 4][step % 5])
        seen = []
        policy.observe = seen.append
        reads.count = 0
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                              custom_generate=hf_specdec.generate, assistant_models=[hf_specdec.ModelDrafter(draft)],
                              spec_policy=policy, return_dict_in_generate=True)
        per_step[timed] = reads.count / len(out.spec_stats.steps)
        observed[timed] = seen
        assert seen == out.spec_stats.steps                  # every step observed, the last one too
    assert per_step[True] == per_step[False], per_step
    assert True not in waits                                 # never inside a step
    assert all(r.verify_s > 0 for r in observed[True])


@pytest.mark.parametrize("cache", ["dynamic", "static", "compiled"])
def test_a_step_reads_the_device_exactly_as_the_loop_documents(monkeypatch, cache):
    """hf_specdec's host reads and blocking copies per step (HostReads: what would sync on a GPU)
    are exactly those the loop documents (loop.py): one a step that reads (here every step: rows
    stop at EOS), and on a dynamic cache one more per model (target, drafter) when some rows finish
    and others go on. Nothing per row, per draft token or per layer, on the dynamic and the static
    cache, with position-dependent logits processors on (min_new_tokens, repetition_penalty: they
    read each row's prefix), uneven acceptance, and plain steps (Nightjar). `compiled`: the tier
    and bucket padding of compiled forwards (the compiler replaced by the plain function)."""
    from transformers import CompileConfig
    target, draft = layer_skip_pair(0.05, layers=3, hidden=64, vocab=512)
    target.generation_config.eos_token_id = 7
    config = None
    if cache == "compiled":
        monkeypatch.setattr(torch, "compile", lambda function, **options: function)
        monkeypatch.setattr(compiled, "pads_shapes", lambda device: True)     # as on CUDA
        config = CompileConfig()
        config._compile_all_devices = True
    reads, seen, step = HostReads(), [], DecodingLoop.step

    def counted(loop):
        before, reads.count = len(loop.batch.active), 0
        with reads:
            out = step(loop)
        seen.append((reads.count, before, len(loop.batch.active)))
        return out
    monkeypatch.setattr(DecodingLoop, "step", counted)
    crops = 2 if cache == "dynamic" else 0          # a static cache keeps its slots when rows leave
    for batch in (1, 6):
        ids, mask = prompts(batch, seed=batch, min_len=8, max_len=20, vocab=512)
        args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=3, repetition_penalty=1.2,
                    do_sample=False)
        for policy in ("fixed:4", "nightjar"):
            seen.clear()
            out = target.generate(**args, custom_generate=hf_specdec.generate, spec_policy=policy,
                                  assistant_models=[hf_specdec.ModelDrafter(draft)],
                                  cache_implementation=None if cache == "dynamic" else "static", compile_config=config)
            assert_same(out, target.generate(**args))
            documented = [1 + (crops if 0 < after < before else 0) for _, before, after in seen]
            assert [r for r, _, _ in seen] == documented, (batch, policy, seen)
            if batch > 1:
                assert any(0 < after < before for _, before, after in seen)     # rows did finish apart


@pytest.mark.parametrize("kind,bound", [("hedgespec", 10), ("hierarchy", 40)])
def test_scoring_and_hierarchies_read_the_device_a_bounded_number_of_times_whatever_the_batch(monkeypatch, kind,
                                                                                             bound):
    """Scoring every drafter (full-information feedback) and a hierarchy's inner cycles read the
    device a few times a step more (their documented reads); on steps where no row finishes, as
    many at batch 12 as at batch 1 (none per row), and a logits processor that reads the sequence
    (min_new_tokens here) costs no read."""
    target, draft = layer_skip_pair(0.05, layers=4, hidden=64, vocab=512)
    reads, seen, step = HostReads(), [], DecodingLoop.step

    def counted(loop):
        before, reads.count = len(loop.batch.active), 0
        with reads:
            out = step(loop)
        if len(loop.batch.active) == before:
            seen.append(reads.count)
        return out
    monkeypatch.setattr(DecodingLoop, "step", counted)
    per_step = {}
    for batch in (1, 12):
        drafters, policy = [hf_specdec.ModelDrafter(draft)], "fixed:2"
        if kind == "hedgespec":
            drafters.append(hf_specdec.PromptLookupDrafter())
            policy = hf_specdec.SpecPolicy(selector=hf_specdec.HedgeSpec(seed=0), length=hf_specdec.FixedLength(4))
        else:
            drafters = [hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(), drafters[0], draft_len=2,
                                                       cycles=2)]
        ids, mask = prompts(batch, seed=batch, min_len=8, max_len=20, vocab=512)
        seen.clear()
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24,
                        custom_generate=hf_specdec.generate, assistant_models=drafters, spec_policy=policy)
        per_step[batch] = sum(seen) / len(seen)
    assert per_step[12] <= bound and per_step[12] <= 1.25 * per_step[1], per_step
