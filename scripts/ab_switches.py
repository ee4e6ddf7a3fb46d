"""A/B on a Hopper GPU of module switches, interleaved with cuDNN on the same inputs, CUPTI
device time:
  PYTHONPATH=.:scripts python3 scripts/ab_switches.py fwd|fwdbwd [head dims] [seq lens]
      [dtype] [full|causal|both] [sides] [--nondeterministic]
A side is `base` (the modules as they are) or assignments `module.NAME=value` joined by `+`,
the module under `flash_attn_hopper` (`kernels.dkv.SHARED_STEP_BARRIERS=False`) and the value
a Python literal. e.g. `fwdbwd 64,128 1024,4096 bfloat16 both
base,kernels.dkv.SHARED_STEP_BARRIERS=False`. B·T = 16k tokens, hidden 2048. Each side is set
before it compiles and restored after. Prints each side's best of rounds of 10-run medians
(ms; dQ and dK/dV alone for fwdbwd), its ratio to cuDNN, and whether the sides' outputs are
bitwise equal. `--nondeterministic` calls our op with deterministic=False (the five-matmul
backward where `config.TUNED_BACKWARD_FUSED` takes it)."""
import ast
import contextlib
import functools
import importlib
import sys

import jax
import jax.numpy as jnp
import flash_attn_hopper as fah
from ab_common import fwd_bwd, grid_args, race_inputs, timings


@contextlib.contextmanager
def switched(side: str):
  """Sets the module attributes that `side` assigns (see the docstring), then restores them."""
  saved = []
  try:
    for assignment in [] if side == "base" else side.split("+"):
      target, _, literal = assignment.partition("=")
      module_name, _, name = target.rpartition(".")
      module = importlib.import_module(f"flash_attn_hopper.{module_name}")
      if not hasattr(module, name):
        raise ValueError(f"side {side!r}: flash_attn_hopper.{module_name} has no {name}")
      saved.append((module, name, getattr(module, name)))
      setattr(module, name, ast.literal_eval(literal))
    yield
  finally:
    for module, name, value in reversed(saved):
      setattr(module, name, value)


def cell(pass_, d, t, causal, dtype, sides, rounds=3, switch=switched, deterministic=True):
  """Times one cell's `sides` (each compiled under `switch(side)`) against cuDNN."""
  q, k, v, dout = race_inputs(d, t, causal, dtype)
  args = (q, k, v) if pass_ == "fwd" else (q, k, v, dout)
  wrap = jax.jit if pass_ == "fwd" else fwd_bwd
  kernels = () if pass_ == "fwd" else ("dq", "dkv")
  fns = {"cudnn": wrap(functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                                         is_causal=causal))}
  for side in sides:
    with switch(side):
      jax.clear_caches()
      fns[side] = wrap(functools.partial(fah.dot_product_attention, is_causal=causal,
                                         deterministic=deterministic)
                       ).lower(*args).compile()
  outs = {n: jax.tree.leaves(fns[n](*args)) for n in sides}
  same = all(bool(jnp.all(a == b)) for n in sides for a, b in zip(outs[n], outs[sides[0]]))
  best = {n: (float("inf"), {}) for n in fns}
  for _ in range(rounds):
    for n, f in fns.items():
      total, per_kernel = timings(f, *args, kernels=kernels)
      best[n] = min(best[n], (total, per_kernel), key=lambda x: x[0])
  base = best["cudnn"][0]
  print(f"{pass_} D {d} T {t} {'causal' if causal else 'full'} {jnp.dtype(dtype).name} "
        f"(same bits: {same}): cudnn {base:.4f} ms | " + " | ".join(
            f"{n}: {best[n][0]:.4f} ms ({base / best[n][0]:.3f}x"
            + "".join(f", {k} {ms:.3f}" for k, ms in best[n][1].items()) + ")"
            for n in sides), flush=True)


def main(argv, default_sides="base", switch=switched):
  deterministic = "--nondeterministic" not in argv
  argv = [a for a in argv if a != "--nondeterministic"]
  pass_ = argv[1]
  dims, seqs, dtype, causal, rest = grid_args(argv, 2)
  sides = (rest[0] if rest else default_sides).split(",")
  for d in dims:
    for t in seqs:
      for c in causal:
        cell(pass_, d, t, c, dtype, sides, rounds=5 if pass_ == "fwd" else 3, switch=switch,
             deterministic=deterministic)


if __name__ == "__main__":
  main(sys.argv)
