"""The forward kernel on an H200 at full size, against the float32 reference.

Chosen by the `gpu` marker; skipped, with what was found, where there is no sm90 GPU.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import testing
from flash_attn_hopper import workloads
from tiers import tiered

pytestmark = pytest.mark.gpu

L = workloads.GPU_TEST_LENGTHS
# (T, S): every length against itself, and unequal pairs around block edges.
SEQ_PAIRS = [(n, n) for n in L] + [(1, 8192), (8192, 1), (113, 1024), (1023, 4096),
                                   (4096, 1023), (128, 113)]
HEAD_DIMS = (64, 128, 256)
# (query heads, kv heads): MHA; GQA with groups of 4; MQA.
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
DTYPES = ("bfloat16", "float16")


def _workload(t, s, heads, d, is_causal, dtype):
  n, kv = HEADS[heads]
  # One batch element: the long shapes' float32 reference is large, and batching is covered
  # by the model shapes and the interpret tests.
  return workloads.Workload(f"t{t}_s{s}_{heads}_d{d}", batch=1, seq_q=t, seq_kv=s,
                            num_q_heads=n, num_kv_heads=kv, head_dim=d,
                            is_causal=is_causal, dtype=dtype)


def _check(rng, w, config=None):
  q, k, v = testing.random_qkv(rng, w)
  fwd = jax.jit(lambda q, k, v: fah.dot_product_attention(
      q, k, v, is_causal=w.is_causal, implementation="flash_attn_hopper", return_residual=True,
      config=config))
  testing.poison_device_memory(2 * q.size * q.dtype.itemsize)
  out, lse = fwd(q, k, v)
  testing.check_attention(out, q, k, v, actual_lse=lse, is_causal=w.is_causal)


# Every sequence pair meets every head dim; dtype and causality alternate over the pairs so
# that each (dtype, causal) combination meets every length class without quadrupling the grid.
GRID = [(t, s, DTYPES[i % 2], bool((i // 2) % 2)) for i, (t, s) in enumerate(SEQ_PAIRS)]
# The quick tier gives each pair one head dim, in turn, so every head dim meets every
# (dtype, causal) combination and every length class; the full tier adds the other two.
GRID_BY_DIM = tiered([(*case, d) for case in GRID for d in HEAD_DIMS],
                     lambda i, case: HEAD_DIMS.index(case[-1]) == (i // len(HEAD_DIMS)) % 3)


@pytest.mark.parametrize("t, s, dtype, is_causal, d", GRID_BY_DIM)
def test_forward_grid(rng, t, s, dtype, is_causal, d):
  _check(rng, _workload(t, s, "gqa", d, is_causal, dtype))


QUICK_HEAD_LAYOUTS = {("mha", 256, "float16"), ("mqa", 64, "bfloat16")}


@pytest.mark.parametrize("heads, d, dtype", tiered(
    itertools.product(("mha", "mqa"), HEAD_DIMS, DTYPES),
    lambda i, case: case in QUICK_HEAD_LAYOUTS))
def test_forward_head_layouts(rng, heads, d, dtype):
  _check(rng, _workload(1024, 1024, heads, d, True, dtype))


@pytest.mark.parametrize("w", tiered(((w,) for w in workloads.MODEL_SHAPES),
                                     lambda i, case: not case[0].name.startswith("mqa")),
                         ids=lambda w: w.name)
def test_model_shapes(rng, w):
  _check(rng, w.replace(batch=1))


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_balanced_tail(rng, d):
  # `ForwardConfig.balanced_tail` with the tuned tiles: four batch elements of 4k, causal, are
  # 512 pairs on an H200's 132 SMs: one round dealt as pairs, the rest from the table.
  w = _workload(4096, 4096, "gqa", d, True, "bfloat16").replace(batch=4)
  cfg = dataclasses.replace(
      config_lib.resolve_forward_config(d, jnp.bfloat16, True, seq_len=4096), balanced_tail=True)
  _check(rng, w, config=cfg)


def test_deterministic(rng):
  w = _workload(4096, 4096, "gqa", 128, True, "bfloat16")
  q, k, v = testing.random_qkv(rng, w)
  fwd = jax.jit(lambda q, k, v: fah.dot_product_attention(q, k, v, is_causal=True,
                                                          implementation="flash_attn_hopper"))
  first, second = fwd(q, k, v), fwd(q, k, v)
  assert bool(jnp.all(first == second))


def test_default_implementation_is_the_kernel_on_hopper(rng):
  w = _workload(256, 256, "mha", 64, False, "float16")
  q, k, v = testing.random_qkv(rng, w)
  out = fah.dot_product_attention(q, k, v)  # No warning, no fallback.
  kernel = fah.dot_product_attention(q, k, v, implementation="flash_attn_hopper")
  assert bool(jnp.all(out == kernel))
