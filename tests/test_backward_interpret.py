"""The real backward kernels (dQ, dK/dV) on the CPU, through the Mosaic GPU interpreter,
against the float32 reference's gradients for a random cotangent."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import testing
from flash_attn_hopper import workloads
from flash_attn_hopper.kernels import dq as dq_kernel

pytestmark = pytest.mark.interpret

SHAPES = (
    # MHA with lengths that are not multiples of any block.
    workloads.Workload("mha_113x203_d64", batch=1, seq_q=113, seq_kv=203, num_q_heads=2,
                       num_kv_heads=2, head_dim=64),
    # GQA, groups of 2, T > S.
    workloads.Workload("gqa_200x77_d64", batch=1, seq_q=200, seq_kv=77, num_q_heads=4,
                       num_kv_heads=2, head_dim=64),
    # MQA, two batch elements, D 128.
    workloads.Workload("mqa_96x130_d128", batch=2, seq_q=96, seq_kv=130, num_q_heads=3,
                       num_kv_heads=1, head_dim=128),
)


def _grads(q, k, v, dout, **kwargs):
  f = lambda q, k, v: fah.dot_product_attention(q, k, v, interpret=True, **kwargs)
  _, vjp = jax.vjp(f, q, k, v)
  return vjp(dout)


@pytest.mark.parametrize("w, dtype, is_causal",
                         list(itertools.product(SHAPES, ("bfloat16", "float16"), (False, True))),
                         ids=lambda x: getattr(x, "name", str(x)))
def test_gradients_match_reference(rng, w, dtype, is_causal):
  q, k, v = testing.random_qkv(rng, w, dtype)
  dout = jnp.asarray(rng.standard_normal(q.shape), dtype)  # A random cotangent, not ones.
  grads = _grads(q, k, v, dout, is_causal=is_causal, scale=0.2)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal, scale=0.2)


def test_gradients_are_deterministic(rng):
  w = SHAPES[1]
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  first = _grads(q, k, v, dout, is_causal=True)
  second = _grads(q, k, v, dout, is_causal=True)
  for a, b in zip(first, second):
    assert bool(jnp.all(a == b))


def test_second_derivative_raises_a_clear_error(rng):
  w = SHAPES[0]
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  loss = lambda q: jnp.sum(fah.dot_product_attention(q, k, v, interpret=True)
                           .astype(jnp.float32) ** 2)
  with pytest.raises(NotImplementedError, match="second derivatives"):
    jax.grad(lambda q: jnp.sum(jax.grad(loss)(q).astype(jnp.float32)))(q)


def test_jit_of_vmap_of_the_gradient(rng):
  w = SHAPES[1]
  qkv = [testing.random_qkv(rng, w, "float16") for _ in range(2)]
  q, k, v = (jnp.stack(xs) for xs in zip(*qkv))
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float16)
  grads = jax.jit(jax.vmap(lambda q, k, v, d: _grads(q, k, v, d, is_causal=True)))(q, k, v, dout)
  for i in range(2):
    testing.check_gradients([g[i] for g in grads], q[i], k[i], v[i], dout[i], is_causal=True)


def test_head_dim_256_gradients_come_from_the_kernels(rng, monkeypatch):
  """dQ (on 32-key blocks) and the split dK/dV kernel; `blockwise` must not run."""
  from flash_attn_hopper import blockwise

  def refuse(*args, **kwargs):
    raise AssertionError("blockwise ran at D 256")

  monkeypatch.setattr(blockwise, "attention_backward", refuse)
  w = workloads.Workload("gqa_70x150_d256", batch=1, seq_q=70, seq_kv=150, num_q_heads=4,
                         num_kv_heads=2, head_dim=256)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  grads = _grads(q, k, v, dout, is_causal=True)
  testing.check_gradients(grads, q, k, v, dout, is_causal=True)


def test_head_dim_256_gradients_with_key_lengths(rng):
  w = workloads.Workload("gqa_70x150_d256", batch=2, seq_q=70, seq_kv=150, num_q_heads=4,
                         num_kv_heads=2, head_dim=256)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  kv_lens = jnp.array([100, 150], jnp.int32)
  grads = _grads(q, k, v, dout, key_value_seq_lengths=kv_lens)
  testing.check_gradients(grads, q, k, v, dout, key_value_seq_lengths=kv_lens)


@pytest.mark.parametrize("run", range(3))
@pytest.mark.parametrize("is_causal", (False, True))
def test_persistent_split_dkv_runs_tiles_past_the_key_lengths(rng, monkeypatch,
                                                              backward_schedules, is_causal,
                                                              run):
  """D 256's split dK/dV kernel on persistent CTAs whose tiles include runs of key blocks
  with no step (dK = dV = 0): past their batch element's length and, under causal, past the
  last query. Neither warpgroup may start the next tile's load before the other has waited
  for this tile's: the interpreter checks each barrier's phase. Run three times: without
  `dkv_split._meet_if_empty` the non-causal case failed in its second run, and the
  key-lengths test above 2 runs in 3."""
  from flash_attn_hopper import config as config_lib

  del run
  w = workloads.Workload("gqa_70x320_d256", batch=2, seq_q=70, seq_kv=320, num_q_heads=2,
                         num_kv_heads=1, head_dim=256)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  # Element 0's key blocks 1-4 have no step (element 1's last holds 4 keys); under causal,
  # with T = 70, neither has a step in blocks 2-4.
  kv_lens = jnp.array([40, 260], jnp.int32)
  monkeypatch.setattr(config_lib, "PERSISTENT_BACKWARD_MAX_STEPS",
                      {("dkv", 256, is_causal): 64})
  kw = dict(key_value_seq_lengths=kv_lens, is_causal=is_causal)
  grads = _grads(q, k, v, dout, **kw)
  assert [(kernel, s.persistent) for kernel, s in backward_schedules] == [("dq", False),
                                                                         ("dkv", True)]
  testing.check_gradients(grads, q, k, v, dout, **kw)


@pytest.mark.parametrize("cfg", [fah.BackwardConfig(block_q=64, block_kv=128, num_stages=2),
                                 fah.BackwardConfig(block_q=128, block_kv=64, num_stages=3)],
                         ids=str)
def test_other_backward_blocks_give_the_same_gradients(rng, cfg):
  """The autotuner's candidates: larger blocks on either side, a deeper ring."""
  w = workloads.Workload("blocks", batch=1, seq_q=200, seq_kv=300, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  grads = _grads(q, k, v, dout, is_causal=True, backward_config=cfg)
  testing.check_gradients(grads, q, k, v, dout, is_causal=True)


#: dQ on 64-row query tiles beside dK/dV's 128-row query blocks (`dq_block_q`).
DQ_64_ROWS = fah.BackwardConfig(block_q=128, dq_block_q=64)


def _check_dq_mask_path(rng, w: workloads.Workload, cfg, feature: str):
  """Gradients of `w` (two batch elements) under `cfg` with one of the dQ kernel's mask
  paths: the causal edge, key lengths, the keys' segment ids (T ≤ S), or a bias's ring and
  its gradient dS."""
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  t, s = w.seq_q, w.seq_kv
  kw = {
      "causal": lambda: dict(is_causal=True),
      "key_lengths": lambda: dict(key_value_seq_lengths=jnp.array([100, 45], jnp.int32)),
      # Documents of random lengths; the queries' ids are the keys' first T.
      "segments": lambda: dict(segment_ids=(lambda ids: (ids[:, :t], ids))(jnp.asarray(
          rng.integers(0, 3, (2, s)).cumsum(1) // 40, jnp.int32))),
      "bias": lambda: dict(bias=jnp.asarray(rng.standard_normal((2, 1, t, s)), jnp.bfloat16)),
  }[feature]()
  f = lambda q, k, v, *b: fah.dot_product_attention(q, k, v, *b, interpret=True,
                                                    backward_config=cfg, **kw)
  if feature == "bias":
    bias = kw.pop("bias")
    _, vjp = jax.vjp(lambda q, k, v, b: f(q, k, v, b), q, k, v, bias)
    testing.check_gradients(vjp(dout), q, k, v, dout, bias=bias, **kw)
  else:
    _, vjp = jax.vjp(f, q, k, v)
    testing.check_gradients(vjp(dout), q, k, v, dout, **kw)


@pytest.mark.parametrize("feature", ["causal", "key_lengths", "bias"])
def test_dq_rows_apart_from_dkv(rng, monkeypatch, feature):
  """The dQ kernel on its own query rows, with the mask paths whose tables it builds on
  them; T is a multiple of neither kernel's rows."""
  seen = []  # The rows the dQ kernel was given: its own, not dK/dV's.
  real_dq = dq_kernel.dq
  def spy(*args, **kwargs):
    seen.append(args[6].config.block_q)
    return real_dq(*args, **kwargs)
  monkeypatch.setattr(dq_kernel, "dq", spy)
  w = workloads.Workload("gqa_200x150_d64", batch=2, seq_q=200, seq_kv=150, num_q_heads=4,
                         num_kv_heads=2, head_dim=64)
  _check_dq_mask_path(rng, w, DQ_64_ROWS, feature)
  assert seen == [DQ_64_ROWS.dq_block_q]


#: D 256's dQ with 32-key blocks (its tuned config): two ring stages in the shared memory of
#: one 64-key stage. Its Q, dO, K and V tiles take a 64-byte swizzle (`dq.operand_swizzle`).
DQ_32_KEYS = fah.BackwardConfig(dq_block_kv=32)


@pytest.mark.parametrize("feature", ["causal", "key_lengths", "segments", "bias"])
def test_head_dim_256_dq_with_32_key_blocks(rng, feature):
  """Every mask path of the dQ kernel on 32-key blocks, where the band's edges and the key
  lengths fall inside a 64-key block of the dK/dV kernel; sizes are not multiples of 32."""
  w = workloads.Workload("gqa_70x150_d256", batch=2, seq_q=70, seq_kv=150, num_q_heads=4,
                         num_kv_heads=2, head_dim=256)
  _check_dq_mask_path(rng, w, DQ_32_KEYS, feature)


@pytest.mark.parametrize("head_dim", (64, 256))
@pytest.mark.parametrize("is_causal", (False, True))
def test_persistent_and_one_cta_per_tile_give_the_same_bits(rng, monkeypatch, backward_schedules,
                                                            is_causal, head_dim):
  """The backward kernels on persistent CTAs (two when interpreting, each running several
  tiles of both kernels, mirror pairs under causal) against one CTA per tile. At D 256 the
  dK/dV kernel is the split one (`kernels/dkv_split.py`), and dQ runs on 32-key blocks
  (two ring stages; with one, as `BackwardConfig(dq_num_stages=1)` gives, it would keep one
  CTA per tile)."""
  from flash_attn_hopper import config as config_lib

  # Even tile counts along T and S (so causal's pairs are dealt to the two CTAs), neither a
  # whole number of tiles.
  w = workloads.Workload(f"gqa_480_d{head_dim}", batch=1, seq_q=480, seq_kv=480,
                         num_q_heads=4, num_kv_heads=2, head_dim=head_dim)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  always = {(kernel, head_dim, is_causal): 1 << 30 for kernel in ("dq", "dkv")}
  monkeypatch.setattr(config_lib, "PERSISTENT_BACKWARD_MAX_STEPS", always)
  persistent = _grads(q, k, v, dout, is_causal=is_causal)
  assert [(kernel, s.persistent) for kernel, s in backward_schedules] == [
      ("dq", True), ("dkv", True)]
  assert all(s.num_ctas == 2 for _, s in backward_schedules if s.persistent)
  monkeypatch.setattr(config_lib, "PERSISTENT_BACKWARD_MAX_STEPS", {})
  per_tile = _grads(q, k, v, dout, is_causal=is_causal)
  assert len(backward_schedules) == 4
  assert not any(s.persistent for _, s in backward_schedules[2:])
  for a, b in zip(persistent, per_tile):
    assert bool(jnp.all(a == b))
  testing.check_gradients(persistent, q, k, v, dout, is_causal=is_causal)


@pytest.mark.parametrize("head_dim, seq", [(64, 256), (256, 128)])
def test_balanced_tail(rng, monkeypatch, backward_schedules, head_dim, seq):
  """`BackwardConfig.balanced_tail` on the interpreter's two persistent CTAs: seven heads of
  two tiles each (128 rows of dQ, 128 keys of dK/dV, or 64 keys of D 256's split dK/dV) are
  seven causal pairs, one round dealt whole and five pairs' tiles from the table the kernels
  read. The same bits as the pairs dealt whole, and right. (D 256's dQ has one 128-row tile
  a head at 128 rows: the paired schedule for an odd tile count, without a table.)"""
  from flash_attn_hopper import config as config_lib

  w = workloads.Workload(f"mha_{seq}_d{head_dim}", batch=1, seq_q=seq, seq_kv=seq,
                         num_q_heads=7, num_kv_heads=7, head_dim=head_dim)
  q, k, v = testing.random_qkv(rng, w, "float16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float16)
  always = {(kernel, head_dim, True): 1 << 30 for kernel in ("dq", "dkv")}
  monkeypatch.setattr(config_lib, "PERSISTENT_BACKWARD_MAX_STEPS", always)
  tuned = config_lib.resolve_backward_config(head_dim, jnp.float16, True, seq_len=seq)
  grads = {}
  for balanced in (True, False):
    cfg = dataclasses.replace(tuned, balanced_tail=balanced)
    grads[balanced] = _grads(q, k, v, dout, is_causal=True, backward_config=cfg)
  tables = [(kernel, s.table is not None) for kernel, s in backward_schedules]
  assert tables == [("dq", head_dim == 64), ("dkv", True), ("dq", False), ("dkv", False)]
  for a, b in zip(grads[True], grads[False]):
    assert bool(jnp.all(a == b))
  testing.check_gradients(grads[True], q, k, v, dout, is_causal=True)
