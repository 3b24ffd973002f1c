import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_grad_enabled(False)  # generate() is no_grad anyway; direct forwards in tests too


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (model, tokenizer), loaded once per session."""
    from hf_specdec.embedded import load_smollm2
    return load_smollm2()
