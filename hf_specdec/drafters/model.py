"""A Transformers causal LM as drafter, with its own KV cache and per-row lag."""
from __future__ import annotations

from typing import Callable

import torch

from ..cached_model import CachedModel
from ..rows import RowInts
from ..sampling import TokenSampler
from ..sequences import SequenceBatch
from ..verify import Verified, target_verify
from .base import ContinueDrafting, Drafter, Prediction, Proposal


def output_vocab_size(model: torch.nn.Module) -> int:
    """Number of logits the model emits per position."""
    head = model.get_output_embeddings()
    if head is None:
        return model.config.get_text_config().vocab_size
    # nn.Linear and its dynamically quantised form both say out_features; embeddings-tied heads too
    return getattr(head, "out_features", None) or head.weight.shape[0]


def sample_drafts(sampler: TokenSampler, batch: SequenceBatch, k: int, continue_drafting: ContinueDrafting | None,
                  logits: torch.Tensor, advance: Callable[[torch.Tensor], torch.Tensor]
                  ) -> tuple[Proposal, torch.Tensor]:
    """Up to k drafts per active row, each picked by the sampler from a model's logits [n, 1, vocab]
    for the row's next position and written at the row's end (the processors of the next position
    read it); advance(token [n]) feeds a draft and returns the logits after it (never called for
    the last). continue_drafting: as in `Drafter.propose`. Returns the proposal and the logits each draft
    was picked from [n, k', vocab]."""
    rows = batch.active.tensor
    start = batch.active_lengths().tensor
    counts = [k] * len(rows)                         # on the host: continue_drafting answers in lists
    drafts, probs, seen, picked_from = [], [], [], []
    asked = [[] for _ in range(len(rows))]           # confidences on the host, a column per draft
    for j in range(k):
        seen.append(logits[:, 0])
        scores = sampler.scores(batch, logits, offset=j)[:, 0]        # [n, vocab]
        token = sampler.pick(scores)
        picked_from.append(scores)
        if sampler.keeps_probs:
            probs.append(sampler.probs(scores))
        batch.tokens[rows, start + j] = token
        drafts.append(token)
        if continue_drafting is not None and j < k - 1:
            dist = probs[-1] if probs else sampler.probs(scores)
            for row, c in zip(asked, dist.gather(1, token[:, None]).squeeze(1).tolist()):
                row.append(c)
            # a row that says no keeps its j + 1 drafts (a row that stopped stays stopped)
            counts = [j + 1 if n == k and not more else n for n, more in zip(counts, continue_drafting(asked))]
            if k not in counts:
                break
        if j < k - 1:
            logits = advance(token)
    # (without continue_drafting every row drafted k: no host list to copy to the device)
    counts = RowInts.of(counts, start.device) if continue_drafting is not None else \
        RowInts(torch.full_like(start, len(drafts)), [len(drafts)] * len(rows))
    tokens = torch.stack(drafts, 1)                                     # [n, k']
    dist = torch.stack(probs, 1) if probs else sampler.probs(torch.stack(picked_from, 1))   # (all drafts at once)
    confidence = dist.gather(2, tokens[..., None]).squeeze(2)
    return Proposal(tokens, counts, dist if probs else None, confidence), torch.stack(seen, 1)


