"""cache_implementation="static" with compiled forwards (Transformers' rule: on CUDA-like devices,
or anywhere with `compile_config._compile_all_devices`). Compiled here with dynamo's "eager"
backend: the same graphs, guards and recompilations as inductor, without its code generation."""
import importlib
import logging
import math
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import hf_specdec
from hf_specdec import compiled, regions, slots, testing, timing
from hf_specdec._compat import kv_cache
from hf_specdec.kept import forget, kept_for
from hf_specdec.testing import build, circle_model, circle_continuation, layer_skip_pair, noisy_copy, prompts
from helpers import Scripted, assert_same, cpu_compile_config, spec


_compile_config = cpu_compile_config


def _kept(model):
    """The model's static storage kept (free) between calls."""
    return kept_for(model).storages.table[model]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _graphs_per_model(*models) -> list[int]:
    """Dynamo's cache entries (compiled graphs) of each model's compiled forwards (per model, device
    and config: one-token and wider forwards)."""
    return [sum(len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
                for f in compiled._COMPILED[m].values() for code in f.codes) for m in models]


def _circle_call(target, draft, ids, new, policy, eos=None):
    """A static, compiled call of the circle pair, checked against the known continuation."""
    vocab = target.config.vocab_size
    expected = torch.cat([ids, circle_continuation(ids, new, vocab)], 1)
    if eos is not None:
        after_eos = torch.cumsum((expected == eos).long(), 1) - (expected == eos).long() > 0
        expected[after_eos] = 0                                                      # generate() pads
    target.generation_config.eos_token_id = eos
    before = _graphs()
    out = spec(target, [draft], policy, input_ids=ids, max_new_tokens=new, do_sample=False,
               cache_implementation="static", compile_config=_compile_config())
    assert_same(out, expected[:, :out.shape[1]])
    return _graphs() - before


