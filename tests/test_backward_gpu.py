"""Gradients on an H200, against the float32 reference's gradients for random cotangents.

Every head dim runs the backward kernels (at D 256: dQ on 32-key blocks and the split dK/dV
kernel, see `autodiff`).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import autodiff
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import testing
from flash_attn_hopper import workloads
from tiers import tiered

pytestmark = pytest.mark.gpu

# (T, S): equal, blocks ± 1, and unequal.
SEQ_PAIRS = ((128, 128), (1023, 1023), (1024, 4096), (4096, 1024), (113, 203))
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def _check(rng, t, s, heads, d, dtype, is_causal, **kw):
  n, kv = HEADS[heads]
  w = workloads.Workload("bwd", batch=1, seq_q=t, seq_kv=s, num_q_heads=n, num_kv_heads=kv,
                         head_dim=d, is_causal=is_causal, dtype=dtype)
  q, k, v = testing.random_qkv(rng, w)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  f = lambda q, k, v: fah.dot_product_attention(q, k, v, is_causal=is_causal,
                                                implementation="flash_attn_hopper", **kw)
  grads = jax.jit(lambda q, k, v, dout: jax.vjp(f, q, k, v)[1](dout))(q, k, v, dout)
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal)


HEAD_DIMS = (64, 128, 256)
COMBOS = list(itertools.product(("bfloat16", "float16"), (False, True)))
# The quick tier gives each (pair, head dim) one (dtype, causal) combination, in turn; the
# full tier adds the other three.
GRID = tiered([(t, s, "gqa", dt, c, d)
               for (t, s), d in itertools.product(SEQ_PAIRS, HEAD_DIMS) for dt, c in COMBOS],
              lambda i, case: COMBOS.index(case[3:5]) == (i // len(COMBOS)) % len(COMBOS))


@pytest.mark.parametrize("t, s, heads, dtype, is_causal, d", GRID)
def test_backward_grid(rng, t, s, heads, dtype, is_causal, d):
  _check(rng, t, s, heads, d, dtype, is_causal)


@pytest.mark.parametrize("heads", tiered([("mha",), ("mqa",)], lambda i, case: case[0] == "mqa"))
def test_backward_head_layouts(rng, heads):
  _check(rng, 1024, 1024, heads, 128, "bfloat16", True)


@pytest.mark.parametrize("d", tiered([(d,) for d in autodiff.KERNEL_BACKWARD_HEAD_DIMS],
                                     lambda i, case: case[0] == 128))
def test_backward_is_deterministic(rng, d):
  n, kv = HEADS["gqa"]
  w = workloads.Workload("bwd", batch=2, seq_q=2048, seq_kv=2048, num_q_heads=n,
                         num_kv_heads=kv, head_dim=d, is_causal=True, dtype="bfloat16")
  q, k, v = testing.random_qkv(rng, w)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  f = lambda q, k, v: fah.dot_product_attention(q, k, v, is_causal=True,
                                                implementation="flash_attn_hopper")
  grads = jax.jit(lambda q, k, v, dout: jax.vjp(f, q, k, v)[1](dout))
  first, second = grads(q, k, v, dout), grads(q, k, v, dout)
  for a, b in zip(first, second):
    assert bool(jnp.all(a == b))


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_balanced_tail(rng, backward_schedules, d):
  # `BackwardConfig.balanced_tail` with the tuned tiles: four batch elements of 40 heads at
  # 1k, causal, where both kernels run on persistent CTAs: 640 pairs of dQ tiles (and of
  # dK/dV tiles; 1280 of D 256's split kernel) on an H200's 132 SMs leave a tail.
  tuned = config_lib.resolve_backward_config(d, jnp.bfloat16, True, seq_len=1024)
  w = workloads.Workload("bwd", batch=4, seq_q=1024, seq_kv=1024, num_q_heads=40,
                         num_kv_heads=40, head_dim=d, is_causal=True, dtype="bfloat16")
  q, k, v = testing.random_qkv(rng, w)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  f = lambda q, k, v: fah.dot_product_attention(
      q, k, v, is_causal=True, implementation="flash_attn_hopper",
      backward_config=dataclasses.replace(tuned, balanced_tail=True))
  grads = jax.jit(lambda q, k, v, dout: jax.vjp(f, q, k, v)[1](dout))(q, k, v, dout)
  assert [(kernel, s.table is not None) for kernel, s in backward_schedules] == [
      ("dq", True), ("dkv", True)]
  testing.check_gradients(grads, q, k, v, dout, is_causal=True)


# dQ on its own query rows (`BackwardConfig.dq_block_q`): 64-row dQ tiles beside dK/dV's
# 128-row query blocks at D 64, every pair, both dtypes, causal and not in turn.
DQ_64_ROWS = fah.BackwardConfig(block_q=128, dq_block_q=64)


@pytest.mark.parametrize("t, s, dtype, is_causal", [
    (t, s, *COMBOS[i % len(COMBOS)]) for i, (t, s) in enumerate(SEQ_PAIRS)])
def test_dq_rows_apart_from_dkv(rng, t, s, dtype, is_causal):
  _check(rng, t, s, "gqa", 64, dtype, is_causal, backward_config=DQ_64_ROWS)


# The five-matmul backward (`BackwardConfig.fused_dq`): every pair at D 64 and 128, its dQ
# from TMA reduce-adds, which only the GPU runs.
FUSED = fah.BackwardConfig(fused_dq=True)
FUSED_GRID = tiered([(t, s, dt, c, d) for (t, s), d in itertools.product(SEQ_PAIRS, (64, 128))
                     for dt, c in COMBOS],
                    lambda i, case: COMBOS.index(case[2:4]) == (i // len(COMBOS)) % len(COMBOS))


@pytest.mark.parametrize("t, s, dtype, is_causal, d", FUSED_GRID)
def test_fused_dq_backward(rng, t, s, dtype, is_causal, d):
  _check(rng, t, s, "gqa", d, dtype, is_causal, backward_config=FUSED)


@pytest.mark.parametrize("kw", tiered(
    [(dict(local_window_size=(300, 0), key_value_seq_lengths=(700,)),),
     (dict(segment_ids="random"),)], lambda i, case: True), ids=str)
def test_fused_dq_backward_masks(rng, kw):
  kw = dict(kw)
  if "key_value_seq_lengths" in kw:
    kw["key_value_seq_lengths"] = jnp.asarray(kw["key_value_seq_lengths"], jnp.int32)
  if kw.get("segment_ids") == "random":
    kw["segment_ids"] = jnp.asarray(testing.random_segment_ids(rng, 1, 1024, 5))
  n, kv = HEADS["gqa"]
  w = workloads.Workload("bwd", batch=1, seq_q=1024, seq_kv=1024, num_q_heads=n,
                         num_kv_heads=kv, head_dim=128, is_causal=True, dtype="bfloat16")
  q, k, v = testing.random_qkv(rng, w)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  f = lambda q, k, v: fah.dot_product_attention(
      q, k, v, is_causal=True, implementation="flash_attn_hopper", backward_config=FUSED, **kw)
  grads = jax.jit(lambda q, k, v, dout: jax.vjp(f, q, k, v)[1](dout))(q, k, v, dout)
  testing.check_gradients(grads, q, k, v, dout, is_causal=True, **kw)
