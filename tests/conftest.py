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


@pytest.fixture(autouse=True)
def forward_clock(monkeypatch):
    """No test depends on the wall clock or the machine's load: the policies' step times come from
    a clock that only our models' forwards move (helpers.ForwardClock; set `.costs` to change them)."""
    from helpers import ForwardClock
    clock = ForwardClock()
    clock.install(monkeypatch)
    return clock