@pytest.mark.parametrize("padded", [True, False])
def test_few_graphs_per_model_while_k_moves_rows_retire_calls_grow_and_shrink(padded, caplog, monkeypatch):
    """Rows reach EOS one after another (a circle model continues last+1, ...), so the batch drops
    from 8 rows to 1 while k cycles through every tier. Padded as on CUDA (rows to a bucket of at
    least 2, widths to a tier of at least 2) each model's forward is one compiled graph; exact, as on
    the CPU, two (one-token forwards are a graph of their own; a batch keeps 2 rows as its rows
    finish). A smaller batch compiles nothing, nor does a cache that grows once it grew (its first
    growth recompiles, which makes the capacity dynamic: dynamo's automatic rule; a static-address
    tensor's capacity cannot be marked dynamic before); calls that need no growth reuse the same
    cache tensors. The compile is logged."""
    caplog.set_level(logging.INFO, logger="hf_specdec.compiled")
    monkeypatch.setattr(compiled, "pads_shapes", lambda device: padded)
    monkeypatch.setattr(compiled, "HOT_ONE_TOKEN", 0)          # one-token forwards compiled from the first
    monkeypatch.setattr(compiled, "HOT_DRAFT_STEP", 10 ** 6)   # a draft's forwards one at a time (fused: below)
    vocab, eos = 512, 500
    target = circle_model("toy", vocab=vocab, dtype=torch.float32)
    draft = circle_model("toy", vocab=vocab, alpha=0.7, dtype=torch.float32)
    ids = torch.randint(1, 400, (8, 6), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = eos - torch.tensor([3, 7, 12, 18, 25, 31, 45, 60])             # rows stop at those steps
    ks = Scripted(lambda step: compiled_ks[step % len(compiled_ks)])
    compiled_ks = (0, 1, 2, 4, 6, 8, 3, 16)
    per_model = 1 if padded else 2
    assert _circle_call(target, draft, ids, 40, ks, eos) == 2 * per_model
    assert _graphs_per_model(target, draft) == [per_model, per_model]
    assert {r.getMessage().split(" in ")[0] for r in caplog.records if r.name == "hf_specdec.compiled"} == {
        "compiled 1 graph(s) of Qwen2ForCausalLM's decoding forward"}
    address = _kept(target).full[0][0].data_ptr()
    assert _circle_call(target, draft, ids[:3], 40, ks) == 0                      # fewer rows, same capacity
    assert _kept(target).full[0][0].data_ptr() == address
    capacity = _kept(target).capacity
    _circle_call(target, draft, ids[:4], 300, ks)          # more slots: recompiles, the capacity dynamic
    assert _kept(target).capacity > capacity
    assert _circle_call(target, draft, ids[:2], 40, ks) == 0
    assert _circle_call(target, draft, ids[:5], 600, ks) == 0                     # more slots again
    assert not counters["graph_break"]


def _graphs_per_function(*models) -> dict:
    """(model's index, kind) -> dynamo's cache entries of that compiled function."""
    return {(i, str(kind)): len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
            for i, m in enumerate(models) for f in compiled._COMPILED[m].values()
            for kind, code in zip(f.functions, f.codes)}


def test_a_growing_cache_recompiles_each_function_once_and_later_functions_never():
    """With eager-until-hot and the fused draft step as they are, a padded batch, k moving through
    plain steps and drafts: the first growth of the cache recompiles each compiled function at most
    once; a function first compiled during or after it (it became hot) compiles once, with the
    capacity already dynamic; a smaller batch and later growths compile nothing anew for any
    function. (Its functions share a code name: what dynamo's automatic-dynamic rule learnt of the
    capacity is the model's, not one function's.)"""
    target = circle_model("toy", vocab=512, dtype=torch.float32)
    draft = circle_model("toy", vocab=512, alpha=0.8, dtype=torch.float32)
    target.generation_config.eos_token_id = None
    ks = Scripted(lambda step: (0, 1, 2, 4, 3, 0, 4)[step % 7])

    def call(rows, new):
        ids = torch.randint(1, 400, (rows, 6), generator=torch.Generator().manual_seed(rows))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        before = _graphs()
        out = spec(target, [draft], ks, input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                   cache_implementation="static", compile_config=_compile_config())
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        assert_same(out, plain)
        return _graphs() - before
    assert call(3, 40) <= 3
    first = _graphs_per_function(target, draft)
    assert set(first.values()) == {1}
    capacity = _kept(target).capacity
    call(3, 300)
    assert _kept(target).capacity > capacity
    grown = _graphs_per_function(target, draft)
    assert all(grown[f] <= 2 for f in first) and all(grown[f] == 1 for f in grown if f not in first)
    assert len(grown) > len(first)          # functions that became hot during the growth's call
    assert call(2, 40) == 0
    call(3, 600)
    again = _graphs_per_function(target, draft)
    assert all(again[f] == grown[f] for f in grown)             # nothing recompiled
    assert all(again[f] == 1 for f in again if f not in grown)  # a function first made now: once
    assert not counters["graph_break"]


def test_one_token_forwards_run_eager_until_they_are_the_hot_path(monkeypatch):
    """Unpadded (the CPU), a model's first HOT_ONE_TOKEN one-token forwards run eager: a speculative
    call compiles the target's wide (regional) graph and the draft's, never the target's inlined
    one-token graph for its few plain steps; a call whose every step is plain compiles it once those
    steps are hot, and later calls run it. Every output is exact."""
    monkeypatch.setattr(compiled, "HOT_ONE_TOKEN", 6)
    target = circle_model("toy", vocab=512, dtype=torch.float32)
    draft = circle_model("toy", vocab=512, alpha=0.8, dtype=torch.float32)
    ids = torch.randint(1, 400, (1, 6), generator=torch.Generator().manual_seed(2))
    ks = Scripted(lambda step: 0 if step in (0, 5) else 3)           # two plain steps: fewer than 6
    _circle_call(target, draft, ids, 40, ks)

    def compiled_widths(model):        # {"wide", "one token"}: the model's compiled functions made
        (forwards,) = compiled._COMPILED[model].values()
        return {"wide" if regional else "one token" for regional in forwards.functions}
    assert compiled_widths(target) == {"wide"}             # the verification's regional graph only
    assert "one token" in compiled_widths(draft)           # the draft's many one-token forwards: compiled
    assert _circle_call(target, draft, ids, 12, "fixed:0") == 1     # hot within the call: one graph
    assert compiled_widths(target) == {"wide", "one token"}
    assert _circle_call(target, draft, ids, 12, "fixed:0") == 0
    assert not counters["graph_break"]


def test_a_call_of_one_row_runs_one_row_on_the_cpu(monkeypatch):
    """Unpadded (the CPU), a call of one row runs its compiled forwards at one row and their exact
    widths: a plain step is [1, 1], as Transformers' own compiled plain step, with every layer
    inlined (only wider forwards run the layers as compile regions)."""
    monkeypatch.setattr(compiled, "HOT_ONE_TOKEN", 0)
    target, draft = layer_skip_pair(0.5, layers=2, hidden=64, vocab=512)
    shapes, regional, call, layer_regions = [], [], compiled.CompiledForwards.__call__, regions.layer_regions

    def watched(self, model, input_ids, *args, **kwargs):
        shapes.append((model is target, *input_ids.shape))
        return call(self, model, input_ids, *args, **kwargs)

    def watched_regions(model):
        regional.append(shapes[-1][2])          # the width of the forward that opened them
        return layer_regions(model)
    monkeypatch.setattr(compiled.CompiledForwards, "__call__", watched)
    monkeypatch.setattr(regions, "layer_regions", watched_regions)
    ids = torch.randint(3, 512, (1, 6), generator=torch.Generator().manual_seed(0))
    for policy in ("fixed:0", "fixed:3"):
        shapes.clear()
        regional.clear()
        out = spec(target, [draft], policy, input_ids=ids, max_new_tokens=12, do_sample=False,
                   cache_implementation="static", compile_config=_compile_config())
        assert_same(out, target.generate(input_ids=ids, max_new_tokens=12, do_sample=False))
        assert len(shapes) > 8 and all(rows == 1 for _, rows, _ in shapes)
        widths = {width for is_target, _, width in shapes if is_target}
        assert widths == {1} if policy == "fixed:0" else 3 + 1 in widths       # k = 3: 4 tokens verified
        assert len(regional) == sum(width > 1 for *_, width in shapes) and 1 not in regional


def test_a_greedy_draft_step_runs_as_one_compiled_call_once_its_shape_is_hot(monkeypatch):
    """Unpadded (the CPU), a greedy draft step (its catch-up forward and k - 1 one-token forwards)
    runs as one compiled call (`CompiledForwards.draft_step`) once the draft ran HOT_DRAFT_STEP
    steps of that shape: the drafts are those of one forward at a time (every step's record equal),
    the output plain generate()'s, as rows finish (3 rows, then 2, then 1 and a dummy row) and
    with catch-ups of 1 and 2 tokens, or none (a head held after HedgeSpec's replay); once every
    shape is hot, a call compiles nothing. Sampling, and a length policy that stops drafts early,
    run one forward at a time."""
    from test_length_policies import toy_profile
    monkeypatch.setattr(compiled, "HOT_ONE_TOKEN", 0)
    target, draft = layer_skip_pair(0.1, layers=2, hidden=64, vocab=512)     # drafts that read their positions
    ids = torch.randint(3, 512, (3, 6), generator=torch.Generator().manual_seed(0))
    free = target.generate(input_ids=ids, max_new_tokens=40, do_sample=False)[:, 6:].tolist()
    firsts = lambda token: [row.index(token) if token in row else None for row in free]   # noqa: E731
    eos = next(t for t in range(3, 512) if firsts(t).count(None) == 1 and len(set(firsts(t))) == 3)  # ends 2 rows
    fused, draft_step = [], compiled.CompiledForwards.draft_step

    def watched(self, model, input_ids, mask, positions, cache_position, after, cache_kwargs, forwards, *args):
        fused.append((model, *input_ids.shape, forwards))
        return draft_step(self, model, input_ids, mask, positions, cache_position, after, cache_kwargs, forwards, *args)
    monkeypatch.setattr(compiled.CompiledForwards, "draft_step", watched)

    def call(policy="fixed:4", drafters=(draft,), **kwargs):
        fused.clear()
        before = _graphs()
        out = spec(target, list(drafters), policy, input_ids=ids, max_new_tokens=40, cache_implementation="static",
                   compile_config=_compile_config(), return_dict_in_generate=True, **kwargs)
        return out, _graphs() - before

    target.generation_config.eos_token_id = eos
    plain = target.generate(input_ids=ids, max_new_tokens=40, do_sample=False)
    monkeypatch.setattr(compiled, "HOT_DRAFT_STEP", 10 ** 6)
    one_at_a_time, _ = call(do_sample=False)
    assert sum(sum(s.accepted) for s in one_at_a_time.spec_stats.steps) > 20
    assert not fused
    monkeypatch.setattr(compiled, "HOT_DRAFT_STEP", 2)
    runs = [call(do_sample=False) for _ in range(3)]     # (the last steps' shorter k is hot by the third)
    for out, _ in runs:
        assert_same(out.sequences, plain)
        assert _records(out) == _records(one_at_a_time)
    assert {model for model, *_ in fused} == {draft}
    assert {(rows, width) for _, rows, width, _ in fused} >= {(3, 1), (3, 2), (2, 1), (2, 2)}   # (2: one and a dummy)
    assert len(fused) > 5 and runs[2][1] == 0
    # HedgeSpec's full-information feedback replays each drafter: the next step drafts from the
    # head it holds, with k - 1 forwards fused
    hedge = lambda: hf_specdec.SpecPolicy(selector=hf_specdec.HedgeSpec(seed=0),  # noqa: E731
                                          length=hf_specdec.FixedLength(4))
    both = (draft, noisy_copy(target, 0.3, seed=1))
    monkeypatch.setattr(compiled, "HOT_DRAFT_STEP", 10 ** 6)
    one_at_a_time, _ = call(hedge(), both, do_sample=False)
    monkeypatch.setattr(compiled, "HOT_DRAFT_STEP", 2)
    for out, _ in [call(hedge(), both, do_sample=False) for _ in range(3)]:
        assert_same(out.sequences, plain)
        assert _records(out) == _records(one_at_a_time)
    assert (1, 3) in {(width, forwards) for _, _, width, forwards in fused}
    call(do_sample=True, spec_generator=torch.Generator().manual_seed(0))
    assert not fused
    call(hf_specdec.AdaSpec(toy_profile(), max_len=6), do_sample=False)
    assert not fused


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_greedy_identical_with_model_drafter_lookup_and_hierarchy(arch):
    model = build(arch, 2, seed=0)
    draft = noisy_copy(model, 0.3)
    ids, mask = prompts(3, seed=3, min_len=3, max_len=12)             # padded, and a bucket of 4 rows
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    hierarchy = hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(), hf_specdec.ModelDrafter(draft),
                                               draft_len=2, cycles=2)
    for drafters, policy in (([draft], "fixed:3"), ([hf_specdec.PromptLookupDrafter()], "fixed:4"),
                             ([hierarchy], "fixed:2"), ([draft, hf_specdec.PromptLookupDrafter()], "auto")):
        out = spec(model, drafters, policy, input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                   cache_implementation="static", compile_config=_compile_config())
        assert_same(out, plain)
    assert compiled._COMPILED[model] and compiled._COMPILED[draft]


