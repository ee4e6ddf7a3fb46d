"""The real forward kernel on the CPU, through the Mosaic GPU interpreter, against the reference.

The interpreter fills unwritten output with NaN, so a tile the kernel forgets fails here.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

pytestmark = pytest.mark.interpret

DTYPES = ("bfloat16", "float16")
CAUSAL = (False, True)


@pytest.mark.parametrize(
    "workload, dtype, is_causal",
    list(itertools.product(workloads.INTERPRET_SHAPES, DTYPES, CAUSAL)),
    ids=lambda x: getattr(x, "name", str(x)))
def test_forward_matches_reference(rng, workload, dtype, is_causal):
  q, k, v = testing.random_qkv(rng, workload, dtype)
  out, lse = fah.dot_product_attention(q, k, v, is_causal=is_causal, interpret=True,
                                       return_residual=True)
  assert out.dtype == q.dtype and out.shape == q.shape
  assert lse.shape == q.shape[:-1]
  testing.check_attention(out, q, k, v, actual_lse=lse, is_causal=is_causal)


def test_scale_is_folded_into_the_exponent(rng):
  w = workloads.INTERPRET_SHAPES[0]
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  out = fah.dot_product_attention(q, k, v, scale=0.37, interpret=True)
  testing.check_attention(out, q, k, v, scale=0.37)


def test_unbatched_tnh_inputs(rng):
  w = workloads.INTERPRET_SHAPES[2]
  q, k, v = testing.random_qkv(rng, w, "float16")
  out = fah.dot_product_attention(q[0], k[0], v[0], is_causal=True, interpret=True)
  assert out.shape == q.shape[1:]
  testing.check_attention(out, q[0], k[0], v[0], is_causal=True)


def test_small_explicit_config_with_deep_ring(rng):
  # Three stages and 64-key blocks: several ring wrap-arounds over S = 203.
  w = workloads.INTERPRET_SHAPES[0]
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=3)
  out = fah.dot_product_attention(q, k, v, interpret=True, config=cfg)
  testing.check_attention(out, q, k, v)


def test_causal_warpgroups_with_unequal_block_counts(rng):
  # block_kv 64 with 64-row warpgroup tiles: warpgroup 1 visits one block more than
  # warpgroup 0 on every tile, which exercises the release path and the producer's drain.
  w = workloads.Workload("causal_250x250", batch=1, seq_q=250, seq_kv=250, num_q_heads=2,
                         num_kv_heads=1, head_dim=64, is_causal=True)
  q, k, v = testing.random_qkv(rng, w, "float16")
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=3)
  out = fah.dot_product_attention(q, k, v, is_causal=True, interpret=True, config=cfg)
  testing.check_attention(out, q, k, v, is_causal=True)


def test_head_dim_256_sends_o_through_the_q_tiles(rng):
  # At D 256 the O tiles do not fit beside Q's: O leaves through Q's buffer and the next
  # tile's Q loads after it. Two CTAs over six tiles run that hand-over several times.
  w = workloads.Workload("mha_200x150_d256", batch=1, seq_q=200, seq_kv=150, num_q_heads=3,
                         num_kv_heads=3, head_dim=256)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  out = fah.dot_product_attention(q, k, v, interpret=True)
  testing.check_attention(out, q, k, v)


def test_jit_of_vmap_over_an_extra_batch_dim(rng):
  import jax
  w = workloads.Workload("vmapped", batch=1, seq_q=70, seq_kv=90, num_q_heads=2,
                         num_kv_heads=1, head_dim=64, is_causal=True)
  qkv = [testing.random_qkv(rng, w, "bfloat16") for _ in range(3)]
  q, k, v = (jnp.stack(xs) for xs in zip(*qkv))
  out = jax.jit(jax.vmap(lambda q, k, v: fah.dot_product_attention(
      q, k, v, is_causal=True, interpret=True)))(q, k, v)
  for i in range(3):
    testing.check_attention(out[i], q[i], k[i], v[i], is_causal=True)


# `ForwardConfig.balanced_tail`: 7 heads of two 128-row tiles are 7 causal pairs on the
# interpreter's two CTAs, so one round is dealt as pairs and the other five pairs' tiles go,
# longest first, to the least loaded CTA, through the table the kernel reads.
def test_balanced_tail(rng):
  w = workloads.Workload("balanced_256", batch=1, seq_q=256, seq_kv=256, num_q_heads=7,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "float16")
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2, balanced_tail=True)
  out, lse = fah.dot_product_attention(q, k, v, is_causal=True, interpret=True, config=cfg,
                                       return_residual=True)
  testing.check_attention(out, q, k, v, actual_lse=lse, is_causal=True)


# FA3's intra-warpgroup overlap (`ForwardConfig.overlap_softmax`, the tuned choice at D 128
# and 256 without causal): forced at D 64 with 64-key blocks, over S = 448 keys (seven
# blocks: the ring wraps several times) and two CTAs that each take several tiles.
def test_overlapped_softmax(rng):
  w = workloads.Workload("overlap_300x448", batch=2, seq_q=300, seq_kv=448, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2, overlap_softmax=True)
  out, lse = fah.dot_product_attention(q, k, v, interpret=True, config=cfg,
                                       return_residual=True)
  testing.check_attention(out, q, k, v, actual_lse=lse)


# Under causal the overlapped loop walks each tile's blocks from the diagonal down
# (`forward._diagonal_first`): 64-key blocks, where warpgroup 0 releases the diagonal block of
# warpgroup 1; 128-key blocks, one diagonal block for both; and bottom-right alignment with
# the diagonal shifted by two blocks, over several CTAs' tiles each.
@pytest.mark.parametrize("block_kv, seq_q, seq_kv, alignment", [
    (64, 448, 448, "top_left"), (128, 512, 512, "top_left"), (64, 320, 448, "bottom_right")])
def test_overlapped_softmax_diagonal_first(rng, block_kv, seq_q, seq_kv, alignment):
  w = workloads.Workload("overlap_causal", batch=2, seq_q=seq_q, seq_kv=seq_kv, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  cfg = fah.ForwardConfig(block_q=64, block_kv=block_kv, num_stages=2, overlap_softmax=True)
  kw = dict(is_causal=True, causal_alignment=alignment)
  out, lse = fah.dot_product_attention(q, k, v, interpret=True, config=cfg,
                                       return_residual=True, **kw)
  testing.check_attention(out, q, k, v, actual_lse=lse, **kw)


# Without a band, the keys' end (key lengths, or S not a whole number of blocks) is a tile's
# one masked block, and the overlapped loop takes its last block first
# (`forward._key_end_first`). Lengths: one inside a block, one on a block's end, and none at
# all (that batch element's tiles stream no block and take the plain loop).
@pytest.mark.parametrize("seq_kv, lengths", [(448, (201, 128, 0)), (450, None)])
def test_overlapped_softmax_key_end_first(rng, seq_kv, lengths):
  w = workloads.Workload("overlap_keys", batch=3, seq_q=300, seq_kv=seq_kv, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2, overlap_softmax=True)
  kw = {} if lengths is None else dict(key_value_seq_lengths=jnp.array(lengths, jnp.int32))
  out, lse = fah.dot_product_attention(q, k, v, interpret=True, config=cfg,
                                       return_residual=True, **kw)
  testing.check_attention(out, q, k, v, actual_lse=lse, **kw)


@pytest.mark.parametrize("kw, overlaps", [
    (dict(seq_kv=448), True),
    (dict(seq_kv=448, is_causal=True), True),  # The diagonal block first.
    (dict(seq_kv=448, is_causal=True, causal_alignment="bottom_right"), False),  # 148 off
    (dict(seq_kv=448, is_causal=True, bias=(False, False)), False),
    (dict(seq_kv=448, local_window_size=(300, 300)), False),
    (dict(seq_kv=448, kv_lens=True), True),  # The block with the keys' end first.
    (dict(seq_kv=450), True),
    (dict(seq_kv=448, kv_lens=True, is_causal=True), False),  # Two masked blocks.
    (dict(seq_kv=450, is_causal=True), False),
    (dict(seq_kv=448, kv_lens=True, bias=(False, False)), False),
    (dict(seq_kv=448, segments=True), False),
    (dict(seq_kv=448, bias=(False, False)), True),  # Beside the plain loop, tile by tile.
])
def test_overlap_is_taken_only_without_masked_blocks(kw, overlaps):
  from flash_attn_hopper import api
  from flash_attn_hopper.kernels import forward
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2, overlap_softmax=True)
  spec = api.mask_spec(300, kw["seq_kv"], is_causal=kw.pop("is_causal", False),
                       local_window_size=kw.pop("local_window_size", None),
                       causal_alignment=kw.pop("causal_alignment", "top_left"))
  opts = forward.ForwardOptions(scale=0.1, mask=spec, config=cfg, interpret=True, **kw)
  assert forward._overlaps(opts) is overlaps
