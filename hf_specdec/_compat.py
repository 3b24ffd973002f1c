"""The only module that touches Transformers internals (cache layout, kwarg names, output classes).

Checked against transformers 5.23.0 and 5.24.0 (the test suite runs on both):
- `DynamicCache(config=...)` builds one layer per decoder layer, `Cache.crop(-n)` drops the last n
  slots of every row, `Cache.batch_select_indices` keeps rows, and a layer's `keys` / `values` are
  [batch, heads, slots, head_dim] tensors.
- The KV cache kwarg: `past_key_values` up to 5.23; 5.24 renamed it `cache` in model forwards and in
  the `model_kwargs` that `generate()` hands a custom decoding loop (the old name still works there
  until 5.40 / 6.0, with a FutureWarning). Every cache kwarg we pass or read goes through
  `cache_kwargs` / `CACHE_KWARG_NAMES`, so the next rename is a change here only.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import threading
from collections.abc import Collection
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor
from transformers.generation.utils import GenerateDecoderOnlyOutput

SUPPORTED_TRANSFORMERS = ">=5.23,<6"


def check_transformers_version(version: str) -> None:
    """Refuse a transformers release outside SUPPORTED_TRANSFORMERS, naming the range."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return  # a source build with an unusual version string: let it through
    if major != 5 or minor < 23:
        raise ImportError(f"hf_specdec supports transformers {SUPPORTED_TRANSFORMERS}, found {version}; "
                          f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'")


check_transformers_version(transformers.__version__)

# names under which generate() may hand a custom decoding loop the KV cache, newest first
CACHE_KWARG_NAMES = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def _cache_kwarg_name(model_class: type) -> str:
    # the deprecation decorators keep the wrapped signature (functools.wraps), so this reads the
    # real parameter list; a remote-code model may still use the old name on a new release
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """`{name: cache}` with the KV cache kwarg name that `model.forward` takes."""
    return {_cache_kwarg_name(type(model)): cache}


def cache_from_model_kwargs(model_kwargs: dict):
    """The cache `generate()` put in a custom loop's `model_kwargs` (under either name), or None."""
    return next((model_kwargs[name] for name in CACHE_KWARG_NAMES if model_kwargs.get(name) is not None), None)


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty dynamic KV cache for `model` in which every layer keeps every token: a sliding
    layer's window is applied by the mask (`sliding_window`), so a rejected draft can be masked
    out there too; a recurrent or convolution layer keeps its states per row (`StateLayer`).
    Refuses layer kinds that cannot hold masked slots."""
    _refuse_unsupported(model)
    if not state_kinds(model):
        return DynamicCache() if sliding_window(model) else DynamicCache(config=model.config)
    cache = DynamicCache(config=model.config)
    for i, (kind, _) in enumerate(layer_kinds(model)):
        if kind in state_kinds(model):
            cache.layers[i] = StateLayer(number_of_states=cache.layers[i].number_of_states)
        elif kind == "sliding_attention":
            cache.layers[i] = DynamicLayer()
    return cache


def cache_in_use(cache) -> bool:
    """Whether a cache someone handed us holds anything: K/V slots, or a recurrent layer's states
    (`get_seq_length` refuses a cache of those alone)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return cache.get_seq_length() > 0
    def used(layer) -> bool:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            return any(layer.has_previous_state.values())
        return not isinstance(layer, DummyLayer) and layer.is_initialized and layer.get_seq_length() > 0
    return any(used(layer) for layer in layers)


def new_static_cache(model: torch.nn.Module, capacity: int, ring_layers: Collection[int] = (), ring: int = 0):
    """An empty preallocated KV cache of `capacity` slots per row (Transformers' StaticCache,
    allocated at its first write), every layer a full one (sliding windows: as `new_cache`), but
    the layers of index `ring_layers`, of `ring` slots."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer
    _refuse_unsupported(model)
    config = model.config
    if sliding_window(model):
        config = copy.deepcopy(config.get_text_config(decoder=True))
        config.layer_types = ["full_attention"] * config.num_hidden_layers   # (kv_sharing_modes still apply)
    cache = StaticCache(config=config, max_cache_len=capacity)
    for i in ring_layers:
        cache.layers[i] = StaticLayer(max_cache_len=ring)
    return cache


def layer_kinds(model: torch.nn.Module) -> list[tuple[str, int | None]]:
    """Each layer's cache kind ("full_attention", "sliding_attention", "chunked_attention",
    "linear_attention", "conv", ...) and its window (sliding and chunked layers), as Transformers
    builds its caches."""
    from transformers.cache_utils import get_layer_types_and_kwargs
    if model.config.is_encoder_decoder:
        return []
    kinds, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return [(kind, kw.get("sliding_window")) for kind, kw in zip(kinds, kwargs)]


def sliding_window(model: torch.nn.Module) -> int | None:
    """The window (in tokens) of `model`'s sliding-window layers; None if it has none."""
    return max((w for kind, w in layer_kinds(model) if kind == "sliding_attention"), default=None)


