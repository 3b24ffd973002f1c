"""Tiny real Transformers models built from configs (random weights, no hub), for tests and benchmarks."""
from __future__ import annotations

import copy

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

VOCAB = 96
EOS = 2
PAD = 0


def _common(vocab):
    return dict(vocab_size=vocab, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)


def build(arch: str = "llama", layers: int = 2, seed: int = 0, vocab: int = VOCAB, hidden: int = 48,
          init: float = 0.3, window: int = 4) -> torch.nn.Module:
    """A tiny causal LM; `init` large enough that logits are well separated (no near-ties).
    "mistral": every layer a sliding window of `window` tokens; "gemma2": sliding and full layers
    alternating (eager attention, soft-capped logits), as Gemma 2/3 and gpt-oss."""
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=init, **_common(vocab))
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=init, use_sliding_window=False, **_common(vocab))
        model = Qwen2ForCausalLM(cfg)
    elif arch == "mistral":
        cfg = MistralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            initializer_range=init, sliding_window=window, **_common(vocab))
        model = MistralForCausalLM(cfg)
    elif arch == "gemma2":
        cfg = Gemma2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                           max_position_embeddings=512, initializer_range=init, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
                           **_common(vocab))
        model = Gemma2ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=512,
                         initializer_range=init, **_common(vocab))
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.generation_config.pad_token_id = PAD
    return model.eval()


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """Target weights plus Gaussian noise: acceptance falls as `scale` grows."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype) * scale * p.std().clamp(min=1e-3))
    return draft.eval()


def prompts(batch: int, seed: int = 0, min_len: int = 3, max_len: int = 9, vocab: int = VOCAB):
    """Left-padded random prompts: (input_ids [batch, L], attention_mask [batch, L])."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen)
    if batch > 1:
        lengths[0] = max_len  # at least one full row, at least one padded row
        lengths[-1] = min_len
    width = int(lengths.max())
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        ids[b, width - n:] = torch.randint(3, vocab, (n,), generator=gen)  # no pad/bos/eos inside
        mask[b, width - n:] = 1
    return ids, mask


def exact_cheap_pair(layers: int = 8, hidden: int = 384, vocab: int = 2048, seed: int = 0):
    """(target, draft): a `layers`-deep Llama whose layers 2.. are zeroed (o_proj = down_proj = 0,
    so they pass the residual through unchanged) and a 1-layer draft with the same weights.

    The draft computes *exactly* the target's function at a fraction of its cost: a perfect,
    cheap drafter whose speedup is real even on a CPU."""
    return layer_skip_pair(0.0, layers, hidden, vocab, seed)


def layer_skip_pair(upper_scale: float, layers: int = 8, hidden: int = 384, vocab: int = 2048, seed: int = 0):
    """(target, draft): a `layers`-deep Llama whose layers 2.. write `upper_scale` times their usual
    output into the residual stream (o_proj, down_proj scaled), and a 1-layer draft that skips them.
    0 gives an exact drafter; at 384 wide, 0.05 makes ~74% of greedy drafts agree, 0.1 ~55%."""
    target = build("llama", layers=layers, seed=seed, vocab=vocab, hidden=hidden, init=0.05)
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(upper_scale)
            layer.mlp.down_proj.weight.mul_(upper_scale)
    draft = build("llama", layers=1, seed=seed, vocab=vocab, hidden=hidden, init=0.05)
    own = draft.state_dict()
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in own})
    return target, draft.eval()


# Qwen2 sizes (hidden, layers, attention heads, key/value heads, MLP width) of the real checkpoints
QWEN2_SIZES = {"0.5b": (896, 24, 14, 2, 4864), "1.5b": (1536, 28, 12, 2, 8960), "7b": (3584, 28, 28, 4, 18944),
               "toy": (64, 2, 4, 2, 128)}
QWEN2_VOCAB = 151936
# Qwen3.5-style hybrids (hidden, layers, attention heads, key/value heads, MLP width, Gated DeltaNet
# heads, their head dim): three Gated DeltaNet layers to one attention layer, as Qwen3.5's
HYBRID_SIZES = {"hybrid-0.3b": (1024, 12, 8, 2, 3584, 16, 128), "hybrid-draft": (512, 4, 4, 2, 1792, 8, 64),
                "hybrid-toy": (64, 4, 4, 2, 128, 2, 16)}


