"""Windows, the bottom-right alignment, sequence lengths, segment ids and the logits soft-cap
on an H200, forward and backward, at full size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import testing
from flash_attn_hopper import workloads
from tiers import tiered

pytestmark = pytest.mark.gpu


def _check_forward_and_gradients(rng, q, k, v, **kw):
  """The jitted kernel's output and LSE (into poisoned memory), then its gradients for a random
  cotangent, against the float32 reference with the same arguments."""
  attn = functools.partial(fah.dot_product_attention, implementation="flash_attn_hopper")
  testing.poison_device_memory(2 * q.size * q.dtype.itemsize)
  out, lse = jax.jit(lambda q, k, v: attn(q, k, v, return_residual=True, **kw))(q, k, v)
  testing.check_attention(out, q, k, v, actual_lse=lse, **kw)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  # With a bias, its gradient too: the dQ kernel's dS (B, N, T, S), summed over the bias's
  # broadcast dims; the poison covers it.
  b, t, n, _ = q.shape
  testing.poison_device_memory(max(4 * q.size, b * n * t * k.shape[1]) * q.dtype.itemsize)
  grads = jax.jit(lambda q, k, v, dout: testing.gradients(attn, q, k, v, dout, **kw))(
      q, k, v, dout)
  testing.check_gradients(grads, q, k, v, dout, **kw)


CASES = [
    # (T, S, D, is_causal, local_window_size, causal_alignment)
    (4096, 4096, 128, True, (1024, 0), "top_left"),
    (4096, 4096, 64, False, (300, 200), "top_left"),
    (2048, 8192, 128, True, None, "bottom_right"),
    (8192, 1023, 64, True, (100, 0), "bottom_right"),
    (1023, 4096, 256, True, 513, "bottom_right"),
]


@pytest.mark.parametrize("t, s, d, is_causal, window, alignment", CASES)
def test_masks_forward_and_gradients(rng, t, s, d, is_causal, window, alignment):
  w = workloads.Workload("masks", batch=1, seq_q=t, seq_kv=s, num_q_heads=8, num_kv_heads=2,
                         head_dim=d)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  kw = dict(is_causal=is_causal, local_window_size=window, causal_alignment=alignment)
  _check_forward_and_gradients(rng, q, k, v, **kw)


@pytest.mark.parametrize("d", tiered([(64,), (128,), (256,)], lambda i, case: case[0] == 128))
def test_sequence_lengths_forward_and_gradients(rng, d):
  w = workloads.Workload("lens", batch=4, seq_q=2048, seq_kv=4096, num_q_heads=8,
                         num_kv_heads=2, head_dim=d)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  kw = dict(is_causal=True, causal_alignment="bottom_right",
            query_seq_lengths=jnp.array([2048, 1000, 1, 2048], jnp.int32),
            key_value_seq_lengths=jnp.array([4096, 3001, 0, 130], jnp.int32))
  _check_forward_and_gradients(rng, q, k, v, **kw)


@pytest.mark.parametrize("d, s, lengths", tiered(
    [(128, 4096, (4096, 3001, 2048, 77)), (256, 4096, (4096, 3001, 2048, 77)),
     (128, 4059, None), (256, 4059, (4059, 0, 3001, 77))],
    lambda i, case: i < 2))
def test_key_end_without_band_forward_and_gradients(rng, d, s, lengths):
  """Key lengths or a ragged S with no band: the forward's overlapped kv_loop takes each
  tile's last block (the one holding the keys' end, masked) first. Lengths past a block
  edge, on one, within the first block, and zero (a batch element with no keys)."""
  w = workloads.Workload("key_end", batch=4, seq_q=2048, seq_kv=s, num_q_heads=8,
                         num_kv_heads=2, head_dim=d)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  kw = {} if lengths is None else dict(key_value_seq_lengths=jnp.array(lengths, jnp.int32))
  _check_forward_and_gradients(rng, q, k, v, **kw)


@pytest.mark.parametrize("is_causal", (False, True))
def test_persistent_split_dkv_with_key_tiles_past_the_lengths(rng, backward_schedules,
                                                              is_causal):
  """D 256's split dK/dV kernel on persistent CTAs (64 steps a tile), whose tiles include
  runs of key blocks with no step: past a batch element's length (0 for one of them) and,
  under causal, past the last query. The two compute warpgroups must meet on those."""
  w = workloads.Workload("empty_key_tiles", batch=4, seq_q=1024, seq_kv=2048, num_q_heads=8,
                         num_kv_heads=2, head_dim=256)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  kw = dict(is_causal=is_causal, key_value_seq_lengths=jnp.array([2048, 0, 700, 64], jnp.int32))
  _check_forward_and_gradients(rng, q, k, v, **kw)
  assert [s.persistent for kernel, s in backward_schedules if kernel == "dkv"] == [True]


def _documents(rng, batch: int, length: int, docs: int):
  """Sorted ids of `docs` contiguous documents of random lengths per batch element."""
  cuts = [np.sort(rng.choice(np.arange(1, length), docs - 1, replace=False)) for _ in range(batch)]
  return jnp.asarray(np.stack([np.repeat(np.arange(docs), np.diff(np.concatenate(
      [[0], c, [length]]))) for c in cuts]), jnp.int32)


@pytest.mark.parametrize("d, is_causal, layout", tiered(
    [(64, True, "packed"), (128, True, "packed"), (256, True, "packed"),
     (128, False, "cross"), (64, False, "unsorted")],
    lambda i, case: case in ((128, True, "packed"), (64, False, "unsorted"))))
def test_segment_ids_forward_and_gradients(rng, d, is_causal, layout):
  t, s = (4096, 4096) if layout != "cross" else (2048, 4096)
  w = workloads.Workload("segments", batch=2, seq_q=t, seq_kv=s, num_q_heads=8, num_kv_heads=2,
                         head_dim=d)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  if layout == "packed":  # 16 documents; self-attention
    ids = _documents(rng, 2, t, 16)
    segment_ids = fah.SegmentIds(ids, ids)
  elif layout == "cross":  # query documents 6 and 7 have no keys
    segment_ids = fah.SegmentIds(_documents(rng, 2, t, 8), _documents(rng, 2, s, 6))
  else:
    segment_ids = fah.SegmentIds(jnp.asarray(rng.integers(0, 4, (2, t)), jnp.int32),
                                 jnp.asarray(rng.integers(0, 4, (2, s)), jnp.int32))
  kw = dict(is_causal=is_causal, segment_ids=segment_ids)
  _check_forward_and_gradients(rng, q, k, v, **kw)


@pytest.mark.parametrize("d, dtype, is_causal", tiered(
    [(64, "float16", True), (128, "bfloat16", False), (256, "bfloat16", True),
     (128, "float16", True)],
    lambda i, case: case in ((64, "float16", True), (128, "bfloat16", False))))
def test_soft_cap_forward_and_gradients(rng, d, dtype, is_causal):
  w = workloads.Workload("cap", batch=1, seq_q=2048, seq_kv=2048, num_q_heads=8,
                         num_kv_heads=2, head_dim=d)
  q, k, v = testing.random_qkv(rng, w, dtype)
  kw = dict(is_causal=is_causal, logits_soft_cap=5.0, scale=2.0 / d ** 0.5)  # past the cap
  _check_forward_and_gradients(rng, q, k, v, **kw)


@pytest.mark.parametrize("d, is_causal, with_bias", tiered(
    [(128, False, True), (64, True, False), (128, True, False), (64, False, True),
     (256, True, False),  # D 256: a mask alone (one-byte tiles), split dK/dV
     (256, False, True)],  # D 256: a one-slot ring of bias tiles; gradients from `blockwise`
    lambda i, case: i < 2 or case[0] == 256))
def test_bias_and_mask_forward_and_gradients(rng, d, is_causal, with_bias):
  """A bias and a mask, or a mask alone, stream their tiles through the backward kernels; the
  bias's own gradient is the dQ kernel's dS, summed over the bias's batch-wide heads."""
  t = s = 2048
  w = workloads.Workload("bias", batch=2, seq_q=t, seq_kv=s, num_q_heads=8, num_kv_heads=2,
                         head_dim=d)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  bias = jnp.asarray(rng.standard_normal((2, 1, t, s)), jnp.bfloat16)     # per batch element
  mask = jnp.asarray(rng.random((1, 8, t, s)) > 0.2)                       # per head
  mask = mask & (jnp.arange(s) < 1500)                                     # blocks skipped
  _check_forward_and_gradients(rng, q, k, v, is_causal=is_causal, mask=mask,
                               bias=bias if with_bias else None)


