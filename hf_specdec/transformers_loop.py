"""Transformers' own assisted loop (batch 1), driven by hf_specdec's drafters and policies.

    hf_specdec.enable(model, loop="transformers")
    model.generate(**inputs, assistant_models=[draft, hf_specdec.PromptLookupDrafter()], spec_policy="hedgespec")

For what only that loop serves: encoder-decoder targets (Whisper with a distil-whisper draft, T5),
`output_scores` / `output_logits`. Each drafter becomes the candidate generator Transformers would
build for it (a model: AssistedCandidateGenerator, encoder-decoder drafts included; a
PromptLookupDrafter: PromptLookupCandidateGenerator). Every step `SpecCandidateGenerator` asks the
policy which drafter drafts and how many tokens (0: a plain step), then tells it the outcome.
A full-information selector (HedgeSpec) has every drafter draft from the same prefix and scores
each on the verified tokens up to the first token any drafter missed: a drafter that diverged has
not drafted beyond. A confidence stop (ConfidenceThreshold, HFHeuristic's threshold) is handed to
Transformers' own generator; policies that trim drafts (AdaSpec) need the batched loop, as does
`spec_generator` (Transformers' loop draws from torch's global RNG).
"""
from __future__ import annotations

import time

import torch

from . import distributed
from ._compat import candidate_generators
from .drafters import ModelDrafter, PromptLookupDrafter
from .generate import ensure_profile
from .policies import ConfidenceThreshold, HFHeuristic, SpecPolicy, StepContext, resolve_policy
from .stats import SpecStats, StepRecord


class SpecCandidateGenerator(candidate_generators.CandidateGenerator):
    """children: Transformers candidate generators, one per drafter; policy: a SpecPolicy."""

    def __init__(self, children: list, policy: SpecPolicy, max_length: int, names: list[str]):
        self.children, self.policy, self.max_length = children, policy, max_length
        self.stats = SpecStats(drafter_names=names, policy=policy)
        self.step = 0

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a step drafts (Transformers 5.25 keeps that many steps of a recurrent
        cache's states to roll back to)."""
        return self.policy.max_len

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        length = input_ids.shape[1]
        ctx = StepContext(step=self.step, batch_size=1, num_drafters=len(self.children), rows=[0],
                          context_tokens=length, remaining=max(self.max_length - length, 0))
        if self.step == 0:
            self.policy.begin(ctx)
        self.ctx = ctx
        decision = self.policy.choose(ctx)
        self.drafter = decision.drafter if isinstance(decision.drafter, int) else decision.drafter[0]
        self.decided_k = decision.k
        self.k = min(decision.k, max(self.max_length - length - 1, 0))
        self.scoring = len(self.children) > 1 and decision.feedback
        self.start, self.candidates, self.seconds = length, {}, {}
        if self.k:
            for j in range(len(self.children)) if self.scoring else [self.drafter]:
                begin = time.perf_counter()
                candidate_generators.set_candidate_length(self.children[j], self.k)
                candidate_generators.sync_candidate_generator(self.children[j], length)
                self.candidates[j] = self.children[j].get_candidates(input_ids)
                self.seconds[j] = time.perf_counter() - begin
        self.verify_start = time.perf_counter()
        return self.candidates.get(self.drafter, (input_ids, None))

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        drafts = {j: ids[0, self.start:] for j, (ids, _) in self.candidates.items()}
        proposed = len(drafts.get(self.drafter, ()))
        record = StepRecord.of_step(
            self.ctx, self.k, self.decided_k, [proposed], [num_matches], drafters=[self.drafter if proposed else -1],
            draft_s=self.seconds.get(self.drafter, 0.0), verify_s=time.perf_counter() - self.verify_start,
            drafter_s={self.drafter: self.seconds[self.drafter]} if proposed else {},
            gammas={0: self._gammas(drafts, input_ids[0, self.start:])} if self.scoring and drafts else None,
            replay_s={j: s for j, s in self.seconds.items() if j != self.drafter})
        self.policy.observe(record)
        self.stats.steps.append(record)
        self.step += 1

    def _gammas(self, drafts: dict, verified: torch.Tensor) -> list[list[float]]:
        """Per verified position, whether each drafter proposed that token: up to and including the
        first position some drafter missed (beyond it that drafter's proposals assumed another prefix)."""
        hits = {j: (d[:len(verified)] == verified[:len(d)]).tolist() for j, d in drafts.items()}
        depth = min((h.index(False) + 1 if False in h else len(h)) for h in hits.values())
        depth = min(max(depth, 1), len(verified))
        return [[float(i < len(hits[j]) and hits[j][i]) for j in range(len(self.children))] for i in range(depth)]


def check(model, assistant_models, spec_policy, kwargs: dict) -> tuple[list, SpecPolicy, float]:
    """Validate a call for Transformers' loop; (each drafter as a model or a PromptLookupDrafter,
    policy, the confidence threshold Transformers' generators stop drafting at)."""
    if not isinstance(assistant_models, (list, tuple)) or not assistant_models:
        raise TypeError("assistant_models must be a non-empty list of models or PromptLookupDrafters")
    drafters = []
    for i, d in enumerate(assistant_models):
        d = d.model if isinstance(d, ModelDrafter) else d
        if not isinstance(d, (torch.nn.Module, PromptLookupDrafter)):
            raise TypeError(f"assistant_models[{i}]: with loop='transformers' a drafter is a model or a "
                            f"PromptLookupDrafter, got {type(d).__name__}; the batched loop runs the others")
        drafters.append(d)
    policy = resolve_policy(spec_policy, len(drafters))
    # a confidence stop is Transformers' generators' own; any other per-token hook they cannot ask
    threshold = policy.length.threshold if isinstance(policy.length, (ConfidenceThreshold, HFHeuristic)) else None
    if threshold is None and (policy.length.continue_drafting or policy.length.verify_lengths):
        raise ValueError(f"{policy.length!r} stops or trims drafts per token, which Transformers' loop cannot ask; "
                         "use it with the batched loop (enable(model)) or pick a per-step length policy")
    if kwargs.get("draft_offload") or kwargs.get("spec_generator") is not None:
        raise ValueError("draft_offload and spec_generator need the batched loop (enable(model))")
    inputs = kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("input_features")))
    if inputs is not None and getattr(inputs, "shape", (1,))[0] != 1:
        raise ValueError(f"Transformers' assisted loop runs batch 1, got a batch of {inputs.shape[0]}; "
                         "use the batched loop (enable(model)) for more rows")
    return drafters, policy, threshold or 0.0


