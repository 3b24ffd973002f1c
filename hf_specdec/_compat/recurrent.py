"""Recurrent and convolution layers of hybrid models (Gated DeltaNet, Mamba-2, short convolutions):
their cache layers and the recurrences of their modeling modules, recorded per column so that a
row can step back over rejected drafts."""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import LinearAttentionLayer

from .modeling import layer_kinds

# Recurrent and convolution layers (hybrid models). In 5.24 every such mixer keeps its states in a
# cache layer of `LinearAttentionCacheLayerMixin`: it reads them with `cache.get_conv_state` /
# `get_recurrent_state`, passes each forward's conv inputs [n, channels, w] to `update_conv_state`
# (which returns them after the state: the causal conv's left context) and its final recurrent state
# to `update_recurrent_state`; with `record_past` it never takes its one-token path (a conv state
# updated in place). The recurrence is a module-level function of its modeling module, which the mixer
# calls by name: one for several tokens, one for a token (what plain decoding runs) (`_RULES`). 5.25
# is the same but for two things: Mamba-2's one-token path updates a copy of the state in place and
# passes the copy to `update_recurrent_state`, and a mixer can keep per-token states itself
# (`recurrent_states_to_keep`, Transformers' own rollback), which our layers leave at 0.
_recording = threading.local()   # this thread's forward: .plan (StatePlan), .states (the last rule's), .in_place
_rules_lock = threading.Lock()
_rules_installed: dict[str, int] = {}   # modeling module -> forwards recording through its wrapped rules


@dataclass(frozen=True)
class StatePlan:
    """Which states a forward keeps: those after each of its columns from `first` on (-1: the
    state before the forward too); `last_only`: only the last column's (no row needs another)."""

    first: int
    last_only: bool = False


def pick_rows(per_column: dict[int, torch.Tensor], columns: list[int]) -> torch.Tensor:
    """Row b's state after its column columns[b], of a forward's states by column
    ({column: [n, *state]}): [n, *state] (the one tensor itself where every row picks one column)."""
    if len(set(columns)) == 1:
        return per_column[columns[0]]
    return torch.stack([per_column[c][b] for b, c in enumerate(columns)])


STATE_KINDS = ("linear_attention", "conv")     # (Transformers' cache kinds of Mamba and linear attention too)


def state_kinds(model: torch.nn.Module) -> set[str]:
    """The layer kinds of `model` that keep a recurrent or convolution state (not K/V)."""
    return {kind for kind, _ in layer_kinds(model) if kind in STATE_KINDS}


def _runnable_state_kinds(model: torch.nn.Module) -> set[str]:
    """The state kinds our loop rolls back per row: short convolutions, and recurrent layers whose
    modeling module has rules `recording_states` wraps (Gated DeltaNet, Mamba-2)."""
    return {"conv"} | ({"linear_attention"} if _rules_of(model) else set())


