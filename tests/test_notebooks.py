"""The example notebooks (examples/*.ipynb) run top to bottom offline and are committed without outputs.

Each notebook runs with nbclient in a fresh ipykernel (cwd examples/, Hub access switched off), with
a cell inserted right after its "parameters" cell that selects the offline configuration (the
embedded SmolLM2 or tiny models) and sizes small enough for a 2-core CPU. Any cell that raises
fails the test; the notebooks assert their own results (every speculative output equals plain
generate(), a seeded sample repeats), and the test also checks that they printed that and drew their plots.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))
COLAB = "https://colab.research.google.com/github/hf-specdec/hf-specdec/blob/main/examples/"

# per notebook: what the test sets after the parameters cell (besides OFFLINE = True), the least number
# of plots it must draw, and a line its output must contain
IDENTICAL = "identical to plain generate(): True"
OFFLINE = {
    "01_quickstart.ipynb": ("MAX_NEW_TOKENS = 32", 1, IDENTICAL),
    "02_hedgespec_drafters.ipynb": ("MAX_NEW_TOKENS = 24", 1, IDENTICAL),
    "03_adaptive_lengths.ipynb": ('OFFLINE_MODELS = "tiny"\nBATCH_SIZES = (1, 4)\nMAX_NEW_TOKENS = 32\n'
                                  "LEARN_RUNS = 1\nREPEATS = 1", 3, IDENTICAL),
    "04_hierarchy.ipynb": ("BATCH_SIZES = (1,)\nMAX_NEW_TOKENS = 24\nREPEATS = 1", 1, IDENTICAL),
    "05_humaneval.ipynb": ('PROBLEMS = ["HumanEval/23", "HumanEval/35", "HumanEval/52"]\nN_SAMPLES = 2\n'
                           "PASS_AT = (1, 2)\nMAX_NEW_TOKENS = 48", 1, " samples pass"),
}
# a hang guard, not a speed check (a notebook takes about 0.5-2.5 min on an idle 2-core CPU; a busy
# machine may take several times that, and no test asserts a wall-clock time)
CELL_TIMEOUT = 1800     # seconds for any one cell


def load(name: str) -> dict:
    return json.loads((EXAMPLES / name).read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_every_notebook_has_an_offline_configuration():
    assert NOTEBOOKS, f"no notebooks in {EXAMPLES}"
    assert sorted(OFFLINE) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    dirty = [i for i, cell in enumerate(load(name)["cells"]) if cell["cell_type"] == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, f"{name}: cells {dirty} hold outputs or execution counts; clear them before committing"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_opens_in_colab(name):
    """Badge first, then an install cell that only installs on Colab, then the parameters cell."""
    cells = load(name)["cells"]
    assert cells[0]["cell_type"] == "markdown"
    assert "colab-badge.svg" in source(cells[0]) and COLAB + name in source(cells[0])
    install = source(cells[1])
    assert cells[1]["cell_type"] == "code"
    assert '"google.colab" in sys.modules' in install and "pip install" in install
    parameters = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(parameters) == 1 and "OFFLINE = None" in source(parameters[0])


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
    """A kernelspec that runs this interpreter: a "python3" kernel installed per user (or system-wide) may
    belong to another environment, and JUPYTER_PATH comes first in Jupyter's search path."""
    spec = tmp_path / "kernels" / "hf-specdec-tests"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hf-specdec tests", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "hf-specdec-tests"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_runs_offline(name, kernel_name, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")             # the kernel inherits the environment
    settings, plots, expected = OFFLINE[name]
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell("OFFLINE = True\n" + settings))

    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{name}: a cell raised\n{err}", pytrace=False)
    seconds = time.perf_counter() - start

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert expected in text, f"{name}: {expected!r} not in its output"
    assert images >= plots, f"{name}: {images} plots drawn, expected at least {plots}"
    logging.getLogger(__name__).info("%s ran in %.0f s", name, seconds)