def generate(model, original, args: tuple, kwargs: dict):
    """One generate() call through Transformers' assisted loop with our drafters and policy."""
    drafters, policy, threshold = check(model, kwargs.pop("assistant_models"), kwargs.pop("spec_policy", None), kwargs)
    ranks = distributed.ranks_of(model)
    # a policy that needs a cost profile (DSD, AdaSpec) gets this target's, as in the batched loop
    ensure_profile(policy, model, [ModelDrafter(d) if isinstance(d, torch.nn.Module) else d for d in drafters], 1,
                   ranks)
    if ranks is not None:        # tensor parallelism: every rank runs rank 0's decisions
        policy = distributed.RankZeroPolicy(policy, ranks)
    kwargs.pop("spec_generator", None)
    generator = None

    def build(call: dict):
        nonlocal generator
        children = [candidate_generators.own_candidate_generator(model, call, lookup_tokens=1, ngram=d.max_ngram)
                    if isinstance(d, PromptLookupDrafter) else
                    candidate_generators.own_candidate_generator(model, call, assistant=d, threshold=threshold)
                    for d in drafters]
        names = [getattr(d, "name", None) or type(d).__name__ for d in drafters]
        generator = SpecCandidateGenerator(children, policy, call["generation_config"].max_length, names)
        return generator
    # any model drafter puts generate() in its assisted mode; with lookup drafters only, prompt lookup does
    trigger = next((d for d in drafters if isinstance(d, torch.nn.Module)), None)
    kwargs.update(assistant_model=trigger) if trigger is not None else kwargs.update(prompt_lookup_num_tokens=1)
    out = candidate_generators.run_with_candidate_generator(model, build, original, *args, **kwargs)
    if not isinstance(out, torch.Tensor) and generator is not None:
        out.spec_stats = generator.stats
    return out
