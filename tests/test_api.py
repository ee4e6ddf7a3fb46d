"""The op's validation, dispatch and error messages (CPU; no kernel is compiled here)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import api
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import testing
from flash_attn_hopper import workloads


def _qkv(rng, b=1, t=16, s=24, n=4, k=2, d=64, dtype=jnp.bfloat16):
  make = lambda shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return make((b, t, n, d)), make((b, s, k, d)), make((b, s, k, d))


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q[0, 0], k, v), "query must have rank 4"),
    (lambda q, k, v: (q, k[0], v[0]), "same rank"),
    (lambda q, k, v: (q, k, v[:, :-1]), "value must have key's shape"),
    (lambda q, k, v: (jnp.concatenate([q, q]), k, v), "same batch size"),
    (lambda q, k, v: (q[..., :32], k, v), "same head dim"),
    (lambda q, k, v: (q[:, :, :3], k, v), r"query heads \(3\) must be a multiple"),
])
def test_bad_shapes_name_the_argument(rng, bad, match):
  with pytest.raises(ValueError, match=match):
    fah.dot_product_attention(*bad(*_qkv(rng)), implementation="xla")


def test_mixed_dtypes_are_a_type_error(rng):
  q, k, v = _qkv(rng)
  with pytest.raises(TypeError, match="one dtype"):
    fah.dot_product_attention(q, k.astype(jnp.float16), v, implementation="xla")


def test_unknown_implementation(rng):
  with pytest.raises(ValueError, match="implementation must be one of"):
    fah.dot_product_attention(*_qkv(rng), implementation="triton")


def test_config_that_overflows_beside_a_bias_names_its_ring(rng):
  """At D 256 a bias's tiles fit beside K and V only in a one-slot ring of their own: an
  explicit config with two is refused, naming the field that fixes it."""
  q, k, v = _qkv(rng, d=256)
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2)
  with pytest.raises(ValueError, match="ForwardConfig.bias_num_stages"):
    fah.dot_product_attention(q, k, v, bias=jnp.zeros((1, 4, 16, 24)), config=cfg,
                              interpret=True)


@pytest.mark.parametrize("name, shape", [("bias", (2, 4, 16, 24)), ("mask", (1, 3, 16, 24)),
                                         ("bias", (16, 1, 1, 1, 24))])
def test_bias_and_mask_shapes_are_named(rng, name, shape):
  q, k, v = _qkv(rng)
  value = jnp.zeros(shape, bool if name == "mask" else jnp.float32)
  with pytest.raises(ValueError, match=f"{name} must be broadcastable to"):
    fah.dot_product_attention(q, k, v, **{name: value}, interpret=True)


def test_kernel_names_supported_dtypes(rng):
  q, k, v = _qkv(rng, dtype=jnp.float32)
  with pytest.raises(TypeError, match="float16, bfloat16; got float32"):
    fah.dot_product_attention(q, k, v, interpret=True)


def test_kernel_names_supported_head_dims(rng):
  q, k, v = _qkv(rng, d=96)
  with pytest.raises(ValueError, match=r"head dims \(64, 128, 256\); got 96"):
    fah.dot_product_attention(q, k, v, interpret=True)


@pytest.mark.skipif(api.on_hopper(), reason="checks the off-Hopper behaviour")
def test_explicit_kernel_off_hopper_says_what_to_do(rng):
  with pytest.raises(RuntimeError, match="needs an sm90.*interpret=True"):
    fah.dot_product_attention(*_qkv(rng), implementation="flash_attn_hopper")


@pytest.mark.skipif(api.on_hopper(), reason="checks the off-Hopper behaviour")
def test_default_falls_back_to_xla_with_one_warning(rng):
  q, k, v = _qkv(rng)
  api._warn_fallback_once.cache_clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fah.dot_product_attention(q, k, v, is_causal=True)
    fah.dot_product_attention(q, k, v, is_causal=True)
  assert [w.category for w in caught] == [RuntimeWarning]
  expected = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_xla_path_passes_every_argument_through(rng):
  q, k, v = _qkv(rng, dtype=jnp.float32)
  kwargs = dict(mask=jnp.asarray(rng.random((1, 1, 16, 24)) > 0.3), is_causal=True,
                key_value_seq_lengths=jnp.array([20], jnp.int32), scale=0.3)
  out, lse = fah.dot_product_attention(q, k, v, implementation="xla", return_residual=True,
                                       **kwargs)
  ref, ref_lse = jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                              return_residual=True, **kwargs)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))


@pytest.mark.parametrize("field, value, match", [
    ("block_q", 96, "block_q must be a positive multiple of 64"),
    ("block_kv", 100, "block_kv must be a positive multiple of 64"),
    ("num_stages", 1, "num_stages must be at least 2"),
    ("block_kv", 128.0, "block_kv must be an int"),
    ("overlap_softmax", 1, "overlap_softmax must be a bool"),
    ("bias_num_stages", 0, "bias_num_stages must be None or an int >= 1"),
])
def test_config_errors_name_the_field(field, value, match):
  with pytest.raises((ValueError, TypeError), match=f"ForwardConfig.{match}"):
    fah.ForwardConfig(**{field: value})


def test_config_that_overflows_shared_memory_is_rejected_before_compiling():
  cfg = fah.ForwardConfig(block_q=64, block_kv=256, num_stages=3)
  with pytest.raises(ValueError, match="shared memory at head_dim=256.*lower"):
    config_lib.resolve_forward_config(256, jnp.bfloat16, False, cfg)


def test_o_gets_its_own_tiles_only_when_they_fit_too():
  """The forward's one decision (`ForwardConfig.separate_o`), which both the kernel and the
  shared-memory test read: O's tiles fit beside these tiles at D 128 but not at D 256, and
  a ring of three f32 bias tiles leaves no room for them at D 128."""
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2, bias_num_stages=3)
  assert cfg.separate_o(128, 2)
  assert cfg.fits(256, 2) and not cfg.separate_o(256, 2)
  assert cfg.fits(128, 2, bias_bytes=4) and not cfg.separate_o(128, 2, bias_bytes=4)


@pytest.mark.parametrize("head_dim", config_lib.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize("dtype", config_lib.SUPPORTED_DTYPES)
@pytest.mark.parametrize("seq_len", (1024, 16384))
def test_every_tuned_config_fits(head_dim, is_causal, dtype, seq_len):
  cfg = config_lib.resolve_forward_config(head_dim, dtype, is_causal, seq_len=seq_len)
  assert cfg.fits(head_dim, jnp.dtype(dtype).itemsize)


def test_long_sequences_take_their_tuned_forward_config():
  (start, long_cfg), = config_lib.TUNED_FORWARD_LONG[(64, False)]
  short = config_lib.resolve_forward_config(64, jnp.float16, False, seq_len=start - 1)
  assert short == config_lib.TUNED_FORWARD[(64, False)] != long_cfg
  assert config_lib.resolve_forward_config(64, jnp.float16, False, seq_len=start) == long_cfg


@pytest.mark.parametrize("window", (-1, (3, -2), (1, 2, 3), "x"))
def test_bad_local_window_size_is_named(window):
  q = jnp.zeros((1, 8, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="local_window_size"):
    fah.dot_product_attention(q, q, q, local_window_size=window, implementation="xla")


def test_bad_causal_alignment_is_named():
  q = jnp.zeros((1, 8, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="causal_alignment"):
    fah.dot_product_attention(q, q, q, causal_alignment="center", implementation="xla")


@pytest.mark.parametrize("window", (None, (4, 2)))
def test_bottom_right_alignment_on_the_xla_path_matches_the_reference(rng, window):
  w = workloads.Workload("br", batch=1, seq_q=24, seq_kv=16, num_q_heads=2, num_kv_heads=1,
                         head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "float32")
  kw = dict(is_causal=True, local_window_size=window, causal_alignment="bottom_right")
  out = fah.dot_product_attention(q, k, v, implementation="xla", **kw)
  ref = fah.attention_reference(q, k, v, **kw)
  assert float(jnp.max(jnp.abs(out - ref))) < 1e-5


@pytest.mark.parametrize("unbatched", (False, True))
def test_segment_ids_on_the_xla_path_match_the_reference(rng, unbatched):
  q, k, v = _qkv(rng, b=1, t=24, s=24, dtype=jnp.float32)
  ids = jnp.asarray([0] * 10 + [1] * 5 + [2] * 9, jnp.int32)
  if unbatched:
    q, k, v = q[0], k[0], v[0]
  out = fah.dot_product_attention(q, k, v, is_causal=True, segment_ids=ids, implementation="xla")
  ref = fah.attention_reference(q, k, v, is_causal=True, segment_ids=ids)
  assert out.shape == q.shape
  assert float(jnp.max(jnp.abs(out - ref))) < 1e-5


@pytest.mark.parametrize("ids, error, match", [
    ((jnp.zeros((1, 16), jnp.float32), jnp.zeros(24, jnp.int32)), TypeError,
     "segment_ids.q must be an integer array"),
    ((jnp.zeros(16, jnp.int32), jnp.zeros((2, 24), jnp.int32)), ValueError,
     r"segment_ids.kv must have shape \(1, 24\)"),
    (jnp.zeros((1, 16), jnp.int32), ValueError, "T == S"),  # one array, but T != S
    ((jnp.zeros(16, jnp.int32),) * 3, ValueError, "pair"),
])
def test_bad_segment_ids_are_named(rng, ids, error, match):
  q, k, v = _qkv(rng, t=16, s=24)
  with pytest.raises(error, match=match):
    fah.dot_product_attention(q, k, v, segment_ids=ids, implementation="xla")


def test_soft_cap_on_the_xla_path_matches_the_reference(rng):
  q, k, v = _qkv(rng, dtype=jnp.float32)
  kw = dict(is_causal=True, logits_soft_cap=1.5, scale=0.4)
  out, lse = fah.dot_product_attention(q, k, v, implementation="xla", return_residual=True, **kw)
  ref, ref_lse = fah.attention_reference(q, k, v, return_residual=True, **kw)
  assert float(jnp.max(jnp.abs(out - ref))) < 1e-6
  assert float(jnp.max(jnp.abs(lse - ref_lse))) < 1e-6
  uncapped = fah.attention_reference(q, k, v, is_causal=True, scale=0.4)
  assert float(jnp.max(jnp.abs(out - uncapped))) > 1e-3  # the cap changed something


@pytest.mark.parametrize("cap, error", [(0.0, ValueError), (-1.0, ValueError),
                                        (float("inf"), ValueError), ("x", TypeError)])
def test_bad_soft_cap_is_named(rng, cap, error):
  q, k, v = _qkv(rng)
  with pytest.raises(error, match="logits_soft_cap"):
    fah.dot_product_attention(q, k, v, logits_soft_cap=cap, implementation="xla")


def test_soft_cap_is_refused_by_cudnn_with_the_fix(rng):
  q, k, v = _qkv(rng)
  with pytest.raises(NotImplementedError, match="logits_soft_cap.*implementation='xla'"):
    fah.dot_product_attention(q, k, v, logits_soft_cap=30.0, implementation="cudnn")


def test_backward_config_errors_name_the_field(rng):
  q, k, v = _qkv(rng)
  with pytest.raises(TypeError, match="backward_config must be a BackwardConfig"):
    fah.dot_product_attention(q, k, v, backward_config=fah.ForwardConfig(), interpret=True)
  with pytest.raises(ValueError, match="BackwardConfig.block_q"):
    fah.BackwardConfig(block_q=32)
  for rows in (32, 0, True, 64.0):
    with pytest.raises(ValueError, match="BackwardConfig.dq_block_q must be None or a posi"):
      fah.BackwardConfig(dq_block_q=rows)
  with pytest.raises(ValueError, match="dq_block_q sizes the dQ kernel, which fused_dq"):
    fah.BackwardConfig(dq_block_q=64, fused_dq=True)
  cfg = fah.BackwardConfig(block_q=128, dq_block_q=64)
  assert (cfg.dq_rows, cfg.for_dq().block_q, cfg.for_dq().dq_block_q) == (64, 64, None)
  # dQ's Q and dO tiles are its own rows': 64-row tiles fit where 128-row ones do not.
  wide = fah.BackwardConfig(block_q=64, num_stages=4, dq_block_q=128)
  assert wide.smem_bytes(128, 2) > fah.BackwardConfig(block_q=64, num_stages=4).smem_bytes(128, 2)
  big = fah.BackwardConfig(block_q=128, block_kv=128, num_stages=3)
  with pytest.raises(ValueError, match="shared memory at head_dim=128.*BackwardConfig"):
    fah.dot_product_attention(*_qkv(rng, d=128), backward_config=big, interpret=True)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize("seq_len", (1024, 2048, 4096, 8192, 16384))
@pytest.mark.parametrize("features", [{}, dict(segments=True), dict(bias_bytes=1),
                                      dict(segments=True, bias_bytes=1)], ids=str)
def test_every_tuned_backward_config_fits(head_dim, is_causal, seq_len, features):
  """Tuned entries that do not fit beside segment ids or a mask give way to the default."""
  cfg = config_lib.resolve_backward_config(head_dim, jnp.bfloat16, is_causal,
                                           seq_len=seq_len, **features)
  assert cfg.smem_bytes(head_dim, 2, **features) <= config_lib.SMEM_BUDGET


@pytest.mark.parametrize("key", sorted(config_lib.TUNED_BACKWARD_LONG), ids=str)
def test_long_sequences_take_their_own_backward_config(key):
  """Each step of a long-sequence entry from its length on, up to the next step's."""
  head_dim, is_causal = key
  steps = config_lib.TUNED_BACKWARD_LONG[key]
  assert [length for length, _ in steps] == sorted({length for length, _ in steps})
  resolve = functools.partial(config_lib.resolve_backward_config, head_dim, jnp.bfloat16,
                              is_causal)
  before = config_lib.TUNED_BACKWARD[key]
  for length, long_cfg in steps:
    assert resolve(seq_len=length - 128) == before != long_cfg
    assert resolve(seq_len=length) == resolve(seq_len=length + 128) == long_cfg
    before = long_cfg
  assert resolve(seq_len=1 << 20) == before
