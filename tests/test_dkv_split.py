"""The split dK/dV kernel (`kernels.dkv_split`, D 256), called directly, without the op.

Interpreted on the CPU against the float32 reference's gradients for a random cotangent, from
the inputs `kernels.backward.attention_backward` gives it (padded as the api pads them, the
LSE in log2 units and δ = rowsum(dO ∘ O) padded to whole forward tiles); its block ranges
against brute force; its shared-memory check; and the kernel lowered for CUDA on the CPU at
model sizes (`tests/test_lowering.py` says what that catches).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash_attn_hopper import config as config_lib
from flash_attn_hopper import masking
from flash_attn_hopper import reference
from flash_attn_hopper import softmax
from flash_attn_hopper import testing
from flash_attn_hopper import workloads
from flash_attn_hopper.kernels import common
from flash_attn_hopper.kernels import dkv_split

HERE = pathlib.Path(__file__).parent

#: The api pads T and S to multiples of 8 (TMA's row tiling), T to at least the forward's CTA
#: rows and S to at least its block_kv; the forward's LSE comes in whole CTA tiles of rows.
SEQ_MULTIPLE = 8
FORWARD_ROWS = 128
FORWARD_BLOCK_KV = 64


def _pad_seq(x, length: int):
  """x zero-padded along axis 1 (T or S) to `length`."""
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, length - x.shape[1])
  return jnp.pad(x, widths)


def _padded_length(n: int, minimum: int) -> int:
  return max(minimum, -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE)


def _spec(t: int, s: int, is_causal=False, local_window_size=None,
          causal_alignment="top_left") -> masking.MaskSpec:
  left, right = local_window_size or (None, None)
  return masking.MaskSpec(is_causal=is_causal, left=left, right=right,
                          offset=s - t if causal_alignment == "bottom_right" else 0)


def _kernel_dkv(q, k, v, dout, *, scale, config=config_lib.BackwardConfig(), interpret=True,
                key_value_seq_lengths=None, segment_ids=None, logits_soft_cap=None, mask=None,
                **band):
  """dK and dV from the kernel, its inputs built as the api and `backward` build them (the
  forward's output and LSE taken from the reference; a mask as uint8 tiles)."""
  t, s = q.shape[1], k.shape[1]
  out, lse = reference.attention_reference(
      q, k, v, return_residual=True, scale=scale, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids, logits_soft_cap=logits_soft_cap, mask=mask, **band)
  t_pad, s_pad = _padded_length(t, FORWARD_ROWS), _padded_length(s, FORWARD_BLOCK_KV)
  t_tiles = -(-t_pad // FORWARD_ROWS) * FORWARD_ROWS
  lse_log2 = jnp.transpose(lse, (0, 2, 1)) * softmax.LOG2E
  delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32),
                     out.astype(q.dtype).astype(jnp.float32))
  tiles = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, t_tiles - t)))
  if segment_ids is not None:
    segment_ids = masking.pad_segment_ids(segment_ids, t_pad, s_pad)
  if mask is not None:  # (B|1, N|1, T, S) uint8, 1: visible; padded keys and rows invisible.
    mask = jnp.pad(mask.astype(jnp.uint8), ((0, 0), (0, 0), (0, t_pad - t), (0, s_pad - s)))
  opts = common.BackwardOptions(
      scale=scale, mask=_spec(t, s, **band), config=config, interpret=interpret, seq_kv=s,
      kv_lens=key_value_seq_lengths is not None, segments=segment_ids is not None,
      soft_cap=logits_soft_cap, bias_is_mask=mask is not None,
      bias=None if mask is None else (mask.shape[0] > 1, mask.shape[1] > 1))
  dk, dv = dkv_split.dkv(_pad_seq(q, t_pad), _pad_seq(k, s_pad), _pad_seq(v, s_pad),
                         _pad_seq(dout, t_pad), tiles(lse_log2), tiles(delta), opts,
                         key_value_seq_lengths, segment_ids, mask)
  return dk[:, :s], dv[:, :s]


