"""Request streams, trace parsing and the serving simulator (pure Python, no models)."""
import pytest

import hf_specdec
from helpers import Scripted
from hf_specdec.costmodel import CostProfile, LatencyModel, SwitchCostTable
from hf_specdec.policies import LengthPolicy
from hf_specdec.serving import MemoryModel, RelativeCosts, Request, Simulator, load_trace, phased, poisson


def profile(target=(0.0, 0.0, 1.0), draft=(0.0, 0.0, 0.1)):
    return CostProfile(LatencyModel(*target), LatencyModel(*draft), SwitchCostTable([0], [1], [[0.0]]), {})


def test_simulator_reproduces_a_hand_computed_case():
    # target forwards take 1 s, draft forwards 0.1 s, every draft is accepted, k = 2
    requests = [Request(0, 0.0, 4, 7), Request(1, 2.5, 4, 3)]
    result = Simulator(profile(), hf_specdec.FixedLength(2), acceptance=1.0).run(requests)
    # A: prefill (target + draft) ends at 1.1 (1 token); a step of 2 drafts + verify ends at 2.3
    # (4 tokens), the next at 3.5 (7: done). B arrived at 2.5, waits for that step; prefill ends at
    # 4.6 (1 token); it needs 2 more, so k is capped at 1: 0.1 + 1 -> done at 5.7.
    a, b = sorted(result.requests, key=lambda r: r.request.id)
    assert (a.first_token, a.finish) == pytest.approx((1.1, 3.5))
    assert (b.first_token, b.finish) == pytest.approx((4.6, 5.7))
    assert [(s.batch_size, s.k, s.emitted) for s in result.steps] == [(1, 2, 3), (1, 2, 3), (1, 1, 2)]
    summary = result.summary(slo_tpot=0.5)
    assert summary["tokens_per_s"] == pytest.approx(10 / 5.7)
    assert summary["mean_latency_s"] == pytest.approx((3.5 + 3.2) / 2)
    assert a.tpot == pytest.approx(2.4 / 6) and b.tpot == pytest.approx(1.1 / 2)
    assert summary["slo_attainment"] == 0.5


def test_simulator_costs_catch_up_and_batches_arrivals():
    # the draft pays per fed token here, so its catch-up after plain steps is visible
    prof = profile(target=(0.0, 0.0, 1.0), draft=(0.0, 0.01, 0.0))
    policy = hf_specdec.SpecPolicy(length=Scripted(lambda step: 0 if step < 2 else 2))
    requests = [Request(0, 0.0, 10, 12), Request(1, 0.0, 6, 12)]
    result = Simulator(prof, policy, acceptance=0.0).run(requests)
    steps = result.steps
    # one prefill for both: target 1 s, draft 16 prompt tokens 0.16 s; then a plain step
    assert steps[0].batch_size == 2 and steps[0].time == pytest.approx(1.16 + 1.0)
    # step 2 drafts: catch-up of each row's first token + 2 plain steps' (3 + 3 tokens), then 2 tokens
    assert steps[2].time - steps[1].time == pytest.approx(1.0 + 0.06 + 0.02)
    assert steps[3].time - steps[2].time == pytest.approx(1.0 + 0.02 + 0.02)       # lag 1 from then on
    # with a prefill model of its own: 0.1 s per prompt token (16 of them), decode steps unchanged
    result = Simulator(prof, policy, acceptance=0.0, prefill=LatencyModel(0.0, 0.1, 0.0)).run(requests)
    assert result.steps[0].time == pytest.approx(1.6 + 0.16 + 1.0)
    assert result.steps[3].time - result.steps[2].time == pytest.approx(1.0 + 0.02 + 0.02)


