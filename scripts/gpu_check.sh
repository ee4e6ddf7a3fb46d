#!/usr/bin/env bash
# The one GPU call: the GPU tests, then the forward benchmark against cuDNN and JAX's
# attention_mgpu on the race grid (B·T = 16k tokens, hidden 2048, T 1k/4k/16k, D 64/128/256,
# causal and not, fp16 and bf16). Run it after every kernel change, on an H200:
#   PYTHONPATH=. bash scripts/gpu_check.sh [OUT_DIR]
# Logs and results go to OUT_DIR (default: $OUT, else bench/results).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-${OUT:-bench/results}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

# -v streams one line per test into the log, so a run cut short still says what passed.
timeout "${FAH_TEST_SECONDS:-280}" python3 -m pytest -v -p no:cacheprovider -m gpu tests \
  2>&1 | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -n 25
tests=${PIPESTATUS[0]}

python3 -m bench --passes fwd --seq-lens 1024,4096,16384 --head-dims 64,128,256 \
  --causal both --dtypes float16,bfloat16 --peers cudnn,mgpu --repeats 10 \
  --time-budget "${FAH_BENCH_SECONDS:-280}" --no-progress --out "$out" --tag h200_forward \
  2>&1 | tee "$out/bench.log" | tail -n 60
bench=${PIPESTATUS[0]}
echo "gpu tests exit $tests, bench exit $bench"
[[ $tests == 0 && $bench == 0 ]]