def _records(out):
    return [(s.k, s.proposed, s.accepted) for s in out.spec_stats.steps]


def _overwrite_cases(model, draft, other):
    from test_length_policies import toy_profile
    profile = toy_profile()
    hierarchy = lambda: hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(),  # noqa: E731
                                                       hf_specdec.ModelDrafter(draft), draft_len=2, cycles=2)
    return {
        "model drafter": (lambda: [draft], lambda: "fixed:3", False),
        "hierarchy greedy": (lambda: [hierarchy()], lambda: "fixed:3", False),
        "hierarchy sampling": (lambda: [hierarchy()], lambda: "fixed:3", True),
        "adaspec": (lambda: [draft], lambda: hf_specdec.AdaSpec(profile, max_len=6), False),
        "adaspec hierarchy": (lambda: [hierarchy()], lambda: hf_specdec.AdaSpec(profile, max_len=6), False),
        "hedgespec": (lambda: [draft, other], lambda: hf_specdec.SpecPolicy(selector=hf_specdec.HedgeSpec(seed=0),
                                                                         length=hf_specdec.FixedLength(3)), False),
        "hedgespec sampling": (lambda: [draft, other], lambda: hf_specdec.SpecPolicy(
            selector=hf_specdec.HedgeSpec(seed=0), length=hf_specdec.FixedLength(3)), True),
    }