@pytest.mark.parametrize("d, t, s", [(128, 1000, 777), (256, 1000, 777), (256, 1024, 832)])
def test_mask_and_bias_with_ragged_lengths(rng, d, t, s):
  """T and S that are not multiples of any tile: the bias's and the mask's tile columns are
  padded for TMA, and dS (through staging tiles at D 128, from registers at D 256) is
  written in whole tiles and sliced. (1024 × 832: whole tiles, T > S.)"""
  w = workloads.Workload("ragged", batch=2, seq_q=t, seq_kv=s, num_q_heads=8, num_kv_heads=2,
                         head_dim=d)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  bias = jnp.asarray(rng.standard_normal((1, 8, t, s)), jnp.bfloat16)
  mask = jnp.asarray(rng.random((2, 1, t, s)) > 0.1)
  _check_forward_and_gradients(rng, q, k, v, bias=bias, mask=mask, is_causal=True)


@pytest.mark.parametrize("d", tiered([(256,), (128,)], lambda i, case: i == 0))
def test_bias_rings_give_the_same_bits_in_every_run(rng, d):
  """One compiled program on the same inputs, run after run: the forward's and the backward's
  outputs are the same bits each time. A race on a ring slot read with loads (the bias
  tiles, the LSE, δ) shows up as runs that differ: at D 256, whose bias ring is one slot deep,
  about half the forward runs at this shape had wrong rows before the loads were fenced
  (`pipeline.order_loads_before_tma`), so eight runs miss it with odds under 1 in 1000."""
  t, s, runs = 1024, 832, 8
  w = workloads.Workload("race", batch=2, seq_q=t, seq_kv=s, num_q_heads=8, num_kv_heads=2,
                         head_dim=d)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  bias = jnp.asarray(rng.standard_normal((1, 8, t, s)), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  attn = functools.partial(fah.dot_product_attention, implementation="flash_attn_hopper",
                           is_causal=True)

  @jax.jit
  def run(q, k, v, bias, dout):
    out, vjp = jax.vjp(attn, q, k, v, bias)
    return (out, *vjp(dout))

  results = []
  for _ in range(runs):
    testing.poison_device_memory(max(4 * q.size, 2 * 8 * t * s) * q.dtype.itemsize)
    results.append([np.asarray(x) for x in run(q, k, v, bias, dout)])
  testing.check_attention(jnp.asarray(results[0][0]), q, k, v, bias=bias, is_causal=True)
  names = ("out", "dq", "dk", "dv", "dbias")
  for i, result in enumerate(results[1:], 1):
    for name, first, again in zip(names, results[0], result):
      np.testing.assert_array_equal(again, first, err_msg=f"{name}, run {i} against run 0")


def test_constant_bias_gradients(rng):
  """A bias that is not differentiated (ALiBi's, say): the backward kernels stream its tiles
  and write no dS."""
  t = s = 2048
  w = workloads.Workload("bias", batch=2, seq_q=t, seq_kv=s, num_q_heads=8, num_kv_heads=2,
                         head_dim=128)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  bias = jnp.asarray(rng.standard_normal((1, 8, t, s)), jnp.bfloat16)
  attn = functools.partial(fah.dot_product_attention, implementation="flash_attn_hopper",
                           bias=bias, is_causal=True)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  testing.poison_device_memory(4 * q.size * q.dtype.itemsize)
  grads = jax.jit(lambda q, k, v, dout: jax.vjp(attn, q, k, v)[1](dout))(q, k, v, dout)
  testing.check_gradients(grads, q, k, v, dout, bias=bias, is_causal=True)


@pytest.mark.parametrize("d", tiered([(128,), (256,)], lambda i, case: i == 0))
def test_mask_with_fully_visible_tiles(rng, d):
  """A mask whose tiles are of every kind, where the tuned forward overlaps (D 128 and 256
  without causal): rows seeing random keys (element-masked blocks, the plain loop), rows
  seeing every key (fully visible tiles: the overlapped loop, no bias tile streamed), rows
  seeing none (no block streamed; jax.nn's mean of V), and rows seeing the keys before 1000
  (blocks skipped, one edge block)."""
  t = s = 2048
  w = workloads.Workload("mask_tiles", batch=2, seq_q=t, seq_kv=s, num_q_heads=8,
                         num_kv_heads=2, head_dim=d)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  rows, keys = np.arange(t)[:, None], np.arange(s)[None, :]
  mask = np.select([rows < 512, rows < 1536, rows < 1792], [rng.random((t, s)) > 0.2, True,
                                                             False], keys < 1000)
  _check_forward_and_gradients(rng, q, k, v, mask=jnp.asarray(mask)[None, None])
