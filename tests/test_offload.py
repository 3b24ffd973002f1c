"""Draft offload/reload through accelerate hooks, driven by a fake memory probe on CPU."""
import accelerate
import pytest
import torch
from accelerate.hooks import AlignDevicesHook, SequentialHook

import hf_specdec
from helpers import Scripted, assert_same, spec
from hf_specdec.offload import OFFLOADED, RESIDENT, DraftResidencyHook, residency_hook
from hf_specdec.testing import build, noisy_copy, prompts

LOW, HIGH = 1000, 10 ** 12          # fake free bytes: below the threshold / plenty


class Probe:
    """Free bytes as a function of how many times it was asked (once per step)."""

    def __init__(self, free):
        self.free, self.calls = free, 0

    def __call__(self):
        self.calls += 1
        return self.free(self.calls)


@pytest.fixture
def pair():
    target = build("llama", 2, seed=0)
    return target, noisy_copy(target, 0.02)


def run(target, draft, ks, probe, batch=3, max_new_tokens=40, suppress_eos=False, **offload_kwargs):
    offload = hf_specdec.DraftOffload(low_free_bytes=2 * LOW, probe=probe, **offload_kwargs)
    ids, mask = prompts(batch, seed=batch)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    if suppress_eos:         # every row runs to max_new_tokens: the batch never shrinks
        kwargs["suppress_tokens"] = [target.generation_config.eos_token_id]
    out = spec(target, [draft], Scripted(ks), draft_offload=offload, return_dict_in_generate=True, **kwargs)
    plain = target.generate(**kwargs)
    return out, plain, offload


def actions(offload):
    return [(e.step, e.action) for e in offload.events]


def test_offload_only_after_persistence_window(pair):
    target, draft = pair
    out, plain, offload = run(target, draft, lambda s: 0, Probe(lambda i: LOW), persist_steps=5)
    assert_same(out.sequences, plain)
    assert actions(offload)[0] == (5, "offload")       # low memory and k = 0 for 5 steps, not 4
    hook = residency_hook(draft)
    assert hook.state == OFFLOADED
    offload.disable()


def test_no_offload_while_speculating_or_memory_recovers(pair):
    target, draft = pair
    # memory is low throughout, but the policy keeps speculating every 4th step
    _, _, offload = run(target, draft, lambda s: 3 if s % 4 == 3 else 0, Probe(lambda i: LOW), persist_steps=5)
    assert offload.events == []
    # the policy never speculates, but the probe oscillates around the threshold: no thrash
    _, _, offload = run(target, draft, lambda s: 0, Probe(lambda i: LOW if i % 2 else HIGH), persist_steps=3)
    assert offload.events == []
    offload.disable()


def test_parameters_are_where_the_hook_says(pair):
    target, draft = pair
    hook = hf_specdec.offload.attach_residency_hook(draft)
    host_ptr = lambda: {n: t.data_ptr() for n, t in hook.host.items()}   # noqa: E731
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    def live_ptr():   # the model's own tensors, by the hook's names
        tensors = {**dict(draft.named_parameters(remove_duplicate=False)),
                   **dict(draft.named_buffers(remove_duplicate=False))}
        return {n: tensors[n].data_ptr() for n in hook.slots}
    hook.offload()
    live = live_ptr()
    assert hook.state == OFFLOADED and live == host_ptr()    # every tensor is its host copy
    hook.start_reload()
    assert hook.poll() and hook.state == RESIDENT
    live = live_ptr()
    assert all(live[n] != host_ptr()[n] for n in live)        # fresh device tensors, host copy kept
    assert all(torch.equal(p, before[n]) for n, p in draft.named_parameters())
    # tied weights stay tied (the same Parameter is moved, not replaced) and are copied once
    tied = build("llama", 1, seed=0)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    h = hf_specdec.offload.attach_residency_hook(tied)
    h.offload()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.data_ptr() in {t.data_ptr() for t in h.host.values()}
    assert sum(n.endswith("weight") and "embed" in n or "lm_head" in n for n in h.slots) == 1
    hf_specdec.offload.detach_residency_hook(tied)
    hf_specdec.offload.detach_residency_hook(draft)


def test_reload_after_recovery_and_outputs_identical_across_cycles(pair):
    target, draft = pair
    # policy: off for steps 0-9 of the call, then speculate; memory low until the 9th probe,
    # then plenty (reload_batch_size=3: the batch counts as small enough already)
    wanted = lambda s: 0 if s < 10 else 3                   # noqa: E731
    out, plain, offload = run(target, draft, wanted, Probe(lambda i: LOW if i < 9 else HIGH),
                              persist_steps=3, reload_batch_size=3)
    assert_same(out.sequences, plain)
    assert actions(offload)[:3] == [(3, "offload"), (11, "reload-start"), (12, "resident")]
    ks = [s.k for s in out.spec_stats.steps]
    assert ks[:11] == [0] * 11                    # step 10 wanted 3, but the draft was still away
    assert ks[11] == 3 and sum(s.proposed[0] for s in out.spec_stats.steps) > 0
    # the next call starts resident and goes through two more offloads, still identical
    offload.probe = Probe(lambda i: LOW if i < 6 or 12 < i < 20 else HIGH)
    ids, mask = prompts(3, seed=7)
    out = spec(target, [draft], Scripted(lambda s: 0 if s < 6 or 12 < s < 20 else 2), draft_offload=offload,
               input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    assert_same(out.sequences, target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False))
    assert [e.action for e in offload.events].count("offload") == 3
    offload.disable()


