"""The op as a timed program of (q, k, v, dout, arrays), shared by `bench.masks` and
`bench.breakdown`.

`arrays` holds the op's array arguments (a mask, segment ids, sequence lengths) and is passed
to the jitted program, as a training step passes its batch's masks: baked in as constants, a
(16k)² mask is a 268 MB literal that XLA schedules differently (bench.masks timed the all-True
mask's forward 0.16 ms slower that way than as an argument, 2026-11-30).
"""

from __future__ import annotations

import jax

import flash_attn_hopper as fah

PASSES = ("fwd", "fwdbwd")


def program(pass_name: str, *, layers: int = 1, **static):
  """The function of (q, k, v, dout, arrays) for `pass_name` ('fwd' or 'fwdbwd'): the op
  with the keyword arguments `static` and `arrays` (a dict, passed as a jit argument).

  `layers` > 1 chains the op as a model's layers do, each layer's output the next one's
  queries, all with the same K, V and `arrays`: what a mask's preparation costs once it is
  shared by the layers of one step (XLA computes it once)."""
  if pass_name not in PASSES:
    raise ValueError(f"pass_name must be one of {PASSES}, got {pass_name!r}")
  if layers < 1:
    raise ValueError(f"layers must be at least 1, got {layers}")

  def attn(q, k, v, arrays):
    for _ in range(layers):
      q = fah.dot_product_attention(q, k, v, **static, **arrays)
    return q
  if pass_name == "fwd":
    return lambda q, k, v, dout, arrays: attn(q, k, v, arrays)

  def fwd_bwd(q, k, v, dout, arrays):
    out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, arrays), q, k, v)
    return out, vjp(dout)
  return fwd_bwd
