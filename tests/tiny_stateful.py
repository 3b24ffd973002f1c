"""Tiny random models of every *stateful* decoder-only causal-LM type of the installed Transformers.

A type is stateful when its causal-LM class says so (``_is_stateful = True``), when its default config
has a cache layer kind other than plain attention (``get_layer_types_and_kwargs`` yields e.g.
"linear_attention", "conv", "hybrid", "indexed_attention"), or when its modeling module keeps a conv or
recurrent state in the cache (``update_conv_state`` / ``update_recurrent_state``: LFM2's default config
is all attention, its conv layers only come from ``full_attn_idxs``). By that rule the sparse-attention
types ("indexed_attention": an indexer key cache that grows like a KV cache) count too, though Transformers'
own assisted generation runs on them.

``tiny_stateful(model_type)`` builds one of these with its real architecture: random weights, float32,
a few layers that keep every layer kind of the real pattern, small sizes. It is the stateful
counterpart of ``test_model_kinds._tiny_of_type``: the generic ``SMALL`` fields shrink every type, and
``OVERRIDES`` holds what one family needs on top (its own layer-pattern field, sizes that must agree).
"""
import functools
import importlib
import inspect
import re

import torch

ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention", "dummy"}
STATE_CALLS = ("update_conv_state(", "update_recurrent_state(")
MAX_PARAMS = 3_000_000
MAX_LAYERS = 4
VOCAB_FIELDS = ("vocab_size", "unpadded_vocab_size")

# the fields every type shrinks to, where its config has them
SMALL = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256, sliding_window=6, initializer_range=0.02,
    # mixture of experts: few, small experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, num_experts_per_token=2,
    n_shared_experts=1, num_shared_experts=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    shared_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1,
    num_expert_group=1, first_k_dense_replace=1, num_dense_layers=1,
    # multi-head latent attention and sparse-attention indexers
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    index_n_heads=2, index_head_dim=16, index_topk=4,
    # mamba / mamba2 mixers
    state_size=8, conv_kernel=4, expand=2, n_groups=1, chunk_size=4, time_step_rank=8, ssm_state_size=8,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_groups=1, mamba_ngroups=1, mamba_chunk_size=4,
    mamba_n_heads=4, mamba_d_head=16, mamba_num_heads=4, mamba_head_dim=16, mamba_dt_rank=8, n_mamba_heads=2,
    # gated delta net / kimi delta attention / short convolutions
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, conv_L_cache=3, conv_kernel_size=4,
    # the tokens: a small vocabulary, 0 pads, nothing ends a generation
    pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False,
)

# what one family needs beyond SMALL: its layer pattern, and sizes its config checks against each other
OVERRIDES = {
    "bamba": dict(attn_layer_indices=[1]),
    "deepseek_v4": dict(num_key_value_heads=1, o_groups=2, o_lora_rank=16,
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}),
    "dots3_note_text": dict(swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16,
                            swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16),
    "falcon_h1": dict(mamba_d_ssm=64),
    "granitemoehybrid": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    "inkling2_loop_text": dict(n_layers_per_attn_res_block=1, loop_layer_index_start=1,
                               loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "lfm2": dict(num_hidden_layers=2, full_attn_idxs=[1], layer_types=None),
    "lfm2_moe": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
    "mamba2": dict(num_heads=4, head_dim=16),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2, hc_lowrank=8),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=32,
                            attention_window_size=6, conv1d_width=4),
    "rwkv": dict(attention_hidden_size=32, context_length=256),
    "xlstm": dict(num_blocks=2, hidden_size=64, embedding_dim=64, num_heads=2,
                  chunk_size=4, qk_dim_factor=1.0, autocast_kernel_dtype="float32"),   # q/k/v dims: k*64
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),
}


def _causal_lm_class(model_type: str):
    from transformers.models.auto import modeling_auto
    name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return getattr(importlib.import_module("transformers"), name)


def _default_config(model_type: str):
    from transformers import CONFIG_MAPPING
    return CONFIG_MAPPING[model_type]()


def _kinds(config) -> list[str]:
    from transformers.cache_utils import get_layer_types_and_kwargs
    return list(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])


def _keeps_a_state_in_the_cache(cls) -> bool:
    source = inspect.getsource(importlib.import_module(cls.__module__))
    return any(call in source for call in STATE_CALLS)


