"""Two or more Hopper GPUs: ring attention (forward and gradients against the float32
reference, the kernels running each block) and the op sharded over batch or heads. Skipped
with fewer than two GPUs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import ring
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout, is_causal", [("zigzag", True), ("contiguous", False)])
def test_ring_on_gpus_matches_reference(rng, layout, is_causal):
  n = jax.device_count()
  if n < 2:
    pytest.skip(f"needs two GPUs; found {n}")
  mesh = jax.make_mesh((n,), ("sp",))
  w = workloads.Workload("ring", batch=1, seq_q=4096, seq_kv=4096, num_q_heads=8,
                         num_kv_heads=2, head_dim=128)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  attn = lambda q, k, v: ring.sharded_attention(mesh, "sp", q, k, v, is_causal=is_causal,
                                                layout=layout)
  testing.check_attention(jax.jit(attn)(q, k, v), q, k, v, is_causal=is_causal)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  grads = jax.jit(lambda q, k, v, dout: jax.vjp(attn, q, k, v)[1](dout))(q, k, v, dout)
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal)


@pytest.mark.parametrize("spec", [("d",), (None, None, "d")], ids=("batch", "heads"))
def test_op_sharded_over_batch_or_heads(rng, spec):
  """Each GPU runs the kernel on its shard; the compiled program gathers nothing."""
  n = jax.device_count()
  if n < 2:
    pytest.skip(f"needs two GPUs; found {n}")
  mesh = jax.make_mesh((n,), ("d",))
  w = workloads.Workload("shards", batch=2 * n, seq_q=2048, seq_kv=2048, num_q_heads=4 * n,
                         num_kv_heads=n, head_dim=128, is_causal=True)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  put = lambda x: jax.device_put(x, sharding)
  attn = jax.jit(lambda q, k, v: fah.dot_product_attention(q, k, v, is_causal=True))
  assert "all-gather" not in attn.lower(put(q), put(k), put(v)).compile().as_text()
  testing.check_attention(attn(put(q), put(k), put(v)), q, k, v, is_causal=True)