def sliding_layers(model: torch.nn.Module) -> set[int]:
    """The indices of `model`'s sliding-window layers (of its cache's layers)."""
    return {i for i, (kind, _) in enumerate(layer_kinds(model)) if kind == "sliding_attention"}


def unsupported_layers(model: torch.nn.Module) -> str | None:
    """The layers our loop cannot roll back a rejected draft in, named (None: it can run them all):
    recurrent or convolution states, chunked attention, or sliding windows where the attention
    takes no 4-D mask (the window is applied by one) or windows differ between layers."""
    config = getattr(model, "config", None)
    if config is None or config.is_encoder_decoder:
        return None
    if bidirectional(model):
        return "bidirectional attention (is_decoder=False)"
    kinds = layer_kinds(model)
    # "dummy": a layer that reads another layer's K/V (Gemma 4's KV sharing) and keeps none
    other = sorted({kind for kind, _ in kinds} - {"full_attention", "sliding_attention", "dummy"}
                   - _runnable_state_kinds(model))
    if "linear_attention" in other:      # (Mamba's cache layers are linear_attention too)
        return "stateful (linear_attention, not Gated DeltaNet or Mamba-2)"
    if other:
        return f"{other[0]}"
    if getattr(model, "_is_stateful", False) and not state_kinds(model):
        return "stateful (recurrent)"
    windows = {w for kind, w in kinds if kind == "sliding_attention"}
    if len(windows) > 1:
        return f"sliding-window (of {len(windows)} sizes)"
    if windows and attn_implementation(model) not in ("sdpa", "eager"):
        return f"sliding-window (attn_implementation={attn_implementation(model)!r})"
    return None


def bidirectional(model: torch.nn.Module) -> bool:
    """An encoder-style model (BERT, RoBERTa, ...) loaded as a causal LM without
    `config.is_decoder=True` attends both ways (Transformers warns at load): verifying k + 1 tokens
    in one forward lets each see the later drafts, which one-token decoding never does."""
    return getattr(model.config, "is_decoder", True) is False and _init_reads_is_decoder(type(model))


@functools.lru_cache(maxsize=None)
def _init_reads_is_decoder(cls) -> bool:
    try:
        return "is_decoder" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False


def _refuse_unsupported(model: torch.nn.Module) -> None:
    layers = unsupported_layers(model)
    if layers:
        raise ValueError(f"{type(model).__name__} has {layers} layers; hf_specdec rolls back rejected tokens by "
                         "masking cache slots, which those layers cannot do")


