"""The backward pass in plain JAX, one KV block at a time: for head dims the kernels lack.

It was the backward of head dim 256 until `kernels/dkv_split.py` (the D 64/128 dK/dV
kernel's two float32 accumulators need 256 registers a thread there, over the 240 a compute
warpgroup has); today every supported head dim has kernels, and `autodiff` sends here only
head dims outside `autodiff.KERNEL_BACKWARD_HEAD_DIMS` (none). This is FlashAttention's
backward written with XLA ops: a `lax.scan` over KV blocks recomputes P from the forward's
LSE, so memory stays O(T · block_kv) and no T×S tensor is built. Matmul operands are the
inputs' 16-bit dtype with float32 accumulation, as in the kernels:

    per KV block j:
      S = Q Kⱼᵀ · scale, masked        P = exp(S − LSE)
      dVⱼ = Pᵀ dO                      dP = dO Vⱼᵀ
      dS = P ∘ (dP − δ)                dQ += dS Kⱼ · scale,  dKⱼ = dSᵀ Q · scale

GQA sums dK and dV over each query-head group inside the einsums. Segment ids (packed
sequences) add one condition to the mask: the key ids travel through the scan with the keys.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from flash_attn_hopper import masking
from flash_attn_hopper import softmax

#: Keys per scan step: large enough to keep the tensor cores busy, small enough that the
#: (B, N, T, block) float32 temporaries stay a small multiple of the inputs.
BLOCK_KV = 256


def _segment_blocks(segment_ids: masking.SegmentIds | None, num_blocks: int, block_kv: int):
  """(q ids broadcast against (B, K, G, T, block) logits, kv ids (blocks, B, block)), or Nones.
  The kv ids are edge-padded to whole blocks (the padded keys are masked by the key limit)."""
  if segment_ids is None:
    return None, None
  b, s = segment_ids.kv.shape
  kv_ids = jnp.pad(segment_ids.kv, ((0, 0), (0, num_blocks * block_kv - s)), mode="edge")
  kv_ids = jnp.moveaxis(kv_ids.reshape(b, num_blocks, block_kv), 1, 0)
  return segment_ids.q[:, None, None, :, None], kv_ids


def _bias_blocks(bias, kv_heads: int, group: int, num_blocks: int, block_kv: int):
  """A (B|1, N|1, T, S) bias as (blocks, B|1, K|1, G|1, T, block), like the logits, or None."""
  if bias is None:
    return None
  bb, nb, t, s = bias.shape
  heads = (kv_heads, group) if nb > 1 else (1, 1)
  blocks = jnp.pad(bias, ((0, 0), (0, 0), (0, 0), (0, num_blocks * block_kv - s))).reshape(
      bb, *heads, t, num_blocks, block_kv)
  return jnp.moveaxis(blocks, 4, 0)


def attention_backward(q, k, v, out, lse, dout, *, scale: float, mask: masking.MaskSpec,
                       seq_kv: int | None = None, kv_lens=None,
                       segment_ids: masking.SegmentIds | None = None,
                       soft_cap: float | None = None, bias=None, block_kv: int = BLOCK_KV,
                       grad_dtype=None):
  """Gradients of attention with respect to q, k and v, from the forward's residuals.

  Args:
    q, out, dout: (B, T, N, D); k, v: (B, S, K, D) with N % K == 0.
    lse: (B, N, ≥T) float32, natural log (the forward kernel's LSE; entries past T unused).
    scale: the logits' scale. mask: the visible band (causal, window, alignment).
    seq_kv: keys at or past it are masked (K/V were padded); None: all keys count.
    kv_lens: None, or (B,) int32 keys per batch element (`key_value_seq_lengths`).
    segment_ids: None, or `masking.SegmentIds` with q (B, T) and kv (B, S) int32 (as padded
      like q and k): query i sees key j only if their ids are equal.
    soft_cap: None, or the logits soft-cap (`softmax.Logits`): P comes from the capped
      logits and dS carries the cap's derivative.
    bias: None, or an additive bias of the scaled logits, (B|1, N|1, T, S) (−inf masks).
    grad_dtype: the dtype of dq, dk and dv (None: their inputs'); float32 for callers that
      add several partial gradients (`ring`).

  Returns:
    (dq, dk, dv), shaped and typed like (q, k, v); with a bias, also dbias, the logits'
    gradient dS summed over the bias's broadcast dimensions, shaped and typed like it.
  """
  b, t, n, d = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  group = n // kv_heads
  seq_kv = s if seq_kv is None else seq_kv
  num_blocks = -(-s // block_kv)
  pad = num_blocks * block_kv - s
  # Queries grouped by their KV head: (B, T, K, G, D).
  grouped = lambda x: x.reshape(b, t, kv_heads, group, d)
  qg, dog = grouped(q), grouped(dout)
  lse = lse[..., :t].reshape(b, kv_heads, group, t)
  # A query that sees nothing (LSE −inf) gets P = 0, not exp(−inf + inf) = NaN, where a bias
  # of −inf masks its keys.
  lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
  delta = jnp.einsum("btnd,btnd->bnt", dout, out, preferred_element_type=jnp.float32)
  delta = delta.reshape(b, kv_heads, group, t)
  blocks = lambda x: jnp.moveaxis(
      jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, num_blocks, block_kv,
                                                             kv_heads, d), 1, 0)
  # Keys per batch element, broadcast against (B, K, G, T, block) logits.
  limit = seq_kv if kv_lens is None else jnp.minimum(kv_lens, seq_kv)[:, None, None, None,
                                                                       None]
  rows = lax.broadcasted_iota(jnp.int32, (t, block_kv), 0)
  cols = lax.broadcasted_iota(jnp.int32, (t, block_kv), 1)
  q_ids, kv_ids = _segment_blocks(segment_ids, num_blocks, block_kv)
  bias_blocks = _bias_blocks(bias, kv_heads, group, num_blocks, block_kv)

  def step(dq, xs):
    j, kj, vj, ids_j, bias_j = xs
    keys = j * block_kv + cols
    visible = keys < limit
    band = mask.visible(rows, keys)
    if band is not None:
      visible = visible & band
    if ids_j is not None:
      visible = visible & (q_ids == ids_j[:, None, None, None, :])
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, kj, preferred_element_type=jnp.float32)
    x, cap_grad = softmax.Logits(scale, soft_cap).transform(
        logits, None if bias_j is None else bias_j.astype(jnp.float32))
    p = jnp.where(visible, jnp.exp(x * (1.0 if soft_cap else scale) - lse[..., None]), 0.0)
    dv = jnp.einsum("bkgts,btkgd->bskd", p.astype(q.dtype), dog,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("btkgd,bskd->bkgts", dog, vj, preferred_element_type=jnp.float32)
    ds32 = p * (dp - delta[..., None])
    ds32 = ds32 if cap_grad is None else ds32 * cap_grad
    ds = ds32.astype(q.dtype)
    dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, kj, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg, preferred_element_type=jnp.float32)
    dbias = None
    if bias_j is not None:  # Summed over what the bias broadcasts.
      axes = tuple(i for i, n in enumerate(bias_j.shape[:3]) if n == 1 and ds32.shape[i] > 1)
      dbias = jnp.sum(ds32, axis=axes, keepdims=True).astype(bias_j.dtype)
    return dq, (dk, dv, dbias)

  dq0 = jnp.zeros((b, t, kv_heads, group, d), jnp.float32)
  dq, (dk, dv, dbias) = lax.scan(step, dq0, (jnp.arange(num_blocks), blocks(k), blocks(v),
                                              kv_ids, bias_blocks))
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, num_blocks * block_kv, kv_heads, d)[:, :s]
  grads = ((dq * scale).reshape(q.shape).astype(grad_dtype or q.dtype),
           (unblock(dk) * scale).astype(grad_dtype or k.dtype),
           unblock(dv).astype(grad_dtype or v.dtype))
  if bias is None:
    return grads
  dbias = jnp.moveaxis(dbias, 0, 4).reshape(bias.shape[0], bias.shape[1], t,
                                            num_blocks * block_kv)
  return (*grads, dbias[..., :s])