@pytest.mark.parametrize("case", ["model drafter", "hierarchy greedy", "hierarchy sampling", "adaspec",
                                  "adaspec hierarchy", "hedgespec", "hedgespec sampling"])
def test_outputs_overwritten_by_the_next_compiled_call_change_nothing(case, monkeypatch):
    """CUDA graph trees overwrite a compiled call's outputs at the next call: with a backend that
    does so (NaN-filling them), every step record and token is the eager backend's, and greedy
    output is plain generate()'s (shapes padded, as on CUDA with graphs)."""
    monkeypatch.setattr(compiled, "pads_shapes", lambda device: True)
    model = build("llama", 2, seed=0, vocab=256)
    draft, other = noisy_copy(model, 0.3), noisy_copy(model, 0.6, seed=2)
    drafters, policy, do_sample = _overwrite_cases(model, draft, other)[case]
    ids, mask = prompts(3, seed=3, min_len=3, max_len=12, vocab=256)
    runs = []
    for backend in ("eager", testing.overwriting_backend):
        config = CompileConfig(fullgraph=True, backend=backend)
        config._compile_all_devices = True
        out = spec(model, drafters(), policy(), input_ids=ids, attention_mask=mask, max_new_tokens=20,
                   do_sample=do_sample, spec_generator=torch.Generator().manual_seed(0), cache_implementation="static",
                   compile_config=config, return_dict_in_generate=True)
        gammas = [g for s in out.spec_stats.steps if s.gammas for row in s.gammas.values() for g in row]
        assert not any(math.isnan(x) for g in gammas for x in g)
        runs.append(out)
    assert _records(runs[0]) == _records(runs[1])
    assert_same(runs[0].sequences, runs[1].sequences)
    if not do_sample:
        assert_same(runs[1].sequences, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                                                     do_sample=False))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason=f"inductor's CPU code needs a C++ compiler: {os.environ.get('CXX', 'g++')!r} is not on PATH")
