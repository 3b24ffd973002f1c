"""Full-information feedback: every drafter's acceptance probability at every verified position.

One verified trajectory scores all drafters without another target forward (HedgeSpec): each
drafter replays the newly verified tokens (`Drafter.replay`) and says what it would have
proposed there; the target's processed scores for those positions come from the verification
forward that produced them. Per position, gamma = 1 - TV(target, draft) = sum_v min(p, q) for a
model drafter when sampling, p(token) for a deterministic drafter, and agreement with the
target's argmax (the emitted token) when greedy. The same holds for any context the target has
scored, which is how the last prompt positions warm-start a selector before its first decision.
"""
from __future__ import annotations

import torch

from . import timing
from .cached_model import CachedModel
from .drafters import Drafter
from .sampling import TokenSampler
from .sequences import SequenceBatch


def score_drafters(drafters: list[Drafter], batch: SequenceBatch, start: torch.Tensor,
                   target_scores: torch.Tensor, do_sample: bool) -> tuple[torch.Tensor, list[float]]:
    """gamma [n, w, num_drafters] for the active rows' positions start[b] .. lengths[b]-1
    (columns past a row's count are 0), and each drafter's scoring time in seconds.

    target_scores: [n, >= w, vocab] processed target scores; column j follows start + j.
    """
    rows = batch.active.tensor
    count = batch.lengths.tensor[rows] - start                                   # [n]
    width = int(count.max())
    valid = torch.arange(width, device=count.device)[None, :] < count[:, None]   # [n, w]
    if do_sample:
        target_probs = torch.softmax(target_scores[:, :width], -1)       # [n, w, vocab]
    else:
        target_best = target_scores[:, :width].argmax(-1)                 # [n, w] = the emitted tokens
    gammas, seconds = [], []
    for drafter in drafters:
        t0 = timing.now()
        guess = drafter.replay(batch, start)
        if not do_sample:
            gamma = (guess.tokens[:, :width] == target_best).float()
        elif guess.probs is not None:
            gamma = torch.minimum(target_probs, guess.probs[:, :width]).sum(-1)
        else:
            gamma = target_probs.gather(-1, guess.tokens[:, :width, None]).squeeze(-1)
        gammas.append(gamma * (guess.valid[:, :width] & valid))
        seconds.append(timing.now() - t0)
    return torch.stack(gammas, -1), seconds


def prime(selector, target: CachedModel, drafters: list[Drafter], batch: SequenceBatch,
          sampler: TokenSampler) -> float:
    """Warm start: score every drafter on the selector's `prompt_positions` last prompt positions
    (contexts the target prefills anyway) and hand it the gammas before the first decision. The
    target stops one token short, so step 0 proceeds as usual. Returns seconds."""
    width = min(getattr(selector, "prompt_positions", 0), int(batch.prompt_mask.sum(1).min()) - 1)
    if width < 1:
        return 0.0
    t0 = timing.now()
    end = batch.active_lengths() - 1
    logits = target.forward(*target.pending(batch, end), keep=width)      # predicts positions end-width+1 .. end
    scores = sampler.scores(batch, logits, offset=-width)
    gammas, _ = score_drafters(drafters, batch, end.tensor - width + 1, scores, sampler.do_sample)
    selector.prime({row: gammas[i].tolist() for i, row in enumerate(batch.active.host)})
    return timing.now() - t0
