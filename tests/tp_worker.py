"""One rank of the tensor-parallel checks (tests/test_tensor_parallel.py runs it under torchrun, 2
processes, gloo). Loads the target saved in --models with `DistributedConfig(tp_plan="auto")`, runs
the cases of --job and writes what each rank saw to <--out>/rank<r>.json after every case:
per case the output tokens and each step's (k, drafters), or the error raised.

Jobs: "agree" (greedy identity, sampling, skewed clocks, stopping criteria, bad setups; rank 1's
clock runs 3x fast and its drafts sleep 20 ms a forward in the cases named "skewed ..."); "unsynced"
(the skewed cases with the agreement turned off: the negative control, expected to diverge or fail).
"""
import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig, StoppingCriteria

import hf_specdec
import hf_specdec.distributed
from hf_specdec.policies import FixedLength, Nightjar, SpecPolicy

args = argparse.ArgumentParser()
args.add_argument("--models", required=True)
args.add_argument("--out", required=True)
args.add_argument("--job", choices=("agree", "unsynced"), required=True)
args.add_argument("--samples", type=int, default=12000)   # rows of the sampling distribution case
args = args.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30 if args.job == "agree" else 10))
rank = dist.get_rank()
models = Path(args.models)
results = {}


def load(name, **kw):
    return AutoModelForCausalLM.from_pretrained(models / name, dtype=torch.float32, **kw).eval()


def tp(name, plan="auto"):
    return load(name, distributed_config=DistributedConfig(tp_plan=plan))


def record(name, fn):
    """Run one case; keep its tokens and decisions, or its error."""
    try:
        out = fn()
        if isinstance(out, torch.Tensor):
            results[name] = {"tokens": out.tolist()}
        else:
            results[name] = {"tokens": out.sequences.tolist(),
                             "steps": [[s.k, s.drafters] for s in out.spec_stats.steps]}
    except Exception as e:      # the error each rank raised is the result
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    save()


def save():
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))


def spec(model, drafters, policy, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=kw.pop("max_new_tokens", 24), pad_token_id=0,
                          custom_generate=hf_specdec.generate, assistant_models=drafters, spec_policy=policy,
                          return_dict_in_generate=True, **kw)


target, near, other = tp("target"), load("near"), load("other")
ids = torch.tensor([[5, 17, 33, 8, 61, 12, 40], [0, 0, 9, 71, 22, 9, 71], [0, 0, 0, 0, 44, 3, 58]])
mask = (ids != 0).long()
GREEDY = dict(do_sample=False, eos_token_id=None)

if args.job == "unsynced":
    hf_specdec.distributed.ranks_of = lambda model: None        # every rank decides on its own


def skew():
    """Rank 1's clock runs 3x fast, and its drafts take 20 ms longer a forward."""
    if rank == 1:
        real = time.perf_counter
        time.perf_counter = lambda: 3.0 * real()
        for draft in (near, other):
            draft.register_forward_hook(lambda *_: time.sleep(0.02))


if args.job == "agree":
    record("plain", lambda: target.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0, **GREEDY))
    cases = {"fixed:3": ([near], "fixed:3"), "auto": ([near], "auto"), "adaspec": ([near], "adaspec"),
             "hedgespec": ([near, other], "hedgespec"),
             "lookup": ([hf_specdec.PromptLookupDrafter(max_ngram=2)], "fixed:3")}
    for name, (drafters, policy) in cases.items():
        record(name, lambda: spec(target, drafters, policy, ids, mask, **GREEDY))
    near_tp = tp("near")
    record("sharded draft", lambda: spec(target, [near_tp], "fixed:3", ids, mask, **GREEDY))
    record("sharded draft, auto", lambda: spec(target, [near_tp, other], "hedgespec", ids, mask, **GREEDY))

    # sampling: ranks seeded differently, tokens alike (rank 0's generator state, or rank 0's seed)
    torch.manual_seed(rank)
    record("sampled", lambda: spec(target, [near], "auto", ids, mask, do_sample=True, temperature=1.2))
    record("sampled, generator", lambda: spec(target, [near], "fixed:2", ids, mask, do_sample=True,
                                              spec_generator=torch.Generator().manual_seed(100 + rank)))

    # a criterion that stops rank 1's rows earlier: rank 0's judgement holds on every rank
    class RankBiased(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= (12 if rank else 20), dtype=torch.bool)
    record("criteria", lambda: spec(target, [near], "fixed:3", ids, mask, stopping_criteria=[RankBiased()],
                                    **GREEDY))

    # bad setups: the same clear error on every rank, before any work (the job goes on)
    wide = load("wide_vocab")
    record("bad: vocabulary", lambda: spec(target, [wide], "fixed:3", ids, mask, **GREEDY))
    head_sharded = tp("near", plan={"lm_head": "colwise"})
    record("bad: sharded logits", lambda: spec(target, [head_sharded], "fixed:3", ids, mask, **GREEDY))
    record("bad: offload", lambda: spec(target, [near], "fixed:3", ids, mask, draft_offload=True, **GREEDY))
    record("bad: inputs", lambda: spec(target, [near], "fixed:3", ids + rank, mask, **GREEDY))

    # sampling distribution: the first two new tokens of one prompt, many seeded rows
    small, small_draft = tp("small"), load("small_draft")
    prompt = torch.tensor([[3, 5, 4, 3]])
    sampling = dict(do_sample=True, temperature=0.8, top_k=5, repetition_penalty=1.3, eos_token_id=None)
    out = small.generate(prompt.repeat(args.samples, 1), max_new_tokens=2, custom_generate=hf_specdec.generate,
                         assistant_models=[small_draft], spec_policy="fixed:1", pad_token_id=0,
                         spec_generator=torch.Generator().manual_seed(1), **sampling)
    results["distribution"] = {"tokens": out[:, prompt.shape[1]:].tolist()}
    save()

skew()
for name, policy in {"skewed auto": "auto", "skewed nightjar": Nightjar(max_len=4, explore=1.0),
                     "skewed adaspec": "adaspec",
                     "skewed hedgespec": SpecPolicy(hf_specdec.HedgeSpec(cost_aware=True), FixedLength(3))}.items():
    drafters = [near, other] if "hedgespec" in name else [near]
    record(name, lambda: spec(target, drafters, policy, ids, mask, **GREEDY))
# Transformers' own assisted loop (batch 1) with our policy
hf_specdec.enable(target, loop="transformers")
record("skewed transformers loop", lambda: target.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=24,
                                                           pad_token_id=0, assistant_models=[near],
                                                           spec_policy=Nightjar(max_len=4, explore=1.0),
                                                           return_dict_in_generate=True,
                                                           **GREEDY))
dist.destroy_process_group()