def _check_dkv(dk, dv, q, k, v, dout, **kwargs):
  """`testing.check_gradients`' rule for dK and dV alone."""
  f32 = lambda *xs: tuple(jnp.asarray(x, jnp.float32) for x in xs)
  _, ref_vjp = jax.vjp(lambda q, k, v: reference.attention_reference(q, k, v, **kwargs),
                       *f32(q, k, v))
  _, naive_vjp = jax.vjp(lambda q, k, v: testing.naive_attention(q, k, v, **kwargs), q, k, v)
  (_, ref_dk, ref_dv), (_, naive_dk, naive_dv) = ref_vjp(*f32(dout)), naive_vjp(dout)
  for name, x, like in (("dk", dk, k), ("dv", dv, v)):
    assert x.shape == like.shape and x.dtype == like.dtype, name
  testing.assert_close_to_reference(dk, ref_dk, naive_dk, what="dk")
  testing.assert_close_to_reference(dv, ref_dv, naive_dv, what="dv")


def _inputs(rng, w: workloads.Workload, dtype):
  q, k, v = testing.random_qkv(rng, w, dtype)
  dout = jnp.asarray(rng.standard_normal(q.shape), dtype)  # A random cotangent, not ones.
  return q, k, v, dout


def _block_sparse_mask():
  """A (1, 2, 192, 192) mask, one per query head of a GQA group: random entries, blocks it
  leaves wholly visible (no tile) or hides (skipped for one head only), and the diagonal,
  so that every query sees a key."""
  rng = np.random.default_rng(7)
  mask = rng.random((1, 2, 192, 192)) < 0.6
  mask[:, :, 64:128, :64] = True
  mask[:, 0, :64, 128:] = False
  mask[:, :, np.arange(192), np.arange(192)] = True
  return jnp.asarray(mask)


def _packed_ids():
  """Documents of 64 tokens, then one that starts inside a block (150)."""
  ids = np.repeat(np.array([[3, 4, 7]], np.int32), 64, axis=1)
  ids[:, 150:] = 9
  return masking.SegmentIds(jnp.asarray(ids), jnp.asarray(ids))


CASES = {
    # MHA, whole blocks, nothing masked.
    "mha_dense": (workloads.Workload("mha_256_d256", batch=1, seq_q=256, seq_kv=256,
                                     num_q_heads=2, num_kv_heads=2, head_dim=256),
                  "bfloat16", dict(scale=0.2)),
    # GQA, groups of 2: each CTA sums two query heads; causal edge blocks.
    "gqa_causal": (workloads.Workload("gqa_256_d256", batch=1, seq_q=256, seq_kv=256,
                                      num_q_heads=4, num_kv_heads=2, head_dim=256),
                   "float16", dict(scale=0.2, is_causal=True)),
    # Tails: T and S not multiples of 64 (nor S of 8), T > S. The api pads S to 80; the last
    # query block (192..255) and key block (64..127) run past the arrays: TMA zero-fills them.
    "tails": (workloads.Workload("gqa_200x77_d256", batch=1, seq_q=200, seq_kv=77,
                                 num_q_heads=4, num_kv_heads=2, head_dim=256),
              "float16", dict(scale=0.2)),
    # MQA with groups of 3, tails (the api pads T to 128, S to 152), a bottom-right causal band,
    # and key lengths: 150 straddles the last key block (128..191), which then masks every
    # step; 90 straddles the second (64..127) and leaves the last one no step at all.
    "tails_lengths": (workloads.Workload("mqa_100x150_d256", batch=2, seq_q=100, seq_kv=150,
                                         num_q_heads=3, num_kv_heads=1, head_dim=256),
                      "bfloat16",
                      dict(scale=0.1, is_causal=True, causal_alignment="bottom_right",
                           key_value_seq_lengths=jnp.array([150, 90], jnp.int32))),
    # A two-sided window (edge blocks on both sides of full ones), packed documents (the
    # spans' block skipping and segment masks) and a soft-cap (Pᵀ ∘ cap' handed over).
    "window_segments_soft_cap": (
        workloads.Workload("gqa_192_d256", batch=1, seq_q=192, seq_kv=192, num_q_heads=2,
                           num_kv_heads=1, head_dim=256),
        "bfloat16", dict(scale=0.2, local_window_size=(70, 10), segment_ids=_packed_ids(),
                         logits_soft_cap=5.0)),
    # A mask per query head of the group (uint8 tiles, skipped where wholly visible) beside a
    # causal band.
    "mask_gqa": (workloads.Workload("gqa_192_d256", batch=1, seq_q=192, seq_kv=192,
                                    num_q_heads=2, num_kv_heads=1, head_dim=256),
                 "float16", dict(scale=0.2, is_causal=True, mask=_block_sparse_mask())),
}