class StateLayer(LinearAttentionLayer):
    """A recurrent / convolution layer's states per row, for our loop: every forward records its
    states after each column its `StatePlan` keeps (`recorded`: (kind, index) -> {column:
    [n, *state]}, references to what the forward computed, no copies); `settle` makes one column's
    each row's state, and while a speculative region is open the recordings are kept, so
    `step_back` can return a row to the state after any of its region tokens. `crop` (slots)
    leaves states alone."""

    def __init__(self, number_of_states: int = 1):
        super().__init__(number_of_states=number_of_states)
        self.record_past = True       # every forward passes its conv inputs to update_conv_state
        self.recurrent_states_to_keep = 0     # (5.25: its mixers' own per-token states: we record ours)
        self.recorded: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        self.region: list[tuple] = []    # (recording, and per row: region token -> column offset, first and last column)

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        size = conv_kernel_size or self.conv_kernel_size[state_idx]
        if self.has_previous_state[state_idx]:
            state = self.conv_states[state_idx]
        else:
            state = conv_states.new_zeros(*conv_states.shape[:-1], size)
            self.conv_kernel_size[state_idx], self.dtype, self.device = size, conv_states.dtype, conv_states.device
        full = torch.cat([state, conv_states], dim=-1)                          # [n, channels, size + w]
        windows = full.unfold(-1, size, 1)                                      # [n, channels, w + 1, size]
        plan, width = _recording.plan, conv_states.shape[-1]
        columns = [width - 1] if plan.last_only else range(plan.first, width)
        self.recorded["conv", state_idx] = {c: windows[:, :, c + 1] for c in columns}
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        states = getattr(_recording, "states", None)
        if states is None:      # 5.25's Mamba-2 one-token path: updated in place on a copy it passes here
            states = next((kept for state, kept in getattr(_recording, "in_place", ()) if state is recurrent_states),
                          None)
        if states is None:
            raise RuntimeError("a recurrent layer's rule did not record its states per token (its kind is not one "
                               "hf_specdec rolls back)")
        self.recorded["recurrent", state_idx], _recording.states = states, None
        return recurrent_states

    def settle(self, columns: list[int], region: tuple[list[int], list[int], list[int]] | None) -> None:
        """After a forward (within its `recording_states`): row b's states become those after its
        column columns[b]; with a region open, the recording is kept: row b's region token t is its
        column t + offset[b], from its column low[b] to last[b] (`region` = (offset, low, last))."""
        for state, kept in _recording.in_place:         # a one-token update made in place (Mamba-2's)
            for i, current in self.recurrent_states.items():
                if current is state:
                    self.recorded["recurrent", i] = kept
        self._set({key: pick_rows(recorded, columns) for key, recorded in self.recorded.items()})
        if region is not None:
            self.region.append((self.recorded, *region))
        self.recorded = {}

    def step_back(self, tokens: list[int]) -> None:
        """Row b's states after its region token tokens[b] (0: the state where the region began);
        the region closes."""
        if not self.region or not tokens:      # (no forward since it began: each row is there; or no rows)
            self.region = []
            return
        found = [next((recorded, t + offset[b]) for recorded, offset, low, last in reversed(self.region)
                      if low[b] <= t + offset[b] <= last[b]) for b, t in enumerate(tokens)]
        one = all(recorded is found[0][0] and c == found[0][1] for recorded, c in found)
        self._set({key: found[0][0][key][found[0][1]] if one else
                   torch.stack([recorded[key][c][b] for b, (recorded, c) in enumerate(found)])
                   for key in found[0][0]})
        self.region = []

    def _set(self, states: dict) -> None:
        for (kind, i), state in states.items():
            self.device, self.dtype = state.device, state.dtype
            getattr(self, f"{kind}_states")[i] = state
            getattr(self, f"is_{kind}_states_initialized")[i] = True
            self.has_previous_state[i] = True

    def crop(self, tokens_to_remove: int) -> None:
        """Slots are K/V's: a state steps back by `step_back`."""

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)
        rows = indices.tolist()
        self.region = [({key: {c: state[indices] for c, state in by_column.items()} for key, by_column in recorded.items()},
                        *([row[b] for b in rows] for row in rows_of)) for recorded, *rows_of in self.region]

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = next((s.shape[0] for s in (*self.conv_states.values(), *self.recurrent_states.values())
                     if s is not None), None)
        if rows is not None:
            self.reorder_cache(torch.arange(rows, device=self.device).repeat_interleave(repeats))

    def append(self, other: "StateLayer", rows: int, other_rows: int) -> None:
        """Take `other`'s rows after these (a side without states yet starts from zeros)."""
        for kind in ("conv", "recurrent"):
            mine, theirs = getattr(self, f"{kind}_states"), getattr(other, f"{kind}_states")
            for i in range(self.number_of_states):
                like = mine[i] if mine[i] is not None else theirs[i]
                if like is None:
                    continue
                parts = [s if s is not None else like.new_zeros(n, *like.shape[1:])
                         for s, n in ((mine[i], rows), (theirs[i], other_rows))]
                self._set({(kind, i): torch.cat(parts)})
                self.conv_kernel_size[i] = self.conv_kernel_size[i] or other.conv_kernel_size[i]


def state_layers(cache) -> list[StateLayer]:
    return [layer for layer in cache.layers if isinstance(layer, StateLayer)]


