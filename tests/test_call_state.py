"""State belongs to one call: what outlives a call (static caches, the "auto" policy) is kept on the
target (`hf_specdec.kept`), lent to one call at a time, checked against the model's dtype and device
on reuse, and freed by `disable()` without waiting for the garbage collector."""
import gc
import sys
import threading
import weakref

import pytest
import torch

import hf_specdec
from hf_specdec import compiled
from hf_specdec.kept import kept_for
from hf_specdec.testing import VOCAB, build, noisy_copy, prompts
from helpers import assert_same, cpu_compile_config
from tiny_stateful import tiny_stateful


def _storage_refs(target, models) -> list:
    """Weak references to every tensor of the static storages kept for `models`, and the storages."""
    table = kept_for(target).storages.table
    refs = []
    for model in models:
        storage = table[model]
        refs += [weakref.ref(storage), weakref.ref(storage.cache), weakref.ref(storage._mask)]
        refs += [weakref.ref(t) for pair in storage.full for t in pair]
    return refs


@pytest.mark.parametrize("compiled", [False, True])
def test_static_caches_are_reused_across_calls_and_all_freed_by_disable(compiled):
    model = build("llama", 2, seed=0)
    draft = noisy_copy(model, 0.3)
    ids, mask = prompts(3, seed=2)
    extra = {"compile_config": cpu_compile_config()} if compiled else {}
    hf_specdec.enable(model)
    gc.collect()
    gc.disable()              # no automatic collection: what is freed below, disable() frees
    try:
        addresses = []
        for rows in (3, 2):
            out = model.generate(input_ids=ids[:rows], attention_mask=mask[:rows], assistant_model=draft,
                                 max_new_tokens=8, do_sample=False, cache_implementation="static", **extra)
            addresses.append(kept_for(model).storages.table[model].full[0][0].data_ptr())
        assert addresses[0] == addresses[1]            # the second call reused the first's tensors
        refs = _storage_refs(model, [model, draft])
        assert all(r() is not None for r in refs)
        hf_specdec.disable(model)
        alive = [r() for r in refs if r() is not None]
        assert not alive, [type(x).__name__ for x in alive]
    finally:
        gc.enable()
    assert_same(out, model.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=8, do_sample=False))


def test_model_to_another_dtype_between_static_calls():
    """A kept storage made for float32 is not reused by a bfloat16 model (nor the other way)."""
    model = build("llama", 2, seed=0)
    draft = noisy_copy(model, 0.3)
    ids, mask = prompts(3, seed=4)
    hf_specdec.enable(model)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        model.to(dtype)
        draft.to(dtype)
        out = model.generate(assistant_model=draft, cache_implementation="static", **kw)
        assert kept_for(model).storages.table[model].full[0][0].dtype == dtype
        assert_same(out, model.generate(**kw))


class MeetingStreamer:
    """A streamer that waits, at its second put (the first decoded column), until the other
    thread's call gets there too: both calls are then mid-call on one model."""

    def __init__(self, meeting: threading.Barrier):
        self.meeting, self.columns = meeting, []

    def put(self, value):
        self.columns.append(value)
        if len(self.columns) == 2:
            self.meeting.wait(timeout=120)

    def end(self):
        pass


@pytest.mark.parametrize("cache", ["dynamic", "static", "compiled", "hybrid"])
def test_two_threads_generate_with_one_model_at_once(cache):
    """Two threads' calls meet at every streamed token; compiled (their decoder layers compile
    regions while they run: `regions.py`), a third thread's plain generate() runs the same layers
    meanwhile, eager, with its own result; on a
    hybrid (Gated DeltaNet), nor to the recurrence rules our calls wrap (`recurrent.recording_states`)."""
    model = tiny_stateful("qwen3_5_text", vocab=VOCAB) if cache == "hybrid" else build("llama", 2, seed=0)
    draft = noisy_copy(model, 0.3)
    hf_specdec.enable(model)
    inputs = [prompts(2, seed=5), prompts(3, seed=6, min_len=4, max_len=11)]
    static = {"cache_implementation": "dynamic" if cache in ("dynamic", "hybrid") else "static"}
    if cache == "compiled":
        static["compile_config"] = cpu_compile_config()
    meeting = threading.Barrier(2)
    results, errors, plain_runs = [None, None], [], []
    done = threading.Event()

    def run(i):
        ids, mask = inputs[i]
        try:
            streamer = MeetingStreamer(meeting)
            out = model.generate(input_ids=ids, attention_mask=mask, assistant_models=[draft], max_new_tokens=12,
                                 do_sample=False, streamer=streamer, **static)
            results[i] = (out, streamer)
        except BaseException as error:        # reported below, from the test's thread
            errors.append(error)
            meeting.abort()

    def plain():
        ids, mask = inputs[0]
        while not done.is_set():
            plain_runs.append(type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=12,
                                                   do_sample=False))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    bystander = threading.Thread(target=plain)
    for t in (*threads, bystander):
        t.start()
    for t in threads:
        t.join(timeout=600)
    done.set()
    bystander.join(timeout=600)
    assert not errors, errors
    for (ids, mask), (out, streamer) in zip(inputs, results):
        assert_same(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
        assert len(streamer.columns) >= 2
    assert plain_runs
    for out in plain_runs:
        assert_same(out, plain_runs[0])
    assert_same(plain_runs[0], type(model).generate(model, input_ids=inputs[0][0], attention_mask=inputs[0][1],
                                                    max_new_tokens=12, do_sample=False))
    if cache == "hybrid":            # the rules are Transformers' own again
        module = sys.modules[type(model).__module__]
        assert not hasattr(module.torch_chunk_gated_delta_rule, "hf_specdec_original")
    if cache == "compiled":          # both threads ran compiled; the layers are as they were
        assert all(f.functions and f.calls for f in compiled._COMPILED[model].values())
        assert not any("forward" in layer.__dict__ for layer in model.model.layers)


def test_auto_policy_is_kept_per_drafter_object_not_per_id():
    """The "auto" policy learned with one draft model is not handed to another, even one that
    reuses the dead one's id()."""
    model = build("llama", 2, seed=0)
    ids, mask = prompts(2, seed=7)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    hf_specdec.enable(model)
    draft = noisy_copy(model, 0.3)
    first = model.generate(assistant_models=[draft], **kw).spec_stats.policy
    assert model.generate(assistant_models=[draft], **kw).spec_stats.policy is first    # learns across calls
    del draft
    gc.collect()
    other = noisy_copy(model, 0.3)
    assert model.generate(assistant_models=[other], **kw).spec_stats.policy is not first
