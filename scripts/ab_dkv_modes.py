"""Interleaved A/B of the dK/dV kernel's step at D 128 (branch dkv-d128-variants):
`PYTHONPATH=. python scripts/ab_dkv_modes.py [T] [--rounds 3]` on the H200.

Sets `kernels.dkv.WIDE_STEP_OVERLAP` to each mode in turn between fwd+bwd runs of one shape
(B·T = 16k, hidden 2048, bf16, non-causal and causal) and prints bench.breakdown's
per-kernel times for each, round after round, so that the GPU's heating affects all alike.
"""

import argparse

import numpy as np

from bench import breakdown
from bench import programs
from flash_attn_hopper.kernels import dkv

MODES = ("none", "products", "pair")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("seq_len", nargs="?", type=int, default=16384)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  t, d = args.seq_len, 128
  qkv = breakdown._inputs(np.random.default_rng(0), t, 2048 // d, 2048 // d, d,
                          batch=16384 // t)
  for causal in (False, True):
    for _ in range(args.rounds):
      for mode in MODES:
        dkv.WIDE_STEP_OVERLAP = mode  # Read when the kernel is traced: a fresh program.
        breakdown.breakdown(f"D{d} T{t} causal={causal} overlap={mode}",
                            programs.program("fwdbwd", is_causal=causal), *qkv, {},
                            repeats=10)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
