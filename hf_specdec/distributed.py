"""Tensor parallelism: every rank runs the same loop, and every decision in it is rank 0's.

Under Transformers' tensor parallelism (`torchrun`, `from_pretrained(...,
distributed_config=DistributedConfig(tp_plan="auto"))`) each rank runs `generate()` on the same
inputs and every forward of the sharded target is a collective: the ranks must run the same
forwards, of the same shapes, in the same order. The models' numbers agree on every rank (a
sharded forward ends in collectives that hand each rank the same logits; a replicated draft
computes the same on each), so the loop's own bookkeeping agrees. What does not are the inputs
of a policy's decisions: each rank's clock (step times, profiles), and random draws. So rank 0's
policy decides and broadcasts (`RankZeroPolicy`: a few ints per step, and per draft token for a
policy that reads confidences); the other ranks' policies stay idle. Sampling draws from a
generator with rank 0's state (`Ranks.shared_generator`), a cost profile is measured by all ranks
together and rank 0's is kept (`costmodel.cached_profile`), and stopping criteria other than
generate()'s own (max_time, for one) are rank 0's (`RankZeroCriteria`).

A drafter is either replicated (each rank holds the whole model) or sharded over the target's
ranks with its logits gathered; `check` refuses other setups on every rank before any work.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import StoppingCriteria

from ._compat import modeling, tensor_parallel
from .policies import Decision, SpecPolicy, StepContext
from .stats import StepRecord


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """The ranks a tensor-parallel target is sharded over."""

    group: object           # torch.distributed ProcessGroup
    source: int             # global rank of the group's rank 0: the one that decides
    decides: bool           # this process is that rank
    device: torch.device    # where a collective's tensors live (CPU for gloo, the GPU for nccl)

    def share(self, values: list[int] | None, count: int) -> list[int]:
        """Rank 0's `values` (`count` ints; None on the other ranks) on every rank."""
        if self.decides:
            tensor = torch.tensor(values, dtype=torch.long, device=self.device)
        else:
            tensor = torch.empty(count, dtype=torch.long, device=self.device)
        dist.broadcast(tensor, src=self.source, group=self.group)
        return tensor.tolist()

    def share_object(self, obj):
        """Rank 0's `obj` (picklable) on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.source, group=self.group, device=self.device)
        return box[0]

    def all_true(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank."""
        flag = torch.tensor([0 if ok else 1], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return not flag.item()

    def shared_generator(self, generator: torch.Generator | None, device: torch.device) -> torch.Generator:
        """A generator that draws alike on every rank: `generator` set to rank 0's state, or (None)
        a new one on `device` seeded by rank 0's draw from torch's global RNG (each rank draws once,
        so the global RNGs stay in step too)."""
        if generator is not None:
            generator.set_state(self.share_object(generator.get_state() if self.decides else None))
            return generator
        seed = int(torch.randint(2 ** 62, (1,)))
        return torch.Generator(device).manual_seed(self.share([seed] if self.decides else None, 1)[0])


def ranks_of(model) -> Ranks | None:
    """The tensor-parallel ranks of `model`, or None when it is whole on this process (no
    torch.distributed, or data parallelism: each process runs its own calls)."""
    group = tensor_parallel.tensor_parallel_group(model)
    if group is None:
        return None
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else modeling.execution_device(model)
    return Ranks(group=group, source=dist.get_global_rank(group, 0), decides=dist.get_rank(group) == 0, device=device)


def check(ranks: Ranks, model, drafters, input_ids: torch.Tensor, draft_offload) -> None:
    """What tensor parallelism needs, checked on every rank before any work (each rank raises
    the same error, rather than one rank raising while the others wait in a collective)."""
    if draft_offload is not None and draft_offload is not False:
        raise ValueError("draft_offload is not supported under tensor parallelism: each rank would move its draft "
                         "on its own memory readings; leave it unset")
    target_ranks = dist.get_process_group_ranks(ranks.group)
    for name, one in [("the target", model)] + [(f"assistant_models[{i}]", m) for i, d in enumerate(drafters)
                                                 for m in d.models()]:
        group = tensor_parallel.tensor_parallel_group(one)
        if group is not None and dist.get_process_group_ranks(group) != target_ranks:
            raise ValueError(f"{name} is sharded over ranks {dist.get_process_group_ranks(group)}, the target over "
                             f"{target_ranks}: a drafter must be replicated (loaded "
                             "without distributed_config) or sharded over the target's ranks")
        if group is not None and tensor_parallel.shards_logits(one):
            raise ValueError(f"{name}'s tensor-parallel plan leaves each rank a shard of the vocabulary's logits "
                             "(its output head is not gathered); speculative decoding verifies full distributions: "
                             "use a plan whose output head gathers (\"colwise_gather_output\", as tp_plan='auto')")
    same = ranks.share_object(input_ids.cpu() if ranks.decides else None)
    if not ranks.all_true(same.shape == input_ids.shape and bool((same == input_ids.cpu()).all())):
        raise ValueError("input_ids differ between the ranks of a tensor-parallel target: every rank must pass "
                         "the same inputs to generate()")


class RankZeroPolicy(SpecPolicy):
    """`policy` decides on rank 0, and every rank runs its decisions; the other ranks' `policy`
    stays idle (it never chooses or observes). One broadcast per step (drafters, k, and whether
    to score the drafters), plus one per draft token for a policy that stops or trims drafts by
    their confidences."""

    def __init__(self, policy: SpecPolicy, ranks: Ranks):
        self.policy, self.ranks = policy, ranks
        self.selector, self.length = policy.selector, policy.length

    def begin(self, ctx: StepContext) -> None:
        self.policy.begin(ctx)

    def choose(self, ctx: StepContext) -> Decision:
        n = ctx.batch_size
        mine = None
        if self.ranks.decides:
            decision = self.policy.choose(ctx)
            drafters = [decision.drafter] * n if isinstance(decision.drafter, int) else list(decision.drafter)
            mine = [decision.k, int(decision.feedback), *drafters]
            if len(mine) != n + 2:      # a bad selector's answer: -1s, which the loop refuses on every rank
                mine = [decision.k, 0] + [-1] * n
        k, feedback, *drafters = self.ranks.share(mine, n + 2)
        return Decision(drafter=drafters, k=k, feedback=bool(feedback))

    def trim(self, lengths: list[int], confidences: list[list[float]]) -> list[int]:
        if self.length.verify_lengths is None:
            return lengths
        return self.ranks.share(self.policy.trim(lengths, confidences) if self.ranks.decides else None, len(lengths))

    @property
    def continue_drafting(self):
        hook = self.length.continue_drafting
        if hook is None:
            return None
        return lambda confidences: [bool(more) for more in self.ranks.share(
            [int(more) for more in hook(confidences)] if self.ranks.decides else None, len(confidences))]

    def observe(self, record: StepRecord) -> None:
        if self.ranks.decides:
            self.policy.observe(record)

    def __repr__(self):
        return f"RankZeroPolicy({self.policy!r})"


class RankZeroCriteria(StoppingCriteria):
    """Stopping criteria judged on rank 0 and broadcast: any criterion may read something other
    than the tokens (max_time reads the clock)."""

    def __init__(self, criteria, ranks: Ranks):
        self.criteria, self.ranks = criteria, ranks

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        n = input_ids.shape[0]
        mine = [int(s) for s in self.criteria(input_ids, scores, **kwargs).tolist()] if self.ranks.decides else None
        return torch.tensor(self.ranks.share(mine, n), dtype=torch.bool, device=input_ids.device)
