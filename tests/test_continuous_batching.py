"""Speculation inside Transformers' continuous batching: per request, the output of plain
`generate_batch` (Transformers' own), whatever the drafts, the blocks, the token budget, EOS,
cancellation and prefix sharing; and no block leaked."""
import copy
import functools

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_specdec
from hf_specdec.continuous_batching import SpecBatchingManager, Speculation
from hf_specdec.drafters import LookupDrafter
from hf_specdec.drafters.ngram import PromptLookupDrafter
from hf_specdec.policies import resolve_policy
from hf_specdec.testing import VOCAB, build, noisy_copy
from hf_specdec.verify import VerifyResult, verify
from tiny_stateful import tiny_stateful

# distinct prompts, some repetitive (prompt lookup finds matches), of different lengths (prefill chunks)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4, 3, 4, 3], [7, 7, 7, 7],
           [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 20, 21, 22], [40, 41]]


@pytest.fixture(scope="module")
def model():
    return build("llama", layers=2)


def speculation(k: int, **drafter) -> Speculation:
    """k drafts a step (a fixed length), from `drafter` (lookup= or draft_model=)."""
    return Speculation(policy=resolve_policy(f"fixed:{k}"), **drafter)


def generation(max_new_tokens=24, eos_token_id=-1, **kwargs):
    return GenerationConfig(**{"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": eos_token_id,
                               "pad_token_id": 0, **kwargs})


def batching(page_size=4, max_batch_tokens=64, num_blocks=128, **kwargs):
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    **kwargs)


def plain(model, prompts, generation_config, cb_config):
    """Transformers' own generate_batch (the class's, even on an enabled model): request id -> tokens."""
    out = type(model).generate_batch(model, prompts, generation_config, cb_config)
    return {rid: o.generated_tokens for rid, o in out.items()}


