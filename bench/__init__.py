"""Benchmark of flash_attn_hopper against cuDNN, XLA, JAX's Mosaic GPU FlashAttention and tokamax.

Usage (from the repository root):

  python -m bench --quick                     # T 1k,4k; D 64,128; fp16+bf16; causal both; fwd
  python -m bench                             # the full T sweep 512..16k, D 64/128/256, fwd+fwdbwd
  python -m bench --passes fwd,bwd,fwdbwd --models --tag nightly
  python -m bench --peers cudnn --seq-lens 4096 --head-dims 128 --dtypes bfloat16 --causal yes
  python -m bench --list                      # print the planned cells only

A run cut short by --time-budget (a device call has ten minutes) is finished by a second run
with the same options and --resume <first run's JSON>: the workloads that ran in full there
are kept as they are, each row's cells from one run (bench/resume.py), and the rest run.

CPU smoke run (no GPU: ours runs in the Mosaic GPU interpreter, XLA is the only peer; XLA on
CPU has no fp16 dot, so bf16; --tokens/--hidden shrink the grid to B=1, N=2):

  python -m bench --peers xla --interpret --seq-lens 128 --head-dims 64 --dtypes bfloat16 \\
      --tokens 128 --hidden 128 --repeats 2 --passes fwd,bwd,fwdbwd --out /tmp/bench

Each cell (workload x pass x implementation) runs on fresh random normal inputs made on the
device, is checked against the float32 reference (flash_attn_hopper.reference) on a slice of
batch elements and heads, and only then timed: the median of --repeats runs of device kernel
time (CUPTI through jax.experimental.mosaic.gpu.profiler on GPU, wall clock elsewhere).
A cell whose error is above the dtype's tolerance is a loud FAIL and gets no TFLOP/s.

TFLOP/s follow FlashAttention's count: forward 4*B*H*T*S*D, halved when causal; the backward
counts 2.5x and forward+backward 3.5x the forward. The report prints a TFLOP/s table with
ours/cuDNN and ours/best-peer per cell, their geometric mean and worst cell per pass and dtype,
and writes <tag>.json (all raw numbers and metadata), <tag>.md and <tag>.png to --out
(default bench/results).

Exit status: 0, or 1 when a cell of ours failed the numerics check.
"""
