"""Tiny real Transformers models built from configs (random weights, no hub), for tests and benchmarks."""
from __future__ import annotations

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96
EOS = 2
PAD = 0


def _common(vocab):
    return dict(vocab_size=vocab, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)


def build(arch: str = "llama", layers: int = 2, seed: int = 0, vocab: int = VOCAB, hidden: int = 48,
          init: float = 0.3) -> torch.nn.Module:
    """A tiny causal LM; `init` large enough that logits are well separated (no near-ties)."""
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
