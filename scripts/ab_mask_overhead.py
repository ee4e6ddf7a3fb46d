"""What a mask that leaves every tile fully visible costs, kernel by kernel (issue 5's
overhead): an all-True (T, T) bool mask against no mask, interleaved rounds in one process so
that the GPU's clock drift falls on both sides alike. Needs a GPU (CUPTI).

    PYTHONPATH=. python3 scripts/ab_mask_overhead.py [--t 16384] [--rounds 6] [--layers 1]

Per round each program runs `--repeats` times; a kernel's figure is the median over all its
runs. Kernels are grouped by name: the forward, dQ and dK/dV kernels, and the rest (XLA's
fusions: the mask's one-byte copy and block tables, δ, the empty-rows select).
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from bench import programs

GROUPS = (("forward", "flash_attn_hopper_fwd"), ("dQ", "flash_attn_hopper_dq"),
          ("dK/dV", "flash_attn_hopper_dkv"))


def _group(kernel: str) -> str:
  return next((name for name, key in GROUPS if key in kernel), "XLA")


def _times(fn, args, repeats: int):
  """Per group, the summed device ms of each run of `fn`."""
  _, runs = profiler.measure(fn, aggregate=False, iterations=repeats)(*args)
  out = collections.defaultdict(list)
  for run in runs:
    sums = collections.Counter()
    for kernel, ms in run:
      sums[_group(kernel)] += ms
      sums["total"] += ms
    for name, ms in sums.items():
      out[name].append(ms)
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--t", type=int, default=16384)
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--layers", type=int, default=1)
  parser.add_argument("--passes", default="fwd,fwdbwd")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  t = args.t
  make = lambda h: jnp.asarray(rng.standard_normal((1, t, h, 128)), jnp.bfloat16)
  q, k, v, dout = make(16), make(4), make(4), make(16)
  sides = {"mask": dict(mask=jnp.ones((t, t), bool)), "none": {}}
  print(f"all-True ({t})² mask vs none, B 1, N 16 over 4, D 128, bf16, {args.layers} layer(s), "
        f"{args.rounds} rounds × {args.repeats}")
  for pass_name in args.passes.split(","):
    fn = jax.jit(programs.program(pass_name, layers=args.layers))
    for arrays in sides.values():
      jax.block_until_ready(fn(q, k, v, dout, arrays))
    times = {side: collections.defaultdict(list) for side in sides}
    for _ in range(args.rounds):
      for side, arrays in sides.items():
        for name, ms in _times(fn, (q, k, v, dout, arrays), args.repeats).items():
          times[side][name].extend(ms)
    median = lambda xs: float(np.median(xs)) if xs else 0.0
    print(f"\n{pass_name}:   {'mask ms':>9} {'none ms':>9} {'mask/none':>10}")
    for name in ("total", *(g for g, _ in GROUPS), "XLA"):
      a, b = median(times["mask"][name]), median(times["none"][name])
      ratio = f"{a / b:9.3f}×" if b else ""
      print(f"  {name:8} {a:9.3f} {b:9.3f} {ratio}", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
