#!/usr/bin/env bash
# The GPU check, run after every kernel change on an H200: the GPU tests, then the forward
# benchmark against cuDNN and JAX's attention_mgpu on the race grid (B·T = 16k tokens, hidden
# 2048, T 1k/4k/16k, D 64/128/256, causal and not, fp16 and bf16).
#   PYTHONPATH=. bash scripts/gpu_check.sh [all|tests|bench] [OUT_DIR]
# Each part fits one 10-minute device call on its own; `all` runs both, each within its time
# budget (FAH_TEST_SECONDS, FAH_BENCH_SECONDS). Logs and results go to OUT_DIR (default: $OUT,
# else bench/results). pytest runs with -v into the log, so a run cut short still says what
# passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part="${1:-all}"
out="${2:-${OUT:-bench/results}}"
case "$part" in all|tests|bench) ;; *) echo "usage: $0 [all|tests|bench] [OUT_DIR]" >&2; exit 2 ;; esac
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
tests=0 bench=0

if [[ $part != bench ]]; then
  timeout "${FAH_TEST_SECONDS:-280}" python3 -m pytest -v -p no:cacheprovider -m gpu tests \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -n 25
  tests=${PIPESTATUS[0]}
  echo "gpu tests: $(grep -c PASSED "$out/gpu_tests.log") passed, exit $tests"
fi

if [[ $part != tests ]]; then
  python3 -m bench --passes fwd --seq-lens 1024,4096,16384 --head-dims 64,128,256 \
    --causal both --dtypes float16,bfloat16 --peers cudnn,mgpu --repeats 10 \
    --time-budget "${FAH_BENCH_SECONDS:-280}" --no-progress --out "$out" --tag h200_forward \
    2>&1 | tee "$out/bench.log" | tail -n 60
  bench=${PIPESTATUS[0]}
fi
echo "gpu tests exit $tests, bench exit $bench"
[[ $tests == 0 && $bench == 0 ]]