def _gated_delta_rule(several, one):
    """Gated DeltaNet's rule for several tokens (`torch_chunk_gated_delta_rule`'s arguments) that,
    in a forward recording states, runs `one` (`torch_recurrent_gated_delta_rule`) token by token and
    keeps the states its StatePlan names for `StateLayer.update_recurrent_state`."""
    @functools.wraps(several)
    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        plan = getattr(_recording, "plan", None)
        if plan is None:
            return several(query, key, value, g=g, beta=beta, initial_state=initial_state,
                           output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           **kwargs)
        n, w = query.shape[:2]
        if plan.last_only:      # (a prefill, a catch-up without holes: plain's own rule, its final state)
            out, state = several(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                 output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
            _recording.states = {w - 1: state}
            return out, state
        state = initial_state if initial_state is not None else torch.zeros(     # (the rules' own zero state)
            n, value.shape[2], key.shape[-1], value.shape[-1], dtype=torch.float32, device=value.device)
        outputs, states = [], {-1: state}          # (each token's state is a new tensor: kept as it is)
        for c in range(w):
            token = slice(c, c + 1)
            out, state = one(query[:, token], key[:, token], value[:, token], g=g[:, token], beta=beta[:, token],
                             initial_state=state, output_final_state=True,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outputs.append(out)
            states[c] = state
        _recording.states = {c: states[c] for c in range(plan.first, w)}
        return torch.cat(outputs, 1), state
    return rule


def _mamba2_scan(several, one):
    """Mamba-2's scan for several tokens (`mamba2_chunk_scan`'s arguments) that, in a forward
    recording states, runs `one` (`mamba2_selective_state_update`, as the mixer's one-token path
    calls it) token by token, keeping the states its StatePlan names."""
    @functools.wraps(several)
    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        plan = getattr(_recording, "plan", None)
        if plan is None:
            return several(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                           dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states, **kwargs)
        n, w, heads, dim = hidden_states.shape
        size = B.shape[-1]
        if plan.last_only:      # (a prefill, a catch-up without holes: plain's own scan, its final state)
            out, state = several(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                                 initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                 return_final_states=True, **kwargs)
            _recording.states = {w - 1: state}
            return (out, state) if return_final_states else out
        state = (initial_states.clone() if initial_states is not None
                 else torch.zeros(n, heads, dim, size, dtype=torch.float32, device=hidden_states.device))
        outputs, states = [], {-1: state.clone()} if plan.first < 0 else {}
        for c in range(w):
            outputs.append(one(state, hidden_states[:, c], dt[:, c, :, None].expand(-1, -1, dim),
                               A[:, None, None].expand(-1, dim, size), B[:, c], C[:, c],
                               None if D is None else D[:, None].expand(-1, dim), z=None,
                               dt_bias=None if dt_bias is None else dt_bias[:, None].expand(-1, dim),
                               dt_softplus=dt_softplus))          # (updates state in place: copies kept)
            if c >= plan.first:
                states[c] = state.clone()
        _recording.states = {c: states[c] for c in range(plan.first, w)}
        out = torch.stack(outputs, 1)
        return (out, state) if return_final_states else out
    return scan


def _mamba2_update(one):
    """Mamba-2's one-token update as the mixer calls it on its cached state (in place, no
    `update_recurrent_state`): in a forward recording states, the states its StatePlan names are
    kept for that state's StateLayer (`_recording.in_place`)."""
    @functools.wraps(one)
    def update(state, *args, **kwargs):
        plan = getattr(_recording, "plan", None)
        if plan is None:
            return one(state, *args, **kwargs)
        before = state.clone() if plan.first < 0 else None
        out = one(state, *args, **kwargs)
        after = state if plan.last_only else state.clone()     # (the state itself: nothing else keeps it)
        kept = {0: after} if before is None else {-1: before, 0: after}
        _recording.in_place.append((state, kept))
        return out
    return update


# per recurrence: (its rule for several tokens, for one token), how to wrap each for recording
_RULES = {"gated_delta": (("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
                          lambda several, one: (_gated_delta_rule(several, one), _gated_delta_rule(one, one))),
          "mamba2": (("mamba2_chunk_scan", "mamba2_selective_state_update"),
                     lambda several, one: (_mamba2_scan(several, one), _mamba2_update(one)))}


def _rules_of(model: torch.nn.Module) -> str | None:
    """Which recurrence of `_RULES` the modeling module of `model` defines (None: none)."""
    module = sys.modules[type(model).__module__]
    return next((kind for kind, (names, _) in _RULES.items()
                 if all(callable(getattr(module, name, None)) for name in names)), None)


@contextlib.contextmanager
def recording_states(model: torch.nn.Module, plan: StatePlan):
    """While open, this thread's forwards of `model` record the states `plan` names in its cache's
    StateLayers, through its modeling module's recurrence rules, wrapped while any thread records
    (a forward of another thread, or not recording, runs the rules as they are)."""
    name, kind = type(model).__module__, _rules_of(model)
    module = sys.modules[name]
    if kind:
        names, wrap = _RULES[kind]
        with _rules_lock:
            if not _rules_installed.get(name):
                originals = [getattr(module, n) for n in names]
                for n, original, wrapped in zip(names, originals, wrap(*originals)):
                    wrapped.hf_specdec_original = original
                    setattr(module, n, wrapped)
            _rules_installed[name] = _rules_installed.get(name, 0) + 1
    outer = getattr(_recording, "plan", None), getattr(_recording, "in_place", None)
    _recording.plan, _recording.in_place = plan, []
    try:
        yield
    finally:
        (_recording.plan, _recording.in_place), _recording.states = outer, None
        if kind:
            with _rules_lock:
                _rules_installed[name] -= 1
                if not _rules_installed[name]:
                    for n in names:
                        setattr(module, n, getattr(module, n).hf_specdec_original)
