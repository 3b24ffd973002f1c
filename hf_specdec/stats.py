"""Per-step records of a speculative `generate()` call and their summary. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class StepRecord:
    """One target forward, built by keyword. Lists are per active row, in batch order."""

    batch_size: int            # active rows in this step
    drafters: list[int]        # per row: index into assistant_models; -1 = no speculation (k = 0)
    k: int                     # the step's draft length (the policy's, within the room left)
    decided_k: int = -1        # the policy's `Decision.k` before the room left cut it (-1: = k)
    proposed: list[int]        # drafts actually proposed per row (<= k)
    accepted: list[int]        # drafts accepted per row
    emitted: list[int]         # tokens appended per row (accepted + 1, cut at a stop; without an
                               # EOS criterion generate() may later cut rows back, not subtracted here)
    draft_s: float             # wall time drafting; on a GPU, device work included only when the
    verify_s: float            # wall time of the target forward + verification; policy reads times
    rows: list[int] = field(default_factory=list)            # original batch index per row
    drafter_s: dict[int, float] = field(default_factory=dict)  # proposing time per drafter used
    # full-information feedback (when the selector asks for it): for each row still decoding after
    # the step, per newly verified position, every drafter's acceptance probability gamma
    gammas: dict[int, list[list[float]]] | None = None
    replay_s: dict[int, float] = field(default_factory=dict)   # scoring time per drafter
    step: int = -1             # index within the call; step 0 also prefills the prompt
    lag: int = 0               # tokens the drafters had to catch up before drafting (StepContext.max_lag)
    # wall time of the step's bookkeeping around drafting and verification (the decision, stopping
    # criteria per emitted token, retiring rows): it grows with the tokens a step emits, so a
    # policy comparing k must pay it too
    overhead_s: float = 0.0
    # a compiled forward of this step ran a shape for one of its first times (on a GPU: compiling or
    # recording a CUDA graph): its times are no steady cost, and policies learn none from them
    warmup: bool = False
    # prompt tokens of other requests prefilled in the same forward (continuous batching): the
    # step's time is theirs too
    prefill_tokens: int = 0

    @classmethod
    def of_step(cls, ctx, k: int, decided_k: int, proposed: list[int], accepted: list[int],
                emitted: list[int] | None = None, drafters: list[int] | None = None, **measured) -> "StepRecord":
        """The record of the step planned from `ctx` (a StepContext): what every executor of a step
        (the loop, the simulator, a hierarchy's inner cycle, Transformers' assisted loop) observes.
        emitted: accepted + 1 per row unless cut; drafters: drafter 0 for every row, -1 when k = 0;
        measured: the times and the other fields the executor measured."""
        return cls(batch_size=ctx.batch_size, drafters=drafters or [0 if k else -1] * ctx.batch_size, k=k,
                   decided_k=decided_k, proposed=proposed, accepted=accepted,
                   emitted=[a + 1 for a in accepted] if emitted is None else emitted,
                   rows=list(ctx.rows), step=ctx.step, lag=ctx.max_lag, **{"draft_s": 0.0, "verify_s": 0.0, **measured})

    @property
    def steady(self) -> bool:
        """Its times are its arm's steady cost: no compile warm-up, no other request's prefill."""
        return not self.warmup and not self.prefill_tokens

    @property
    def seconds(self) -> float:
        """The step's wall time, as a policy should weigh it (selector feedback scoring excluded)."""
        return self.draft_s + self.verify_s + self.overhead_s


@dataclass
class SpecStats:
    steps: list[StepRecord] = field(default_factory=list)
    drafter_names: list[str] = field(default_factory=list)   # assistant_models, in order
    policy: object = None   # the SpecPolicy that ran: under spec_policy="auto", the one that learns across calls
    prime_seconds: float = 0.0   # scoring drafters on the prompt before the first step (warm start)
    # lossy: Transformers' assistant_ensemble_weight, the weight the target verified with (None: lossless)
    ensemble_weight: float | None = None

    def drafter_row_steps(self) -> dict[str, int]:
        """How many (row, step) pairs each drafter drafted for ("none": k = 0)."""
        counts: dict[str, int] = {}
        for step in self.steps:
            for d in step.drafters:
                name = self.drafter_names[d] if d >= 0 else "none"
                counts[name] = counts.get(name, 0) + 1
        return counts

    @property
    def scoring_seconds(self) -> float:
        """Time spent scoring drafters for full-information feedback."""
        return self.prime_seconds + sum(sum(s.replay_s.values()) for s in self.steps)

    @property
    def target_forwards(self) -> int:
        return len(self.steps)

    @property
    def tokens_generated(self) -> int:
        return sum(sum(s.emitted) for s in self.steps)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per row per target forward, bonus token included (1.0 = no gain)."""
        row_forwards = sum(s.batch_size for s in self.steps)
        return self.tokens_generated / row_forwards if row_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        proposed = sum(sum(s.proposed) for s in self.steps)
        return sum(sum(s.accepted) for s in self.steps) / proposed if proposed else 0.0

    @property
    def draft_seconds(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def verify_seconds(self) -> float:
        return sum(s.verify_s for s in self.steps)

    @property
    def overhead_seconds(self) -> float:
        return sum(s.overhead_s for s in self.steps)

    def summary(self) -> dict:
        return {
            "target_forwards": self.target_forwards,
            "tokens_generated": self.tokens_generated,
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "overhead_seconds": round(self.overhead_seconds, 4),
            "scoring_seconds": round(self.scoring_seconds, 4),
            "drafter_row_steps": self.drafter_row_steps(),
        }