def test_reload_waits_for_load_to_drop(pair):
    target, draft = pair
    # memory recovers at once, but the batch never shrinks below the one the draft left at
    out, plain, offload = run(target, draft, lambda s: 0, Probe(lambda i: LOW if i <= 3 else HIGH),
                              persist_steps=3, batch=2, max_new_tokens=20, suppress_eos=True)
    assert_same(out.sequences, plain)
    assert {s.batch_size for s in out.spec_stats.steps} == {2}
    assert actions(offload) == [(3, "offload")]
    offload.disable()


def test_nightjar_with_offload_is_lossless_under_any_schedule(pair):
    target, draft = pair
    probe = Probe(lambda i: LOW if (i // 7) % 2 else HIGH)
    policy = hf_specdec.Nightjar(max_len=4, seed=0)
    offload = hf_specdec.DraftOffload(low_free_bytes=2 * LOW, persist_steps=2, reload_batch_size=8, probe=probe)
    for seed in range(3):
        ids, mask = prompts(4, seed=seed)
        out = spec(target, [draft], policy, draft_offload=offload, input_ids=ids, attention_mask=mask,
                   max_new_tokens=40, do_sample=False)
        assert_same(out, target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False))
    offload.disable()


def test_disable_removes_the_hooks_and_brings_the_draft_back(pair):
    target, draft = pair
    forward = draft.forward
    _, _, offload = run(target, draft, lambda s: 0, Probe(lambda i: LOW), persist_steps=2)
    assert isinstance(draft._hf_hook, DraftResidencyHook) and draft.forward is not forward
    offload.disable()
    assert not hasattr(draft, "_hf_hook") and not hasattr(draft, "_old_forward")
    assert draft.forward == forward
    assert all(p.device.type == "cpu" for p in draft.parameters())
    ids, mask = prompts(2)
    assert_same(spec(target, [draft], "fixed:3", input_ids=ids, attention_mask=mask, max_new_tokens=20),
                target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20))


def test_dispatched_draft_keeps_accelerates_hooks(pair):
    target, draft = pair
    n = len(draft.model.layers)
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(n)}}
    draft = accelerate.dispatch_model(draft, device_map=device_map, force_hooks=True)
    align = draft._hf_hook
    assert isinstance(align, AlignDevicesHook)
    out, plain, offload = run(target, draft, lambda s: 0 if s < 8 else 3,
                              Probe(lambda i: LOW if i < 5 else HIGH), persist_steps=2, reload_batch_size=3)
    assert_same(out.sequences, plain)
    hook = residency_hook(draft)
    assert isinstance(draft._hf_hook, SequentialHook) and draft._hf_hook.hooks == (align, hook)
    assert [a for _, a in actions(offload)] == ["offload", "reload-start", "resident"]
    offload.disable()
    assert draft._hf_hook is align                     # accelerate's hook is still in charge


def test_forward_while_offloaded_reloads(pair):
    _, draft = pair
    hook = hf_specdec.offload.attach_residency_hook(draft)
    ids, _ = prompts(1)
    expected = draft(ids).logits
    hook.offload()
    assert torch.equal(draft(ids).logits, expected) and hook.state == RESIDENT
    hf_specdec.offload.detach_residency_hook(draft)


@pytest.mark.parametrize("kwargs,match", [
    (dict(persist_steps=0), "persist_steps"), (dict(low_free_bytes=-1), "low_free_bytes"),
    (dict(reload_batch_size=0), "reload_batch_size"), (dict(persist_steps=2.5), "persist_steps")])
def test_bad_offload_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_specdec.DraftOffload(**kwargs)


def test_bad_offload_types():
    with pytest.raises(TypeError, match="probe"):
        hf_specdec.DraftOffload(probe=5)
    target = build("llama", 2, seed=0)
    calls = []
    target.register_forward_hook(lambda *args: calls.append(1))
    ids, mask = prompts(2)
    with pytest.raises(TypeError, match="draft_offload"):
        spec(target, [target], draft_offload="yes", input_ids=ids, attention_mask=mask, max_new_tokens=4)
    assert not calls                      # refused before any work


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_frees_memory_and_reloads_asynchronously():
    target = build("llama", 2, seed=0, hidden=256, vocab=4096).cuda()
    draft = noisy_copy(target, 0.02).cuda()
    hook = hf_specdec.offload.attach_residency_hook(draft)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    hook.offload()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= 0.95 * hook.nbytes
    assert all(t.is_pinned() for t in hook.host.values())
    hook.start_reload()
    while not hook.poll():
        pass
    assert all(p.is_cuda for p in draft.parameters())
    ids, mask = prompts(3)
    ids, mask = ids.cuda(), mask.cuda()
    offload = hf_specdec.DraftOffload(low_free_bytes=2 * LOW, persist_steps=2, reload_batch_size=3,
                                      probe=Probe(lambda i: LOW if i < 5 else HIGH))
    out = spec(target, [draft], Scripted(lambda s: 0 if s < 8 else 3), draft_offload=offload, input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert_same(out, target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False))
    offload.disable()
    hf_specdec.offload.detach_residency_hook(draft)
