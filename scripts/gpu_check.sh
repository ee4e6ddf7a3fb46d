#!/usr/bin/env bash
# The GPU check, run after every kernel change on an H200: the GPU tests, then the forward
# benchmark against cuDNN and JAX's attention_mgpu on the race grid (B·T = 16k tokens, hidden
# 2048, T 1k/4k/16k, D 64/128/256, causal and not, fp16 and bf16).
#   PYTHONPATH=. bash scripts/gpu_check.sh [all|tests|bench|fwdbwd|backward|masks|ring] [OUT_DIR]
# `all` fits one 10-minute device call: the 61 tests of the quick tier took ~210 s as 8
# parallel processes (XLA does not autotune in the tests), the forward grid ~265 s (2026-12-01);
# each part stops at its time budget (FAH_TEST_SECONDS, FAH_BENCH_SECONDS). FAH_GPU_FULL=1
# adds the `full` tier's ~85 tests, for a call of their own (FAH_SKIP_PASSED). Logs and
# results go to OUT_DIR (default: $OUT, else bench/results).
# The tests run one process each (scripts/run_tests_isolated.py): a hang is cut off and named.
# FAH_TEST_FILTER narrows them (a pytest selection); FAH_SKIP_PASSED names an earlier log
# whose passed tests are skipped. FAH_RESUME names the JSON of a grid that its budget cut
# short (carried into the tree), to finish it (`python -m bench --resume`).
# `fwdbwd`, after backward work: the backward and masks GPU tests (53, ~300 s), then the
# fwd+bwd grid against cuDNN in FAH_DTYPES (default bfloat16; ~250 s each, so a grid may take
# a second call with FAH_RESUME and FAH_SKIP_PASSED).
# FAH_PEERS names the peers of both grids (default cudnn,mgpu,tokamax: each one that does not
# import is listed as unavailable and skipped). Wheels in .whl/ (`scripts/peer_wheels.sh`, carried
# with the call) are installed into a temporary folder on PYTHONPATH first: that is how tokamax
# gets onto the GPU machine, which reaches no registry.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part="${1:-all}"
out="${2:-${OUT:-bench/results}}"
case "$part" in all|tests|bench|fwdbwd|backward|masks|ring) ;;
  *) echo "usage: $0 [all|tests|bench|fwdbwd|backward|masks|ring] [OUT_DIR]" >&2; exit 2 ;; esac
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    .whl/*.whl && export PYTHONPATH="$PYTHONPATH:$site"
fi
peers="${FAH_PEERS:-cudnn,mgpu,tokamax}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
tests=0 bench=0

if [[ $part == backward ]]; then  # the backward issue's grid against cuDNN, then 64k memory
  python3 -m bench --passes bwd,fwdbwd --seq-lens 1024,4096,16384 --head-dims 64,128,256 \
    --causal both --dtypes bfloat16,float16 --peers cudnn --repeats 5 \
    --time-budget "${FAH_BENCH_SECONDS:-540}" --no-progress --out "$out" --tag h200_backward \
    2>&1 | tee "$out/bench_backward.log" | tail -n 60
  status=${PIPESTATUS[0]}
  python3 -m bench.memory 2>&1 | tee "$out/bench_memory.log"  # 64k tokens: ours vs cuDNN
  exit "$status"
fi
if [[ $part == masks ]]; then  # the masks issue's speed pairs
  python3 -m bench.masks 2>&1 | tee "$out/bench_masks.log"
  exit "${PIPESTATUS[0]}"
fi
if [[ $part == ring ]]; then  # on a machine with 2+ GPUs: the ring's tests, then its scaling
  python3 -m pytest -q -m gpu tests/test_ring_gpu.py 2>&1 | tail -n 20
  python3 -m bench.ring 2>&1 | tee "$out/bench_ring.log"
  exit "${PIPESTATUS[0]}"
fi

if [[ $part == fwdbwd ]]; then
  : "${FAH_TEST_FILTER:=tests/test_backward_gpu.py tests/test_masks_gpu.py}"
fi
if [[ $part != bench ]]; then
  # One process per test, several at a time (compiling is most of a test's time, on the CPU):
  # a test that hangs on the GPU is cut off and named, and the rest still run.
  python3 scripts/run_tests_isolated.py --jobs "${FAH_TEST_JOBS:-8}" \
    --timeout "${FAH_TEST_TIMEOUT:-200}" --budget "${FAH_TEST_SECONDS:-300}" \
    --log "$out/gpu_tests.log" ${FAH_SKIP_PASSED:+--skip-passed "$FAH_SKIP_PASSED"} \
    ${FAH_TEST_FILTER:-tests} | grep -v -E "^PASSED .*::[^ ]*$" | tail -n 40
  tests=${PIPESTATUS[0]}
fi

if [[ $part == fwdbwd ]]; then
  dtypes="${FAH_DTYPES:-bfloat16}"
  python3 -m bench --passes fwdbwd --seq-lens 1024,4096,16384 --head-dims 64,128,256 \
    --causal both --dtypes "$dtypes" --peers "$peers" --repeats 5 \
    --time-budget "${FAH_BENCH_SECONDS:-250}" --no-progress --out "$out" \
    --tag "h200_fwdbwd_$(sed 's/bfloat16/bf16/g; s/float16/fp16/g; s/,/_/g' <<< "$dtypes")" \
    ${FAH_RESUME:+--resume "$FAH_RESUME"} \
    2>&1 | tee "$out/bench.log" | tail -n 40
  bench=${PIPESTATUS[0]}
elif [[ $part != tests ]]; then
  python3 -m bench --passes fwd --seq-lens 1024,4096,16384 --head-dims 64,128,256 \
    --causal both --dtypes float16,bfloat16 --peers "$peers" --repeats 10 \
    --time-budget "${FAH_BENCH_SECONDS:-265}" --no-progress --out "$out" --tag h200_forward \
    ${FAH_RESUME:+--resume "$FAH_RESUME"} 2>&1 | tee "$out/bench.log" | tail -n 60
  bench=${PIPESTATUS[0]}
fi
echo "gpu tests exit $tests, bench exit $bench"
[[ $tests == 0 && $bench == 0 ]]