# Recurrent and convolution layers (hybrid models). In 5.24 every such mixer keeps its states in a
# cache layer of `LinearAttentionCacheLayerMixin`: it reads them with `cache.get_conv_state` /
# `get_recurrent_state`, passes each forward's conv inputs [n, channels, w] to `update_conv_state`
# (which returns them after the state: the causal conv's left context) and its final recurrent state
# to `update_recurrent_state`; with `record_past` it never takes its one-token path (a conv state
# updated in place). The recurrence is a module-level function of its modeling module, which the mixer
# calls by name: one for several tokens, one for a token (what plain decoding runs) (`_RULES`).
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


def slot_cache_inputs_missing(model: torch.nn.Module) -> str | None:
    """What our slot caches need that `model.forward` does not take (None: nothing): a KV cache,
    and explicit position ids (holes in a row's slots would otherwise shift its positions)."""
    params = inspect.signature(type(model).forward).parameters
    if not any(name in params for name in CACHE_KWARG_NAMES):
        return "a KV cache"
    if "position_ids" not in params:
        return "position_ids"
    return None


def reads_target_states(assistant) -> bool:
    """Whether Transformers drafts with `assistant` from the target's own states (Gemma 4
    assistants read its shared K/V), not as a model of its own."""
    return type(assistant).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant"))


def target_states_mismatch(assistant, target) -> str | None:
    """Why a Gemma 4 assistant cannot read `target`'s states (None: it can): it reads hidden
    states of its `backbone_hidden_size` and a Gemma 4 target's per-kind K/V."""
    text = target.config.get_text_config()
    backbone = getattr(assistant.config, "backbone_hidden_size", None)
    if backbone is not None and backbone != text.hidden_size:
        return f"it reads hidden states of size {backbone}, the target's are {text.hidden_size}"
    if not text.model_type.startswith("gemma4"):
        return f"it reads a Gemma 4 target's K/V, the target is {type(target).__name__}"
    return None


def kv_sharing_sources(model: torch.nn.Module) -> dict[str, int]:
    """Per attention kind, the layer whose K/V a Gemma 4 assistant reads (`shared_kv_states`): the
    target's "store" layers (the last of each kind before its KV-sharing layers), else the last
    layer of each kind."""
    config = model.config.get_text_config()
    kinds = config.layer_types
    modes = getattr(config, "kv_sharing_modes", None) or [None] * len(kinds)
    sources = {kind: i for i, (kind, mode) in enumerate(zip(kinds, modes)) if mode == "store"}
    return sources or {kind: i for i, kind in enumerate(kinds)}


