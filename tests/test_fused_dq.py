"""`BackwardConfig(fused_dq=True)`: dQ accumulated inside the dK/dV kernel (an opt-in
prototype, `kernels/fused_dq.py`).

Interpreted on the CPU against the float32 reference's gradients for a random cotangent and
against the unfused kernels; lowered for CUDA on the CPU (what that catches:
`tests/test_lowering.py`); its config checks and rank arithmetic. The ordered TMA adds and
the semaphores run only on the GPU (the interpreter has neither): `tests/test_backward_gpu.py`
style checks there are the next session's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import api
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import masking
from flash_attn_hopper import testing
from flash_attn_hopper import workloads
from flash_attn_hopper.kernels import dq as dq_kernel
from flash_attn_hopper.kernels import fused_dq

FUSED = config_lib.BackwardConfig(fused_dq=True)

CASES = (
    # MHA with lengths that are not multiples of any block.
    (workloads.Workload("mha_113x203_d64", batch=1, seq_q=113, seq_kv=203, num_q_heads=2,
                        num_kv_heads=2, head_dim=64), False),
    # GQA, groups of 2, T > S, causal.
    (workloads.Workload("gqa_200x77_d64", batch=1, seq_q=200, seq_kv=77, num_q_heads=4,
                        num_kv_heads=2, head_dim=64), True),
    # MQA, two batch elements, D 128, several KV tiles (ordered adds across tiles).
    (workloads.Workload("mqa_96x300_d128", batch=2, seq_q=96, seq_kv=300, num_q_heads=3,
                        num_kv_heads=1, head_dim=128), False),
)


def _grads(q, k, v, dout, backward_config=FUSED, **kwargs):
  f = lambda q, k, v: fah.dot_product_attention(q, k, v, implementation="flash_attn_hopper",
                                                interpret=True,
                                                backward_config=backward_config, **kwargs)
  _, vjp = jax.vjp(f, q, k, v)
  return vjp(dout)


def _inputs(rng, w, dtype="bfloat16"):
  q, k, v = testing.random_qkv(rng, w, dtype)
  return q, k, v, jnp.asarray(rng.standard_normal(q.shape), dtype)  # A random cotangent.


@pytest.fixture
def no_dq_kernel(monkeypatch):
  """The separate dQ kernel must not run."""
  def refuse(*args, **kwargs):
    raise AssertionError("the dQ kernel ran with fused_dq=True")
  monkeypatch.setattr(dq_kernel, "dq", refuse)


@pytest.mark.interpret
@pytest.mark.usefixtures("no_dq_kernel")
@pytest.mark.parametrize("w, is_causal", CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_gradients_match_reference(rng, w, is_causal):
  q, k, v, dout = _inputs(rng, w)
  grads = _grads(q, k, v, dout, is_causal=is_causal, scale=0.2)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal, scale=0.2)


@pytest.mark.interpret
@pytest.mark.usefixtures("no_dq_kernel")
@pytest.mark.parametrize("d, blocks, is_causal", [
    (64, (128, 64, 2), False),  # block_q 128: M 128 products, D 64's shared staging tile.
    (128, (64, 64, 2), True),   # D 128 causal: both warpgroups add a column half each step.
], ids=str)
def test_other_blocks(rng, d, blocks, is_causal):
  w = workloads.Workload("gqa_260x330", batch=1, seq_q=260, seq_kv=330, num_q_heads=4,
                         num_kv_heads=2, head_dim=d)
  q, k, v, dout = _inputs(rng, w)
  cfg = config_lib.BackwardConfig(*blocks, fused_dq=True)
  grads = _grads(q, k, v, dout, backward_config=cfg, is_causal=is_causal)
  testing.check_gradients(grads, q, k, v, dout, is_causal=is_causal)


@pytest.mark.interpret
def test_matches_unfused_and_is_deterministic(rng):
  w, is_causal = CASES[1]
  q, k, v, dout = _inputs(rng, w)
  first = _grads(q, k, v, dout, is_causal=is_causal)
  second = _grads(q, k, v, dout, is_causal=is_causal)
  unfused = _grads(q, k, v, dout, backward_config=config_lib.BackwardConfig(),
                   is_causal=is_causal)
  for a, b, c in zip(first, second, unfused):
    assert bool(jnp.all(a == b))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.interpret
@pytest.mark.usefixtures("no_dq_kernel")
@pytest.mark.parametrize("t, s, alignment", [(150, 420, "top_left"),
                                              (420, 150, "bottom_right")])
def test_causal_with_tiles_or_queries_that_see_nothing(rng, t, s, alignment):
  """Causal (tiles run and add last to first) where T ≠ S leaves KV tiles that no query
  sees (top-left, T < S) or queries that see no key (bottom-right, T > S); T and S are not
  multiples of the blocks."""
  w = workloads.Workload(f"gqa_{t}x{s}_d64", batch=1, seq_q=t, seq_kv=s, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v, dout = _inputs(rng, w)
  kw = dict(is_causal=True, causal_alignment=alignment)
  testing.check_gradients(_grads(q, k, v, dout, **kw), q, k, v, dout, **kw)


@pytest.mark.interpret
@pytest.mark.usefixtures("no_dq_kernel")
def test_window_and_key_lengths(rng):
  """A left window (tiles that start past a query block: rank from first_tile) and key
  lengths (tiles past them add nothing; blocks nobody visits come out zero)."""
  w = workloads.Workload("mha_300x300_d64", batch=2, seq_q=300, seq_kv=300, num_q_heads=1,
                         num_kv_heads=1, head_dim=64)
  q, k, v, dout = _inputs(rng, w)
  kw = dict(is_causal=True, local_window_size=(70, 0),
            key_value_seq_lengths=jnp.array([300, 100], jnp.int32))
  testing.check_gradients(_grads(q, k, v, dout, **kw), q, k, v, dout, **kw)


@pytest.mark.interpret
@pytest.mark.usefixtures("no_dq_kernel")
def test_jit_of_vmap_of_the_gradient(rng):
  """Under vmap the fused kernel runs once per instance (its semaphores are per call)."""
  w, is_causal = CASES[1]
  inputs = [_inputs(rng, w) for _ in range(2)]
  q, k, v, dout = (jnp.stack(xs) for xs in zip(*inputs))
  grads = jax.jit(jax.vmap(lambda q, k, v, d: _grads(q, k, v, d, is_causal=is_causal)))(
      q, k, v, dout)
  for i in range(2):
    testing.check_gradients([g[i] for g in grads], q[i], k[i], v[i], dout[i],
                            is_causal=is_causal)


@pytest.mark.parametrize("left", [None, 0, 70, 300])
@pytest.mark.parametrize("offset", [0, -50, 90])
def test_first_tile_is_the_first_tile_of_the_band(left, offset):
  """`first_tile` against brute force over `masking.q_block_range`."""
  spec = masking.MaskSpec(is_causal=True, left=left, offset=offset)
  seq_q, block_q, keys, tiles = 640, 64, 128, 8
  for j in range(seq_q // block_q):
    visiting = []
    for t in range(tiles):
      r = masking.q_block_range(spec, t * keys, keys, seq_q, block_q)
      if int(r.first) <= j < int(r.end):
        visiting.append(t)
    if visiting:  # A contiguous run that starts at first_tile.
      assert visiting == list(range(visiting[0], visiting[-1] + 1))
      assert int(fused_dq.first_tile(spec, j, keys, block_q)) == visiting[0]


@pytest.mark.parametrize("left", [None, 0, 70, 300])
@pytest.mark.parametrize("offset", [0, -50, 90, -600])
@pytest.mark.parametrize("seq_q, seq_kv", [(640, 1024), (600, 1000), (600, 130)])
def test_ranks_order_the_visiting_tiles(left, offset, seq_q, seq_kv):
  """`rank` against brute force over `masking.q_block_range` and the tiles with keys: for
  every query block, the visiting tiles' ranks are 0, 1, … with no gap (a gap would hang
  the GPU: a tile would wait for an add that never comes), in the order of `tile_of`'s
  launch (last to first with a causal bound, so a tile waits only on tiles launched
  before it)."""
  block_q, keys, tiles = 64, 128, 8
  for spec in (masking.MaskSpec(is_causal=True, left=left, offset=offset),
               masking.MaskSpec(is_causal=False, left=left, offset=offset)):
    launch = [int(fused_dq.tile_of(i, tiles, spec)) for i in range(tiles)]
    assert sorted(launch) == list(range(tiles))
    for j in range(-(-seq_q // block_q)):
      visiting = []
      for t in launch:
        r = masking.q_block_range(spec, t * keys, keys, seq_q, block_q)
        if int(r.first) <= j < int(r.end) and t * keys < seq_kv:
          visiting.append(t)  # In launch order.
      ranks = [int(fused_dq.rank(spec, t, j, keys, block_q, seq_q, seq_kv)) for t in visiting]
      assert ranks == list(range(len(visiting))), (spec, j, visiting, ranks)


def test_config_checks_name_the_field():
  with pytest.raises(ValueError, match="fused_dq"):
    config_lib.BackwardConfig(fused_dq=1)
  with pytest.raises(ValueError, match="fused_dq"):
    FUSED.check_fits(256, 2)
  cfg = config_lib.BackwardConfig(block_q=64, block_kv=64, num_stages=2)
  fused = config_lib.BackwardConfig(block_q=64, block_kv=64, num_stages=2, fused_dq=True)
  extra = 2 * 2 * 64 * 64 * 2 + 64 * 128 * 4  # dSᵀ (two buffers), dQ's float32 staging.
  assert fused.smem_bytes(128, 2) == cfg._dkv_smem_bytes(128, 2, False, 0) + extra
  fused.check_fits(128, 2)
  with pytest.raises(ValueError, match="fused_dq adds"):  # Three stages overflow at D 128.
    config_lib.BackwardConfig(num_stages=3, fused_dq=True).check_fits(128, 2)


def test_unsupported_features_raise(rng):
  w, _ = CASES[0]
  q, k, v, dout = _inputs(rng, w)
  ids = jnp.zeros((1, w.seq_q), jnp.int32), jnp.zeros((1, w.seq_kv), jnp.int32)
  with pytest.raises(NotImplementedError, match="segment_ids.*fused_dq=False"):
    _grads(q, k, v, dout, segment_ids=ids)
  with pytest.raises(NotImplementedError, match="mask.*fused_dq=False"):
    _grads(q, k, v, dout, mask=jnp.ones((w.seq_q, w.seq_kv), bool))


@pytest.fixture
def as_if_on_hopper(monkeypatch):
  """The op's device check answers yes, so it takes the kernel path on the CPU."""
  monkeypatch.setattr(api, "on_hopper", lambda: True)


