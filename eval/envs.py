"""The models the benchmarks run on, each loaded here once: a target, its tokenizer and draft models.

    env = ENVS["qwen-coder-onednn"]()                  # Env(model, tokenizer, draft)
    inputs = encode(env.tokenizer, humaneval_texts(env.tokenizer, limit=4), chat=True)

  qwen-coder   Qwen2.5-Coder-1.5B-Instruct (target) with the 0.5B as draft: the real pair (fetched
               once; load_model's kernels for this CPU); qwen-coder-onednn: float32 on oneDNN linear
               layers (CPUs without bf16 matrix instructions); qwen-coder-cpu: the demo's kernels
               for this CPU (hf_specdec.embedded.cpu_kernels), and the draft with a reduced
               vocabulary as drafter `draft-vocab`; qwen-coder-bf16w: the same with the target on
               bf16 weights in float32 arithmetic
  smollm2      the embedded SmolLM2-135M-Instruct (fp32); drafters derived from it (bf16, int8,
               prompt lookup: eval/methods.py)
  gemma3       Gemma 3 270M (fp32; 5 of 6 layers a 512-token sliding window)
  tiny-exact   an 8-layer Llama whose layers 2.. are zeroed and a 1-layer draft computing exactly
               its function (hf_specdec.testing.exact_cheap_pair): a perfect, cheap drafter
  tiny, tiny-distilled  three tiny Llamas for a hierarchy (`tiny_hierarchy`)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hf_specdec.embedded import QWEN_PAIR as QWEN
from hf_specdec.testing import build, exact_cheap_pair, noisy_copy
from humaneval_data import load_problems, prompt_text


@dataclass(frozen=True)
class Env:
    model: object                    # the target
    tokenizer: object = None         # None: the tiny models, fed random token ids
    draft: object = None             # the draft model; None: drafters derived from the target
    intermediate: object = None      # a model between draft and target, for a hierarchy
    drafters: dict = dataclasses.field(default_factory=dict)   # more drafters by method name (@<name>)
    title: str = ""                  # the target in words, for result headings


def qwen_coder(target: dict | None = None, draft: dict | None = None) -> Env:
    """The real pair; target / draft: hf_specdec.embedded.load_model arguments (kernels, dtype)."""
    from hf_specdec.embedded import load_model
    model, tokenizer = load_model(QWEN[0], **(target or {}))
    small, _ = load_model(QWEN[1], **(draft or {}))
    onednn = ", oneDNN linear layers" if (target or {}).get("onednn") else ""
    return Env(model, tokenizer, small, title=f"Qwen2.5-Coder-1.5B-Instruct {str(model.dtype)[6:]}{onednn}")


def cpu_qwen_coder(target: str | None = None) -> Env:
    """The demo's kernels (target: another KERNELS name for the target); also @draft-vocab: the same
    draft with its head over DRAFT_VOCAB tokens."""
    import hf_specdec
    from hf_specdec.embedded import DRAFT_VOCAB, cpu_kernels, load_model
    from hf_specdec.kernels import load_arguments
    kernels = cpu_kernels()
    target = target or kernels.target_kernel
    env = qwen_coder(load_arguments(target), kernels.draft)
    reduced, _ = load_model(QWEN[1], **kernels.draft, draft_vocab=DRAFT_VOCAB)
    measured = "measured: cpu_kernels" if target == kernels.target_kernel else "target chosen by name"
    return dataclasses.replace(env, title=f"{env.title}; target {target}, draft {kernels.draft_kernel} "
                                          f"({measured}); @draft-vocab: its head over {DRAFT_VOCAB} tokens",
                               drafters={"draft-vocab": hf_specdec.ModelDrafter(reduced, name="draft-vocab")})


def smollm2() -> Env:
    from hf_specdec.embedded import load_smollm2
    model, tokenizer = load_smollm2()
    return Env(model, tokenizer, title="SmolLM2-135M fp32")


def gemma3() -> Env:
    from hf_specdec.embedded import load_model
    model, tokenizer = load_model("gemma-3-270m")
    return Env(model, tokenizer, title="Gemma 3 270M fp32")


def tiny_exact() -> Env:
    target, draft = exact_cheap_pair()
    return Env(target, draft=draft, title="tiny exact pair")


def _truncated(source, layers: int, seed: int):
    """The first `layers` layers of `source` (embeddings and head included) as a model of its own."""
    model = build("llama", layers=layers, seed=seed, vocab=2048, hidden=384, init=0.05)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in source.state_dict().items() if k in own})
    return model


def tiny_hierarchy(distilled: bool) -> Env:
    """The target's effective network is layers 0-1 (layer 1 weakened); its other layers are zeroed
    but still computed. tiny: a 4-layer noisy copy (intermediate) is nearly exact at a third of the
    cost, and a 1-layer copy (draft) agrees with it on about two thirds of tokens. tiny-distilled: a
    24-layer target, an 8-layer copy with more noise (intermediate, ~0.8 agreement), and a draft cut
    from the *intermediate*: it agrees with the intermediate more often (~0.82) than with the target
    (~0.68), the case a middle level is for. Vocabulary 2048."""
    target = build("llama", layers=24 if distilled else 12, seed=0, vocab=2048, hidden=384, init=0.05)
    with torch.no_grad():
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        scale = 0.1 if distilled else 0.2
        target.model.layers[1].self_attn.o_proj.weight.mul_(scale)
        target.model.layers[1].mlp.down_proj.weight.mul_(scale)
    if distilled:
        intermediate = noisy_copy(_truncated(target, 8, 1), 0.03, seed=1)
        draft = _truncated(intermediate, 1, 2)
    else:
        intermediate = noisy_copy(_truncated(target, 4, 1), 0.01, seed=1)
        draft = _truncated(target, 1, 2)
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = 0
    return Env(target, draft=draft, intermediate=intermediate, title="tiny hierarchy")


ENVS = {"qwen-coder": qwen_coder, "qwen-coder-onednn": lambda: qwen_coder({"onednn": True}, {"onednn": True}),
        "qwen-coder-cpu": cpu_qwen_coder, "qwen-coder-bf16w": lambda: cpu_qwen_coder("bf16w"), "smollm2": smollm2,
        "gemma3": gemma3, "tiny-exact": tiny_exact,
        "tiny": lambda: tiny_hierarchy(False), "tiny-distilled": lambda: tiny_hierarchy(True)}


def humaneval_texts(tokenizer, style: str = "chat", limit: int | None = None) -> list[str]:
    """HumanEval prompts as the model sees them (humaneval_data.prompt_text: chat or raw)."""
    return [prompt_text(p, tokenizer, style) for p in load_problems(limit=limit)]


def encode(tokenizer, texts: list[str], chat: bool = False) -> dict:
    """Left-padded input_ids / attention_mask; a chat template already holds the special tokens."""
    return dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat))


def random_ids(vocab: int, rows: int, length: int = 32, seed: int = 0) -> dict:
    """Random prompts for the tiny models: input_ids [rows, length] (no special ids 0..2), mask of ones."""
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
