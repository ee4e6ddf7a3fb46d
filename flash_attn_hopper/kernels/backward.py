"""The backward pass: a preprocess for δ, then the dQ and the dK/dV kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flash_attn_hopper import config as config_lib
from flash_attn_hopper import pipeline
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
    bias: (B|1, N|1, T, S) padded like q and k (−inf masks), given exactly when `opts.bias`;
      its own gradient is not computed here (see `autodiff`).

  Returns:
    (dq, dk, dv), shaped and typed like (q, k, v). dK and dV are summed over each GQA group
    inside the kernel, in a fixed order: two runs give bitwise-equal results.
  """
  t, t_tiles = q.shape[1], lse.shape[-1]
  # δ = rowsum(dO ∘ O), float32, padded with zeros so padded rows contribute nothing.
  delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, t_tiles - t)))
  lse_log2 = lse * softmax.LOG2E
  if opts.config.fused_dq:
    return _fused_backward(q, k, v, dout, lse_log2, delta, opts, kv_lens, segment_ids, bias)
  dq = dq_kernel.dq(q, k, v, dout, lse_log2, delta, opts, kv_lens, segment_ids, bias)
  # dK/dV after dQ, never beside it: on the GPU the two launch in order on one stream anyway,
  # and the CPU interpreter deadlocks when XLA runs two interpreted kernels at once.
  q, dq = lax.optimization_barrier((q, dq))
  # Wide heads: one key block per CTA, the warpgroups split by role (dV, dK).
  dkv = dkv_split.dkv if q.shape[-1] >= config_lib.SPLIT_DKV_HEAD_DIM else dkv_kernel.dkv
  dk, dv = dkv(q, k, v, dout, lse_log2, delta, opts, kv_lens, segment_ids, bias)
  return dq, dk, dv


def _fused_backward(q, k, v, dout, lse_log2, delta, opts: common.BackwardOptions, kv_lens,
                    segment_ids, bias):
  """`BackwardConfig.fused_dq`: the dK/dV kernel alone, which also accumulates dQ (in float32,
  in a fixed order; `kernels/fused_dq.py`), then dQ's scale and cast in XLA."""
  d = q.shape[-1]
  for feature, present in (("segment_ids", segment_ids is not None),
                           ("a bias or mask", bias is not None)):
    if present:
      raise NotImplementedError(
          f"BackwardConfig(fused_dq=True) does not support {feature} yet (they narrow a key "
          f"tile's query blocks by data, which breaks the order of the dQ adds); use "
          f"fused_dq=False")
  if d not in config_lib.FUSED_DQ_HEAD_DIMS:
    raise NotImplementedError(f"BackwardConfig(fused_dq=True) supports head dims "
                              f"{config_lib.FUSED_DQ_HEAD_DIMS}, got {d}; use fused_dq=False")
  lens = (kv_lens,) if kv_lens is not None else ()
  dk, dv, acc = _one_call_per_instance(
      lambda *args: dkv_kernel.dkv(*args[:6], opts, *args[6:]))(
          q, k, v, dout, lse_log2, delta, *lens)
  cfg = opts.config
  keys = pipeline.NUM_COMPUTE_WARPGROUPS * cfg.block_kv
  visited = fused_dq.visited_blocks(
      opts.mask, num_tiles=-(-k.shape[1] // keys), keys=keys, seq_q=q.shape[1],
      seq_kv=k.shape[1] if opts.seq_kv is None else opts.seq_kv, block_q=cfg.block_q,
      kv_lens=kv_lens if opts.kv_lens else None, batch=q.shape[0])
  dq = fused_dq.finalize(acc, visited, seq_q=q.shape[1], scale=opts.scale, dtype=q.dtype)
  return dq, dk, dv


def _one_call_per_instance(f):
  """`f` (arrays in, a tuple of arrays out), which under `jax.vmap` runs once per instance
  (`lax.map`) instead of as one batched kernel: the fused dQ's semaphores are indexed by
  (batch, head, query block), not by a vmapped axis, so two instances in one launch would
  share them and break each other's order (a later tile could add before the first one
  stores)."""
  g = jax.custom_batching.custom_vmap(f)

  @g.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched)]
    out = lax.map(lambda xs: f(*xs), args)
    return out, jax.tree.map(lambda _: True, out)

  return g
