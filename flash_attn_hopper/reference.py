"""The reference attention: the op's signature and mask semantics, computed in float32.

It never imports a kernel. Inputs are upcast to float32 (float64 inputs stay float64, which the
reference's own test uses), so its error is far below that of any half-precision kernel.

Mask semantics follow `jax.nn.dot_product_attention`:
- `is_causal` aligns top-left: query i sees key j when j <= i, whatever T and S are.
- `local_window_size=(left, right)` lets query i see keys j with i - left <= j <= i + right.
- `query_seq_lengths` / `key_value_seq_lengths` mask padding; output rows past a query's length
  are zero.
- `segment_ids` (packed sequences, which `jax.nn` lacks): query i of batch element b sees key j
  only when their segment ids are equal, on top of the other masks.
- A row whose every key is masked takes a uniform softmax over its keys (masked logits become a
  large finite negative number, as in `jax.nn`'s XLA path), so it returns the mean of V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flash_attn_hopper import masking


def _as_4d(x):
  return None if x is None else jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)


def _logits_mask(t, s, mask, is_causal, q_lens, kv_lens, window, offset=0, segments=None):
  """A boolean (B|1, N|1, T, S) mask of visible logits, or None when all are visible.

  `offset` shifts the diagonal that causality and the window follow (S − T: bottom-right);
  `segments` is None or a (B, T), (B, S) `masking.SegmentIds`."""
  q_pos = jnp.arange(t)[:, None] + offset
  k_pos = jnp.arange(s)[None, :]
  visible = None

  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)

  if mask is not None:
    visible = both(visible, mask)
  if is_causal:
    visible = both(visible, (k_pos <= q_pos)[None, None])
  if window is not None:
    left, right = window
    visible = both(visible, ((q_pos - left <= k_pos) & (k_pos <= q_pos + right))[None, None])
  if q_lens is not None:
    visible = both(visible, (jnp.arange(t)[None, :] < q_lens[:, None])[:, None, :, None])
  if kv_lens is not None:
    visible = both(visible, (jnp.arange(s)[None, :] < kv_lens[:, None])[:, None, None, :])
  if segments is not None:
    visible = both(visible, segments.q[:, None, :, None] == segments.kv[:, None, None, :])
  return visible


def band_mask(t: int, s: int, *, is_causal=False, local_window_size=None,
              causal_alignment="top_left"):
  """The (T, S) boolean mask of the causal and window constraints (None: nothing masked);
  how `jax.nn`'s own paths get a bottom-right alignment, as an explicit mask."""
  if isinstance(local_window_size, int):
    local_window_size = (local_window_size, local_window_size)
  visible = _logits_mask(t, s, None, is_causal, None, None, local_window_size,
                         offset=s - t if causal_alignment == "bottom_right" else 0)
  return None if visible is None else visible[0, 0]


def attention_reference(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                        query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, segment_ids=None, return_residual=False,
                        causal_alignment="top_left", logits_soft_cap=None, compute_dtype=None):
  """Attention in float32 with `jax.nn.dot_product_attention`'s semantics.

  Args:
    query: (B, T, N, H) or (T, N, H).
    key, value: (B, S, K, H) or (S, K, H), with N a multiple of K (GQA/MQA).
    bias, mask: broadcastable to (B, N, T, S); mask is boolean, True means "attend".
    scale: multiplies the logits; default 1/sqrt(H).
    is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size: as in `jax.nn`.
    segment_ids: None; a `masking.SegmentIds` or (q_ids, kv_ids) pair of integer (B, T) and
      (B, S) arrays ((T,) and (S,): the same for every batch element); or, when T == S, one
      array for both. Query i of batch element b sees key j only if q_ids[b, i] == kv_ids[b, j].
      A query whose segment has no visible key returns the mean of V, like any masked row.
    return_residual: also return the float32 log-sum-exp of the scaled logits, shape (B, T, N).
    causal_alignment: 'top_left' (jax.nn's) or 'bottom_right' (query i's diagonal is key
      i + S − T), for the causal mask and the window alike.
    logits_soft_cap: None, or cap: the scaled logits x (bias included) become
      cap·tanh(x / cap) before the masks (Gemma 2).
    compute_dtype: overrides the float32 (float64) arithmetic; the tests' naive baseline
      for what jax.nn lacks (soft-cap) is this function in the inputs' own dtype.

  Returns:
    The output in float32 (float64 for float64 inputs), shaped like `query`; with
    `return_residual`, a pair (output, lse).
  """
  out_shape = jnp.shape(query)
  compute = jnp.float64 if jnp.result_type(query) == jnp.float64 else jnp.float32
  compute = compute_dtype or compute
  q, k, v = (_as_4d(jnp.asarray(x, compute)) for x in (query, key, value))
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  group = n // kv_heads
  k = jnp.repeat(k, group, axis=2)
  v = jnp.repeat(v, group, axis=2)
  scale = 1.0 / float(np.sqrt(h)) if scale is None else float(scale)
  if isinstance(local_window_size, int):
    local_window_size = (local_window_size, local_window_size)

  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=jax.lax.Precision.HIGHEST) * scale
  if bias is not None:
    logits = logits + _as_4d(jnp.asarray(bias, compute))
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  visible = _logits_mask(t, s, None if mask is None else _as_4d(jnp.asarray(mask, bool)),
                         is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size,
                         offset=s - t if causal_alignment == "bottom_right" else 0,
                         segments=masking.as_segment_ids(segment_ids, b, t, s))
  if visible is not None:
    big = float(jnp.finfo(jnp.float32 if jnp.finfo(compute).bits >= 32 else compute).max)
    logits = jnp.where(visible, logits, jnp.asarray(-0.7 * big, compute))
  lse = jax.nn.logsumexp(logits, axis=-1)                                   # (B, N, T)
  # Not exp(logits − lse): in a fully masked row lse rounds to the mask value itself, which
  # would make every probability 1 instead of 1/S.
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bnts,bsnh->btnh", probs, v, precision=jax.lax.Precision.HIGHEST)
  if query_seq_lengths is not None:
    out = out * (jnp.arange(t)[None, :] < query_seq_lengths[:, None])[:, :, None, None]
  out = jnp.reshape(out, out_shape)
  if return_residual:
    return out, jnp.reshape(jnp.transpose(lse, (0, 2, 1)), out_shape[:-1])
  return out
