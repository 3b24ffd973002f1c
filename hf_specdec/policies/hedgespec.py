"""HedgeSpec: drafter choice as full-information online learning ("Not-a-Bandit", 2025). Pure Python.

After every verification each drafter is scored on the verified tokens (`record.gammas`, see
`hf_specdec.scoring`), so every drafter's loss is known each round, not only the chosen one's.
Each request (batch row) has its own learner and its own FIFO queue of delayed losses
(`DelayedFeedback`); before each decision the queue is drained into the learner (QFI-D), and the
row's drafter is drawn from the learner's weights.

Cost-aware variant (ours): the length loss becomes 1 - EAL/(K+1) * T_v / (T_v + K c_i), i.e. one
minus the drafter's expected tokens per unit time relative to a free, perfect drafter, with c_i
drafter i's measured time per drafted token and T_v the measured verification time.
"""
from __future__ import annotations

import math
import random

from ..stats import StepRecord
from .base import DrafterSelector, StepContext, non_negative_int
from .feedback import DelayedFeedback
from .learners import LEARNERS, Learner

_DEFAULT_DEPTH = 4  # K of the length loss when the first step of a request does not speculate
_EMA = 0.2  # weight of the newest timing in the running cost estimates


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


class HedgeSpec(DrafterSelector):
    """Pick each row's drafter with a full-information learner over every drafter's loss.

    learner: "normalhedge" (default, parameter-free), "hedge" or "adanormalhedge".
    loss: "length" (expected acceptance length, the paper's default) or "prob" (acceptance
        probability).
    warmup: the first `warmup` positions of each request use the acceptance-probability loss,
        which needs no delay ("hybrid loss"); 0 turns it off.
    depth: K of the length loss; default: the draft length of the request's first speculative step.
    cost_aware: weigh expected tokens by each drafter's measured cost (tokens per second).
    feedback_every: score the drafters on every n-th step only (after `warmup_steps` steps);
        fewer scoring forwards at the price of fewer updates (the paper's skipped updates).
    prompt_positions: before the first decision, score the drafters on this many last prompt
        positions (acceptance-probability losses; the target prefills them anyway); 0: start uniform.
    pick: "sample" from the weights (default) or "argmax".
    """

    def __init__(self, learner: str = "normalhedge", loss: str = "length", warmup: int = 6,
                 depth: int | None = None, cost_aware: bool = False, feedback_every: int = 1,
                 warmup_steps: int = 4, prompt_positions: int = 16, pick: str = "sample", seed: int = 0):
        if learner not in LEARNERS:
            raise ValueError(f"HedgeSpec(learner) must be one of {sorted(LEARNERS)}, got {learner!r}")
        if loss not in ("length", "prob"):
            raise ValueError(f"HedgeSpec(loss) must be 'length' or 'prob', got {loss!r}")
        if pick not in ("sample", "argmax"):
            raise ValueError(f"HedgeSpec(pick) must be 'sample' or 'argmax', got {pick!r}")
        if depth is not None and non_negative_int(depth, "HedgeSpec(depth)") < 1:
            raise ValueError(f"HedgeSpec(depth) must be >= 1, got {depth}")
        if non_negative_int(feedback_every, "HedgeSpec(feedback_every)") < 1:
            raise ValueError(f"HedgeSpec(feedback_every) must be >= 1, got {feedback_every}")
        self.learner_name, self.loss, self.pick = learner, loss, pick
        self.warmup = non_negative_int(warmup, "HedgeSpec(warmup)")
        self.warmup_steps = non_negative_int(warmup_steps, "HedgeSpec(warmup_steps)")
        self.prompt_positions = non_negative_int(prompt_positions, "HedgeSpec(prompt_positions)")
        self.depth, self.cost_aware, self.feedback_every = depth, cost_aware, feedback_every
        self.rng = random.Random(seed)
        self.trace: list[tuple[int, int, list[float]]] = []  # (step, row, weights) per decision
        # timings describe the models and the machine, not a request: they carry over between calls
        self.verify_cost = None                         # EMA seconds of one verification
        self.draft_cost: dict[int, float] = {}          # EMA seconds per drafted token, by drafter
        self.replay_cost: dict[int, float] = {}         # EMA seconds of a scoring pass (fallback)
        self.last_k = None
        self.num_drafters = None

    def begin(self, ctx: StepContext) -> None:
        if self.num_drafters not in (None, ctx.num_drafters):
            self.verify_cost, self.draft_cost, self.replay_cost = None, {}, {}   # another pool
        self.num_drafters = ctx.num_drafters
        self.learners: dict[int, Learner] = {r: LEARNERS[self.learner_name](ctx.num_drafters) for r in ctx.rows}
        self.queues: dict[int, DelayedFeedback] = {}
        self.trace = []

    def prime(self, gammas: dict[int, list[list[float]]]) -> None:
        """Acceptance-probability losses on the last prompt positions: the first choice is informed."""
        depth = self.depth or self.last_k or _DEFAULT_DEPTH
        for row, per_position in gammas.items():
            for gamma in per_position:
                self.learners[row].update(self._losses("prob", gamma, depth))

    def wants_feedback(self, step: int) -> bool:
        return step < self.warmup_steps or step % self.feedback_every == 0

    def choose(self, ctx: StepContext) -> list[int]:
        choices = []
        for row in ctx.rows:
            learner = self.learners[row]
            queue = self.queues.get(row)
            for kind, values in queue.pop_all() if queue else ():
                learner.update(self._losses(kind, values, queue.depth))
            weights = learner.weights()
            self.trace.append((ctx.step, row, weights))
            if self.pick == "argmax":
                best = max(weights)
                choices.append(self.rng.choice([i for i, w in enumerate(weights) if w == best]))
            else:
                choices.append(self.rng.choices(range(len(weights)), weights)[0])
        return choices

    def observe(self, record: StepRecord) -> None:
        self._observe_costs(record)
        if record.gammas is None:
            return
        for row, gammas in record.gammas.items():
            if row not in self.queues:
                depth = self.depth or record.k or _DEFAULT_DEPTH
                warmup = self.warmup if self.loss == "length" else math.inf  # "prob": no delay ever
                self.queues[row] = DelayedFeedback(depth, warmup)
            self.queues[row].add(gammas)

    def _losses(self, kind: str, values: list[float], depth: int) -> list[float]:
        speed = self._speed_factors(depth) if self.cost_aware else [1.0] * len(values)
        if kind == "prob":
            return [1.0 - v * s for v, s in zip(values, speed)]
        return [1.0 - v / (depth + 1) * s for v, s in zip(values, speed)]

    def _speed_factors(self, depth: int) -> list[float]:
        """T_v / (T_v + K c_i) per drafter: 1 for a free drafter, smaller for costly ones."""
        if not self.verify_cost:
            return [1.0] * self.num_drafters
        out = []
        for i in range(self.num_drafters):
            per_token = self.draft_cost.get(i, self.replay_cost.get(i, 0.0))
            out.append(self.verify_cost / (self.verify_cost + depth * per_token))
        return out

    def _observe_costs(self, record: StepRecord) -> None:
        if not record.steady:
            return
        if record.k:
            self.last_k = record.k
            self.verify_cost = _ema(self.verify_cost, record.verify_s)
            for i, seconds in record.drafter_s.items():
                self.draft_cost[i] = _ema(self.draft_cost.get(i), seconds / record.k)
        for i, seconds in record.replay_s.items():
            self.replay_cost[i] = _ema(self.replay_cost.get(i), seconds)

    def __repr__(self):
        return (f"HedgeSpec(learner={self.learner_name!r}, loss={self.loss!r}, cost_aware={self.cost_aware}, "
                f"feedback_every={self.feedback_every})")