#: Configs that fit with fused_dq, per head dim: (block_q, block_kv, num_stages).
LOWERING_CONFIGS = {64: [(64, 64, 2), (64, 64, 3), (128, 64, 2)], 128: [(64, 64, 2)]}
LOWERING_FEATURES = {
    "dense": {},
    "causal": dict(is_causal=True),
    "window_lengths": dict(is_causal=True, local_window_size=(300, 0),
                           key_value_seq_lengths=jnp.array([1024, 130], jnp.int32)),
    "soft_cap_tail": dict(logits_soft_cap=30.0, t=1000, s=777),
}


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("feature", list(LOWERING_FEATURES))
@pytest.mark.parametrize("d, blocks", [(d, b) for d, bs in LOWERING_CONFIGS.items() for b in bs],
                         ids=str)
def test_fused_backward_lowers_for_hopper(d, blocks, feature):
  """The whole program lowers for CUDA: the dK/dV kernel (with the TMA reduce-adds and the
  semaphores), no dQ kernel."""
  kw = dict(LOWERING_FEATURES[feature])
  t, s = kw.pop("t", 1024), kw.pop("s", 1024)
  q = jax.ShapeDtypeStruct((2, t, 8, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, s, 2, d), jnp.bfloat16)
  cfg = config_lib.BackwardConfig(*blocks, fused_dq=True)

  def loss(q, k, v):
    return fah.dot_product_attention(q, k, v, implementation="flash_attn_hopper",
                                     backward_config=cfg, **kw).astype(jnp.float32).sum()

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "flash_attn_hopper_dkv_mosaic_gpu" in text
  assert "flash_attn_hopper_dq_mosaic_gpu" not in text


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("d", [64, 128])
def test_blocking_signal_order_lowers_too(d, monkeypatch):
  """`fused_dq.SIGNAL_AT_NEXT_ADD = False` (signal right after each add, the fallback)."""
  monkeypatch.setattr(fused_dq, "SIGNAL_AT_NEXT_ADD", False)
  test_fused_backward_lowers_for_hopper(d, (64, 64, 2), "causal")
