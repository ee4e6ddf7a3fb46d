"""The backward kernels on an H200, against the float32 reference's gradients.

The op keeps gradients through the kernel off on the GPU (`autodiff.BACKWARD_ON_GPU`) until
these pass there; each test turns them on for itself.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import autodiff
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

pytestmark = pytest.mark.gpu

# (T, S): equal, blocks ± 1, and unequal.
SEQ_PAIRS = ((128, 128), (1023, 1023), (1024, 4096), (4096, 1024), (113, 203))
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


@pytest.fixture(autouse=True)
def backward_on_gpu(monkeypatch):
  monkeypatch.setattr(autodiff, "BACKWARD_ON_GPU", True)


def _check(rng, t, s, heads, d, dtype, is_causal):
  n, kv = HEADS[heads]
  w = workloads.Workload("bwd", batch=1, seq_q=t, seq_kv=s, num_q_heads=n, num_kv_heads=kv,
                         head_dim=d, is_causal=is_causal, dtype=dtype)
  q, k, v = testing.random_qkv(rng, w)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  f = lambda q, k, v: fah.dot_product_attention(q, k, v, is_causal=is_causal,
                                                implementation="flash_attn_hopper")
  grads = jax.jit(lambda q, k, v, dout: jax.vjp(f, q, k, v)[1](dout))(q, k, v, dout)
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal)


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("t, s, heads, dtype, is_causal", [
    (t, s, h, dt, c) for (t, s), h, dt, c in itertools.product(
        SEQ_PAIRS, ("gqa",), ("bfloat16", "float16"), (False, True))])
def test_backward_grid(rng, t, s, heads, dtype, is_causal, d):
  _check(rng, t, s, heads, d, dtype, is_causal)


@pytest.mark.parametrize("heads", ("mha", "mqa"))
def test_backward_head_layouts(rng, heads):
  _check(rng, 1024, 1024, heads, 128, "bfloat16", True)