def test_real_inductor_on_the_cpu_is_exact_and_compiles_once(monkeypatch):
    """The real inductor backend (code generation and all), as a GPU runs it minus the CUDA graphs:
    a batch drafting with prompt lookup (one compiled model; the prompts hold the continuation's
    first tokens, so drafts are found and accepted), identical to plain, and a second call with
    another batch size and other draft lengths compiles nothing (two graphs: a step whose rows all
    found no draft is one token wide, a graph of its own)."""
    monkeypatch.setattr(compiled, "HOT_ONE_TOKEN", 0)
    target = circle_model("toy", vocab=512, dtype=torch.float32)
    ids = torch.stack([torch.cat([torch.arange(s + 5, s + 13), torch.arange(s, s + 5)]) for s in (20, 100, 300)])
    mask = torch.ones_like(ids)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    graphs = []
    for rows, policy in ((3, "fixed:4"), (2, "fixed:2")):
        before = _graphs()
        out = spec(target, [hf_specdec.PromptLookupDrafter()], policy, input_ids=ids[:rows],
                   attention_mask=mask[:rows], max_new_tokens=24, do_sample=False, cache_implementation="static",
                   compile_config=config, return_dict_in_generate=True)
        assert torch.equal(out.sequences[:, ids.shape[1]:], circle_continuation(ids[:rows], 24, 512))
        assert sum(sum(s.accepted) for s in out.spec_stats.steps) > 5
        graphs.append(_graphs() - before)
    assert graphs == [2, 0]


COMPILE_S = 1000.0   # what a graph's first call takes on the test's clock: more than every forward together
COMPILES = []        # the clock of each compiled graph's first call (_compiling_backend)


def _compiling_backend(graph_module, example_inputs, **options):
    """Dynamo's eager backend, but a graph's first call moves the test's clock by COMPILE_S (as a
    GPU compiles or records)."""
    first = [True]

    def run(*args):
        if first[0]:
            COMPILES[0].time += COMPILE_S
            COMPILES.append(COMPILE_S)
            first[0] = False
        return graph_module(*args)
    return run