def circle_model(size: str, vocab: int = QWEN2_VOCAB, alpha: float = 1.0, seed: int = 0, device=None,
                 dtype=torch.bfloat16, sliding_window: int | None = None) -> torch.nn.Module:
    """A Qwen2 causal LM of a real size (`QWEN2_SIZES`) that does all its work yet whose greedy
    output is known: from any prompt it continues last+1, last+2, ... (mod vocab).

    Every layer's o_proj and down_proj are zero, so the residual stream is the input embedding.
    Embedding row x is the point (cos 2*pi*f*x/V, sin 2*pi*f*x/V) over hidden/2 random integer
    frequencies f (f*x reduced mod V in integers first), and lm_head row v is embedding row v-1:
    the logit of v peaks at v = x+1 (hidden/2 against random cosine sums of about sqrt(hidden)).
    alpha < 1 makes a draft: for a random share 1-alpha of tokens x (drawn with `seed` + 1) the
    input embedding row x is row x+1, so it proposes x+2 there, which the target rejects; per-token
    acceptance is then about alpha. Models built with the same `seed` and size share embeddings."""
    from transformers import AutoModelForCausalLM
    if size in HYBRID_SIZES:
        return _circle(_hybrid(size, vocab, device, dtype), alpha, seed)
    hidden, layers, heads, kv_heads, mlp = QWEN2_SIZES[size]
    # sliding_window: Gemma 3's layer pattern, five sliding-window layers to one full one (the
    # window changes no output here, as attention's output projection is zero: only the costs)
    windows = {} if sliding_window is None else dict(
        use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0,
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)])
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=mlp, vocab_size=vocab,
                         tie_word_embeddings=False, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0,
                         **({"use_sliding_window": False} | windows))
    device = torch.device(device or "cpu")
    with torch.device(device):                      # built where it runs, in its dtype: 7B in seconds on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return _circle(model, alpha, seed)


def _hybrid(size: str, vocab: int, device, dtype) -> torch.nn.Module:
    """A Qwen3.5 text model of `HYBRID_SIZES[size]`, random weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    hidden, layers, heads, kv_heads, mlp, linear_heads, linear_dim = HYBRID_SIZES[size]
    config = Qwen3_5TextConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, intermediate_size=mlp, vocab_size=vocab, linear_num_key_heads=linear_heads,
        linear_num_value_heads=linear_heads, linear_key_head_dim=linear_dim, linear_value_head_dim=linear_dim,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        tie_word_embeddings=False, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.device(torch.device(device or "cpu")):
        return Qwen3_5ForCausalLM(config).to(dtype)


def _circle(model: torch.nn.Module, alpha: float, seed: int) -> torch.nn.Module:
    """`model` rewired as a circle model (`circle_model`): every layer's output projections zero."""
    set_circle_alpha(model, alpha, seed)
    with torch.no_grad():
        model.lm_head.weight.copy_(_circle_rows(model, seed).roll(1, dims=0))     # row v = row v-1
        for name, module in model.model.layers.named_modules():
            if name.endswith(("o_proj", "out_proj", "down_proj")):
                module.weight.zero_()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def _circle_rows(model, seed: int) -> torch.Tensor:
    """[vocab, hidden]: row x = (cos 2*pi*f*x/V, sin 2*pi*f*x/V) over hidden/2 integer frequencies f."""
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    device = model.lm_head.weight.device
    freqs = torch.randint(1, vocab, (hidden // 2,), generator=torch.Generator().manual_seed(seed)).to(device)
    angle = (freqs[None, :] * torch.arange(vocab, device=device)[:, None]) % vocab * (2 * torch.pi / vocab)
    return torch.cat([angle.cos(), angle.sin()], dim=1)


def set_circle_alpha(model, alpha: float, seed: int = 0) -> None:
    """Rewire a `circle_model`'s input embedding, in place, for per-token acceptance about alpha
    (1.0: the target's own): the same model, so its compiled forwards and cache are kept."""
    rows = _circle_rows(model, seed)
    vocab = len(rows)
    if alpha < 1.0:
        x = torch.arange(vocab, device=rows.device)
        wrong = (torch.rand(vocab, generator=torch.Generator().manual_seed(seed + 1)) >= alpha).to(rows.device)
        rows[wrong] = rows[(x[wrong] + 1) % vocab].clone()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(rows)


def circle_continuation(input_ids: torch.Tensor, new_tokens: int, vocab: int = QWEN2_VOCAB) -> torch.Tensor:
    """What greedy decoding of a `circle_model` appends to input_ids [batch, p]: [batch, new_tokens]."""
    steps = torch.arange(1, new_tokens + 1, device=input_ids.device)
    return (input_ids[:, -1:] + steps) % vocab


def overwriting_backend(graph_module, example_inputs, **options):
    """A dynamo backend with CUDA graph trees' output semantics, on any device: each call of a
    graph compiled by it NaN-fills (-1 for integers) the outputs of the previous such call, as a
    graph's next run frees or overwrites them. Outputs that alias an input (a cache) stay."""
    held = _OVERWRITTEN

    def run(*args):
        for t in held:
            t.fill_(float("nan") if t.is_floating_point() else -1)
        out = graph_module(*args)
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        held[:] = [o for o in torch.utils._pytree.tree_leaves(out)
                   if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs]
        return out
    return run


_OVERWRITTEN: list = []   # the outputs of the last call of any graph compiled by `overwriting_backend`