def _gradients_match_reference(rng, case: str):
  w, dtype, kwargs = CASES[case]
  q, k, v, dout = _inputs(rng, w, dtype)
  dk, dv = _kernel_dkv(q, k, v, dout, **kwargs)
  _check_dkv(dk, dv, q, k, v, dout, **kwargs)


def _two_runs_are_bitwise_equal(rng):
  w = workloads.Workload("gqa_128_d256", batch=1, seq_q=128, seq_kv=128, num_q_heads=4,
                         num_kv_heads=1, head_dim=256)
  q, k, v, dout = _inputs(rng, w, "bfloat16")
  first = _kernel_dkv(q, k, v, dout, scale=0.2, is_causal=True)
  second = _kernel_dkv(q, k, v, dout, scale=0.2, is_causal=True)
  for a, b in zip(first, second):
    assert bool(jnp.all(a == b))


def _op_gradients_with_backward_config(rng):
  """Through the op: D 256 gradients from the kernels (dQ with a one-stage ring, then this
  kernel), which it runs only when asked for with a backward_config until they pass on a
  GPU; dQ, dK and dV against the reference, for a random cotangent."""
  import flash_attn_hopper as fah
  w = workloads.Workload("gqa_130_d256", batch=1, seq_q=130, seq_kv=130, num_q_heads=2,
                         num_kv_heads=1, head_dim=256)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  kw = dict(is_causal=True)
  attn = lambda q, k, v: fah.dot_product_attention(
      q, k, v, interpret=True, backward_config=fah.BackwardConfig(dq_num_stages=1), **kw)
  testing.check_gradients(jax.vjp(attn, q, k, v)[1](dout), q, k, v, dout, **kw)


#: The interpreted runs, each a function of a numpy Generator, by name.
INTERPRETED = {
    **{case: functools.partial(_gradients_match_reference, case=case) for case in CASES},
    "bitwise_equal_runs": _two_runs_are_bitwise_equal,
    "op_with_backward_config": _op_gradients_with_backward_config,
}

#: Threads of XLA's CPU client in the interpreted runs (`PJRT_NPROC`; by default one per
#: core). The interpreter runs each warpgroup as an XLA computation whose callbacks block on
#: the kernel's barriers, on that client's threads. Here warpgroup 1 (waiting for Pᵀ) and the
#: producer (waiting for a free slot) are often blocked at once, so with two cores warpgroup 0
#: found no thread to go on: the segment ids case deadlocked on every run.
INTERPRETER_THREADS = 8


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(INTERPRETED))
def test_interpreted_kernel(case):
  """Runs INTERPRETED[case] in a fresh process, as PJRT_NPROC must be set before JAX starts."""
  env = dict(os.environ, PJRT_NPROC=str(INTERPRETER_THREADS), JAX_PLATFORMS="cpu",
             PYTHONPATH=str(HERE.parent))
  proc = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