def _counts_as_stateful(model_type: str) -> bool:
    """Decoder-only, text-only (its config is its own text config), and stateful as the docstring says."""
    try:
        config, cls = _default_config(model_type), _causal_lm_class(model_type)
        if config.is_encoder_decoder or type(config.get_text_config(decoder=True)) is not type(config):
            return False      # composite: the family's `*_text` type, where there is one, stands for it
        return (getattr(cls, "_is_stateful", False) or not set(_kinds(config)) <= ATTENTION_KINDS
                or _keeps_a_state_in_the_cache(cls))
    except Exception:         # noqa: BLE001 - a type whose default config or class does not load
        return False


@functools.cache
def stateful_types() -> list[str]:
    """The stateful decoder-only causal-LM types of the installed Transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if _counts_as_stateful(t))


def _per_layer_fields(config) -> dict[str, list]:
    """The config's per-layer lists (layer_types, mlp_layer_types, layers_block_type, ...), as set."""
    n = getattr(config, "num_hidden_layers", None)
    fields = {}
    for name, value in config.to_dict().items():
        if isinstance(value, list) and len(value) == n and all(isinstance(v, str) for v in value):
            fields[name] = value
    return fields


def _kept_layers(fields: dict[str, list]) -> list[int]:
    """Indices of the real layers to keep: the first of each layer kind (then of each MLP kind, ...)."""
    keep = []
    for name in sorted(fields, key=lambda f: f != "layer_types"):
        for kind in dict.fromkeys(fields[name]):
            if len(keep) < MAX_LAYERS and not any(fields[name][i] == kind for i in keep):
                keep.append(fields[name].index(kind))
    for i in range(2):            # at least 2 layers
        if len(keep) < 2 and i not in keep:
            keep.append(i)
    return sorted(keep)


def _tiny_config_kwargs(model_type: str, vocab: int) -> dict:
    config = _default_config(model_type)
    fields = config.to_dict()          # (not hasattr: it sees properties, and per-layer attributes raise)
    kwargs = {name: value for name, value in SMALL.items() if name in fields}
    kwargs.update({name: vocab for name in VOCAB_FIELDS if name in fields})
    per_layer = _per_layer_fields(config)
    if per_layer:
        keep = _kept_layers(per_layer)
        kwargs.update({name: [value[i] for i in keep] for name, value in per_layer.items()})
        kwargs["num_hidden_layers"] = len(keep)
    elif "num_hidden_layers" in fields:            # one kind of layer, set by no per-layer list
        kwargs["num_hidden_layers"] = 2
    kwargs.update(OVERRIDES.get(model_type, {}))
    return kwargs


def tiny_config(model_type: str, vocab: int = 96):
    """The tiny config of this stateful type: SMALL, its real layer pattern cut to a few layers, OVERRIDES."""
    from transformers import CONFIG_MAPPING
    return CONFIG_MAPPING[model_type](**_tiny_config_kwargs(model_type, vocab))


def tiny_stateful(model_type: str, seed: int = 0, vocab: int = 96):
    """An eval float32 random model of this stateful type, at most MAX_PARAMS parameters, or None
    where its tiny config does not build."""
    try:
        config, cls = tiny_config(model_type, vocab), _causal_lm_class(model_type)
        with torch.device("meta"):
            if sum(p.numel() for p in cls(config).parameters()) > MAX_PARAMS:
                return None
        torch.manual_seed(seed)
        return cls(config).float().eval()
    except Exception:             # noqa: BLE001 - a type this shrinking does not fit
        return None


def layer_kinds_of(model) -> list[str]:
    """The model's cache layer kinds other than plain attention, sorted."""
    return sorted(set(_kinds(model.config)) - ATTENTION_KINDS)


# mixers found by name: those whose state is not behind a Conv1d child or an A_log parameter
MIXER_NAME = re.compile(r"Mixer$|Mamba\w*Layer$|DeltaNet|DeltaAttention|ShortConv|LightningAttention|Rglru|"
                        r"RecurrentBlock|^RwkvSelfAttention$|^RwkvFeedForward$|^xLSTMLayer$|Compressor$")
NOT_A_MIXER = ("Gate", "DecoderLayer", "Model", "ForCausalLM")     # they hold a mixer, or only its parameters


def _holds_a_state(module) -> bool:
    name = type(module).__name__
    if name.endswith(NOT_A_MIXER):
        return False
    return (hasattr(module, "A_log") or bool(MIXER_NAME.search(name))
            or any(isinstance(child, torch.nn.Conv1d) for child in module.children()))


def mixer_classes(model) -> list[str]:
    """Class names of the model's modules that hold a recurrent or convolution state, sorted."""
    return sorted({type(m).__name__ for m in model.modules() if _holds_a_state(m) and m is not model})
