"""eval/bench_tp.py refuses bad arguments, and a run outside torchrun, before loading any model."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "eval" / "bench_tp.py"


@pytest.mark.parametrize("argv, words", [(["--rounds", "0"], "--rounds must be >= 1"),
                                         (["--methods", "fixed:4@nowhere"], "drafter"),
                                         ([], "run it under torchrun")])
def test_bad_arguments_are_refused_before_any_model_is_loaded(argv, words):
    run = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and words in run.stderr, run.stderr[-500:]