def layer_kv(cache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index`'s keys and values [rows, heads, slots, dim] in `cache` (dynamic or static)."""
    layer = cache.layers[index]
    return layer.keys, layer.values


def assistant_step(assistant: torch.nn.Module, inputs_embeds: torch.Tensor, masks: dict[str, torch.Tensor],
                   positions: torch.Tensor, shared_kv: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafting step of a Gemma 4 assistant (`Gemma4AssistantForCausalLM` and its unified kind)
    on inputs_embeds [n, 1, 2 x target hidden] (the target's embedding of the last token and its
    hidden state) at positions [n, 1], attending the target's `shared_kv` through our 4-D `masks`
    by layer kind (its own forward builds them from a 2-D padding mask, which cannot mark a slot
    cache's holes). Returns (logits [n, 1, vocab], its next hidden state [n, 1, target hidden])."""
    hidden = assistant.model(inputs_embeds=assistant.pre_projection(inputs_embeds), attention_mask=masks,
                             position_ids=positions, shared_kv_states=shared_kv, use_cache=False).last_hidden_state
    if assistant.config.use_ordered_embeddings:
        logits = assistant.masked_embedding(hidden, assistant.lm_head.weight)
    else:
        logits = assistant.lm_head(hidden)
    return logits, assistant.post_projection(hidden)


def static_cache_position(first_slot: int, width: int, device) -> torch.Tensor:
    """The slots [width] a forward writes in a static cache: `first_slot` on. (5.24's StaticLayer
    writes at its own running length, which callers keep equal to first_slot.)"""
    return torch.arange(first_slot, first_slot + width, device=device)


def set_static_tensors(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Point a StaticCache layer at other `keys` / `values` [rows, heads, capacity, dim] (views of
    a larger allocation, or grown ones), of the capacity the layer then holds."""
    layer.keys, layer.values = keys, values
    layer.max_cache_len = keys.shape[2]


def compile_config(model: torch.nn.Module, generation_config):
    """The `CompileConfig` a static-cache generate() call compiles `model`'s decoding forwards with,
    or None where Transformers would not compile (`_valid_auto_compile_criteria`: CUDA-like devices
    or `compile_config._compile_all_devices`, not `disable_compile`, no quantizer or CPU offload
    that forbids it). Without a user config: Transformers' default with `fullgraph=True`."""
    from transformers import CompileConfig, StaticCache
    probe = StaticCache(config=model.config, max_cache_len=1)
    if not model._valid_auto_compile_criteria({"cache": probe, "past_key_values": probe}, generation_config):
        return None
    return generation_config.compile_config or CompileConfig(fullgraph=True)


def attn_implementation(model: torch.nn.Module) -> str:
    """The attention implementation `model` was loaded with ("sdpa", "eager", "flash_attention_2", ...)."""
    return model.config._attn_implementation


def set_static_length(cache, length: int, ring_layers: Collection[int] = (), front: int = 0) -> None:
    """Where the next write of every layer of a StaticCache goes (5.24: `cumulative_length`, a
    0-d tensor per layer), `length - front` in the layers of index `ring_layers`: two ops for all
    layers of a length (foreach), not one per layer."""
    for ring, at in ((False, length), (True, length - front)):
        lengths = [layer.cumulative_length for i, layer in enumerate(cache.layers)
                   if _stores(layer) and (i in ring_layers) == ring]
        if lengths:
            torch._foreach_zero_(lengths)
            torch._foreach_add_(lengths, at)


def _storing(cache) -> list:
    """The layers of `cache` that keep K/V of their own (not a KV-sharing layer's `DummyLayer`, nor
    a recurrent layer's states)."""
    return [layer for layer in cache.layers if _stores(layer)]


def _stores(layer) -> bool:
    return not isinstance(layer, (DummyLayer, StateLayer))


def static_layers(cache) -> list:
    """The initialised layers of a StaticCache: their `keys` / `values` are [n, heads, capacity, dim]."""
    return [layer for layer in _storing(cache) if layer.is_initialized]


def repeat_rows(cache: DynamicCache, times: int) -> None:
    """Every row's slots `times` times over, copies next to each other."""
    cache.batch_repeat_interleave(times)


def crop(cache: DynamicCache, num_slots: int) -> None:
    """Drop the last `num_slots` slots of every row."""
    if num_slots > 0:
        cache.crop(-num_slots)


def drop_front(cache: DynamicCache, num_slots: int, layers: Collection[int] | None = None) -> None:
    """Drop the first `num_slots` slots of every row, in the layers of index `layers` (None: all)."""
    if num_slots > 0:
        for i, layer in enumerate(cache.layers):
            if (layers is None or i in layers) and _stores(layer) and layer.is_initialized and layer.keys.numel():
                layer.keys, layer.values = layer.keys[..., num_slots:, :], layer.values[..., num_slots:, :]


def gather_slots(cache: DynamicCache, order: torch.Tensor, layers: Collection[int]) -> None:
    """The layers of index `layers` keep, in row b, the slots order[b] [rows, slots'] (in that order)."""
    for i in layers:
        layer = cache.layers[i]
        if _stores(layer) and layer.is_initialized:
            layer.keys, layer.values = (t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                                        for t in (layer.keys, layer.values))


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only `rows` (a 1-D index tensor) in the batch dimension."""
    cache.batch_select_indices(rows)


def append_rows(cache: DynamicCache, rows: int, other: DynamicCache, other_rows: int) -> None:
    """Append the `other_rows` rows of `other` to the `rows` rows of `cache` (batch dimension).
    The cache with fewer slots is left-padded with zero slots, which callers mask as holes; a
    cache without slots yet contributes only such padding."""
    for layer, extra in zip(state_layers(cache), state_layers(other)):
        layer.append(extra, rows, other_rows)

    def filled(layer):
        return layer.is_initialized and layer.keys.numel() > 0
    for layer, extra in zip(_storing(cache), _storing(other)):
        parts = [(part, n, filled(part)) for part, n in ((layer, rows), (extra, other_rows))]
        full = [part for part, _, has_slots in parts if has_slots]
        if not full:
            continue
        width = max(part.keys.shape[-2] for part in full)

        def merged(name):
            like = getattr(full[0], name)                                       # [n, heads, slots, dim]
            padded = [torch.nn.functional.pad(t := getattr(part, name), (0, 0, width - t.shape[-2], 0))
                      if has_slots else like.new_zeros(n, like.shape[1], width, like.shape[3])
                      for part, n, has_slots in parts]
            return torch.cat(padded, 0)
        keys, values = merged("keys"), merged("values")
        if not layer.is_initialized:  # the layer's own bookkeeping (device; dtype up to 5.23)
            layer.lazy_initialization(full[0].keys, full[0].values)
        layer.keys, layer.values = keys, values


def pad_token_id(generation_config) -> int:
    """The pad token generate() prepared for this call (its own fallback to EOS included), else 0."""
    pad = generation_config._pad_token_tensor
    return int(pad) if pad is not None else 0


def execution_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: an accelerate hook's `execution_device` if it names one (the
    weights may be elsewhere, e.g. offloaded), else the device of its first parameter."""
    hook = getattr(model, "_hf_hook", None)
    for h in getattr(hook, "hooks", (hook,)):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(model.parameters()).device


def tensor_parallel_group(model: torch.nn.Module):
    """The process group that Transformers' tensor parallelism shards `model` over
    (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan=...))`), or None: the model is
    whole on this process."""
    if (getattr(model, "tp_size", None) or 1) <= 1:
        return None
    mesh = model._device_mesh
    return mesh["tp"].get_group() if "tp" in (mesh.mesh_dim_names or ()) else mesh.get_group()


def shards_logits(model: torch.nn.Module) -> bool:
    """Whether `model`'s tensor-parallel plan leaves each rank part of the vocabulary's logits
    (e.g. "colwise" on the output head) instead of all of them ("colwise_gather_output")."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None)
    style = (getattr(model, "_tp_plan", None) or {}).get(name)
    layout = getattr(ALL_PARALLEL_STYLES.get(style), "output_layouts", None) if style else None
    return any(isinstance(one, Shard) for one in (layout if isinstance(layout, (tuple, list)) else [layout]))


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the speculation statistics of the call."""

    spec_stats: object | None = None


# --- Transformers' own assisted loop (hf_specdec.transformers_loop) ---------------------------
# `generate()` builds its candidate generator in `_get_candidate_generator` (private) and runs it in
# `_assisted_decoding`; AssistedCandidateGenerator drafts `num_assistant_tokens` and stops early
# below `assistant_confidence_threshold`, PromptLookupCandidateGenerator drafts `num_output_tokens`.
from transformers.generation.candidate_generator import (  # noqa: E402
    AssistedCandidateGenerator, CandidateGenerator, PromptLookupCandidateGenerator)


def own_candidate_generator(model, call: dict, assistant=None, lookup_tokens: int | None = None, ngram: int = 2,
                            threshold: float = 0.0):
    """What Transformers would build for this call with `assistant` (a model), or with prompt
    lookup drafting up to `lookup_tokens` from n-grams up to `ngram`. `call`: the keyword
    arguments `generate()` passed to `_get_candidate_generator`. Its own schedule is switched off
    (the caller sets the length every step, `set_candidate_length`); a model assistant stops
    drafting below `threshold` (0: never)."""
    import copy
    config = copy.deepcopy(call["generation_config"])
    config.prompt_lookup_num_tokens, config.max_matching_ngram_size = lookup_tokens, ngram
    generator = type(model)._get_candidate_generator(model, **{**call, "generation_config": config,
                                                              "assistant_model": assistant})
    if isinstance(generator, AssistedCandidateGenerator):
        generator.assistant_generation_config.num_assistant_tokens_schedule = "constant"
        generator.assistant_generation_config.assistant_confidence_threshold = threshold
        generator.generation_config.assistant_confidence_threshold = threshold
    elif not isinstance(generator, PromptLookupCandidateGenerator):
        raise ValueError(f"Transformers built a {type(generator).__name__} for this drafter; hf_specdec drives "
                         "AssistedCandidateGenerator and PromptLookupCandidateGenerator only")
    return generator


def sync_candidate_generator(generator, length: int) -> None:
    """Bring a model assistant's mask and positions to a sequence of `length` tokens before it
    drafts. Transformers' own loop asks its generator every step, from the prompt on, and the
    generator extends them only once it holds a cache; ours skips it on plain steps (k = 0) and
    for drafters the policy did not pick, so it may first draft, or draft again, further on."""
    if isinstance(generator, AssistedCandidateGenerator):
        from transformers.generation.candidate_generator import _prepare_attention_mask, _prepare_position_ids
        encoder_decoder = generator.assistant_model.config.is_encoder_decoder
        generator.assistant_kwargs = _prepare_attention_mask(generator.assistant_kwargs, length, encoder_decoder)
        generator.assistant_kwargs = _prepare_position_ids(generator.assistant_kwargs, length, encoder_decoder)


def set_candidate_length(generator, k: int) -> None:
    if isinstance(generator, PromptLookupCandidateGenerator):
        generator.num_output_tokens = k
    else:
        generator.num_assistant_tokens = k


@functools.lru_cache(maxsize=None)
def _candidate_generator_params() -> tuple[str, ...]:
    return tuple(inspect.signature(transformers.GenerationMixin._get_candidate_generator).parameters)[1:]


def run_with_candidate_generator(model, build, generate, *args, **kwargs):
    """`generate(*args, **kwargs)` (an assisted call) with `build(call)` as its candidate generator,
    where `call` holds the arguments generate() passes to `_get_candidate_generator`."""
    def get_candidate_generator(*a, **kw):
        return build(dict(zip(_candidate_generator_params(), a), **kw))
    previous = model.__dict__.get("_get_candidate_generator")
    model._get_candidate_generator = get_candidate_generator      # this call only
    try:
        return generate(*args, **kwargs)
    finally:
        if previous is None:
            del model._get_candidate_generator
        else:
            model._get_candidate_generator = previous


# Transformers' continuous batching (generation/continuous_batching/, the same in 5.23 and 5.24): a
# batch's small int32 inputs live in one bulk tensor of max_batch_tokens + 1 columns;
# `logits_indices` is a view of its row 3 cut to max_requests_per_batch, and the rows from
# `static_inputs` on hold the logits processors' per-row arguments.
def cb_logit_rows(ios) -> tuple[torch.Tensor, torch.Tensor]:
    """A ContinuousBatchingIOs' (logits indices [max_batch_tokens], processor arguments
    [processors, max_batch_tokens]) at their full width: room for a logit row per query token."""
    bulk = ios._bulk_input_tensor
    return bulk[3], bulk[ios.static_inputs:]


def cb_request_arguments(processors, states: list) -> torch.Tensor | None:
    """The per-request processors' arguments [processors, n] (int32 storage) of requests `states`,
    as Transformers prepares them for a step; None without per-request processors."""
    if not processors.tensors_required:
        return None
    storage = torch.zeros(processors.tensors_required, len(states), dtype=torch.int32)
    futures = [SimpleNamespace(state=state, has_new_token=True) for state in states]   # what it reads
    return processors.prepare_tensor_args(futures, storage)


def cb_process(processors, scores: torch.Tensor, arguments: torch.Tensor) -> torch.Tensor:
    """scores [m, vocab] through the per-request processors only, row i with arguments[:, i]."""
    per_request = [p for p in processors.logits_processor if isinstance(p, ContinuousBatchingLogitsProcessor)]
    for processor, argument in zip(per_request, arguments):
        scores = processor(scores, argument)
    return scores


@contextlib.contextmanager
def cb_sampling_replaced(runner, sample):
    """Within it, `runner` (a `ModelRunner`) picks a forward's tokens with `sample(scores [1, m, vocab],
    output_ids)` in place of its `_sample`: its `_forward_process_and_sample` runs the forward, the
    logits processors and the sampling in one method, with no seam between the processed scores
    and the pick, which a speculating step replaces with `verify`."""
    runner._sample = sample
    try:
        yield
    finally:
        del runner._sample


def cb_capacity(cache) -> int:
    """The most tokens one request can hold in a paged cache of full-attention layers (the only
    kind speculation runs on): every block of the cache."""
    return cache.max_tokens_read


def cb_forget_handler(manager, request_id: str) -> None:
    """Drop the result handler registered for a request that was then refused (`transformers serve`
    registers it before `add_request`)."""
    with manager.output_router._lock:
        manager.output_router.result_handlers.pop(request_id, None)


def cb_forks_pending(scheduler) -> bool:
    """A continuous batching scheduler has requests to fork (num_return_sequences > 1)."""
    return bool(scheduler._requests_to_fork)


# `transformers serve` (transformers/cli/serving/, the same in 5.23 and 5.24): `ModelManager._load_model` loads each model the
# server serves (its device, dtype, quantization; GGUF weights named `repo:file.gguf`), and the CLI is
# the typer app `transformers.cli.transformers.app`.
@contextlib.contextmanager
def serve_loads(on_load):
    """Within it, each model `transformers serve` loads passes through `on_load(model, load) -> model`,
    where `load(name)` loads another model as the server loads its own."""
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import split_model_id
    original = ModelManager._load_model

    def load_model(self, model_id_and_revision, *args, **kwargs):
        def load(name: str):
            repo, gguf_file = split_model_id(name)
            return original(self, self.process_model_name(repo), gguf_file=gguf_file)
        return on_load(original(self, model_id_and_revision, *args, **kwargs), load)

    ModelManager._load_model = load_model
    try:
        yield
    finally:
        ModelManager._load_model = original


@contextlib.contextmanager
def serve_refusals(check_chat, refused: type[Exception]):
    """Within it, `transformers serve` checks each chat completion's body with `check_chat(body)` after
    its own validation, and answers a `refused` exception (from `check_chat`, or a continuous
    batching manager's `add_request`) with a 400 and its message, as OpenAI answers an invalid
    request, instead of its 500."""
    from fastapi.responses import JSONResponse
    from transformers.cli.serving import server
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    build, validate = server.build_server, ChatCompletionHandler._validate_request

    async def answer(request, error):
        return JSONResponse({"error": {"message": str(error), "type": "invalid_request_error"}}, status_code=400)

    def build_server(*args, **kwargs):
        app = build(*args, **kwargs)
        app.add_exception_handler(refused, answer)
        return app

    def validated(self, body: dict) -> None:
        validate(self, body)
        check_chat(body)

    server.build_server, ChatCompletionHandler._validate_request = build_server, validated
    try:
        yield
    finally:
        server.build_server, ChatCompletionHandler._validate_request = build, validate


def transformers_cli(args: list[str]) -> None:
    """Run `transformers <args>` in this process (it exits the process when done)."""
    from transformers.cli.transformers import app
    app(args)