def test_steps_that_compiled_are_marked_and_no_policy_cost(forward_clock):
    target = circle_model("toy", vocab=512, dtype=torch.float32)
    draft = circle_model("toy", vocab=512, alpha=0.8, dtype=torch.float32)
    ids = torch.randint(1, 400, (2, 6), generator=torch.Generator().manual_seed(1))
    config = CompileConfig(fullgraph=True, backend=_compiling_backend)
    config._compile_all_devices = True
    policy = hf_specdec.SpecPolicy(length=hf_specdec.MeasuredGoodput())
    COMPILES[:] = [forward_clock]
    out = spec(target, [draft], policy, input_ids=ids, max_new_tokens=40, do_sample=False,
               cache_implementation="static", compile_config=config, return_dict_in_generate=True)
    steps = out.spec_stats.steps
    # on the injected clock only a compile moves a step by COMPILE_S: every such step is marked
    # warmup, and no marked step reaches the policy's costs
    compiling = [s for s in steps if s.seconds >= COMPILE_S]
    assert len(COMPILES) > 1 and compiling and all(s.warmup for s in compiling)
    assert not all(s.warmup for s in steps)
    measured = [t for costs in policy.length.buckets.values() for arm in costs.seconds.values() for t in arm]
    assert measured and max(measured) < COMPILE_S


class _ClockEvent:
    """A CUDA event on the CPU: it records the injected clock's time (the forward clock: what the
    forwards before it cost, as a GPU event records when the device reached it), and completes only
    once the host has waited for the device after it: the loop's host read (`host_read`), or
    `synchronize()`, a stall that is counted (`syncs`)."""
    pending: list = []
    syncs = 0

    def __init__(self, enable_timing):
        assert enable_timing

    def record(self):
        self.at, self.done = timing.now(), False
        _ClockEvent.pending.append(self)

    def query(self):
        return self.done

    def synchronize(self):
        _ClockEvent.syncs += 1
        _ClockEvent.device_done()

    @staticmethod
    def device_done():
        """The host waited for the device: every event recorded so far has completed."""
        for event in _ClockEvent.pending:
            event.done = True
        _ClockEvent.pending = []

    def elapsed_time(self, end):
        assert self.done and end.done, "an event read before it completed"
        return (end.at - self.at) * 1000.0


RECORD_S = 100.0     # what a concrete shape's first calls take on the test's clock (_cuda_like_backend)


def _cuda_like_backend(graph_module, example_inputs, **options):
    """_compiling_backend, and the first two calls of each concrete shape move the test's clock by
    RECORD_S (CUDA graph trees warm a shape up, then record it)."""
    compiled_run, calls = _compiling_backend(graph_module, example_inputs), {}

    def run(*args):
        shape = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        calls[shape] = calls.get(shape, 0) + 1
        if calls[shape] <= 2:
            COMPILES[0].time += RECORD_S
        return compiled_run(*args)
    return run


