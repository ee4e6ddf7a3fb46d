"""The flax adapters: a flax model with our attention matches it with flax's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")

FEATURES, HEADS, SEQ, BATCH = 128, 2, 40, 2  # head dim 64


def _nnx_pair(attention_fn):
  make = lambda fn: nnx.MultiHeadAttention(
      num_heads=HEADS, in_features=FEATURES, dtype=jnp.bfloat16, decode=False,
      rngs=nnx.Rngs(0), **({} if fn is None else {"attention_fn": fn}))
  return make(None), make(attention_fn)


def _loss(model, x, cotangent):
  out = model(x, is_causal=True) if isinstance(model, nnx.MultiHeadAttention) else model(x)
  return jnp.sum(out.astype(jnp.float32) * cotangent)


@pytest.mark.interpret
def test_nnx_outputs_and_gradients_match_flax_attention(rng):
  theirs, ours = _nnx_pair(fah.flax_attention_fn(interpret=True))
  x = jnp.asarray(rng.standard_normal((BATCH, SEQ, FEATURES)), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal((BATCH, SEQ, FEATURES)), jnp.float32)
  out_theirs, out_ours = theirs(x, is_causal=True), ours(x, is_causal=True)
  # Both run in bf16; ours may be at most about as far from theirs as bf16 rounding allows.
  np.testing.assert_allclose(np.asarray(out_ours, np.float32),
                             np.asarray(out_theirs, np.float32), atol=3e-2, rtol=3e-2)
  g_theirs = nnx.grad(_loss)(theirs, x, cotangent)
  g_ours = nnx.grad(_loss)(ours, x, cotangent)
  flat = lambda g: [(path, np.asarray(v.get_value(), np.float32))
                    for path, v in nnx.to_flat_state(nnx.state(g))]
  pairs = list(zip(flat(g_ours), flat(g_theirs)))
  largest = max(np.linalg.norm(b) for _, (_, b) in pairs)
  for (path, a), (_, b) in pairs:
    # The key bias's true gradient is zero (softmax ignores a per-query constant): compare
    # such near-zero gradients against the model's gradient scale, not their own.
    diff, scale = np.linalg.norm(a - b), max(np.linalg.norm(b), 0.05 * largest)
    assert diff <= 3e-2 * scale, f"{path}: gradient difference {diff:.3g} vs scale {scale:.3g}"


def test_linen_with_mask_matches_flax_attention(rng):
  # Off Hopper our op falls back to jax.nn's XLA path, which takes masks: this checks that
  # the adapter passes linen's arguments through with the right meaning.
  x = jnp.asarray(rng.standard_normal((BATCH, SEQ, FEATURES)), jnp.float32)
  mask = jnp.asarray(rng.random((BATCH, 1, SEQ, SEQ)) > 0.3)
  make = lambda **kw: linen.MultiHeadDotProductAttention(num_heads=HEADS, **kw)
  theirs, ours = make(), make(attention_fn=fah.flax_attention_fn(implementation="xla"))
  params = theirs.init(jax.random.key(0), x, mask=mask)
  np.testing.assert_allclose(np.asarray(ours.apply(params, x, mask=mask)),
                             np.asarray(theirs.apply(params, x, mask=mask)),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dropout_rate=0.1, deterministic=False), "attention dropout"),
    (dict(module=object()), "sowing attention weights"),
    (dict(input_positions=jnp.arange(4)), "input_positions"),
])
def test_what_the_kernel_cannot_do_is_named(rng, kwargs, match):
  q = jnp.asarray(rng.standard_normal((1, 4, 2, 64)), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=match):
    fah.flax_attention_fn(implementation="xla")(q, q, q, **kwargs)


def test_kernel_output_equals_the_op(rng):
  w = workloads.INTERPRET_SHAPES[0]
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  out = fah.flax_attention_fn(implementation="xla")(q, k, v, is_causal=True)
  ref = fah.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
