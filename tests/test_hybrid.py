"""Hybrid models (recurrent or convolution layers beside attention) in our loop: each row's states
step back to its own accepted count (hf_specdec/states.py). Every stateful type of the installed
Transformers either runs, identical to plain generate(), or is refused before any work with its
layer kind named; sampling keeps the target's distribution."""
import logging

import pytest
import torch

import hf_specdec
from hf_specdec._compat import kv_cache, recurrent
from hf_specdec.testing import noisy_copy, prompts
from helpers import spec
from test_sampling import TV_BOUND, exact_distribution
from tiny_stateful import stateful_types, tiny_stateful

VOCAB = 96
logger = logging.getLogger(__name__)


def _runs(target, drafters, ids, mask, policy="fixed:3", new=16):
    out = spec(target, drafters, policy, input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
               return_dict_in_generate=True)
    return out.sequences, out.spec_stats.steps


def test_every_stateful_type_runs_identical_to_plain_or_is_refused_naming_its_layers():
    """Batch 1 and a left-padded batch of 3, with a noisy copy of the target (its own family) and
    with prompt lookup: greedy output is plain generate()'s, past at least 3 verification steps in
    which every row saw a rejection (a model drafter). A type our loop cannot roll back gets a
    ValueError naming its layer kind, and its cache is not touched (nothing ran)."""
    ran, refused = {}, {}
    for model_type in stateful_types():
        target = tiny_stateful(model_type, vocab=VOCAB)
        if target is None:
            continue
        reason = kv_cache.unsupported_layers(target)
        ids, mask = prompts(3, seed=4, min_len=3, max_len=9, vocab=VOCAB)
        if reason:
            with pytest.raises(ValueError, match=r"the target \(\w+\) has .+ layers"):
                spec(target, [hf_specdec.PromptLookupDrafter()], input_ids=ids, attention_mask=mask, max_new_tokens=4)
            refused[model_type] = reason
            continue
        draft = noisy_copy(target, 0.3, seed=1)
        for rows in (1, 3):
            plain = target.generate(input_ids=ids[-rows:], attention_mask=mask[-rows:], max_new_tokens=16,
                                    do_sample=False)
            out, steps = _runs(target, [draft], ids[-rows:], mask[-rows:])
            assert torch.equal(out, plain), (model_type, rows)
            rejected = [any(a < s.k for a in s.accepted[row:row + 1]) for s in steps for row in range(rows)]
            assert len(steps) >= 3 and all(any(rejected[row::rows]) for row in range(rows)), (model_type, rows)
            out, _ = _runs(target, [hf_specdec.PromptLookupDrafter()], ids[-rows:], mask[-rows:], "fixed:4")
            assert torch.equal(out, plain), (model_type, rows, "lookup")
        ran[model_type] = sorted(recurrent.state_kinds(target))
    logger.info("stateful types run: %s; refused: %s", ran, refused)
    assert {"qwen3_5_text", "nemotron_h", "lfm2"} <= set(ran), ran     # Gated DeltaNet, Mamba-2, convolution


def test_a_static_cache_is_refused_for_a_hybrid_before_any_work():
    target = tiny_stateful("qwen3_5_text", vocab=VOCAB)
    ids, mask = prompts(2, seed=4, vocab=VOCAB)
    with pytest.raises(ValueError, match=r"linear_attention layers, whose states .* default cache only"):
        spec(target, [hf_specdec.PromptLookupDrafter()], input_ids=ids, attention_mask=mask, max_new_tokens=4,
             cache_implementation="static")


SMALL_VOCAB = 6
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=5)
N = 12000


def _sampled(target, draft, prompt, seed):
    """Frequencies of the first two new tokens [t1, t2] over N seeded rows of fixed:1: t2 follows
    t1's verification, whose rejected draft the target's states must step back from."""
    out = spec(target, [draft], "fixed:1", input_ids=prompt.repeat(N, 1), max_new_tokens=2, eos_token_id=None,
               spec_generator=torch.Generator().manual_seed(seed), **SAMPLING)
    new = out[:, prompt.shape[1]:]
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    counts.index_put_((new[:, 0], new[:, 1]), torch.ones(N), accumulate=True)
    return counts / N


@pytest.fixture(scope="module", params=["qwen3_5_text", "nemotron_h"])      # Gated DeltaNet, Mamba-2
def hybrid(request):
    """A hybrid over 6 tokens with a spread-out next-token distribution that its recurrent layers'
    states decide (their weights scaled up, the attention layers' output zero)."""
    target = tiny_stateful(request.param, vocab=SMALL_VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(10)
        for name, module in target.named_modules():
            if hasattr(module, "conv1d"):            # a recurrent mixer
                for weight_name, weight in module.named_parameters():
                    weight.mul_(6 if weight_name.startswith(("in_proj", "conv1d")) else
                                2 if weight_name.startswith("out_proj") else 1)
            elif name.endswith("o_proj"):
                module.weight.zero_()
    prompt = torch.tensor([[3, 5, 4, 3]])
    return target, noisy_copy(target, 0.5, seed=1), prompt, exact_distribution(target, prompt, 2, SAMPLING)


def test_sampling_from_a_hybrid_target_keeps_its_distribution(hybrid):
    target, draft, prompt, exact = hybrid
    assert exact.max() < 0.5                    # (not one near-certain path)
    tv = 0.5 * (_sampled(target, draft, prompt, seed=1) - exact).abs().sum()
    assert tv < TV_BOUND, f"TV {tv:.4f}"


def test_negative_control_states_that_do_not_step_back_are_caught(hybrid, monkeypatch):
    """The same test with a rollback that keeps each row's states after its rejected draft."""
    target, draft, prompt, exact = hybrid
    monkeypatch.setattr(recurrent.StateLayer, "step_back", lambda self, tokens: setattr(self, "region", []))
    tv = 0.5 * (_sampled(target, draft, prompt, seed=1) - exact).abs().sum()
    assert tv > 3 * TV_BOUND, f"states that never step back went unnoticed (TV {tv:.4f})"


def test_a_hierarchy_with_a_hybrid_level_is_refused_where_it_is_built():
    hybrid = tiny_stateful("qwen3_5_text", vocab=VOCAB)
    with pytest.raises(ValueError, match=r"HierarchicalDrafter\(draft\) is a Qwen3_5ForCausalLM, whose recurrent"):
        hf_specdec.HierarchicalDrafter(hybrid, noisy_copy(hybrid, 0.1))