@pytest.mark.parametrize("drafts", ["perfect", "useless"])
def test_the_default_on_cuda_s_order_of_events_drafts_with_a_perfect_cheap_draft_only(drafts, monkeypatch, forward_clock):
    """CUDA's order of events on the CPU: phase times are events, read only after a host read
    (`DecodingLoop.observe_late`: with no EOS, a plain step reads nothing, so it is observed after
    the next one that reads, or at the call's end: an event completes only at a host read, and no
    step may wait on the device for one), shapes pad to CUDA's buckets and tiers, and the
    first calls of each shape are warm-ups the policy does not count. Costs as on a GPU: a compile
    and each shape's first two calls (warm-up, recording) dearer than a call's every forward, a
    forward about as dear at 5 tokens as at 1 (the forward clock), the draft an eighth of the target. With
    a perfect draft the default leaves k = 0 within its first two calls (the first is all plain:
    its plain steps are observed at its end) and then drafts most steps; with a useless one
    (another model's weights: nothing accepted) it stays plain bar its probes."""
    monkeypatch.setattr(compiled, "pads_shapes", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    monkeypatch.setattr(timing.PhaseClock, "__init__", lambda self, device: setattr(self, "events", True))
    loop = importlib.import_module("hf_specdec.loop")
    read, step = loop.host_read, loop.DecodingLoop.step
    monkeypatch.setattr(loop, "host_read", lambda numbers: (read(numbers), _ClockEvent.device_done())[0])
    waits = []            # per step: the device waits it made (each step's events are read after a host read)

    def counted_step(self):
        before = _ClockEvent.syncs
        record = step(self)
        waits.append(_ClockEvent.syncs - before)
        return record
    monkeypatch.setattr(loop.DecodingLoop, "step", counted_step)
    target, draft = layer_skip_pair(0.0, layers=8, hidden=64, vocab=512)
    if drafts == "useless":
        draft = build("llama", layers=1, seed=7, vocab=512, hidden=64, init=0.05)
    target.generation_config.eos_token_id = None        # no row can stop: plain steps read nothing
    forward_clock.costs[target], forward_clock.costs[draft] = 8.0, 1.0
    ids = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    policy = hf_specdec.SpecPolicy(length=hf_specdec.MeasuredGoodput())     # the default's length policy
    config = CompileConfig(fullgraph=True, backend=_cuda_like_backend)
    config._compile_all_devices = True
    COMPILES[:] = [forward_clock]
    drafting = []
    for _ in range(4):
        out = spec(target, [draft], policy, input_ids=ids, max_new_tokens=48, do_sample=False,
                   cache_implementation="static", compile_config=config, return_dict_in_generate=True)
        steps = out.spec_stats.steps
        drafting.append(sum(s.k > 0 for s in steps) / len(steps))
        assert_same(out.sequences, target.generate(input_ids=ids, max_new_tokens=48, do_sample=False))
    assert sum(waits) == 0, f"{sum(waits)} waits on the device in {len(waits)} steps"
    if drafts == "perfect":
        assert drafting[1] > 0.5 and drafting[-1] > 0.5
    else:
        assert max(drafting) <= 0.1


def test_a_step_s_host_time_leaves_out_its_wait_for_the_device(monkeypatch, forward_clock):
    """On a GPU the one host read waits for the drafting and verifying that the clock's marks
    already time: overhead_s must not count it again (emulated: a read that takes 0.05 s)."""
    loop = importlib.import_module("hf_specdec.loop")
    read = loop.host_read

    def slow(numbers):
        forward_clock.time += 0.05
        return read(numbers)
    monkeypatch.setattr(loop, "host_read", slow)
    model = build("llama", 2, seed=0)
    out = spec(model, [noisy_copy(model, 0.3)], "fixed:3", input_ids=prompts(2, seed=1)[0], max_new_tokens=12,
               do_sample=False, return_dict_in_generate=True)
    assert max(s.overhead_s for s in out.spec_stats.steps) < 0.04


def test_attention_that_graphs_cannot_capture_is_refused_before_any_work():
    """FlashAttention's padded path reads the device: a compiled static call refuses it, naming
    attn_implementation, before any forward (the model's config says what it was loaded with)."""
    model = build("llama", 2, seed=0)
    draft = noisy_copy(model, 0.3)
    draft.config._attn_implementation = "flash_attention_2"       # as loaded with attn_implementation=...
    ids, mask = prompts(2, seed=1)
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match="assistant_models\\[0\\].*attn_implementation='flash_attention_2'"):
        spec(model, [draft], "fixed:2", input_ids=ids, attention_mask=mask, max_new_tokens=4,
             cache_implementation="static", compile_config=_compile_config())
    assert not forwards
    # uncompiled (a CPU without _compile_all_devices) it is no obstacle: the static cache runs eager
    draft.config._attn_implementation = "eager"
    assert_same(spec(model, [draft], "fixed:2", input_ids=ids, attention_mask=mask, max_new_tokens=4,
                     cache_implementation="static"),
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False))


