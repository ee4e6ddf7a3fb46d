"""A/B on a Hopper GPU: the epilogue's addresses hoisted by LLVM out of a persistent CTA's
tile loop, or computed after the step loop (`kernels.common.unhoisted`), interleaved with
cuDNN on the same inputs, CUPTI device time:
  PYTHONPATH=. python3 scripts/ab_unhoisted_epilogue.py fwd|fwdbwd [head dims] [seq lens]
      [dtype] [full|causal|both] [sides]
e.g. `fwdbwd 128 1024,4096 bfloat16 full hoisted,unhoisted,unhoisted_wide`. B·T = 16k
tokens, hidden 2048. A side sets the switches before it compiles: `hoisted` turns both off
(`dkv.UNHOISTED_EPILOGUE`, `forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM`), `unhoisted` turns both
on for every head dim, `unhoisted_wide` also gives the D 128 non-causal dK/dV kernel
persistent CTAs at every length (`config.PERSISTENT_BACKWARD_MAX_STEPS`). Prints each side's
best of rounds of 10-run medians (ms; dQ and dK/dV alone for fwdbwd), its ratio to cuDNN,
and whether the sides' outputs are bitwise equal."""
import functools, sys
import jax, jax.numpy as jnp
import flash_attn_hopper as fah
from flash_attn_hopper import config as config_lib
from flash_attn_hopper.kernels import dkv, forward
from ab_common import fwd_bwd, race_inputs, timings

TUNED = config_lib.PERSISTENT_BACKWARD_MAX_STEPS
MIN_HEAD_DIM = forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM


def _set(side: str):
  unhoisted = side.startswith("unhoisted")
  dkv.UNHOISTED_EPILOGUE = unhoisted
  forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM = 0 if unhoisted else 1 << 30
  config_lib.PERSISTENT_BACKWARD_MAX_STEPS = (
      {**TUNED, ("dkv", 128, False): 1 << 30} if side == "unhoisted_wide" else TUNED)


def _restore():
  dkv.UNHOISTED_EPILOGUE = True
  forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM = MIN_HEAD_DIM
  config_lib.PERSISTENT_BACKWARD_MAX_STEPS = TUNED


def cell(pass_, d, t, causal, dtype, sides, rounds=3):
  q, k, v, dout = race_inputs(d, t, causal, dtype)
  args = (q, k, v) if pass_ == "fwd" else (q, k, v, dout)
  wrap = jax.jit if pass_ == "fwd" else fwd_bwd
  kernels = () if pass_ == "fwd" else ("dq", "dkv")
  fns = {"cudnn": wrap(functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                                         is_causal=causal))}
  for side in sides:
    _set(side)
    jax.clear_caches()
    fns[side] = wrap(functools.partial(fah.dot_product_attention, is_causal=causal)
                     ).lower(*args).compile()
  _restore()
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


def main(argv):
  pass_ = argv[1]
  dims = [int(x) for x in (argv[2] if len(argv) > 2 else "128").split(",")]
  seqs = [int(x) for x in (argv[3] if len(argv) > 3 else "1024,4096").split(",")]
  dtype = jnp.dtype(argv[4] if len(argv) > 4 else "bfloat16")
  causal = {"full": (False,), "causal": (True,), "both": (False, True)}[
      argv[5] if len(argv) > 5 else "both"]
  sides = (argv[6] if len(argv) > 6 else "hoisted,unhoisted").split(",")
  for d in dims:
    for t in seqs:
      for c in causal:
        cell(pass_, d, t, c, dtype, sides, rounds=5 if pass_ == "fwd" else 3)


if __name__ == "__main__":
  main(sys.argv)
