"""A/B on a Hopper GPU: the backward kernels' schedule (`kernels/common.backward_schedule`),
up to three sides compiled in one process by swapping `config.PERSISTENT_BACKWARD_MAX_STEPS`:
per_tile (an empty table: one CTA per tile), tuned (the module's table) and persistent (every
tile on persistent CTAs), interleaved with cuDNN on the same inputs, CUPTI device time:
  PYTHONPATH=. python3 scripts/ab_backward_schedule.py [head dims] [seq lens] [dtype] [sides]
e.g. `64,128 1024,2048,4096 bfloat16`. B·T = 16k tokens, hidden 2048, causal and not. Times
fwd+bwd (a jitted value_and_grad with a random cotangent), and the dQ and dK/dV kernels
alone from the profile. Prints each side's median ms (best of 3 rounds of 10-run medians),
its fwd+bwd ratio to cuDNN, and checks that the three sides' gradients are bitwise equal."""
import functools, sys
import jax, jax.numpy as jnp
import flash_attn_hopper as fah
from flash_attn_hopper import config as config_lib
from ab_common import fwd_bwd, race_inputs, timings

TUNED = config_lib.PERSISTENT_BACKWARD_MAX_STEPS
dims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64,128").split(",")]
seqs = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1024,2048,4096").split(",")]
dtype = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
ALWAYS = {(kernel, d, causal): 1 << 30 for kernel in ("dq", "dkv") for d in dims
          for causal in (False, True)}
SIDES = {"per_tile": {}, "tuned": TUNED, "persistent": ALWAYS}
SIDES = {n: SIDES[n] for n in (sys.argv[4] if len(sys.argv) > 4 else ",".join(SIDES)).split(",")}


def cell(d, t, causal):
  q, k, v, dout = race_inputs(d, t, causal, dtype)
  fns = {"cudnn": fwd_bwd(functools.partial(jax.nn.dot_product_attention,
                                            implementation="cudnn", is_causal=causal))}
  for name, steps in SIDES.items():
    config_lib.PERSISTENT_BACKWARD_MAX_STEPS = steps
    jax.clear_caches()
    fns[name] = fwd_bwd(functools.partial(fah.dot_product_attention, is_causal=causal)
                        ).lower(q, k, v, dout).compile()
  config_lib.PERSISTENT_BACKWARD_MAX_STEPS = TUNED
  grads = {n: fns[n](q, k, v, dout)[1] for n in SIDES}
  first = next(iter(SIDES))
  same = all(bool(jnp.all(a == b)) for n in SIDES for a, b in zip(grads[n], grads[first]))
  ref = fns["cudnn"](q, k, v, dout)[1]
  err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))
            for a, r in zip(grads[first], ref))
  best = {n: (float("inf"), {}) for n in fns}
  for _ in range(3):
    for n, f in fns.items():
      total, kernels = timings(f, q, k, v, dout)
      if total < best[n][0]:
        best[n] = (total, kernels)
  base = best["cudnn"][0]
  print(f"fwd+bwd D {d} T {t} {'causal' if causal else 'full'} {dtype.name} "
        f"(same bits: {same}, err vs cudnn {err:.1e}): cudnn {base:.3f} ms | " + " | ".join(
            f"{n}: {best[n][0]:.3f} ms ({base / best[n][0]:.3f}x, dq "
            f"{best[n][1]['dq']:.3f}, dkv {best[n][1]['dkv']:.3f})" for n in SIDES),
        flush=True)


for d in dims:
  for t in seqs:
    for causal in (False, True):
      cell(d, t, causal)
