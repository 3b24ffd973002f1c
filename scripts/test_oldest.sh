#!/usr/bin/env bash
# The test suite on the oldest Transformers release the project supports (pyproject.toml's lower
# bound, its .0 release), every other package as scripts/constraints.txt pins it, in a throwaway
# virtual environment. PYTEST_ARGS="tests/test_x.py" runs only those tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OLDEST=$(sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml).0
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
sed "s/^transformers==.*/transformers==$OLDEST/" scripts/constraints.txt > "$TMP/constraints.txt"
$PY -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
CONSTRAINTS="$TMP/constraints.txt" PYTHON="$VPY" bash scripts/install.sh
"$VPY" -c "import transformers; print('transformers', transformers.__version__)"
"$VPY" -m pytest -q ${PYTEST_ARGS:-}
