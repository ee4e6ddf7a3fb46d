"""Tests of `attention_reference`, the yardstick that every kernel test compares against.

Two independent oracles: a float64 NumPy loop written here (shapes, GQA/MQA, causal, scale, LSE),
and `jax.nn.dot_product_attention`'s XLA path in float32 (all of the mask arguments and bias).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_attn_hopper.masking import SegmentIds
from flash_attn_hopper.reference import attention_reference

# (num_q_heads, num_kv_heads)
HEADS = {
    "mha": (4, 4),  # multi-head: one KV head per query head
    "gqa": (6, 2),  # grouped-query: three query heads share each KV head
    "mqa": (3, 1),  # multi-query: every query head shares the one KV head
}
# (T, S): query and key lengths
SEQ_LENS = {
    "t5_s7": (5, 7),      # fewer queries than keys
    "t13_s9": (13, 9),    # more queries than keys
    "t1_s1": (1, 1),      # a single token
    "t16_s16": (16, 16),  # square
}
CAUSAL = {"full": False, "causal": True}
# None is the default 1/sqrt(H); 2.0 sharpens the softmax well past it.
SCALES = {"default_scale": None, "scale2": 2.0}

BATCH = 2
HEAD_DIM = 8

# float32 against float32: both compute in float32 with different reduction orders.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
# float64 against float64.
F64_TOL = dict(rtol=1e-12, atol=1e-12)


def named(params: dict):
  """`parametrize` arguments (values, ids) from a dict of named values."""
  return dict(argvalues=list(params.values()), ids=list(params))


def random_qkv(rng, batch, seq_q, seq_kv, num_q_heads, num_kv_heads, head_dim, dtype):
  """Standard-normal q, k, v in BTNH layout; never zero, so no test passes on zeros."""
  q = rng.standard_normal((batch, seq_q, num_q_heads, head_dim))
  k = rng.standard_normal((batch, seq_kv, num_kv_heads, head_dim))
  v = rng.standard_normal((batch, seq_kv, num_kv_heads, head_dim))
  return tuple(x.astype(dtype) for x in (q, k, v))


def numpy_attention(q, k, v, *, scale, is_causal, soft_cap=None):
  """Attention in float64, one (batch, head) at a time; returns (out BTNH, lse BTN)."""
  batch, seq_q, num_q_heads, head_dim = q.shape
  seq_kv, num_kv_heads = k.shape[1], k.shape[2]
  group = num_q_heads // num_kv_heads
  scale = 1 / np.sqrt(head_dim) if scale is None else scale
  out = np.zeros((batch, seq_q, num_q_heads, head_dim))
  lse = np.zeros((batch, seq_q, num_q_heads))
  for b in range(batch):
    for n in range(num_q_heads):
      kv_head = n // group
      logits = scale * (q[b, :, n] @ k[b, :, kv_head].T)  # (T, S)
      if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
      if is_causal:  # Top-left: query i sees key j when j <= i.
        logits[np.arange(seq_kv)[None, :] > np.arange(seq_q)[:, None]] = -np.inf
      row_max = logits.max(axis=1, keepdims=True)
      weights = np.exp(logits - row_max)
      row_sum = weights.sum(axis=1, keepdims=True)
      out[b, :, n] = (weights / row_sum) @ v[b, :, kv_head]
      lse[b, :, n] = (row_max + np.log(row_sum))[:, 0]
  return out, lse


@pytest.mark.parametrize("scale", **named(SCALES))
@pytest.mark.parametrize("is_causal", **named(CAUSAL))
@pytest.mark.parametrize("seq_lens", **named(SEQ_LENS))
@pytest.mark.parametrize("heads", **named(HEADS))
def test_matches_numpy_float64(rng, heads, seq_lens, is_causal, scale):
  q, k, v = random_qkv(rng, BATCH, *seq_lens, *heads, HEAD_DIM, np.float64)
  expected_out, expected_lse = numpy_attention(q, k, v, scale=scale, is_causal=is_causal)
  with jax.enable_x64(True):
    out, lse = attention_reference(q, k, v, scale=scale, is_causal=is_causal,
                                   return_residual=True)
    assert out.dtype == jnp.float64
    out, lse = np.asarray(out), np.asarray(lse)
  np.testing.assert_allclose(out, expected_out, **F64_TOL)
  np.testing.assert_allclose(lse, expected_lse, **F64_TOL)


@pytest.mark.parametrize("is_causal", **named(CAUSAL))
def test_soft_cap_matches_numpy_float64(rng, is_causal):
  q, k, v = random_qkv(rng, BATCH, 9, 13, *HEADS["gqa"], HEAD_DIM, np.float64)
  expected_out, expected_lse = numpy_attention(q, k, v, scale=0.7, is_causal=is_causal,
                                               soft_cap=2.5)
  with jax.enable_x64(True):
    out, lse = attention_reference(q, k, v, scale=0.7, is_causal=is_causal,
                                   logits_soft_cap=2.5, return_residual=True)
    out, lse = np.asarray(out), np.asarray(lse)
  np.testing.assert_allclose(out, expected_out, **F64_TOL)
  np.testing.assert_allclose(lse, expected_lse, **F64_TOL)


def test_unbatched_matches_batched(rng):
  q, k, v = random_qkv(rng, 1, 5, 7, *HEADS["gqa"], HEAD_DIM, np.float32)
  out, lse = attention_reference(q, k, v, is_causal=True, return_residual=True)
  out_3d, lse_3d = attention_reference(q[0], k[0], v[0], is_causal=True, return_residual=True)
  assert out_3d.shape == q.shape[1:] and lse_3d.shape == q.shape[1:3]
  np.testing.assert_array_equal(out_3d, out[0])
  np.testing.assert_array_equal(lse_3d, lse[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_half_inputs_are_upcast_to_float32(rng, dtype):
  q, k, v = random_qkv(rng, BATCH, 5, 7, *HEADS["mha"], HEAD_DIM, dtype)
  out, lse = attention_reference(q, k, v, return_residual=True)
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  upcast = [np.asarray(x, np.float32) for x in (q, k, v)]
  expected_out, expected_lse = attention_reference(*upcast, return_residual=True)
  np.testing.assert_array_equal(out, expected_out)
  np.testing.assert_array_equal(lse, expected_lse)


# Keyword arguments of both functions, built from (rng, batch, num_q_heads, T, S).
FEATURES = {
    "plain": lambda rng, b, n, t, s: {},
    "causal": lambda rng, b, n, t, s: dict(is_causal=True),
    "scale": lambda rng, b, n, t, s: dict(scale=0.7),
    "bias_per_head": lambda rng, b, n, t, s: dict(
        bias=rng.standard_normal((b, n, t, s)).astype(np.float32)),
    "bias_broadcast": lambda rng, b, n, t, s: dict(
        bias=rng.standard_normal((1, 1, t, s)).astype(np.float32)),
    "mask_per_head": lambda rng, b, n, t, s: dict(mask=rng.random((b, n, t, s)) < 0.7),
    "mask_broadcast": lambda rng, b, n, t, s: dict(mask=rng.random((1, 1, t, s)) < 0.7),
    "bias_and_mask_causal": lambda rng, b, n, t, s: dict(
        bias=rng.standard_normal((b, 1, t, s)).astype(np.float32),
        mask=rng.random((1, n, t, s)) < 0.7, is_causal=True),
    "query_lengths": lambda rng, b, n, t, s: dict(
        query_seq_lengths=rng.integers(1, t + 1, b, dtype=np.int32)),
    "key_lengths": lambda rng, b, n, t, s: dict(
        key_value_seq_lengths=rng.integers(1, s + 1, b, dtype=np.int32)),
    "both_lengths_causal": lambda rng, b, n, t, s: dict(
        query_seq_lengths=rng.integers(1, t + 1, b, dtype=np.int32),
        key_value_seq_lengths=rng.integers(1, s + 1, b, dtype=np.int32), is_causal=True),
    "window": lambda rng, b, n, t, s: dict(local_window_size=(2, 1)),
    "window_symmetric_int": lambda rng, b, n, t, s: dict(local_window_size=3),
    "window_causal": lambda rng, b, n, t, s: dict(local_window_size=(3, 0), is_causal=True),
}
XLA_SEQ_LENS = {name: SEQ_LENS[name] for name in ("t5_s7", "t13_s9")}
# The keyword arguments that are arrays; the others are static.
ARRAY_ARGS = ("bias", "mask", "query_seq_lengths", "key_value_seq_lengths")


def assert_matches_jax_nn(q, k, v, *, jit=False, **kwargs):
  """Compares the reference with jax.nn's XLA path, both returning the LSE.

  Eager mode compiles once per op and shape, which tests that share shapes reuse; `jit=True`
  compiles once per problem instead, which is cheaper for a stream of new shapes.
  """
  arrays = {name: kwargs.pop(name) for name in ARRAY_ARGS if name in kwargs}
  reference = functools.partial(attention_reference, return_residual=True, **kwargs)
  jax_nn = functools.partial(jax.nn.dot_product_attention, implementation="xla",
                             return_residual=True, **kwargs)
  if jit:
    reference, jax_nn = jax.jit(reference), jax.jit(jax_nn)
  out, lse = reference(q, k, v, **arrays)
  expected_out, expected_lse = jax_nn(q, k, v, **arrays)
  # jax.nn returns the residual in the input dtype (float32 here), in BTN like the reference.
  assert lse.shape == expected_lse.shape == q.shape[:-1]
  np.testing.assert_allclose(out, expected_out, **F32_TOL)
  np.testing.assert_allclose(lse, expected_lse, **F32_TOL)


@pytest.mark.parametrize("feature", **named(FEATURES))
@pytest.mark.parametrize("seq_lens", **named(XLA_SEQ_LENS))
@pytest.mark.parametrize("heads", **named(HEADS))
def test_matches_jax_nn_xla(rng, heads, seq_lens, feature):
  (num_q_heads, _), (seq_q, seq_kv) = heads, seq_lens
  q, k, v = random_qkv(rng, BATCH, seq_q, seq_kv, *heads, HEAD_DIM, np.float32)
  assert_matches_jax_nn(q, k, v, **feature(rng, BATCH, num_q_heads, seq_q, seq_kv))


@st.composite
def attention_problems(draw):
  """Small random shapes and mask arguments, as (q, k, v, kwargs) in float32."""
  batch = draw(st.integers(1, 2))
  seq_q, seq_kv = draw(st.integers(1, 9)), draw(st.integers(1, 9))
  num_kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
  head_dim = draw(st.sampled_from([1, 4, 16]))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  q, k, v = random_qkv(rng, batch, seq_q, seq_kv, num_kv_heads * group, num_kv_heads, head_dim,
                       np.float32)
  kwargs = dict(is_causal=draw(st.booleans()),
                scale=draw(st.one_of(st.none(), st.floats(0.1, 3.0))))
  if draw(st.booleans()):
    kwargs["local_window_size"] = (draw(st.integers(0, 4)), draw(st.integers(0, 4)))
  if draw(st.booleans()):
    kwargs["key_value_seq_lengths"] = rng.integers(0, seq_kv + 1, batch, dtype=np.int32)
  if draw(st.booleans()):
    kwargs["query_seq_lengths"] = rng.integers(0, seq_q + 1, batch, dtype=np.int32)
  return q, k, v, kwargs


@settings(max_examples=30)
@given(attention_problems())
def test_matches_jax_nn_xla_random_problems(problem):
  q, k, v, kwargs = problem
  assert_matches_jax_nn(q, k, v, jit=True, **kwargs)


def expected_mean_of_v(v, num_q_heads):
  """The mean of V over all keys, per query head: (B, 1, N, H) in float64."""
  group = num_q_heads // v.shape[2]
  return np.repeat(v.astype(np.float64).mean(axis=1, keepdims=True), group, axis=2)


def test_fully_masked_rows_by_mask_return_mean_of_v(rng):
  num_q_heads, num_kv_heads = HEADS["gqa"]
  q, k, v = random_qkv(rng, BATCH, 5, 7, num_q_heads, num_kv_heads, HEAD_DIM, np.float32)
  mask = rng.random((1, 1, 5, 7)) < 0.7
  mask[..., 0, :] = mask[..., 1, :] = True
  masked_rows = [2, 4]
  mask[..., masked_rows, :] = False
  out = np.asarray(attention_reference(q, k, v, mask=mask))
  mean_v = expected_mean_of_v(v, num_q_heads)
  masked_out = out[:, masked_rows]
  np.testing.assert_allclose(masked_out, np.broadcast_to(mean_v, masked_out.shape),
                             rtol=1e-6, atol=1e-6)
  # The other rows attend to some keys: none of them equals the mean.
  assert not np.allclose(out[:, :2], mean_v, atol=1e-3)


def test_fully_masked_rows_by_window_and_lengths_return_mean_of_v(rng):
  # With T=9 > S=4 and window (1, 1), queries 5..8 see no key; batch 1 has no valid key at all.
  num_q_heads, num_kv_heads = HEADS["mqa"]
  q, k, v = random_qkv(rng, BATCH, 9, 4, num_q_heads, num_kv_heads, HEAD_DIM, np.float32)
  out = np.asarray(attention_reference(
      q, k, v, local_window_size=(1, 1), key_value_seq_lengths=np.array([4, 0], np.int32)))
  mean_v = expected_mean_of_v(v, num_q_heads)
  np.testing.assert_allclose(out[0, 5:], np.broadcast_to(mean_v[0], out[0, 5:].shape),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out[1], np.broadcast_to(mean_v[1], out[1].shape),
                             rtol=1e-6, atol=1e-6)


def test_rows_past_query_length_are_zero(rng):
  q, k, v = random_qkv(rng, BATCH, 6, 7, *HEADS["mha"], HEAD_DIM, np.float32)
  out = np.asarray(attention_reference(q, k, v, query_seq_lengths=np.array([6, 2], np.int32)))
  assert np.all(out[1, 2:] == 0)
  assert np.all(out[0] != 0) and np.all(out[1, :2] != 0)


def numpy_segment_attention(q, k, v, q_ids, kv_ids, *, is_causal):
  """Attention with segment ids in float64, one (batch, head, query) at a time, from the
  definition: the softmax over the keys of the query's segment (and causally before it), or
  the mean of all of V when there is none. Returns (out BTNH, lse BTN; NaN for no keys)."""
  batch, seq_q, num_q_heads, head_dim = q.shape
  seq_kv, group = k.shape[1], num_q_heads // k.shape[2]
  out = np.zeros(q.shape)
  lse = np.full(q.shape[:3], np.nan)
  for b, i, n in np.ndindex(batch, seq_q, num_q_heads):
    keys = [j for j in range(seq_kv)
            if q_ids[b, i] == kv_ids[b, j] and not (is_causal and j > i)]
    if not keys:
      out[b, i, n] = v[b, :, n // group].mean(axis=0)
      continue
    logits = k[b, keys, n // group] @ q[b, i, n] / np.sqrt(head_dim)
    weights = np.exp(logits - logits.max())
    out[b, i, n] = weights @ v[b, keys, n // group] / weights.sum()
    lse[b, i, n] = logits.max() + np.log(weights.sum())
  return out, lse


# (q ids, kv ids) per batch element: (T, S) = (7, 9).
SEGMENT_LAYOUTS = {
    # Packed documents, self-attention style, with a one-token document (id 2).
    "packed": ([[0, 0, 0, 1, 1, 2, 3], [5, 5, 5, 5, 5, 5, 5]],
               [[0, 0, 0, 1, 1, 2, 3, 3, 3], [5, 5, 5, 5, 5, 5, 5, 5, 5]]),
    # Query segment 9 has no keys (its rows return the mean of V); ids are unsorted.
    "empty_and_unsorted": ([[9, 1, 0, 1, 9, 0, 2], [3, 1, 3, 1, 3, 1, 3]],
                           [[0, 1, 0, 2, 1, 1, 0, 2, 2], [1, 3, 1, 3, 1, 3, 1, 3, 3]]),
}


@pytest.mark.parametrize("is_causal", **named(CAUSAL))
@pytest.mark.parametrize("layout", **named(SEGMENT_LAYOUTS))
@pytest.mark.parametrize("heads", **named(HEADS))
def test_segment_ids_match_numpy_float64(rng, heads, layout, is_causal):
  q_ids, kv_ids = (np.array(x, np.int32) for x in layout)
  q, k, v = random_qkv(rng, BATCH, 7, 9, *heads, HEAD_DIM, np.float64)
  expected_out, expected_lse = numpy_segment_attention(q, k, v, q_ids, kv_ids,
                                                       is_causal=is_causal)
  with jax.enable_x64(True):
    out, lse = attention_reference(q, k, v, segment_ids=(q_ids, kv_ids), is_causal=is_causal,
                                   return_residual=True)
    out, lse = np.asarray(out), np.asarray(lse)
  np.testing.assert_allclose(out, expected_out, **F64_TOL)
  seen = ~np.isnan(expected_lse)
  np.testing.assert_allclose(lse[seen], expected_lse[seen], **F64_TOL)


def test_segment_ids_forms_agree(rng):
  q, k, v = random_qkv(rng, BATCH, 6, 6, *HEADS["gqa"], HEAD_DIM, np.float32)
  ids = np.array([0, 0, 1, 1, 1, 2], np.int32)
  expected = attention_reference(q, k, v, segment_ids=SegmentIds(np.tile(ids, (BATCH, 1)),
                                                                 np.tile(ids, (BATCH, 1))))
  for form in (ids, (ids, ids), np.tile(ids, (BATCH, 1))):
    np.testing.assert_array_equal(attention_reference(q, k, v, segment_ids=form), expected)
  # Unbatched inputs take (L,) ids.
  np.testing.assert_array_equal(attention_reference(q[0], k[0], v[0], segment_ids=ids),
                                expected[0])


@pytest.mark.parametrize("feature", **named({name: FEATURES[name] for name in (
    "plain", "causal", "mask_per_head", "both_lengths_causal", "window")}))
@pytest.mark.parametrize("heads", **named(HEADS))
def test_segment_ids_match_jax_nn_with_the_equivalent_mask(rng, heads, feature):
  (num_q_heads, _), (seq_q, seq_kv) = heads, (7, 9)
  q, k, v = random_qkv(rng, BATCH, seq_q, seq_kv, *heads, HEAD_DIM, np.float32)
  kwargs = feature(rng, BATCH, num_q_heads, seq_q, seq_kv)
  q_ids, kv_ids = (rng.integers(0, 3, (BATCH, n), dtype=np.int32) for n in (seq_q, seq_kv))
  out, lse = attention_reference(q, k, v, segment_ids=(q_ids, kv_ids), return_residual=True,
                                 **kwargs)
  same = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  kwargs["mask"] = same & kwargs.get("mask", True)
  expected_out, expected_lse = jax.nn.dot_product_attention(
      q, k, v, implementation="xla", return_residual=True, **kwargs)
  np.testing.assert_allclose(out, expected_out, **F32_TOL)
  np.testing.assert_allclose(lse, expected_lse, **F32_TOL)


def test_the_tolerance_rule_fails_what_it_should():
  """`testing.assert_close_to_reference`: twice the naive error plus about one ulp of the
  largest value passes; a wrong element, a NaN (an unwritten tile) or a shape does not."""
  from flash_attn_hopper import testing
  ref = np.linspace(-8.7, 8.7, 64, dtype=np.float32).reshape(8, 8)
  naive = jnp.asarray(ref, jnp.bfloat16)  # One rounding: within half an ulp.
  ulp_at_8 = 2.0 ** -4  # bf16 at [8, 16)
  off_by_one_ulp = np.array(naive, np.float32)
  off_by_one_ulp[-1, -1] -= ulp_at_8  # 8.7 → 8.625: past an absolute 1e-2 on top
  testing.assert_close_to_reference(jnp.asarray(off_by_one_ulp, jnp.bfloat16), ref, naive)
  wrong, unwritten = (np.array(naive, np.float32) for _ in range(2))
  wrong[3, 4] += 0.25
  unwritten[:4] = np.nan
  for bad, match in ((wrong, "max abs error"), (unwritten, "non-finite"),
                     (np.array(naive, np.float32)[:4], "shape")):
    with pytest.raises(AssertionError, match=match):
      testing.assert_close_to_reference(jnp.asarray(bad, jnp.bfloat16), ref, naive)