def test_the_target_as_its_own_drafter_gets_a_second_static_cache():
    model = build("llama", 2, seed=0)
    ids, mask = prompts(3, seed=4)
    out = spec(model, [model], "fixed:3", input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
               cache_implementation="static", compile_config=_compile_config(), return_dict_in_generate=True)
    assert_same(out.sequences, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    assert all(a == p for s in out.spec_stats.steps for a, p in zip(s.accepted, s.proposed))   # its own drafts


@pytest.mark.parametrize("k", [3, 4, 6, 8])
def test_a_drafter_cache_exactly_at_its_reservation_boundary(k, monkeypatch):
    """A model drafter's k - 1 one-token forwards each pad to width 2 on a compiled cache and step
    back over the pad, so the last one writes the speculative region's k-th slot. Caches with no
    slack (compacted every few steps) reach the case where the free room is exactly what the
    drafter reserved: no compaction may move slots inside its region. Rows accept unevenly; the
    output is exact and the drafts' acceptance is what a roomy cache gives. (Padded, as on CUDA.)"""
    monkeypatch.setattr(compiled, "pads_shapes", lambda device: True)
    target, draft = layer_skip_pair(0.5, layers=3, hidden=64, vocab=512)
    target.generation_config.eos_token_id = None
    ids, mask = prompts(3, seed=3, min_len=3, max_len=12, vocab=512)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=60, do_sample=False)
    plain = target.generate(**kw)
    static = dict(cache_implementation="static", compile_config=_compile_config(), return_dict_in_generate=True)
    roomy = spec(target, [draft], f"fixed:{k}", **kw, **static)
    forget(target)                       # the next call makes new storages, tight ones
    monkeypatch.setattr(slots, "static_capacity", lambda tokens, pads: tokens + 1)
    edges, reserve = [], slots.StaticSlots.reserve

    def watched(self, width):
        tier = self.compiled.width(width) if self.compiled and self.full else width
        if tier and self.used + tier == self.capacity:
            edges.append(width)
        return reserve(self, width)
    monkeypatch.setattr(slots.StaticSlots, "reserve", watched)
    tight = spec(target, [draft], f"fixed:{k}", **kw, **static)
    assert edges
    assert_same(tight.sequences, plain)
    assert_same(roomy.sequences, plain)
    assert tight.spec_stats.acceptance_rate == roomy.spec_stats.acceptance_rate


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_each_layer_region_runs_its_own_weights_and_cache_under_compile(arch):
    """A compiled forward with the decoder layers as regions (dynamo reuses one layer's subgraph for
    all) computes what the eager forward computes, and writes each layer's own cache slots: from
    torch 2.14 a layer reached through a weak reference ran every layer with layer 0's weights and
    cache. The logits of a 3-layer model whose layers differ, and every layer's keys."""
    from transformers import StaticCache
    model = build(arch, 3, seed=0)
    ids = torch.tensor([[5, 9, 2, 7]])

    def forward(cache):
        return model(input_ids=ids, use_cache=True, **kv_cache.cache_kwargs(model, cache)).logits
    caches = [StaticCache(config=model.config, max_cache_len=8) for _ in range(2)]
    with torch.no_grad():
        eager = forward(caches[0])
        forward(caches[1])              # (a static cache allocates at its first use: not in a region)
        caches[1].reset()
        torch._dynamo.reset()
        with regions.layer_regions(model):
            compiled_logits = torch.compile(forward, backend="eager")(caches[1])
    torch.testing.assert_close(compiled_logits, eager)
    for eager_layer, compiled_layer in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(compiled_layer.keys, eager_layer.keys)


def test_decoder_layers_are_compile_regions_only_while_our_compiled_forward_runs():
    """`regions.layer_regions`: inside, each decoder layer's forward is its region (a method bound
    to it, equal every time) and computes what the layer computes; nested uses count; after,
    the layers are as they were, and nothing keeps the model alive. A layer with a forward of its
    own (an accelerate hook's) is left alone."""
    import gc
    import weakref
    model = build("llama", 3, seed=0)
    layers = list(model.model.layers)
    hooked = layers[2].forward = layers[2].forward        # an instance forward, as a hook sets one
    x = torch.randn(1, 4, model.config.hidden_size)
    position = torch.arange(4)[None]
    rotary = model.model.rotary_emb(x, position)
    eager = layers[0](x, position_embeddings=rotary)
    with regions.layer_regions(model):
        first = [layer.__dict__.get("forward") for layer in layers]
        with regions.layer_regions(model):
            assert [layer.__dict__.get("forward") for layer in layers] == first
        assert [layer.__dict__.get("forward") for layer in layers] == first
        assert first[0] is not None and first[1] is not None and first[2] is hooked
        assert torch.equal(layers[0](x, position_embeddings=rotary), eager)
    with regions.layer_regions(model):
        assert [layer.__dict__.get("forward") for layer in layers] == first      # equal methods
    assert [("forward" in layer.__dict__) for layer in layers] == [False, False, True]
    ref = weakref.ref(model)
    del model, layers, first, hooked
    gc.disable()
    try:
        assert ref() is None          # freed by reference counting
    finally:
        gc.enable()
