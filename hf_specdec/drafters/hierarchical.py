"""Hierarchical speculation: a draft -> intermediate chain that drafts for the target.

Per target step, up to `cycles` inner cycles: the draft proposes `draft_len` tokens per row, the
intermediate verifies them with the shared `verify()` (one forward), and each row appends its
accepted drafts plus the intermediate's replacement or bonus token. Speculative sampling makes
every appended token an exact sample from the intermediate's processed distribution q_i given the
row's prefix, and whether a position is produced depends only on earlier positions, so the
rows' tokens are an ordinary variable-length draft from q_i: the target verifies it with q_i as
the proposal distribution (greedy: the intermediate's argmax chain) and stays lossless.

Each model keeps its own cache and lag; rows advance independently (per-row counts). The draft
can itself be a `HierarchicalDrafter` or any drafter (e.g. prompt lookup), so chains of any
length are nested pairs: `HierarchicalDrafter(HierarchicalDrafter(d0, d1), d2)`, or `chain(...)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._compat import recurrent
from ..policies import FixedLength, LengthPolicy, StepContext
from ..rows import RowInts
from ..sequences import SequenceBatch
from ..stats import StepRecord
from ..timing import PhaseClock
from .base import ContinueDrafting, Drafter, Prediction, Proposal
from .model import ModelDrafter
from .target_states import TargetStatesDrafter


@dataclass
class LevelStats:
    """Draft -> intermediate counters of one generate() call."""

    cycles: int = 0                  # intermediate verification forwards
    proposed: int = 0                # draft tokens the intermediate judged (summed over rows)
    accepted: int = 0                # of which it accepted
    produced: int = 0                # tokens handed on (accepted + replacement/bonus, summed over rows)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class HierarchicalDrafter(Drafter):
    """draft: the cheaper drafter (a causal LM or any Drafter); intermediate: a causal LM (its
    distribution is the proposal the target sees); draft_len: drafts per inner cycle, an int >= 1
    or a LengthPolicy (chooses per cycle, observes each cycle); cycles: inner cycles per target
    step at most (fewer once every row has k tokens)."""

    scorable = True          # it proposes from the intermediate's distribution, which `replay` scores

    def __init__(self, draft, intermediate, draft_len=4, cycles: int = 2, name: str | None = None):
        from . import as_drafter   # (defined in the package that imports this module)
        self.lower = as_drafter(draft, where="HierarchicalDrafter(draft)")
        if isinstance(intermediate, Drafter) and not isinstance(intermediate, ModelDrafter):
            raise TypeError(f"HierarchicalDrafter(intermediate) must be a causal LM: its distribution is the "
                            f"target's proposal, got {type(intermediate).__name__}")
        self.upper = intermediate if isinstance(intermediate, ModelDrafter) else \
            as_drafter(intermediate, where="HierarchicalDrafter(intermediate)")
        for where, level in (("draft", self.lower), ("intermediate", self.upper)):
            if isinstance(level, TargetStatesDrafter):
                raise ValueError(f"HierarchicalDrafter({where}) is a {type(level.model).__name__}, which drafts from "
                                 "the target's own states, not an intermediate's: pass it in assistant_models itself")
            hybrid = next((m for m in level.models() if recurrent.state_kinds(m)), None)
            if hybrid is not None:     # a level forgets tokens past a step's (`CachedModel.truncate`)
                raise ValueError(f"HierarchicalDrafter({where}) is a {type(hybrid).__name__}, whose recurrent states "
                                 "step back within a step only: pass it in assistant_models itself")
        for level in (self.lower, self.upper):      # a level forgets tokens of a step the target rejects
            if isinstance(level, ModelDrafter):     # (`discard_after`): its sliding-window layers keep them
                level.runner.trims_window = False
        if self.lower.vocab_size is not None and self.lower.vocab_size != self.upper.vocab_size:
            raise ValueError(f"HierarchicalDrafter: the draft's vocabulary size {self.lower.vocab_size} differs "
                             f"from the intermediate's {self.upper.vocab_size}")
        if isinstance(draft_len, LengthPolicy):
            self.inner_length = draft_len
        elif isinstance(draft_len, int) and not isinstance(draft_len, bool) and draft_len >= 1:
            self.inner_length = FixedLength(draft_len)
        else:
            raise ValueError(f"HierarchicalDrafter(draft_len) must be an integer >= 1 or a LengthPolicy, got {draft_len!r}")
        if isinstance(cycles, bool) or not isinstance(cycles, int) or cycles < 1:
            raise ValueError(f"HierarchicalDrafter(cycles) must be an integer >= 1, got {cycles!r}")
        self.cycles = cycles
        self.vocab_size = self.upper.vocab_size
        self.name = name or f"{self.lower.name}->{self.upper.name}"
        self.stats = LevelStats()

    def begin(self, batch: SequenceBatch, sampler) -> None:
        super().begin(batch, sampler)
        self.lower.begin(batch, sampler)
        self.upper.begin(batch, sampler)
        self.stats = LevelStats()
        self._cycle = 0
        self.clock = PhaseClock(self.upper.runner.device)

    def propose(self, batch: SequenceBatch, k: int, continue_drafting: ContinueDrafting | None = None) -> Proposal:
        # a cycle writes at most k tokens per row past what the row has produced so far
        batch.reserve(self.cycles * k + 1)
        rows = batch.active.tensor
        start = batch.active_lengths().tensor.clone()                       # [n]
        produced = torch.zeros_like(start)                                  # [n] tokens made so far
        lengths = batch.lengths.tensor.clone()
        chain = batch.view(lengths=RowInts(lengths))   # the chain's row ends; the batch's stay at `start`
        logits_out, scores_out = [], []                                     # per cycle: [n, w+1, vocab]
        columns = []                                                        # per cycle: [n, w+1] output column
        for _ in range(self.cycles):
            missing = int((k - produced).max())
            if missing <= 0:
                break
            lengths[rows] = start + produced
            ctx = self._context(chain)
            kd = min(max(0, int(self.inner_length.choose(ctx))), missing - 1)
            logits, scores, accepted = self._cycle_once(chain, ctx, kd)
            steps = torch.arange(logits.shape[1], device=start.device)[None, :]
            columns.append(torch.where(steps <= accepted[:, None], produced[:, None] + steps, -1))
            logits_out.append(logits)
            scores_out.append(scores)
            produced += accepted + 1
        self._start, self._produced = start, produced
        # gather each row's output columns 0..k-1 from the cycles that made them
        width = int(produced.clamp(max=k).max())
        # logits one column further: after k accepted tokens, the next prediction is known too
        self._logits = self._gather(columns, logits_out, int(produced.clamp(max=k + 1).max()))
        scores = self._gather(columns, scores_out, width)
        tokens = batch.tokens[rows[:, None], start[:, None] + torch.arange(width, device=start.device)[None, :]]
        dist = self.sampler.probs(scores)
        confidence = dist.gather(-1, tokens[..., None]).squeeze(-1)
        return Proposal(tokens, RowInts(produced.clamp(max=k)), dist if self.sampler.keeps_probs else None, confidence)

    def _context(self, batch: SequenceBatch) -> StepContext:
        rows = batch.active.tensor
        return StepContext(self._cycle, len(rows), 1, rows.tolist(),
                           context_tokens=int((batch.lengths.tensor[rows] - batch.real_start(rows)).sum()))

    def _cycle_once(self, batch: SequenceBatch, ctx: StepContext, kd: int):
        """Draft kd tokens per row (the inner length policy's choice from `ctx`), verify them with
        the intermediate, append accepted + 1 to the buffer. Returns the intermediate's logits and processed scores [n, w+1, vocab] for the
        positions from the row's length on, and the accepted counts [n]."""
        rows = batch.active.tensor
        length = batch.lengths.tensor[rows]
        c0, warmups = self.clock.mark(), batch.warmups.calls
        if kd:
            proposal = self.lower.propose(batch, kd)
            counts = proposal.counts
            width = proposal.counts.max()
            drafts, probs = proposal.tokens[:, :width], proposal.probs
            probs = probs[:, :width] if probs is not None else None
        else:
            counts, probs = RowInts.full(len(rows), 0, length.device), None
            drafts = torch.zeros(len(rows), 0, dtype=torch.long, device=length.device)
        batch.write(rows, length, drafts)
        c1 = self.clock.mark()
        verified = self.upper.verify(batch, drafts, counts, probs)
        result = verified.result
        if kd:
            self.lower.accepted(RowInts(result.num_accepted))
        batch.tokens[rows, length + result.num_accepted] = result.next_tokens
        c2 = self.clock.mark()
        proposed, accepted = torch.stack([counts.tensor, result.num_accepted]).tolist()    # one host read
        self.stats.cycles += 1
        self.stats.proposed += sum(proposed)
        self.stats.accepted += sum(accepted)
        self.stats.produced += sum(accepted) + len(rows)
        self.inner_length.observe(StepRecord.of_step(ctx, kd, kd, proposed, accepted, draft_s=self.clock.seconds(c0, c1),
                                                     verify_s=self.clock.seconds(c1, c2),
                                                     warmup=batch.warmups.calls != warmups))
        self._cycle += 1
        return verified.logits, verified.scores, result.num_accepted

    @staticmethod
    def _gather(columns: list[torch.Tensor], values: list[torch.Tensor], width: int) -> torch.Tensor:
        """[n, width, vocab]: output column c of row b from the cycle whose `columns` maps to c."""
        n, vocab = values[0].shape[0], values[0].shape[-1]
        out = values[0].new_zeros(n, width + 1, vocab)
        for where, value in zip(columns, values):
            where = torch.where((where >= 0) & (where < width), where, width)   # the rest: a spare column
            out.scatter_(1, where[..., None].expand(-1, -1, vocab), value)
        return out[:, :width]

    def accepted(self, num_accepted: RowInts) -> None:
        """The target accepted num_accepted[b] of row b's tokens: both levels forget the rest."""
        num_accepted = num_accepted.tensor
        self.discard_after(self._start + num_accepted)
        # logits after each accepted token are still right; the next one too, if it was produced
        self.upper.remember(self._logits, self._start, torch.minimum(num_accepted + 1, self._produced))

    def lag(self, batch: SequenceBatch) -> RowInts | None:
        lags = [lag for lag in (self.lower.lag(batch), self.upper.lag(batch)) if lag is not None]
        return lags[0] if len(lags) == 1 else lags[0].maximum(lags[1]) if lags else None

    def replay(self, batch: SequenceBatch, start: torch.Tensor) -> Prediction:
        """The chain proposes from the intermediate's distribution: score that."""
        return self.upper.replay(batch, start)

    def forwards(self) -> list[tuple[str, int]]:
        return self.lower.forwards() + self.upper.forwards()

    def models(self) -> list[torch.nn.Module]:
        return self.lower.models() + self.upper.models()

    def release(self, batch: SequenceBatch) -> None:
        self.lower.release(batch)
        self.upper.release(batch)

    def close(self) -> None:
        self.lower.close()
        self.upper.close()

    def discard_after(self, ends: torch.Tensor) -> None:
        self.lower.discard_after(ends)
        self.upper.discard_after(ends)

    def select_rows(self, keep: RowInts) -> None:
        self.lower.select_rows(keep)
        self.upper.select_rows(keep)


def chain(models: list, draft_len=4, cycles: int = 2) -> Drafter:
    """Drafters cheapest first (the last one drafts for the target): nested HierarchicalDrafters."""
    if not isinstance(models, (list, tuple)) or len(models) < 2:
        raise ValueError(f"chain(models) needs a list of at least 2 models, cheapest first, got {models!r}")
    drafter = models[0]
    for upper in models[1:]:
        drafter = HierarchicalDrafter(drafter, upper, draft_len, cycles)
    return drafter
