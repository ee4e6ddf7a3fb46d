"""Test helpers: random inputs, the naive baseline and precision-scaled tolerances.

The tolerance rule (FlashAttention's): a kernel's error against the float32 reference may be
at most about twice that of a naive implementation in the same dtype, plus rounding noise.
The naive implementation is `jax.nn.dot_product_attention`'s XLA path on the same
half-precision inputs. This module never imports a kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flash_attn_hopper import masking
from flash_attn_hopper import reference

#: The kernel may be this many times as far from the reference as the naive implementation.
ERROR_FACTOR = 2.0
#: Rounding noise allowed on top, per dtype: about one ulp of an O(1) output, scaled by the
#: reference's largest magnitude where that is larger (a gradient summed over heads reaches
#: 8 or more, where one bf16 ulp is 0.0625 and one rounding step decides the max error).
NOISE = {jnp.dtype(jnp.float16): 1e-3, jnp.dtype(jnp.bfloat16): 8e-3,
         jnp.dtype(jnp.float32): 1e-5}


def random_qkv(rng: np.random.Generator, workload, dtype=None):
  """Fresh standard-normal q, k, v for a `Workload` (never zeros)."""
  dtype = jnp.dtype(dtype or workload.dtype)
  make = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  return make(workload.q_shape), make(workload.kv_shape), make(workload.kv_shape)


def random_segment_ids(rng: np.random.Generator, batch: int, length: int,
                       max_segments: int) -> np.ndarray:
  """(B, L) int32 ids of packed documents: each row is 1..max_segments contiguous runs of
  random lengths (a run may be a single token), with increasing ids from a random start."""
  ids = np.empty((batch, length), np.int32)
  for row in ids:
    count = rng.integers(1, min(max_segments, length) + 1)
    starts = np.sort(rng.choice(np.arange(1, length), count - 1, replace=False))
    row[:] = rng.integers(0, 4) + np.searchsorted(starts, np.arange(length), side="right")
  return ids


def segment_mask(segment_ids, batch: int, seq_q: int, seq_kv: int):
  """`segment_ids` (any form the op accepts) as the equivalent boolean (B, 1, T, S) mask."""
  ids = masking.as_segment_ids(segment_ids, batch, seq_q, seq_kv)
  return ids.q[:, None, :, None] == ids.kv[:, None, None, :]


def naive_attention(q, k, v, *, causal_alignment="top_left", segment_ids=None,
                    logits_soft_cap=None, **kwargs):
  """The baseline: jax.nn's XLA attention in the inputs' own dtype (a bottom-right
  alignment and segment ids, which jax.nn lacks, go in as an explicit mask). With a soft-cap,
  which jax.nn cannot take, it is the reference's arithmetic in the inputs' dtype."""
  if logits_soft_cap is not None:
    return reference.attention_reference(
        q, k, v, causal_alignment=causal_alignment, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, compute_dtype=jnp.result_type(q), **kwargs)
  if segment_ids is not None:
    batch = q.shape[0] if q.ndim == 4 else 1
    same = segment_mask(segment_ids, batch, q.shape[-3], k.shape[-3])
    same = same if q.ndim == 4 else same[0]
    mask = kwargs.pop("mask", None)
    kwargs["mask"] = same if mask is None else jnp.logical_and(mask, same)
  if causal_alignment != "top_left":
    band = reference.band_mask(q.shape[-3], k.shape[-3], is_causal=kwargs.pop("is_causal", False),
                               local_window_size=kwargs.pop("local_window_size", None),
                               causal_alignment=causal_alignment)
    mask = kwargs.pop("mask", None)
    kwargs["mask"] = band if mask is None else jnp.logical_and(mask, band)
  return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)


def max_abs_error(x, ref) -> float:
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  return float(np.max(np.abs(x - np.asarray(ref, np.float64)), initial=0.0))


def assert_close_to_reference(actual, ref, naive, *, what="output", factor=ERROR_FACTOR):
  """Asserts max|actual − ref| ≤ factor·max|naive − ref| + noise (`NOISE`, times
  max(1, max|ref|)), and no NaN anywhere.

  NaN fails: the interpreter fills unwritten output with NaN, so a missed tile fails here.
  """
  actual32 = np.asarray(jnp.asarray(actual, jnp.float32))
  assert actual32.shape == np.shape(ref), f"{what}: shape {actual32.shape} != {np.shape(ref)}"
  assert np.all(np.isfinite(actual32)), (
      f"{what}: {np.sum(~np.isfinite(actual32))} non-finite values (an unwritten tile?)")
  err = max_abs_error(actual32, ref)
  base = max_abs_error(naive, ref)
  scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
  bound = factor * base + NOISE[jnp.dtype(jnp.asarray(actual).dtype)] * scale
  assert err <= bound, (f"{what}: max abs error {err:.3g} exceeds {factor}× the naive "
                        f"implementation's {base:.3g} + noise (bound {bound:.3g})")


def check_attention(actual_out, q, k, v, *, actual_lse=None, **kwargs):
  """Checks an attention output (and optionally its LSE) against the float32 reference."""
  ref_out, ref_lse = reference.attention_reference(q, k, v, return_residual=True, **kwargs)
  naive_out, naive_lse = naive_attention(q, k, v, return_residual=True, **kwargs)
  assert_close_to_reference(actual_out, ref_out, naive_out)
  if actual_lse is not None:
    # jax.nn returns its LSE in the input dtype; ours is float32, so allow its rounding only.
    assert actual_lse.dtype == jnp.float32, f"lse dtype {actual_lse.dtype} != float32"
    # A query that sees no key: the reference's LSE is its mask value, the kernel's −inf.
    empty = np.asarray(ref_lse) < -1e30
    assert np.all(np.asarray(actual_lse)[empty] == -np.inf), "lse of empty rows != -inf"
    seen = lambda x: np.where(empty, 0.0, np.asarray(jnp.asarray(x, jnp.float32)))
    lse_err = max_abs_error(seen(actual_lse), seen(ref_lse))
    lse_bound = ERROR_FACTOR * max_abs_error(seen(naive_lse), seen(ref_lse)) + 1e-3
    assert lse_err <= lse_bound, f"lse: max abs error {lse_err:.3g} > bound {lse_bound:.3g}"


def gradients(attention, q, k, v, dout, *, wrt_bias=None, **kwargs):
  """The vjp of `attention(q, k, v, **kwargs)` for the cotangent `dout`: (dq, dk, dv), and
  dbias after them when `wrt_bias` (default: whether `kwargs` holds a bias;
  `check_gradients` then checks it too)."""
  bias = kwargs.pop("bias", None)
  if wrt_bias is None:
    wrt_bias = bias is not None
  if not wrt_bias:
    return jax.vjp(lambda q, k, v: attention(q, k, v, bias=bias, **kwargs), q, k, v)[1](dout)
  fn = lambda q, k, v, bias: attention(q, k, v, bias=bias, **kwargs)
  return jax.vjp(fn, q, k, v, bias)[1](dout)


def check_gradients(actual, q, k, v, dout, **kwargs):
  """Checks (dq, dk, dv), or (dq, dk, dv, dbias) for the `bias` in `kwargs`, against the
  float32 reference's gradients for the cotangent `dout`, with the same rule as the output:
  at most ERROR_FACTOR × the naive implementation's error."""
  f32 = lambda *xs: tuple(jnp.asarray(x, jnp.float32) for x in xs)
  wrt_bias = len(actual) == 4
  if wrt_bias:
    assert actual[3].dtype == kwargs["bias"].dtype, f"dbias: dtype {actual[3].dtype}"
  ref_kwargs = dict(kwargs)
  if kwargs.get("bias") is not None:
    ref_kwargs["bias"] = f32(kwargs["bias"])[0]
  refs = gradients(reference.attention_reference, *f32(q, k, v, dout), wrt_bias=wrt_bias,
                   **ref_kwargs)
  naives = gradients(naive_attention, q, k, v, dout, wrt_bias=wrt_bias, **kwargs)
  for name, a, r, n in zip(("dq", "dk", "dv", "dbias"), actual, refs, naives):
    assert_close_to_reference(a, r, n, what=name)


def poison_device_memory(nbytes: int, device=None) -> None:
  """Best effort on a GPU: fills and frees `nbytes` of device memory with NaN, so that the
  allocator hands the NaN-filled block to the next output and an unwritten tile reads NaN."""
  block = jnp.full((max(1, nbytes // 4),), jnp.nan, jnp.float32, device=device)
  block.block_until_ready()
  del block