def _brute_force_blocks(spec, key0, seq_q, block_q):
  """Per query block: whether some query of it sees some key of [key0, key0 + BLOCK_KV),
  and whether every query sees every key (queries past seq_q count for neither)."""
  keys = np.arange(key0, key0 + dkv_split.BLOCK_KV)[:, None]
  queries = np.arange(-(-seq_q // block_q) * block_q)[None, :]
  visible = np.ones((keys.size, queries.size), bool)
  diag = queries + spec.offset
  if spec.upper is not None:
    visible &= keys <= diag + spec.upper
  if spec.left is not None:
    visible &= keys >= diag - spec.left
  real = np.broadcast_to(queries < seq_q, visible.shape).reshape(keys.size, -1, block_q)
  blocks = visible.reshape(keys.size, -1, block_q)
  return (blocks & real).any(axis=(0, 2)), (blocks | ~real).all(axis=(0, 2))


SPECS = [masking.MaskSpec(is_causal=True), masking.MaskSpec(is_causal=True, offset=70),
         masking.MaskSpec(is_causal=True, left=100), masking.MaskSpec(left=30, right=5),
         masking.MaskSpec(left=0, right=200, offset=-40), masking.MaskSpec()]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_block_ranges_cover_the_band_and_mask_every_edge(spec):
  """Blocks outside [first, end) see none of the keys; those in [full_lo, full_hi) see all
  of them, so they may go unmasked."""
  seq_q, block_q = 400, 64
  for key0 in range(0, 512, dkv_split.BLOCK_KV):
    b = [int(x) for x in masking.q_block_range(spec, jnp.int32(key0), dkv_split.BLOCK_KV,
                                               seq_q, block_q)]
    assert b[0] <= b[1] <= b[2] <= b[3]
    any_visible, all_visible = _brute_force_blocks(spec, key0, seq_q, block_q)
    outside = np.ones_like(any_visible)
    outside[b[0]:b[3]] = False
    assert not np.any(any_visible & outside), (key0, b)
    assert np.all(all_visible[b[1]:b[2]]), (key0, b)


def test_shared_memory_at_head_dim_256():
  cfg = config_lib.BackwardConfig()  # block_q 64, two stages
  need = dkv_split.smem_bytes(cfg, 256, 2)
  # Q and dO ring 128 KiB, K and V 64 KiB, two Pᵀ slots 16 KiB, the LSE and δ ring 1 KiB.
  assert need == (128 + 64 + 16 + 1) * 1024 <= config_lib.SMEM_BUDGET
  dkv_split.check_config(cfg, 256, 2, segments=True, bias_bytes=1)  # A mask's ring: 8 KiB.
  # A bias's ring, two bytes an entry, fits one slot deep only (8 KiB; two would be 16).
  assert dkv_split.bias_stages(cfg, 256, 2, False, bias_bytes=1) == cfg.num_stages
  assert dkv_split.bias_stages(cfg, 256, 2, True, bias_bytes=2) == 1
  assert dkv_split.smem_bytes(cfg, 256, 2, bias_bytes=2) == need + 8 * 1024
  dkv_split.check_config(cfg, 256, 2, segments=True, bias_bytes=2)
  with pytest.raises(ValueError, match="block_q or BackwardConfig.num_stages"):
    dkv_split.check_config(config_lib.BackwardConfig(num_stages=3), 256, 2)
  with pytest.raises(ValueError, match="block_q or BackwardConfig.num_stages"):
    dkv_split.check_config(config_lib.BackwardConfig(block_q=128), 256, 2)
  with pytest.raises(ValueError, match="block_kv == 64"):
    dkv_split.check_config(config_lib.BackwardConfig(block_kv=128), 256, 2)


@pytest.mark.parametrize("segments, bias_bytes", [(False, 0), (True, 0), (False, 1), (True, 1),
                                                  (True, 2)])
def test_config_budgets_the_split_kernel_as_it_allocates(segments, bias_bytes):
  """`BackwardConfig.smem_bytes` mirrors this kernel's own count (config cannot import it)."""
  cfg = config_lib.BackwardConfig(dq_num_stages=1)
  assert cfg._dkv_smem_bytes(256, 2, segments, bias_bytes) == dkv_split.smem_bytes(
      cfg, 256, 2, segments, bias_bytes)
  cfg.check_fits(256, 2, segments, bias_bytes)
  with pytest.raises(ValueError, match="BackwardConfig.block_kv must be 64 at head_dim=256"):
    config_lib.BackwardConfig(block_kv=128, dq_num_stages=1).check_fits(256, 2)
  with pytest.raises(ValueError, match="dq_num_stages=1"):
    config_lib.BackwardConfig().check_fits(256, 2)
  with pytest.raises(ValueError, match="BackwardConfig.dq_num_stages must be"):
    config_lib.BackwardConfig(dq_num_stages=0)
  # dQ's ring on 32-key blocks: two stages fit at D 256 (the tuned entry), three do not.
  config_lib.BackwardConfig(dq_block_kv=32).check_fits(256, 2, segments, bias_bytes)
  with pytest.raises(ValueError, match="smaller dq_block_kv"):
    config_lib.BackwardConfig(dq_block_kv=32, dq_num_stages=3).check_fits(256, 2)
  for keys in (0, 48, 32.0, True):
    with pytest.raises(ValueError, match="BackwardConfig.dq_block_kv must be None or a "
                                         "positive multiple of 32"):
      config_lib.BackwardConfig(dq_block_kv=keys)


def _lower(*, dtype=jnp.bfloat16, t=1024, s=1024, heads=(8, 2), kv_lens=False,
           segments=False, soft_cap=None, mask=None, **band) -> str:
  """Lowers the kernel for CUDA at model sizes (B 2, D 256), inputs as the api pads them."""
  n, kv_heads = heads
  t_pad, s_pad = _padded_length(t, FORWARD_ROWS), _padded_length(s, FORWARD_BLOCK_KV)
  q = jax.ShapeDtypeStruct((2, t_pad, n, 256), dtype)
  kv = jax.ShapeDtypeStruct((2, s_pad, kv_heads, 256), dtype)
  rows = jax.ShapeDtypeStruct((2, n, -(-t_pad // FORWARD_ROWS) * FORWARD_ROWS), jnp.float32)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32) if kv_lens else None
  ids = masking.SegmentIds(jax.ShapeDtypeStruct((2, t_pad), jnp.int32),
                           jax.ShapeDtypeStruct((2, s_pad), jnp.int32)) if segments else None
  if mask is not None:  # (B|1, N|1) of the (T, S) uint8 mask
    mask = jax.ShapeDtypeStruct((*mask, t_pad, s_pad), jnp.uint8)
  opts = common.BackwardOptions(scale=0.0625, mask=_spec(t, s, **band),
                                config=config_lib.BackwardConfig(), seq_kv=s, kv_lens=kv_lens,
                                segments=segments, soft_cap=soft_cap,
                                bias=None if mask is None else (mask.shape[0] > 1,
                                                                mask.shape[1] > 1),
                                bias_is_mask=mask is not None)
  fn = lambda q, k, v, do, lse, delta, lens, ids, mask: dkv_split.dkv(
      q, k, v, do, lse, delta, opts, lens, ids, mask)
  lowered = jax.jit(fn).trace(q, kv, kv, q, rows, rows, lens, ids, mask)
  return lowered.lower(lowering_platforms=("cuda",)).as_text()


LOWERING = {
    **{f"{dtype}_{'causal' if causal else 'dense'}": dict(dtype=jnp.dtype(dtype),
                                                           is_causal=causal)
       for dtype, causal in itertools.product(("bfloat16", "float16"), (False, True))},
    "window": dict(is_causal=True, local_window_size=(300, 0)),
    "two_sided_window": dict(local_window_size=(200, 100)),
    "bottom_right_lengths": dict(is_causal=True, causal_alignment="bottom_right", s=2048,
                                 kv_lens=True),
    "segments": dict(is_causal=True, segments=True),
    "soft_cap": dict(soft_cap=30.0),
    "mqa": dict(heads=(8, 1)),
    "tails": dict(t=1000, s=777),
    "mask_per_head": dict(is_causal=True, mask=(1, 8)),
    "mask_segments_lengths": dict(mask=(2, 1), segments=True, kv_lens=True),
}


@pytest.mark.parametrize("feature", list(LOWERING))
def test_kernel_lowers_for_hopper(feature):
  text = _lower(**LOWERING[feature])
  assert "flash_attn_hopper_dkv_split_mosaic_gpu" in text


if __name__ == "__main__":  # One interpreted run (see `test_interpreted_kernel`).
  name = sys.argv[1]
  seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
  INTERPRETED[name](np.random.default_rng(seed))
