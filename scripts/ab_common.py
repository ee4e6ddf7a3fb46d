"""What the A/B and ptxas scripts share: a race-grid cell's inputs, a jitted fwd+bwd with a
cotangent, and one call's device time with its kernels' share (CUPTI, through Mosaic GPU's
profiler; needs the GPU)."""
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from flash_attn_hopper import workloads

PREFIX = "flash_attn_hopper_"


CAUSAL_MODES = {"full": (False,), "causal": (True,), "both": (False, True)}


def grid_args(argv, first: int, dims="128", seqs="1024,4096", causal="both"):
  """The cells a script's command line names from `argv[first]` on: head dims, sequence
  lengths, dtype and `full|causal|both`, each with its default when left out. Returns
  (dims, seqs, dtype, causal modes, the arguments after those four)."""
  args = list(argv[first:first + 4]) + [None] * 4
  dims, seqs, dtype, causal = (a or b for a, b in zip(args, (dims, seqs, "bfloat16", causal)))
  return ([int(x) for x in dims.split(",")], [int(x) for x in seqs.split(",")],
          jnp.dtype(dtype), CAUSAL_MODES[causal], list(argv[first + 4:]))


def race_inputs(head_dim: int, seq: int, is_causal: bool, dtype, rng=None):
  """Standard-normal (q, k, v, dout) in `dtype` for the race grid's cell
  (`workloads.hidden_2048_grid`: B·T = 16k tokens, hidden 2048); `rng` defaults to a fresh
  generator seeded 0."""
  dtype = jnp.dtype(dtype)
  cell, = workloads.hidden_2048_grid((seq,), (head_dim,), (is_causal,), (dtype.name,))
  rng = np.random.default_rng(0) if rng is None else rng
  return tuple(jnp.asarray(rng.standard_normal(cell.q_shape), dtype) for _ in range(4))


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