def test_simulator_rows_without_drafts_verify_only_their_next_token():
    # the target costs 1 s per token it is fed; a lookup drafter that never finds a match
    prof = profile(target=(0.0, 1.0, 0.0), draft=(0.0, 0.0, 0.0))
    never = Simulator(prof, hf_specdec.FixedLength(2), acceptance=1.0, proposal_rate=0.0).run([Request(0, 0.0, 4, 5)])
    assert [(s.k, s.emitted) for s in never.steps] == [(2, 1), (2, 1), (1, 1), (0, 1)]   # k capped by room
    assert [s.time for s in never.steps] == pytest.approx([5.0, 6.0, 7.0, 8.0])    # prefill 4 s, then 1 s
    always = Simulator(prof, hf_specdec.FixedLength(2), acceptance=1.0).run([Request(0, 0.0, 4, 5)])
    assert [(s.k, s.emitted, s.time) for s in always.steps] == [(2, 3, pytest.approx(7.0)), (0, 1, pytest.approx(8.0))]
    half = Simulator(prof, hf_specdec.FixedLength(2), acceptance=0.0, proposal_rate=0.5, seed=1)
    steps = half.run([Request(i, 0.0, 4, 200) for i in range(4)]).steps
    widths = [round(s2.time - s1.time) // 4 - 1 for s1, s2 in zip(steps, steps[1:])]   # verified drafts
    assert set(widths[:-2]) == {0, 2} and 0.02 < widths.count(0) / len(widths) < 0.15   # no row: 1/16


def test_simulator_calls_the_length_policys_drafting_hooks():
    # the policy asks for 3 drafts, stops drafting after 2 and has row 1 verify none of them
    class StopsEarly(LengthPolicy):
        def choose(self, ctx):
            return 3
        def continue_drafting(self, confidences):
            assert confidences[0] == [0.75] * len(confidences[0])     # confidence = acceptance
            return [len(confidences[0]) < 2] * len(confidences)
        def verify_lengths(self, confidences):
            return [len(confidences[0]), 0]
    prof = profile(target=(0.0, 1.0, 0.0), draft=(0.0, 0.0, 0.1))   # 1 s per verified token, 0.1 s per draft forward
    steps = Simulator(prof, StopsEarly(), acceptance=0.75).run([Request(i, 0.0, 4, 100) for i in range(2)]).steps
    # prefill 8 tokens + one draft forward; then 2 draft forwards and 2 rows x 3 verified positions
    assert steps[0].time == pytest.approx(8.1 + 0.2 + 6.0)


def test_simulator_memory_limits_admission_and_offload_frees_it():
    # each request reserves 4 + 6 = 10 bytes of KV; the draft weighs 10: 2 requests fit beside it, 3 without
    memory = MemoryModel(capacity=30, kv_per_token=1, draft_bytes=10, reload_seconds=0.5)
    requests = [Request(i, 0.0, 4, 6) for i in range(6)]
    def run(offload):
        return Simulator(profile(), "fixed:0", acceptance=1.0, memory=memory, draft_offload=offload).run(requests)
    kept = run(None)
    offload = hf_specdec.DraftOffload(low_free_bytes=5, persist_steps=2)
    freed = run(offload)
    assert max(s.batch_size for s in kept.steps) == 2
    events = offload.events          # offloaded after 2 tight k = 0 steps; back once the batch is small
    assert [(e.action, e.step) for e in events[:1]] == [("offload", 2)] and "reload-start" in events[-1].action
    assert max(s.batch_size for s in freed.steps) == 3
    assert freed.summary()["tokens_per_s"] > kept.summary()["tokens_per_s"]
    with pytest.raises(ValueError, match="needs memory"):
        Simulator(profile(), "fixed:0", acceptance=1.0, draft_offload=offload)
    with pytest.raises(ValueError, match="capacity"):
        Simulator(profile(), hf_specdec.FixedLength(0), 1.0, memory=memory).run([Request(0, 0.0, 15, 10)])


def test_simulator_reloads_the_draft_when_load_drops():
    # k = 0 for 6 steps (the draft goes), then k = 2 is wanted; the lone late request gets it once the
    # reload has landed, after its draft caught up the whole context (its cache went with the draft)
    prof = profile(draft=(0.0, 0.01, 0.0))
    memory = MemoryModel(capacity=30, kv_per_token=1, draft_bytes=10, reload_seconds=0.5)
    offload = hf_specdec.DraftOffload(low_free_bytes=5, persist_steps=2, reload_batch_size=1)
    policy = Scripted(lambda step: 0 if step < 6 else 2)
    requests = [Request(i, 0.0, 4, 6) for i in range(3)] + [Request(3, 100.0, 4, 8)]
    steps = Simulator(prof, policy, acceptance=1.0, memory=memory, draft_offload=offload).run(requests).steps
    assert [e.action for e in offload.events] == ["offload", "reload-start", "resident"]
    late = [s for s in steps if s.time > 100]
    assert [s.k for s in late] == [2, 2, 0]                              # the last token: no room
    assert late[0].time - 100 == pytest.approx(1.0 + 1.0 + 0.05 + 0.01)  # prefill, verify, catch-up 5, draft 1


def test_simulator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="proposal_rate"):
        Simulator(profile(), "fixed:2", acceptance=0.5, proposal_rate=2)
    with pytest.raises(ValueError, match="acceptance"):
        Simulator(profile(), "fixed:2", acceptance=1.5)
    with pytest.raises(ValueError, match="max_batch"):
        Simulator(profile(), "fixed:2", acceptance=0.5, max_batch=0)
    with pytest.raises(TypeError, match="profile"):
        Simulator({}, "fixed:2", acceptance=0.5)
    with pytest.raises(TypeError, match="prefill"):
        Simulator(profile(), "fixed:2", acceptance=0.5, prefill=(0.0, 0.1, 0.0))
    with pytest.raises(ValueError, match="confidence"):
        Simulator(profile(), "fixed:2", acceptance=0.5, confidence=-0.1)
    with pytest.raises(TypeError, match="memory"):
        Simulator(profile(), "fixed:2", acceptance=0.5, memory=30)
    with pytest.raises(ValueError, match="noise"):
        Simulator(profile(), "fixed:2", acceptance=0.5, noise=1.5)
    with pytest.raises(TypeError, match="draft_offload"):
        Simulator(profile(), "fixed:2", acceptance=0.5, draft_offload="yes")
    with pytest.raises(TypeError, match="CostProfile"):
        Simulator(RelativeCosts(draft_base=0.5), "adaspec", acceptance=0.5)
    with pytest.raises(ValueError, match="MemoryModel.capacity"):
        MemoryModel(capacity=-1, kv_per_token=1)
    with pytest.raises(ValueError, match="reload_seconds"):
        MemoryModel(capacity=10, kv_per_token=1, reload_seconds="fast")


