"""Per-kernel device time of the op's programs (CUPTI), to see where a pass's time goes:
`python -m bench.breakdown [--case mask|causal|all] [--repeats 5]`.

- `mask`: an all-True (T, S) `mask` at T = 16k (B 1, 16 query heads over 4, D 128, bf16)
  against no mask, forward and fwd+bwd: the XLA fusions that prepare the mask (its one-byte
  copy, the block tables) beside the kernels; with `--layers L`, L chained layers share the
  mask (each output the next layer's queries), to see its preparation paid once per step;
- `causal`: fwd+bwd causal and not, D 64 and 128 at T 4k and 16k (B·T = 16k, hidden 2048):
  the forward, dQ and dK/dV kernels' shares.

Each line is one kernel's median over the repeats; the total is the median of the sums.
Needs a GPU (CUPTI).
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from bench import programs


def breakdown(name: str, fn, *args, repeats: int = 5) -> None:
  """Prints `fn`'s total device time and each kernel's over 5 µs, medians of `repeats`."""
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  _, runs = profiler.measure(fn, aggregate=False, iterations=repeats)(*args)
  per_kernel = collections.defaultdict(list)
  for run in runs:
    seen = collections.Counter()
    for kernel, ms in run:
      seen[kernel] += 1
      per_kernel[(kernel, seen[kernel])].append(ms)
  median = lambda xs: sorted(xs)[len(xs) // 2]
  print(f"== {name}: total {median([sum(ms for _, ms in run) for run in runs]):.3f} ms")
  for (kernel, i), times in per_kernel.items():
    if median(times) > 0.005:
      print(f"   {median(times):8.3f}  {kernel[:90]}{'' if i == 1 else f' #{i}'}", flush=True)


def _inputs(rng, t: int, heads: int, kv_heads: int, d: int, batch: int = 1):
  make = lambda h: jnp.asarray(rng.standard_normal((batch, t, h, d)), jnp.bfloat16)
  return make(heads), make(kv_heads), make(kv_heads), make(heads)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", default="all", choices=("mask", "causal", "all"))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--layers", type=int, default=1, help="layers sharing the mask (mask)")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  run = lambda name, fn, *a: breakdown(name, fn, *a, repeats=args.repeats)
  if args.case in ("mask", "all"):
    t = 16384
    qkv = _inputs(rng, t, 16, 4, 128)
    mask = jnp.ones((t, t), bool)
    layered = f", {args.layers} layers" if args.layers > 1 else ""
    for pass_name in programs.PASSES:
      program = programs.program(pass_name, layers=args.layers)
      run(f"all-True mask {pass_name}{layered}", program, *qkv, dict(mask=mask))
      run(f"no mask {pass_name}{layered}", program, *qkv, {})
  if args.case in ("causal", "all"):
    for t in (16384, 4096):
      for d in (128, 64):
        qkv = _inputs(rng, t, 2048 // d, 2048 // d, d, batch=16384 // t)
        for causal in (True, False):
          run(f"fwdbwd D{d} T{t} causal={causal}", programs.program("fwdbwd", is_causal=causal),
            *qkv, {})
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
