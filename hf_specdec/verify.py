"""The one rejection sampler every speculative path uses (2-model, n-gram, hierarchy).

Notation (Leviathan et al. 2023; Chen et al. 2023): a drafter proposes x_1..x_k with proposal
distributions q_j; the target gives p_j for j = 1..k+1. Draft x_j is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection the replacement is drawn from
norm(max(0, p_j - q_j)); if all k pass, a bonus token is drawn from p_{k+1}. The emitted tokens
are distributed exactly as the target's. A drafter with no distribution (n-gram lookup) is a
point mass: q_j = 1 at x_j. Greedy decoding: accept while x_j == argmax p_j.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .rows import RowInts

if TYPE_CHECKING:
    from .cached_model import CachedModel, SpecRegion
    from .sampling import TokenSampler
    from .sequences import SequenceBatch


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [n] accepted drafts per row (0..draft_counts)
    next_tokens: torch.Tensor   # [n] replacement (after a rejection) or bonus token


def verify(draft_tokens: torch.Tensor, draft_counts: torch.Tensor, target_scores: torch.Tensor,
           draft_probs: torch.Tensor | None, do_sample: bool,
           generator: torch.Generator | None = None, ensemble_weight: float | None = None) -> VerifyResult:
    """Accept a prefix of each row's drafts.

    draft_tokens [n, k]; draft_counts [n] (row b proposes its first draft_counts[b] tokens);
    target_scores [n, k+1, vocab], processed; draft_probs [n, k, vocab] or None (point mass).
    ensemble_weight w (Transformers' `assistant_ensemble_weight`, DIVERSE's static ensemble; needs
    draft_probs): drafts are verified against v = w p + (1 - w) q, which is lossy: greedy accepts
    while x_j == argmax v_j and emits argmax v_j at a mismatch (argmax p as the bonus); sampling
    accepts with min(1, v(x) / q(x)) = min(1, 1 - w + w p(x) / q(x)), whose residual
    norm(max(0, v - q)) is norm(max(0, p - q)).
    """
    n, k = draft_tokens.shape
    if k == 0:      # plain decoding step (speculation off): the next token only, same RNG draws
        scores = target_scores[:, 0]
        next_tokens = scores.argmax(-1) if not do_sample else \
            torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(1)
        return VerifyResult(torch.zeros_like(draft_counts), next_tokens)
    rows = torch.arange(n, device=draft_tokens.device)
    proposed = torch.arange(k, device=draft_tokens.device)[None, :] < draft_counts[:, None]  # [n, k]

    if not do_sample:
        best = target_scores.argmax(-1)                                    # [n, k+1]
        judge = best[:, :k]                                                # [n, k]: what a draft must equal
        if ensemble_weight is not None:
            w = ensemble_weight
            judge = (w * torch.softmax(target_scores[:, :k], -1) + (1 - w) * draft_probs).argmax(-1)
        num_accepted = ((draft_tokens == judge) & proposed).long().cumprod(1).sum(1)
        next_tokens = best[rows, num_accepted]
        if ensemble_weight is not None:      # at a mismatch the ensemble's token, else the bonus argmax p
            mismatch = num_accepted < draft_counts
            next_tokens = torch.where(mismatch, judge[rows, num_accepted.clamp(max=k - 1)], next_tokens)
        return VerifyResult(num_accepted, next_tokens)

    target_probs = torch.softmax(target_scores, dim=-1)                    # [n, k+1, vocab]
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)   # [n, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    if ensemble_weight is not None:         # u < v(x) / q(x), v = w p + (1 - w) q
        p_draft = ensemble_weight * p_draft + (1 - ensemble_weight) * q_draft
    ok = (u * q_draft < p_draft) & proposed
    num_accepted = ok.long().cumprod(1).sum(1)

    p_next = target_probs[rows, num_accepted]                              # [n, vocab]
    rejected = num_accepted < draft_counts
    at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(1, draft_tokens[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, at]
    residual = (p_next - q_next).clamp(min=0)
    # p == q up to rounding: rejection had probability ~0; fall back to p itself
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_next)
    p_next = torch.where(rejected[:, None], residual, p_next)
    next_tokens = torch.multinomial(p_next, 1, generator=generator).squeeze(1)
    return VerifyResult(num_accepted, next_tokens)


@dataclass
class Verified:
    result: VerifyResult
    scores: torch.Tensor   # [n, w+1, vocab] processed scores of positions start .. start + w
    logits: torch.Tensor   # [n, w+1, vocab] the verifier's logits of those positions
    region: SpecRegion     # the model's slots of the drafts (`CachedModel.rollback`)


def target_verify(model: CachedModel, batch: SequenceBatch, drafts: torch.Tensor, counts: RowInts,
                  draft_probs: torch.Tensor | None, sampler: TokenSampler, head: torch.Tensor | None = None,
                  rollback: bool = True, ensemble: bool = False) -> Verified:
    """Verify drafts with `model`: the target of a step, or a hierarchy's intermediate model.

    One forward over each active row's tokens not yet fed up to its length and its drafts [n, w],
    already written at its end (row b proposes its first counts[b]); `verify`; with `rollback`
    the model's cache keeps each row's accepted drafts and forgets the rest (else the caller does,
    with `region`, when it has read the counts). head: [n, vocab] logits of the position at
    each row's end, when the model has fed every row up to there: only the drafts are fed.
    ensemble: verify with the sampler's ensemble weight (the target's verification only: a
    hierarchy's intermediate stays lossless).
    """
    width = drafts.shape[1]
    draft_real = torch.arange(width, device=counts.tensor.device)[None, :] < counts.tensor[:, None]
    if head is not None:
        region = model.open_region(0, width)
        logits = head[:, None]
        if width:
            logits = torch.cat([logits, model.forward(drafts, draft_real, counts.host, keep=width)], 1)
    else:
        pending, real, pending_counts = model.pending(batch)
        region = model.open_region(pending.shape[1], width)
        if width:
            pending, real = torch.cat([pending, drafts], 1), torch.cat([real, draft_real], 1)
        both = None if pending_counts is None or counts.host is None else \
            [p + d for p, d in zip(pending_counts, counts.host)]
        logits = model.forward(pending, real, both, keep=width + 1)
    scores = sampler.scores(batch, logits)                            # [n, w+1, vocab]
    result = verify(drafts, counts.tensor, scores, draft_probs, sampler.do_sample, sampler.generator,
                    sampler.ensemble_weight if ensemble else None)
    if rollback:
        model.rollback(region, RowInts(result.num_accepted), counts.host)
    return Verified(result, scores, logits, region)