class Oracle(LookupDrafter):
    """Drafts the plain continuation with one draft made wrong: the j-th, j cycling over 0..k (k:
    none), so every acceptance count occurs, the first draft rejected and all accepted included."""

    def __init__(self, prompts, outputs: dict):
        self.known = [(p, outputs[f"req_{i}"]) for i, p in enumerate(prompts)]
        self.calls = 0

    def continuation(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        seq = tokens.tolist()
        for prompt, out in self.known:
            done = len(seq) - len(prompt)
            if seq[:len(prompt)] == prompt and seq[len(prompt):] == out[:done]:
                drafts = out[done:done + k]
                wrong, self.calls = self.calls % (k + 1), self.calls + 1
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % VOCAB
                return torch.tensor(drafts, dtype=torch.long)
        raise AssertionError(f"a request's tokens left the plain output: {seq}")


def run(model, prompts, generation_config, cb_config, speculation, cancel=None, wave=None):
    """Our manager over `prompts` (the manager API, as `transformers serve` uses it): request id ->
    tokens, and the processor's counts. wave: add that many requests at a time, each wave once the
    last finished (None: all at once). Checks that every block went back to the pool."""
    manager = SpecBatchingManager(model, generation_config, cb_config, speculation=speculation)
    manager.start()
    try:
        results, wave = {}, wave or len(prompts)
        for first in range(0, len(prompts), wave):
            ids = manager.add_requests(inputs=prompts[first:first + wave], max_new_tokens=generation_config.max_new_tokens)
            if cancel is not None:
                manager.cancel_request(ids[cancel])
            finished = len(results) + len(ids) - (cancel is not None)
            while len(results) < finished:
                result = manager.get_result(timeout=60)
                assert result is not None, "the generation loop stopped"
                assert result.error is None, result.error
                if result.is_finished():
                    results[result.request_id] = result.generated_tokens
        processor = manager.batch_processor
    finally:
        manager.stop(block=True, timeout=60)
    assert_no_block_leaked(processor.cache)
    return results, processor.counts


def assert_no_block_leaked(cache):
    assert all(not allocator.block_table for allocator in cache.cache_allocators.values())
    cache.evict_cached_blocks()          # prefix sharing keeps finished requests' blocks until evicted
    cache.pool.try_to_free_sectors()
    assert cache.pool.num_free_sectors == cache.pool.num_sectors


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("max_batch_tokens", [64, 8])
def test_an_oracle_with_errors_gives_plain_output_at_every_acceptance_count(model, page_size, max_batch_tokens):
    config, cb = generation(), batching(page_size=page_size, max_batch_tokens=max_batch_tokens)
    expected = plain(model, PROMPTS, config, cb)
    oracle = Oracle(PROMPTS, expected)
    got, counts = run(model, PROMPTS, config, cb, speculation(4, lookup=oracle))
    assert got == expected
    assert 0 < counts.accepted < counts.drafted
    assert counts.steps < sum(len(v) for v in expected.values())    # fewer forwards than tokens
    if max_batch_tokens == 8:      # the budget cut drafts and split prefills: both beside verification
        assert counts.shared_steps > 0


def test_prompt_lookup_through_generate_batch_and_paged_generate(model):
    config, cb = generation(), batching()
    expected = plain(model, PROMPTS, config, cb)
    hf_specdec.enable(model)
    try:
        out = model.generate_batch(PROMPTS, config, cb, prompt_lookup_num_tokens=3)
        assert {rid: o.generated_tokens for rid, o in out.items()} == expected
        same_length = [p for p in PROMPTS if len(p) == 7] + [[30, 31, 32, 30, 31, 32, 30]]
        ids = torch.tensor(same_length)
        want = model.generate(ids, generation_config=config, cache_implementation="paged",
                              continuous_batching_config=batching())
        with_lookup = model.generate(ids, generation_config=config, cache_implementation="paged",
                                     continuous_batching_config=batching(), prompt_lookup_num_tokens=3)
        assert torch.equal(with_lookup, want)
    finally:
        hf_specdec.disable(model)
    assert "generate_batch" not in model.__dict__ and "init_continuous_batching" not in model.__dict__


@pytest.mark.parametrize("max_batch_tokens", [64, 8])
def test_a_draft_model_through_generate_batch(model, max_batch_tokens):
    """The draft model follows requests as they join, prefill in chunks, draft, are cut by the token
    budget and finish: per request, plain output. A copy of the target has every draft accepted
    (its cache follows each request exactly); a noisy copy has drafts rejected in every request."""
    from hf_specdec.testing import noisy_copy
    config, cb = generation(max_new_tokens=20), batching(max_batch_tokens=max_batch_tokens)
    expected = plain(model, PROMPTS, config, cb)
    got, counts = run(model, PROMPTS, config, cb, speculation(4, draft_model=copy.deepcopy(model)))
    assert got == expected
    # (a budget of 8 tokens leaves a few drafts a step, once every prompt is prefilled)
    assert counts.accepted == counts.drafted > len(PROMPTS) * (10 if max_batch_tokens > 8 else 5)
    draft = noisy_copy(model, 0.05)
    got, counts = run(model, PROMPTS, config, cb, speculation(4, draft_model=draft))
    assert got == expected
    assert 0 < counts.accepted < counts.drafted
    hf_specdec.enable(model)
    try:
        out = model.generate_batch(PROMPTS, config, cb, assistant_model=draft)
    finally:
        hf_specdec.disable(model)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected


ASSISTED = dict(num_assistant_tokens=3, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
WARPED = dict(do_sample=True, temperature=0.7, top_k=10)


@pytest.mark.parametrize("route", ["paged-generate-keywords", "paged-generate-config", "generate-batch-config",
                                   "assistant-config", "init-keywords"])
def test_assisted_settings_and_sampling_reach_continuous_batching_by_every_route(model, monkeypatch, route):
    """Transformers' assisted-generation settings (3 drafts a step, "constant", threshold 0: FixedLength(3))
    reach our manager as they reach generate(): keywords of a paged generate() or of
    init_continuous_batching, the call's generation config, the assistant's own; dropped, the
    manager would run the default policy. Sampling at temperature 0.7 / top-k 10 given the same
    way, a copy of the target has at least 95% of its drafts accepted."""
    from hf_specdec.policies import FixedLength
    from hf_specdec.batch_processor import SpecBatchProcessor
    processors = []
    init = SpecBatchProcessor.__init__
    monkeypatch.setattr(SpecBatchProcessor, "__init__", lambda self, *a: (processors.append(self), init(self, *a))[1])
    draft = copy.deepcopy(model)
    ids = torch.tensor([p for p in PROMPTS if len(p) == 7] + [[30, 31, 32, 30, 31, 32, 30]])
    base = dict(max_new_tokens=20, eos_token_id=-1, pad_token_id=0)
    hf_specdec.enable(model)
    try:
        if route == "paged-generate-keywords":
            model.generate(ids, cache_implementation="paged", continuous_batching_config=batching(),
                           assistant_model=draft, **base, **WARPED, **ASSISTED)
        elif route == "paged-generate-config":
            model.generate(ids, generation_config=GenerationConfig(**base, **WARPED, **ASSISTED),
                           cache_implementation="paged", continuous_batching_config=batching(), assistant_model=draft)
        elif route == "generate-batch-config":
            model.generate_batch(PROMPTS, GenerationConfig(**base, **WARPED, **ASSISTED), batching(),
                                 assistant_model=draft)
        elif route == "assistant-config":
            draft.generation_config = GenerationConfig(**ASSISTED)
            model.generate_batch(PROMPTS, GenerationConfig(**base, **WARPED), batching(), assistant_model=draft)
        else:
            manager = model.init_continuous_batching(GenerationConfig(**base, **WARPED), batching(),
                                                     assistant_model=draft, **ASSISTED)
            manager.start()
            try:
                manager.add_requests(inputs=PROMPTS, max_new_tokens=20)
                for _ in PROMPTS:
                    assert manager.get_result(timeout=60) is not None
            finally:
                manager.stop(block=True, timeout=60)
    finally:
        hf_specdec.disable(model)
    [processor] = processors
    length, counts = processor.speculation.policy.length, processor.counts
    assert isinstance(length, FixedLength) and length.k == 3, length
    assert counts.accepted >= 0.95 * counts.drafted > 0, (counts.accepted, counts.drafted)


def test_a_forward_that_prefills_a_prompt_verifies_no_drafts(model, monkeypatch):
    """Requests join while others decode (a token budget of 8 chunks their prompts): no forward
    that prefills a prompt also verifies drafts, so a joining request's first token comes as soon
    as in Transformers' own step (the draft model prefills it a step behind). Output: plain's."""
    from hf_specdec._compat import cb as adapter
    from hf_specdec.batch_processor import SpecBatchProcessor
    config, cb = generation(max_new_tokens=20), batching(max_batch_tokens=8)
    forwards, original = [], SpecBatchProcessor._generation_step

    def spy(processor, target):
        queries = [adapter.query(f) + (adapter.has_new_token(f),) for f in adapter.scheduled(processor.processor)]
        prefills = any(not new or (n > 1 and adapter.request_id(state) not in processor._drafts)
                       for state, n, new in queries)
        forwards.append((prefills, processor._rows is not None))
        original(processor, target)

    monkeypatch.setattr(SpecBatchProcessor, "_generation_step", spy)
    got, counts = run(model, PROMPTS, config, cb, speculation(4, draft_model=copy.deepcopy(model)))
    assert got == plain(model, PROMPTS, config, cb)
    assert sum(prefills for prefills, _ in forwards) >= len(PROMPTS)       # requests joined as others decoded
    assert not any(prefills and drafts for prefills, drafts in forwards), forwards
    assert counts.accepted == counts.drafted > 0


def test_a_prompt_the_cache_cannot_take_yet_does_not_stop_drafting(model, monkeypatch):
    """A cache too small for every request: those it holds decode, drafting, while the others wait
    for blocks (Transformers' scheduler admits no prompt while the cache's free share is below its
    safety margin). Output: plain's."""
    from hf_specdec.batch_processor import SpecBatchProcessor
    config, cb = generation(max_new_tokens=24), batching(num_blocks=16)
    waiting_drafted, original = [], SpecBatchProcessor._propose

    def spy(processor):
        scheduler = processor.scheduler        # (a request it had to offload blocks new ones: not this case)
        waiting = bool(scheduler.waiting_requests) and not scheduler.block_new_requests
        original(processor)
        waiting_drafted.append(waiting and bool(processor._drafts))

    monkeypatch.setattr(SpecBatchProcessor, "_propose", spy)
    got, counts = run(model, PROMPTS, config, cb, speculation(3, draft_model=copy.deepcopy(model)))
    assert got == plain(model, PROMPTS, config, cb)
    assert any(waiting_drafted), waiting_drafted


def test_the_draft_model_runs_without_autograd_in_the_loop_s_thread(model):
    """The generation loop's thread runs with autograd on (its starter was not in inference mode):
    a draft forward there must not record a graph, or every step's activations stay alive through
    the draft's cache (on the real pair, gigabytes a step)."""
    draft = copy.deepcopy(model)
    assert all(p.requires_grad for p in draft.parameters())
    manager = SpecBatchingManager(model, generation(max_new_tokens=8), batching(),
                                  speculation=speculation(3, draft_model=draft))
    manager.start()
    try:
        manager.get_result(manager.add_request(PROMPTS[0], max_new_tokens=8), timeout=60)
        drafter = manager.batch_processor.drafter.drafter
        assert drafter.runner.forwards > 0
        assert not drafter._known.requires_grad
        assert not any(t.requires_grad for layer in drafter.runner.slots.cache.layers for t in (layer.keys, layer.values))
    finally:
        manager.stop(block=True, timeout=60)


@pytest.mark.parametrize("policy", [None, "nightjar", "dsd", "adaspec"])
def test_the_policies_by_name_draft_and_give_plain_output(model, policy, forward_clock):
    """"auto" by default with a draft model, Nightjar, DSD and AdaSpec by name, as generate_batch
    builds them, with a draft 8x cheaper than the target (the test clock's costs; the profiled
    policies' latency models say the same): each drafts and gives plain output; AdaSpec, weighing
    the draft model's confidences, trims drafts."""
    from hf_specdec.continuous_batching import speculation_from
    from hf_specdec.costmodel import CostProfile, LatencyModel, SwitchCostTable
    from hf_specdec.testing import noisy_copy
    config, cb = generation(), batching()
    expected = plain(model, PROMPTS, config, cb)
    draft = noisy_copy(model, 0.5)
    forward_clock.costs[model], forward_clock.costs[draft] = 8.0, 1.0
    spec = speculation_from(model, config, assistant_model=draft, spec_policy=policy)
    if policy in ("dsd", "adaspec"):       # measured tiny models cost the same: forward overhead
        spec.policy.length.use_profile(CostProfile(LatencyModel(1e-6, 1e-3, 8e-2), LatencyModel(1e-7, 1e-4, 1e-2),
                                                   SwitchCostTable([1], [1], [[1e-2]])))
    trims, trim = [], spec.policy.trim

    def counted(lengths, confidences):
        kept = trim(lengths, confidences)
        trims.append(sum(lengths) - sum(kept))
        return kept
    object.__setattr__(spec.policy, "trim", counted)
    got, counts = run(model, PROMPTS, config, cb, spec)
    assert got == expected
    assert 0 < counts.accepted < counts.drafted
    assert (sum(trims) > 0) == (policy == "adaspec"), trims


def test_a_policy_sees_the_decoding_requests_and_k_0_is_transformers_own_step(model, monkeypatch):
    from helpers import Scripted
    from hf_specdec.policies import SpecPolicy
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
    config, cb = generation(max_new_tokens=16), batching()
    expected = plain(model, PROMPTS, config, cb)
    plain_steps, original = [], ContinuousBatchProcessor._generation_step
    monkeypatch.setattr(ContinuousBatchProcessor, "_generation_step",
                        lambda self, model: (plain_steps.append(1), original(self, model))[1])
    drafters = [{"lookup": PromptLookupDrafter()}] * 2 + [{"draft_model": copy.deepcopy(model)}]
    for ks, drafter in zip((lambda step: 0, lambda step: step % 3, lambda step: 3 * (step % 5 == 4)), drafters):
        length = Scripted(ks)          # (a draft model then follows the requests only every 5th step)
        plain_steps.clear()
        got, counts = run(model, PROMPTS, config, cb, Speculation(policy=SpecPolicy(length=length), **drafter))
        assert got == expected
        assert all(1 <= c.batch_size <= len(PROMPTS) for c in length.contexts)
        assert max(c.batch_size for c in length.contexts) == len(PROMPTS)       # all decode together
        assert len(plain_steps) == counts.steps - counts.drafting_steps   # Transformers' own step, when none drafts
        assert bool(counts.drafting_steps) == (ks(1) != 0 or ks(2) != 0 or ks(4) != 0)
        lags = [c.max_lag for c in length.contexts]
        # the draft model's lag: whole prompts as requests join, the tokens of 4 plain steps after them
        assert max(lags) >= max(map(len, PROMPTS)) and 4 in lags if "draft_model" in drafter else not any(lags)
    assert counts.accepted == counts.drafted > 0         # the draft model caught up every time


def test_streaming_delivers_accepted_tokens_as_they_come(model):
    """streaming=True: each delivery a prefix of the final output, which is plain; a step that
    accepts drafts delivers them together."""
    config, cb = generation(max_new_tokens=20), batching()
    expected = plain(model, PROMPTS, config, cb)
    manager = SpecBatchingManager(model, config, cb, speculation=speculation(4, draft_model=copy.deepcopy(model)))
    manager.start()
    try:
        ids = [manager.add_request(p, request_id=f"req_{i}", max_new_tokens=20, streaming=True)
               for i, p in enumerate(PROMPTS)]
        deliveries, final = {i: [] for i in ids}, {}
        while len(final) < len(ids):
            result = manager.get_result(timeout=60)
            assert result is not None and result.error is None
            deliveries[result.request_id].append(list(result.generated_tokens))
            if result.is_finished():
                final[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=60)
    assert final == expected
    for rid, seen in deliveries.items():
        assert all(expected[rid][:len(d)] == d for d in seen)
        assert len(seen) < len(expected[rid])          # several tokens a delivery


def test_num_return_sequences_forks_requests_with_their_drafts(model):
    # sampling with top_k=1: forks need do_sample, and the outputs stay deterministic
    config = generation(max_new_tokens=16, num_return_sequences=2, do_sample=True, top_k=1)
    cb = batching(max_batch_tokens=8)
    expected = plain(model, PROMPTS, config, cb)
    assert len(expected) == 2 * len(PROMPTS)
    hf_specdec.enable(model)
    try:
        out = model.generate_batch(PROMPTS, config, cb, prompt_lookup_num_tokens=3)
    finally:
        hf_specdec.disable(model)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected


def test_eos_inside_accepted_drafts_and_max_new_tokens(model, monkeypatch):
    """An EOS among a step's accepted drafts ends the request there (the tokens accepted after it
    dropped), and max_new_tokens cuts the drafts: plain output. The oracle drafts the run without
    EOS, so the drafts run past the EOS position; the test counts the steps that accept one."""
    from hf_specdec.batch_processor import SpecBatchProcessor
    free = plain(model, PROMPTS, generation(), batching())
    eos = free["req_2"][5]                       # a token some requests emit mid-way
    inside, accept = [], SpecBatchProcessor._accept

    def spy(processor, scores, output_ids):
        accept(processor, scores, output_ids)
        inside.extend(rid for rid, v in processor._verdicts.items() if len(v.appended) < v.accepted)
    monkeypatch.setattr(SpecBatchProcessor, "_accept", spy)
    for config in (generation(eos_token_id=eos), generation(max_new_tokens=7)):
        expected = plain(model, PROMPTS, config, batching())
        got, _ = run(model, PROMPTS, config, batching(), speculation(6, lookup=Oracle(PROMPTS, free)))
        assert got == expected
        if config.eos_token_id == eos:
            stopped = [rid for rid, tokens in expected.items() if len(tokens) < 24]
            assert stopped and all(expected[rid][-1] == eos for rid in stopped)
            assert set(inside) & set(stopped), inside        # an EOS accepted as a draft


def test_cancelled_request_leaves_the_others_exact_and_frees_its_blocks(model):
    config, cb = generation(max_new_tokens=40), batching()
    expected = plain(model, PROMPTS, config, cb)
    got, _ = run(model, PROMPTS, config, cb, speculation(3, lookup=PromptLookupDrafter()), cancel=2)
    assert got == {rid: tokens for rid, tokens in expected.items() if rid != "req_2"}


def test_prefix_sharing_over_a_second_round_built_from_the_first(model):
    config, cb = generation(max_new_tokens=16), batching(page_size=4)
    first = plain(model, PROMPTS, config, cb)
    second_prompts = [p + first[f"req_{i}"][:9] for i, p in enumerate(PROMPTS)]
    expected = plain(model, second_prompts, config, cb)
    manager = SpecBatchingManager(model, config, cb, speculation=speculation(3, lookup=PromptLookupDrafter()))
    manager.start()
    try:
        rounds = []
        for prompts in (PROMPTS, second_prompts):
            ids = manager.add_requests(inputs=prompts, max_new_tokens=16)
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=60)
                assert result is not None and result.error is None
                if result.is_finished():
                    results[result.request_id] = result.generated_tokens
            rounds.append([results[i] for i in ids])
        cache = manager.batch_processor.cache
        shared = sum(len(a.ledger.block_to_hash) for a in cache.cache_allocators.values())
    finally:
        manager.stop(block=True, timeout=60)
    assert rounds[0] == [first[f"req_{i}"] for i in range(len(PROMPTS))]
    assert rounds[1] == [expected[f"req_{i}"] for i in range(len(PROMPTS))]
    assert shared > 0
    assert_no_block_leaked(cache)


def test_a_prompt_longer_than_the_cache_is_refused_and_the_loop_goes_on(model):
    """Transformers' loop fails on a prompt its paged cache cannot hold, and with it every request in
    flight and after; ours refuses it in add_request and serves the others."""
    from hf_specdec.continuous_batching import RequestRefused
    config, cb = generation(max_new_tokens=8), batching(num_blocks=16)       # 16 blocks of 4 tokens
    manager = SpecBatchingManager(model, config, cb, speculation=speculation(3, lookup=PromptLookupDrafter()))
    manager.start()
    try:
        with pytest.raises(RequestRefused, match="the prompt has 64 tokens; the paged cache holds 64"):
            manager.add_request(list(range(1, 65)), max_new_tokens=8)
        request = manager.add_request(PROMPTS[0], max_new_tokens=8)
        result = manager.get_result(request, timeout=60)
    finally:
        manager.stop(block=True, timeout=60)
    assert result.error is None and result.generated_tokens == plain(model, PROMPTS[:1], config, cb)["req_0"]


def test_what_speculation_cannot_run_is_refused_before_any_work(model):
    spec = speculation(3, lookup=PromptLookupDrafter())
    with pytest.raises(ValueError, match="use_async_batching"):
        SpecBatchingManager(model, generation(), batching(use_async_batching=True), speculation=spec)
    with pytest.raises(ValueError, match="sliding-window"):
        SpecBatchingManager(build("mistral"), generation(), batching(), speculation=spec)
    with pytest.raises(ValueError, match="recurrent or convolution layers"):
        SpecBatchingManager(tiny_stateful("lfm2"), generation(), batching(), speculation=spec)
    hf_specdec.enable(model)
    try:
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be"):
            model.generate_batch(PROMPTS, generation(), batching(), prompt_lookup_num_tokens=0)
        with pytest.raises(ValueError, match="assistant_models not supported in continuous batching"):
            model.generate(torch.tensor([PROMPTS[0]]), generation_config=generation(), cache_implementation="paged",
                           assistant_models=[build("llama", layers=1)])
        with pytest.raises(ValueError, match="spec_policy"):
            model.generate_batch(PROMPTS, generation(), batching(), prompt_lookup_num_tokens=2, spec_policy="fixed:x")
        with pytest.raises(ValueError, match="not both"):
            model.generate_batch(PROMPTS, generation(), batching(), assistant_model=build("llama", layers=1),
                                 prompt_lookup_num_tokens=2)
        with pytest.raises(ValueError, match="vocab"):
            model.generate_batch(PROMPTS, generation(), batching(), assistant_model=build("llama", vocab=VOCAB + 8))
    finally:
        hf_specdec.disable(model)


SAMPLE_VOCAB, SAMPLE_PROMPT, SAMPLES = 6, [3, 5, 4, 3], 6000
NEW, CHAIN = 5, 3      # new tokens per request (the prefill's, then a step with up to CHAIN drafts, ...)
SAMPLING = dict(do_sample=True, temperature=0.5, top_k=2)     # at most 2 ** NEW sequences: a tight TV test


def conditional(joint: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """p(next token | the first new tokens `prefix`) [V] from a joint over the new tokens [V] * NEW."""
    marginal = joint.sum(tuple(range(len(prefix) + 1, joint.ndim))) if len(prefix) + 1 < joint.ndim else joint
    row = marginal[tuple(prefix)]
    return row / row.sum()


def next_token(model, sampling=SAMPLING):
    """q(next token | the first new tokens) [V] under generate()'s own processing of `sampling`, memoized."""
    @functools.cache
    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        ids = torch.tensor([SAMPLE_PROMPT + list(prefix)])
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                              return_dict_in_generate=True, **sampling).scores[0].softmax(-1)[0]
    return lambda prefix: probs(tuple(prefix))


class Greedy(LookupDrafter):
    """Drafts the target's most likely continuation, token by token (a point mass: any deterministic
    drafter is)."""

    def __init__(self, joint: torch.Tensor):
        self.joint = joint

    def q(self, prefix: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(conditional(self.joint, prefix).argmax(), SAMPLE_VOCAB).float()

    def continuation(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        new, drafts = tokens.tolist()[len(SAMPLE_PROMPT):], []
        while len(drafts) < k and len(new) < NEW:
            drafts.append(int(self.q(new).argmax()))
            new.append(drafts[-1])
        return torch.tensor(drafts, dtype=torch.long)


def expected_counts(p, q) -> tuple[float, float, float, float]:
    """(mean, variance) of the drafts a request accepts and of those it verifies, exactly, when each
    step drafts min(CHAIN, room - 1) tokens from q(prefix) [V] and verifies them against p(prefix)
    by rejection sampling: every outcome enumerated (the first token comes from the prefill)."""
    def request(prefix, room):                    # -> [(probability, accepted, drafted)]
        return [(1.0, 0, 0)] if room == 0 else step(prefix, min(CHAIN, room - 1), room, min(CHAIN, room - 1))

    def step(prefix, left, room, k):              # `left` of the step's k drafts still to verify
        target, out = p(prefix), []
        if left == 0:                              # the bonus token (or a step without drafts)
            return [(target[y] * pr, a, d + k) for y in target.nonzero().flatten().tolist()
                    for pr, a, d in request(prefix + [y], room - 1)]
        draft = q(prefix)
        accept, residual = torch.minimum(target, draft), (target - draft).clamp(min=0)
        out += [(accept[x] * pr, a + 1, d) for x in accept.nonzero().flatten().tolist()
                for pr, a, d in step(prefix + [x], left - 1, room - 1, k)]
        out += [(residual[y] * pr, a, d + k) for y in residual.nonzero().flatten().tolist()
                for pr, a, d in request(prefix + [y], room - 1)]
        return out

    first = p([])
    leaves = [(first[y] * pr, a, d) for y in first.nonzero().flatten().tolist() for pr, a, d in request([y], NEW - 1)]
    prob = torch.tensor([float(pr) for pr, _, _ in leaves])
    moments = []
    for values in (torch.tensor([float(a) for _, a, _ in leaves]), torch.tensor([float(d) for _, _, d in leaves])):
        mean = (prob * values).sum()
        moments += [float(mean), float((prob * (values - mean) ** 2).sum())]
    return tuple(moments)


def sampled_joint(model, speculation, seed, per_request):
    """Frequencies of the NEW tokens [V] * NEW over SAMPLES requests of one prompt, in waves that one
    step prefills (no request drafts while a prompt waits)."""
    config = generation(max_new_tokens=NEW, **SAMPLING)
    results, counts = run(model, [SAMPLE_PROMPT] * SAMPLES, config,
                          batching(max_batch_tokens=512, seed=seed, per_request_processors=per_request),
                          speculation, wave=64)
    frequencies = torch.zeros([SAMPLE_VOCAB] * NEW)
    for tokens in results.values():
        frequencies[tuple(tokens)] += 1
    return frequencies / SAMPLES, counts


def accept_all(drafts, counts, *args):
    """A sampler without the acceptance test: every draft kept."""
    return VerifyResult(num_accepted=counts, next_tokens=verify(drafts, counts, *args).next_tokens)


def no_residual(drafts, counts, scores, draft_probs, do_sample, *args):
    """A sampler that replaces a rejected draft with a draw from p, not from the residual max(0, p - q)."""
    result = verify(drafts, counts, scores, draft_probs, do_sample, *args)
    p = torch.softmax(scores[torch.arange(len(counts)), result.num_accepted], -1)
    redrawn = torch.multinomial(p, 1).squeeze(1)
    return VerifyResult(result.num_accepted, torch.where(result.num_accepted < counts, redrawn, result.next_tokens))


def raw_draft(processors, input_ids, scores, arguments):
    """A draft that samples its raw logits, not through the target's warpers (lossless: its q is
    verified, but its drafts are accepted at another rate than the warped q's)."""
    return scores


CONFIGURATIONS = {"config-warpers": False, "per-request-processors": True}


@pytest.mark.parametrize("configuration,drafter,broken", [
    *[(c, d, None) for c in CONFIGURATIONS for d in ("lookup", "model")],
    *[("config-warpers", d, accept_all) for d in ("lookup", "model")], ("config-warpers", "model", no_residual),
    *[(c, "model", raw_draft) for c in CONFIGURATIONS]])
def test_sampling_follows_the_target_and_a_broken_sampler_is_caught(monkeypatch, configuration, drafter, broken):
    """The NEW tokens' joint distribution over SAMPLES requests is the target's (TV distance within
    the null's spread) with chains of CHAIN drafts accepted in part,
    from a lookup's point masses and from a draft model sampling through the target's warpers (the
    generation config's, or per request); the drafts accepted and verified are what rejection
    sampling gives for that q (mean within 4 standard deviations). Each broken acceptance fails
    the TV test; a draft that ignores the warpers stays lossless but fails the acceptance check.
    (Temperature 0.5 and top-k 2 in the generation config.)"""
    from test_sampling import exact_distribution
    target = build("llama", layers=2, seed=0, vocab=SAMPLE_VOCAB, hidden=32, init=0.6)
    exact = exact_distribution(target, torch.tensor([SAMPLE_PROMPT]), NEW, SAMPLING)
    # the TV distance of SAMPLES draws from `exact` itself, the test's null
    null = [0.5 * (torch.bincount(torch.multinomial(exact.flatten(), SAMPLES, replacement=True),
                                  minlength=exact.numel()) / SAMPLES - exact.flatten()).abs().sum() for _ in range(5)]
    if broken is raw_draft:
        monkeypatch.setattr("hf_specdec.request_rows.cb.process", raw_draft)
    elif broken is not None:
        monkeypatch.setattr("hf_specdec.batch_processor.verify", broken)
    if drafter == "lookup":
        source = {"lookup": Greedy(exact)}
        q = source["lookup"].q
    else:
        source = {"draft_model": noisy_copy(target, 0.05)}      # accepts about 0.55 of its drafts
        q = next_token(source["draft_model"])
    joint, counts = sampled_joint(target, speculation(CHAIN, **source), 1, CONFIGURATIONS[configuration])
    tv = 0.5 * (joint - exact).abs().sum()
    accepted, accepted_var, drafted, drafted_var = expected_counts(functools.partial(conditional, exact), q)
    assert 0.3 < accepted / drafted < 0.9         # chains accepted in part: every outcome occurs
    lossless = tv <= 2 * max(null)
    as_expected = abs(counts.accepted - SAMPLES * accepted) < 4 * (SAMPLES * accepted_var) ** 0.5 and \
        abs(counts.drafted - SAMPLES * drafted) < 4 * (SAMPLES * drafted_var) ** 0.5
    detail = (f"TV {tv:.4f}, null {max(null):.4f}; accepted {counts.accepted} (expected {SAMPLES * accepted:.0f}), "
              f"drafted {counts.drafted} (expected {SAMPLES * drafted:.0f})")
    assert lossless == (broken in (None, raw_draft)), detail
    if broken in (None, raw_draft):       # (a broken acceptance may keep the right share: its TV fails)
        assert as_expected == (broken is None), detail


@pytest.mark.parametrize("per_request", [False, True], ids=CONFIGURATIONS)
def test_sampling_accepts_what_generate_accepts(model, per_request):
    """Rejection sampling with a draft that samples as the request does, at temperature 0.7 and top-k
    10 (the generation config's warpers, or per request): a noisy copy of the target accepts the
    share generate() does with the same pair, k and settings."""
    config = generation(max_new_tokens=20, do_sample=True, temperature=0.7, top_k=10)
    draft = noisy_copy(model, 0.02)       # its raw logits would be accepted about 0.4, its warped ones 0.65
    _, counts = run(model, PROMPTS * 8, config, batching(seed=0, per_request_processors=per_request),
                    speculation(4, draft_model=draft))
    shares = [counts.accepted / counts.drafted]
    hf_specdec.enable(model)
    try:
        stats = []
        for prompt in PROMPTS * 8:
            out = model.generate(torch.tensor([prompt]), generation_config=config, eos_token_id=None, assistant_model=draft,
                                 spec_policy="fixed:4", return_dict_in_generate=True)
            stats.append(out.spec_stats)
    finally:
        hf_specdec.disable(model)
    steps = [step for s in stats for step in s.steps]
    shares.append(sum(map(sum, (st.accepted for st in steps))) / sum(map(sum, (st.proposed for st in steps))))
    assert 0.1 < shares[1] < 0.9 and abs(shares[0] - shares[1]) < 0.1, shares


@pytest.mark.parametrize("per_request", [False, True], ids=["config-warpers", "per-request-processors"])
def test_a_copy_of_the_target_drafts_through_the_target_s_warpers(model, per_request):
    """Temperature 0.7 and top-k 10 in the generation config: Transformers' continuous batching
    warps the target's logits with them, per request or (`per_request_processors` off, its default)
    as the config's own processors. The draft samples through the same warpers, so a copy of the
    target (p = q) has every draft accepted; drafting from its raw logits, most were rejected."""
    config = generation(max_new_tokens=20, do_sample=True, temperature=0.7, top_k=10)
    cb_config = batching(seed=0, per_request_processors=per_request)
    _, counts = run(model, PROMPTS * 2, config, cb_config, speculation(4, draft_model=copy.deepcopy(model)))
    assert counts.accepted >= 0.98 * counts.drafted > 0, (counts.accepted, counts.drafted)


def test_the_benchmark_baseline_is_transformers_own_manager(model, monkeypatch):
    """eval/bench_continuous_batching.py's "plain" runs Transformers' manager and processor, none of
    ours, even on an enabled model; its lookup method runs ours, with the same outputs."""
    import sys
    from pathlib import Path
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))
    import bench_continuous_batching as bench
    from methods import Method
    managers = []
    original = ContinuousBatchingManager.start
    monkeypatch.setattr(ContinuousBatchingManager, "start", lambda self: (managers.append(self), original(self))[1])
    hf_specdec.enable(model)
    try:
        runs = [bench.serve(model, method, PROMPTS, generation(), batching(), concurrency=2)
                for method in (Method("plain"), Method("lookup:3", k=3))]
        arrivals = bench.serve(model, Method("lookup:3", k=3), PROMPTS, generation(), batching(),
                               arrivals=[0.0, 0.0, 0.05, 0.1, 0.1, 0.2])    # the open loop: the same outputs
        ours = bench.serve(model, Method("generate"), PROMPTS, generation(), batching(), draft=copy.deepcopy(model),
                           concurrency=4)       # our generate() in batches of 4 (left-padded): the same outputs
    finally:
        hf_specdec.disable(model)
    assert type(managers[0]) is ContinuousBatchingManager and runs[0]["counts"] is None
    assert isinstance(managers[1], SpecBatchingManager) and runs[1]["counts"].drafted
    assert {r: o.tokens for r, o in runs[0]["results"].items()} == \
        {r: o.tokens for r, o in runs[1]["results"].items()} == {r: o.tokens for r, o in arrivals["results"].items()} \
        == {r: o.tokens for r, o in ours["results"].items()}
    rescore = bench.rescorer(model, PROMPTS, generation())
    row = bench.summary(runs[1], runs[0]["results"], rescore)
    assert row["identical"] == len(PROMPTS) and row["drafted"] > 0 and row["near_tie"] == row["other"] == 0
    changed = runs[1]["results"]["r2"]               # a request whose tokens changed is re-scored: a float32
    changed.tokens[3] = (changed.tokens[3] + 1) % VOCAB   # target has no near-tie there
    row = bench.summary(runs[1], runs[0]["results"], rescore)
    assert (row["identical"], row["near_tie"], row["other"]) == (len(PROMPTS) - 1, 0, 1)


def test_blocks_are_hashed_only_over_tokens_in_the_cache(model, monkeypatch):
    """Prefix sharing hashes a block once the cache holds all its tokens: never one whose last slots
    hold rejected drafts (or the pending token, which the next forward writes)."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    config, cb = generation(max_new_tokens=24), batching(page_size=4)
    expected = plain(model, PROMPTS, config, cb)
    over = []
    mark = PagedAttentionCache.mark_complete_blocks

    def checked(cache, state, complete_blocks):
        mark(cache, state, complete_blocks)
        for allocator in cache.cache_allocators.values():
            table = allocator.block_table.get(state.request_id, [])
            hashed = sum(allocator.ledger.block_to_hash.get(b) is not None for b in table)
            if hashed > state.position_offset // allocator.tokens_per_page:
                over.append((state.request_id, hashed, state.position_offset))
    monkeypatch.setattr(PagedAttentionCache, "mark_complete_blocks", checked)
    got, counts = run(model, PROMPTS, config, cb, speculation(4, lookup=Oracle(PROMPTS, expected)))
    assert got == expected and counts.drafted > counts.accepted
    assert not over, over


def test_the_manager_is_built_by_transformers_own_init_continuous_batching(model, monkeypatch):
    """An enabled model's `init_continuous_batching` runs Transformers' own (its checks, its attention
    switch, the continuous batching config a generation config carries) and makes the manager it
    built ours."""
    calls = []
    own = type(model).init_continuous_batching
    monkeypatch.setattr(type(model), "init_continuous_batching",
                        lambda self, *a, **k: (calls.append(a), own(self, *a, **k))[1])
    config = generation()
    config.continuous_batching_config = batching(num_blocks=32)      # (deprecated in Transformers, still read)
    hf_specdec.enable(model)
    try:
        manager = model.init_continuous_batching(config, prompt_lookup_num_tokens=3)
        assert isinstance(manager, SpecBatchingManager) and len(calls) == 1
        assert manager.continuous_batching_config.num_blocks == 32 and manager.generation_config is config
        assert manager.speculation.lookup is not None
        out = model.generate_batch(PROMPTS, config, prompt_lookup_num_tokens=3)
    finally:
        hf_specdec.disable(model)
    assert {rid: o.generated_tokens for rid, o in out.items()} == plain(model, PROMPTS, generation(), batching())


def test_serve_speculates_with_the_draft_once_loaded_and_checks_its_arguments_first(model):
    """`python -m hf_specdec serve`'s hook on the loaded model (tests/test_serve.py runs the server):
    a bad argument fails before the model is changed; then each manager the server makes speculates."""
    import argparse
    from hf_specdec import serve
    target = build("llama", layers=2)
    with pytest.raises(ValueError, match="spec_policy"):
        serve.speculate(target, lambda name: copy.deepcopy(target), draft="copy", spec_policy="no-such-policy")
    assert target.init_continuous_batching.__func__ is type(target).init_continuous_batching    # untouched
    serve.speculate(target, lambda name: copy.deepcopy(target), draft="copy")
    manager = target.init_continuous_batching(generation(), batching())
    assert isinstance(manager, SpecBatchingManager) and manager.speculation.draft_model is not None
    hf_specdec.disable(target)
    assert type(target.init_continuous_batching(generation(), batching())) is not SpecBatchingManager
    args = argparse.Namespace(model="m", draft="d", prompt_lookup_num_tokens=None, max_matching_ngram_size=None,
                              spec_policy=None)
    with pytest.raises(ValueError, match="--compile"):
        serve.run(args, ["--port", "8000", "--compile"])
