"""The backward pass: a preprocess for δ, then the dQ and the dK/dV kernels (with
`BackwardConfig.fused_dq`, the dK/dV kernel alone, which also adds up dQ)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from flash_attn_hopper import config as config_lib
from flash_attn_hopper import softmax
from flash_attn_hopper.kernels import common
from flash_attn_hopper.kernels import dkv as dkv_kernel
from flash_attn_hopper.kernels import dkv_split
from flash_attn_hopper.kernels import dq as dq_kernel
from flash_attn_hopper.kernels import fused_dq


def attention_backward(q, k, v, out, lse, dout, opts: common.BackwardOptions, kv_lens=None,
                       segment_ids=None, bias=None):
  """Gradients of attention with respect to q, k and v.

  Args:
    q, k, v, out: the forward kernel's inputs and output (padded as the api padded them).
    lse: the forward kernel's LSE, (B, N, T_tiles) float32, natural log.
    dout: the output's cotangent, shaped like `out`.
    opts: static options.
    kv_lens: (B,) int32 keys per batch element, given exactly when `opts.kv_lens`.
    segment_ids: `masking.SegmentIds` padded like q and k, given exactly when `opts.segments`.
    bias: (B|1, N|1, T, S) padded like q and k (−inf masks), given exactly when `opts.bias`.

  Returns:
    (dq, dk, dv, dbias), the first three shaped and typed like (q, k, v). dK and dV are summed
    over each GQA group inside the kernel, in a fixed order: two runs give bitwise-equal
    results. So is dQ, except with `opts.config.fused_dq` (its adds come in no fixed
    order). dbias is None unless `opts.bias_grad`: then the dQ kernel's dS, summed (in
    float32) over the dimensions the bias broadcasts, shaped and typed like `bias`.
  """
  t, t_tiles = q.shape[1], lse.shape[-1]
  # δ = rowsum(dO ∘ O), float32, padded with zeros so padded rows contribute nothing.
  delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, t_tiles - t)))
  lse_log2 = lse * softmax.LOG2E
  if opts.config.fused_dq:
    acc = fused_dq.accumulator(q, opts.config.block_q)
    dk, dv = dkv_kernel.dkv(q, k, v, dout, lse_log2, delta, opts, kv_lens, segment_ids, bias,
                            dq_acc=acc)
    dq = fused_dq.finalize(acc[...], seq_q=q.shape[1], scale=opts.scale, dtype=q.dtype)
    return dq, dk, dv, None
  dq_opts = dataclasses.replace(opts, config=opts.config.for_dq())  # its own query rows
  dq = dq_kernel.dq(q, k, v, dout, lse_log2, delta, dq_opts, kv_lens, segment_ids, bias)
  dq, ds = dq if opts.bias_grad else (dq, None)
  # dK/dV after dQ, never beside it: on the GPU the two launch in order on one stream anyway,
  # and the CPU interpreter deadlocks when XLA runs two interpreted kernels at once.
  q, dq = lax.optimization_barrier((q, dq))
  # Wide heads: one key block per CTA, the warpgroups split by role (dV, dK).
  dkv = dkv_split.dkv if q.shape[-1] >= config_lib.SPLIT_DKV_HEAD_DIM else dkv_kernel.dkv
  dk, dv = dkv(q, k, v, dout, lse_log2, delta, opts, kv_lens, segment_ids, bias)
  return dq, dk, dv, None if ds is None else _sum_to(ds, bias)


def _sum_to(ds, bias):
  """dS (B, N, T, S) summed over the dimensions `bias` broadcasts, in its shape and dtype."""
  axes = tuple(i for i in range(2) if bias.shape[i] == 1 and ds.shape[i] > 1)
  if not axes:
    return ds.astype(bias.dtype)
  return ds.astype(jnp.float32).sum(axes, keepdims=True).astype(bias.dtype)
