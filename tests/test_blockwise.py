"""The blockwise (XLA) backward, against the float32 reference's gradients, on any device."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from flash_attn_hopper import blockwise
from flash_attn_hopper import masking
from flash_attn_hopper import reference
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

SHAPES = (
    workloads.Workload("mha_113x203_d64", batch=1, seq_q=113, seq_kv=203, num_q_heads=2,
                       num_kv_heads=2, head_dim=64),
    workloads.Workload("gqa_130x77_d256", batch=2, seq_q=130, seq_kv=77, num_q_heads=4,
                       num_kv_heads=2, head_dim=256),
    workloads.Workload("mqa_64x300_d128", batch=1, seq_q=64, seq_kv=300, num_q_heads=3,
                       num_kv_heads=1, head_dim=128),
)


def _grads(q, k, v, dout, *, is_causal, scale, block_kv, seq_kv=None):
  s = k.shape[1] if seq_kv is None else seq_kv
  out, lse = reference.attention_reference(q, k[:, :s], v[:, :s], is_causal=is_causal,
                                           scale=scale, return_residual=True)
  lse = jnp.swapaxes(lse, 1, 2)  # (B, T, N) -> (B, N, T), the kernel's layout.
  return blockwise.attention_backward(q, k, v, out.astype(q.dtype), lse, dout, scale=scale,
                                      mask=masking.MaskSpec(is_causal=is_causal),
                                      seq_kv=seq_kv, block_kv=block_kv)


@pytest.mark.parametrize("w", SHAPES, ids=lambda w: w.name)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("is_causal", (False, True))
def test_gradients_match_reference(rng, w, dtype, is_causal):
  q, k, v = testing.random_qkv(rng, w, dtype)
  dout = jnp.asarray(rng.standard_normal(q.shape), dtype)
  # 64-key blocks: several scan steps, the last one partial.
  grads = _grads(q, k, v, dout, is_causal=is_causal, scale=0.15, block_kv=64)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal, scale=0.15)


def test_keys_past_seq_kv_are_masked_and_get_zero_gradients(rng):
  w = SHAPES[0]
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  dq, dk, dv = _grads(q, k, v, dout, is_causal=False, scale=0.1, block_kv=64, seq_kv=150)
  testing.check_gradients((dq, dk[:, :150], dv[:, :150]), q, k[:, :150], v[:, :150], dout,
                          scale=0.1)
  assert bool(jnp.all(dk[:, 150:] == 0)) and bool(jnp.all(dv[:, 150:] == 0))


def test_key_lengths_per_batch_element(rng):
  w = SHAPES[1]  # two batch elements, GQA, D 256
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  kv_lens = jnp.array([30, 77], jnp.int32)
  out, lse = reference.attention_reference(q, k, v, key_value_seq_lengths=kv_lens, scale=0.1,
                                           return_residual=True)
  grads = blockwise.attention_backward(q, k, v, out.astype(q.dtype), jnp.swapaxes(lse, 1, 2),
                                       dout, scale=0.1, mask=masking.MaskSpec(),
                                       kv_lens=kv_lens, block_kv=64)
  testing.check_gradients(grads, q, k, v, dout, key_value_seq_lengths=kv_lens, scale=0.1)


@pytest.mark.parametrize("w", SHAPES, ids=lambda w: w.name)
@pytest.mark.parametrize("is_causal", (False, True))
def test_segment_ids(rng, w, is_causal):
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  ids = masking.SegmentIds(
      jnp.asarray(testing.random_segment_ids(rng, w.batch, w.seq_q, 5)),
      jnp.asarray(testing.random_segment_ids(rng, w.batch, w.seq_kv, 5)))
  # A query whose segment has no visible key gets jax.nn's mean of V from the op, not from
  # this backward: a zero cotangent there leaves the two gradients equal.
  visible = testing.segment_mask(ids, w.batch, w.seq_q, w.seq_kv)[:, 0]
  if is_causal:
    visible &= jnp.tril(jnp.ones((w.seq_q, w.seq_kv), bool))
  seen = visible.any(axis=-1)[:, :, None, None]
  dout = jnp.where(seen, jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16), 0)
  out, lse = reference.attention_reference(q, k, v, is_causal=is_causal, segment_ids=ids,
                                           scale=0.15, return_residual=True)
  grads = blockwise.attention_backward(q, k, v, out.astype(q.dtype), jnp.swapaxes(lse, 1, 2),
                                       dout, scale=0.15,
                                       mask=masking.MaskSpec(is_causal=is_causal),
                                       segment_ids=ids, block_kv=64)
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal, segment_ids=ids,
                          scale=0.15)