def test_poisson_and_phased_streams():
    stream = poisson(rate=50, duration=20, seed=1)
    assert abs(len(stream) - 1000) < 4 * 1000 ** 0.5
    assert all(a.arrival <= b.arrival for a, b in zip(stream, stream[1:]))
    assert all(16 <= r.output_len <= 128 and r.prompt_len == 128 for r in stream)
    three = phased([(10, 5), (10, 50), (10, 5)], seed=2)
    counts = [sum(lo <= r.arrival < lo + 10 for r in three) for lo in (0, 10, 20)]
    assert counts[1] > 5 * max(counts[0], counts[2])
    assert phased([(10, 5)], seed=3) == phased([(10, 5)], seed=3)
    with pytest.raises(ValueError, match="phases"):
        phased([(0, 5)])
    with pytest.raises(ValueError, match="output_len"):
        poisson(1, 1, output_len=(5, 2))


def test_load_trace_formats(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,396,109\n"
                     "2023-11-16 18:16:00.0000000,879,1\n")
    reqs = load_trace(azure)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(374, 44), (396, 109), (879, 1)]
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 4.314579, 13.31941], abs=1e-6)
    plain = tmp_path / "plain.csv"
    plain.write_text("arrival_s,prompt_len,output_len\n0.5,10,20\n\n1.25,11,21\n")
    assert load_trace(plain) == [Request(0, 0.5, 10, 20), Request(1, 1.25, 11, 21)]
    assert len(load_trace(plain, limit=1)) == 1


@pytest.mark.parametrize("text,match", [
    ("", "header"),
    ("time,in,out\n1,2,3\n", "header"),
    ("arrival_s,prompt_len,output_len\n", "no requests"),
    ("arrival_s,prompt_len,output_len\n0,10,20\nsoon,10,20\n", r"plain.csv:3: cannot parse"),
    ("arrival_s,prompt_len,output_len\n0,10\n", r":2: cannot parse .*3 columns"),
    ("arrival_s,prompt_len,output_len\n2,10,20\n1,10,20\n", r":3: arrival times must not decrease"),
    ("arrival_s,prompt_len,output_len\n0,0,20\n", r":2: prompt and output lengths"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46.1,374,44\n", r":2: cannot parse"),
])
def test_load_trace_rejects_malformed_files(tmp_path, text, match):
    path = tmp_path / "plain.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_trace(path)
