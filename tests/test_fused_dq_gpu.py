"""`BackwardConfig(fused_dq=True)` on an H200: what the interpreter cannot run (the ordered
TMA reduce-adds and the global semaphores, `kernels/fused_dq.py`), against the float32
reference's gradients for random cotangents, the unfused kernels and itself (bitwise).

Not yet run on a GPU: a hang here is a semaphore that never reaches its rank (see the module
docstring's ordering argument); run under a timeout.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import testing
from flash_attn_hopper import workloads
from tiers import tiered

pytestmark = pytest.mark.gpu

#: Configs that fit with fused_dq: (block_q, block_kv, num_stages), per head dim.
CONFIGS = {64: ((64, 64, 2), (128, 64, 2), (64, 64, 3)), 128: ((64, 64, 2),)}
# (T, S): awkward lengths, several KV tiles per query block, T ≠ S both ways.
SEQ_PAIRS = ((113, 203), (1023, 1023), (1024, 4096), (4096, 1024))
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def _grads(q, k, v, dout, cfg, **kw):
  f = lambda q, k, v: fah.dot_product_attention(q, k, v, implementation="flash_attn_hopper",
                                                backward_config=cfg, **kw)
  return jax.jit(lambda q, k, v, dout: jax.vjp(f, q, k, v)[1](dout))(q, k, v, dout)


def _inputs(rng, t, s, heads, d, dtype="bfloat16", batch=1):
  n, kv = HEADS[heads]
  w = workloads.Workload("fused", batch=batch, seq_q=t, seq_kv=s, num_q_heads=n,
                         num_kv_heads=kv, head_dim=d, dtype=dtype)
  q, k, v = testing.random_qkv(rng, w)
  return q, k, v, jnp.asarray(rng.standard_normal(q.shape, np.float32), q.dtype)


# The quick tier: each config's first head dim and block shape at two (T, S) pairs, causal
# and not; the `full` tier adds the rest.
GRID = tiered([(d, blocks, t, s, c) for d, bs in CONFIGS.items() for blocks in bs
               for t, s in SEQ_PAIRS for c in (False, True)],
              lambda i, case: case[1] == (64, 64, 2) and case[2:4] in ((113, 203), (1024, 4096)))


@pytest.mark.parametrize("d, blocks, t, s, is_causal", GRID)
def test_gradients_match_reference(rng, d, blocks, t, s, is_causal):
  q, k, v, dout = _inputs(rng, t, s, "gqa", d)
  grads = _grads(q, k, v, dout, fah.BackwardConfig(*blocks, fused_dq=True),
                 is_causal=is_causal)
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal)


@pytest.mark.parametrize("heads, dtype", tiered(
    itertools.product(HEADS, ("bfloat16", "float16")), lambda i, case: i == 5))
def test_head_layouts_and_dtypes(rng, heads, dtype):
  q, k, v, dout = _inputs(rng, 2048, 2048, heads, 128, dtype, batch=2)
  grads = _grads(q, k, v, dout, fah.BackwardConfig(fused_dq=True), is_causal=True)
  testing.check_gradients(grads, q, k, v, dout, is_causal=True)


@pytest.mark.parametrize("d", [64, 128])
def test_bitwise_deterministic_and_close_to_unfused(rng, d):
  """Many KV tiles per query block (S 8192: 64 tiles of 128 keys), so an unordered add
  would show up as bitwise differences between runs."""
  q, k, v, dout = _inputs(rng, 1024, 8192, "gqa", d, batch=2)
  cfg = fah.BackwardConfig(fused_dq=True)
  runs = [_grads(q, k, v, dout, cfg) for _ in range(3)]
  for other in runs[1:]:
    for a, b in zip(runs[0], other):
      assert bool(jnp.all(a == b))
  unfused = _grads(q, k, v, dout, fah.BackwardConfig())
  for a, b in zip(runs[0], unfused):
    assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) < 5e-2


def test_window_and_key_lengths(rng):
  q, k, v, dout = _inputs(rng, 2048, 2048, "gqa", 128, batch=2)
  kw = dict(is_causal=True, local_window_size=(300, 0),
            key_value_seq_lengths=jnp.array([2048, 130], jnp.int32))
  grads = _grads(q, k, v, dout, fah.BackwardConfig(fused_dq=True), **kw)
  testing.check_gradients(grads, q, k, v, dout, **kw)
