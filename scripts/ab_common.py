"""What the A/B scripts share: a jitted fwd+bwd with a cotangent, and one call's device time
with its kernels' share (CUPTI, through Mosaic GPU's profiler; needs the GPU)."""
import statistics

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

PREFIX = "flash_attn_hopper_"


def fwd_bwd(attention):
  """jit(value_and_grad) of sum(attention(q, k, v) · dout) in float32, over q, k and v; it
  takes (q, k, v, dout). (The cotangent is an argument: closed over, it became a constant
  that XLA spent over a second folding, on every compile.)"""
  def loss(q, k, v, dout):
    return jnp.sum(attention(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def timings(fn, *args, kernels=("dq", "dkv")):
  """(total ms, {kernel: ms}) of one call of `fn`: medians over 10 runs; a kernel's time
  sums every profiled kernel whose name contains PREFIX + kernel (`dkv` takes `dkv_split`)."""
  _, runs = profiler.measure(fn, aggregate=False, iterations=10)(*args)
  total = statistics.median(sum(t for _, t in run) for run in runs)
  return total, {k: statistics.median(sum(t for name, t in run if PREFIX + k in name)
                                      for run in runs) for k in kernels}
