#!/usr/bin/env bash
# `make gpu-check`, on a lent GPU machine (its own torch with CUDA; no package index, no model hub):
# installs the wheels `make gpu-wheels` carried into a target folder, runs the CUDA tests, then
# eval/bench_compiled.py's one cell and eval/bench_gpu.py within a budget (each cell written as it finishes; a rerun resumes).
#   RESULTS  where results go (default docs/results/bench_gpu); BUDGET_S  no cell starts after this
#   many seconds from the start (default 300; the tests count);
#   HF_SPECDEC_COMMIT  the commit the results are stamped with (a copy whose git HEAD is stale)
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/hf_specdec_site}
RESULTS=${RESULTS:-docs/results/bench_gpu}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())") || exit 1
timeout "${TEST_TIMEOUT_S:-90}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$RESULTS/$name-tests.log"
BUDGET_S=${BUDGET_S:-300}
# first, the compiled path call by call: Transformers' compiled plain, ours fixed:0 / fixed:4 / default
# on the static path, batch 1, every call's wall, steps, warm-ups, graphs, CUDA-graph skips, learnt costs
# (at most FIRST_CELL_S, default 300: every call is logged as it ends, the cell written when it ends)
TORCH_LOGS=recompiles timeout "${FIRST_CELL_S:-300}" python3 eval/bench_compiled.py --pair 7b/0.5b --alpha 0.8 \
    --batches 1 --out "$RESULTS/$name-compiled" 2>&1 | tee "$RESULTS/$name-compiled.log"
python3 eval/bench_gpu.py --out "$RESULTS/$name" --pairs 7b/0.5b --alphas 0.8,0.95 --batch-sizes 1,16 \
    --budget-s "$((BUDGET_S - SECONDS))" 2>&1 | tee "$RESULTS/$name-bench.log"
# then, if the budget leaves room for its compiles: a sliding-window target (Gemma 3's layer pattern)
if [ $((BUDGET_S - SECONDS)) -gt 200 ]; then
  python3 eval/bench_gpu.py --out "$RESULTS/$name-sliding" --pairs 7b/0.5b --sliding-window 64 --alphas 0.8 \
      --batch-sizes 16 --methods plain,plain/static,fixed:4@draft/static --budget-s "$((BUDGET_S - SECONDS))" \
      2>&1 | tee "$RESULTS/$name-sliding.log"
fi