class ModelDrafter(Drafter):
    scorable = True

    def __init__(self, model: torch.nn.Module, name: str | None = None):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"ModelDrafter(model) takes one Transformers causal LM, got {type(model).__name__}"
                            + ("; for several drafters pass assistant_models=[...]" if isinstance(model, (list, tuple))
                               else ""))
        self.model = model
        self.runner = CachedModel(model)
        self.name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        self.vocab_size = output_vocab_size(model)

    def begin(self, batch, sampler):
        super().begin(batch, sampler)
        self.runner.reset(batch)
        self._region = None
        # Logits the drafter already holds for positions from the current step's start on, so that
        # scoring (`replay`) and the next proposal need no extra forward:
        #   _known [n, P, vocab]: row b's first _known_count[b] columns predict positions start[b]..
        #   _head [n, vocab]: predicts position lengths[b], valid while the drafter has no lag
        self._known = self._known_count = self._known_start = self._head = None

    def propose(self, batch: SequenceBatch, k: int, continue_drafting: ContinueDrafting | None = None) -> Proposal:
        start = batch.active_lengths().tensor
        head = self._head[:, None] if self._head is not None and self._caught_up(batch) else None  # (a replay's)
        pending = None if head is not None else self.runner.pending(batch)      # to catch up: the lag
        self._head = None
        # a greedy step's forwards (the catch-up's, unless a head is held, and k - 1 drafts') in one
        # compiled call, where the cache can
        width, forwards = (1, k - 1) if head is not None else (pending[0].shape[1], k)
        fuse = continue_drafting is None and self.sampler.picks_argmax and k > 1
        if fuse and self.runner.fuses_draft_step(width, forwards):
            proposal, self._known = self._greedy_step(batch, k, head, pending)
        else:
            logits = head if head is not None else self.runner.forward(*pending, keep=1)   # catch up, then draft
            # the drafts' own forwards, so that no compaction moves slots inside the speculative region:
            # k - 1 one-token forwards, each padded to width 2 on a compiled cache and stepped back over
            # the pad, so the last one writes the region's k-th slot
            self._region = self.runner.open_region(0, k)
            proposal, self._known = sample_drafts(self.sampler, batch, k, continue_drafting, logits,
                                                  lambda token: self.runner.forward(token[:, None], None, keep=1))
        self._fed_drafts = proposal.tokens.shape[1] - 1  # the last draft was never fed
        self._known_start = start.clone()                # _known [n, k', vocab] predicts start .. start+k'-1
        return proposal

    def _greedy_step(self, batch: SequenceBatch, k: int, head: torch.Tensor | None, pending: tuple | None
                     ) -> tuple[Proposal, torch.Tensor]:
        """`sample_drafts` of a sampler that picks the argmax, without `continue_drafting`, as one
        compiled call (`CachedModel.draft_step`): the catch-up of `pending` (as `pending()` gave it)
        and k - 1 draft forwards; or, from a held head [n, 1, vocab], the k - 1 draft forwards."""
        if head is None:
            self._region = self.runner.open_region(pending[0].shape[1], k)      # (after the catch-up's slots)
            logits, tokens = self.runner.draft_step(*pending, k)
        else:
            first = head[:, 0].argmax(-1, keepdim=True)                          # [n, 1]
            self._region = self.runner.open_region(0, k)
            later_logits, later = self.runner.draft_step(first, None, None, k - 1)
            logits, tokens = torch.cat([head, later_logits], 1), torch.cat([first, later], 1)
        rows, start = batch.active.tensor, batch.active_lengths().tensor
        batch.tokens[rows[:, None], start[:, None] + torch.arange(k, device=start.device)] = tokens
        confidence = self.sampler.probs(logits).gather(2, tokens[..., None]).squeeze(2)
        return Proposal(tokens, RowInts(torch.full_like(start, k), [k] * len(start)), None, confidence), logits

    def _caught_up(self, batch) -> bool:
        return self.runner.lag(batch).max() == 0

    def lag(self, batch):
        return self.runner.lag(batch)

    def accepted(self, num_accepted):
        kept = num_accepted.minimum(self._fed_drafts)
        self.runner.rollback(self._region, kept, [self._fed_drafts] * len(kept))
        self._known_count = kept.tensor + 1     # the logits after each kept draft are still right
        self._region = None

    def verify(self, batch: SequenceBatch, drafts: torch.Tensor, draft_counts: RowInts,
               draft_probs: torch.Tensor | None) -> Verified:
        """This model verifies another drafter's drafts [n, w], written at each active row's end
        (the intermediate of a hierarchy): `target_verify` on its cache, from the logits it holds
        when a replay caught it up."""
        caught_up = self._head is not None and self._caught_up(batch)
        head, self._head = self._head if caught_up else None, None
        return target_verify(self.runner, batch, drafts, draft_counts, draft_probs, self.sampler, head)

    def remember(self, logits: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
        """Logits [n, w, vocab] this model computed for positions start[b] .. of each active row, the
        first count[b] of which still hold (a hierarchy verified with it): `replay` and the next
        proposal need no forward for them."""
        self._known, self._known_start, self._known_count = logits, start, count

    def replay(self, batch: SequenceBatch, start: torch.Tensor) -> Prediction:
        """Feed the verified tokens not yet in the cache and return the drafter's prediction at
        each verified position; afterwards the drafter has no lag and holds the next head."""
        rows = batch.active
        count = batch.active_lengths().tensor - start                    # [n] verified positions
        proposed_here = (self._known_start == start).all() if self._known is not None else count.new_tensor(0)
        width, proposed_here = torch.stack([count.max() + 1, proposed_here.long()]).tolist()  # one host read
        if proposed_here:                                                # proposed this step
            known, known_count = self._known, self._known_count
        elif self._head is not None:                                     # caught up last step
            known, known_count = self._head[:, None], (self.runner.fed.tensor == start).long()
        else:
            known, known_count = None, torch.zeros_like(count)
        needed = count + 1 - known_count                                 # [n] positions to feed
        keep, fits = torch.stack([needed.max(), (self.runner.lag(batch).tensor >= needed).all().long()]).tolist()
        assert fits, "replay: lost positions"
        out = self.runner.forward(*self.runner.pending(batch), keep=keep)    # [n, keep, vocab]
        # column c of `out` predicts position lengths - keep + c, i.e. step column j = c + count - keep + 1
        j = torch.arange(width, device=count.device)[None, :]            # [1, width]
        column = (j - count[:, None] + keep - 1).clamp(0, keep - 1)       # [n, width]
        logits = out.gather(1, column[..., None].expand(-1, -1, out.shape[-1]))
        if known is not None:
            known = torch.nn.functional.pad(known[:, :width], (0, 0, 0, max(0, width - known.shape[1])))
            logits = torch.where((j < known_count[:, None])[..., None], known, logits)
        self._head = logits[torch.arange(len(rows)), count]              # predicts position lengths
        self._known = self._known_count = self._known_start = None
        scores = self.sampler.scores(batch, logits[:, :-1], offset=-count)  # column j follows start + j
        probs = self.sampler.probs(scores) if self.sampler.do_sample else None
        return Prediction(scores.argmax(-1), j[:, :-1] < count[:, None], probs)

    def forwards(self):
        return [(self.name, self.runner.forwards)]

    def models(self):
        return [self.model]

    def release(self, batch):
        self.runner.release(batch)
        self._head = self._known = self._known_count = self._known_start = None

    def close(self):
        self.runner.close()

    def discard_after(self, ends):
        self.runner.truncate(ends)
        self._head = None

    def add_rows(self, batch, prefill):
        # The running rows either lag (the usual case: joiners get their last token unfed, lag 1,
        # so the next proposal's catch-up reads real logits for them) or, after a replay, are
        # caught up with a held head (joiners then feed everything and bring their own head).
        caught_up = self._head is not None and prefill
        joining = CachedModel(self.model)
        joining.reset(batch, from_first_real=True)
        if prefill:
            end = batch.active_lengths() - (0 if caught_up else 1)
            logits = joining.forward(*joining.pending(batch, end), keep=1)        # [m, 1, vocab]
        self.runner.append(joining)
        self._head = torch.cat([self._head, logits[:, 0]]) if caught_up else None
        self._known = self._known_count = self._known_start = None

    def select_rows(self, keep):
        self.runner.select_rows(keep)
        keep = keep.tensor               # logits live on the batch's device, like `keep`
        if self._head is not None:
            self._head = self._head[keep]
        if self._known is not None:
            self._known = self._known[keep]
        if self._known_count is not None:
            self._known_count, self._known_start = self._known_count[keep], self._known_start[keep]
