"""Autodiff wiring of the kernel attention: a `jax.custom_vjp` over the kernels.

Residuals are (q, k, v, out, lse). The backward runs in the Pallas kernels (δ preprocess, dQ,
dK/dV; at D 256 dQ on 32-key blocks and the split dK/dV kernel). A bias's own gradient
is the dQ kernel's dS, summed over the bias's broadcast dimensions, written only when the bias
is differentiated (the custom VJP's symbolic zeros say whether it is: a constant bias, such as
ALiBi's, costs no dS). `blockwise` (FlashAttention's backward in XLA ops, O(T) extra memory
like the kernels) is the backward of head dims without kernels (none today).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import custom_derivatives

from flash_attn_hopper import blockwise
from flash_attn_hopper import config as config_lib
from flash_attn_hopper.kernels import backward as backward_kernel
from flash_attn_hopper.kernels import common
from flash_attn_hopper.kernels import forward as forward_kernel


#: Head dims whose gradients come from the Pallas backward kernels; the others go through
#: `blockwise`. The kernels passed tests/test_backward_gpu.py (fp16/bf16, GQA/MHA/MQA, causal
#: and not, T and S from 113 to 4096) on an H200 with jax 0.11.2: D 64 and 128 on 2026-11-29,
#: D 256 (and its masks) on 2026-11-30.
KERNEL_BACKWARD_HEAD_DIMS = (64, 128, 256)


def backward_in_kernels(head_dim: int) -> bool:
  """Whether the backward kernels (not `blockwise`) compute the gradients: every option runs
  in them, so only the head dim decides."""
  return head_dim in KERNEL_BACKWARD_HEAD_DIMS


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def attention(q, k, v, kv_lens, segment_ids, bias, opts: forward_kernel.ForwardOptions,
              bwd_config: config_lib.BackwardConfig | None = None,
              deterministic: bool = True):
  """Kernel attention on canonical inputs; returns (out, lse) as `attention_forward` does.

  `bwd_config` sets the backward kernels' blocks (None: the tuned ones; without
  `deterministic`, the five-matmul backward's where they measured faster, whose dQ may
  differ in its last bits from run to run: `config.resolve_backward_config`).

  `kv_lens` is None, or (B,) int32 keys per batch element when `opts.kv_lens`;
  `segment_ids` is None, or `masking.SegmentIds` padded like q and k when `opts.segments`.
  Neither has a gradient. `bias` is None, or (B|1, N|1, T, S) padded like q and k when
  `opts.bias`; with `opts.bias_grad`, it gets a gradient, shaped and typed like it, when it
  is differentiated."""
  return forward_kernel.attention_forward(q, k, v, opts, kv_lens, segment_ids, bias)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Differentiated:
  """A residual with no arrays: whether the bias is differentiated (static in the backward)."""
  bias: bool


def _attention_fwd(q, k, v, kv_lens, segment_ids, bias, opts, bwd_config, deterministic):
  # With symbolic zeros each input leaf comes as a CustomVJPPrimal, whose `perturbed` says
  # whether it is differentiated.
  wanted = _Differentiated(bias=bias is not None and bias.perturbed)
  q, k, v, kv_lens, segment_ids, bias = custom_derivatives.custom_vjp_primal_tree_values(
      (q, k, v, kv_lens, segment_ids, bias))
  # Through `attention` itself, so that differentiating the residuals (a second derivative)
  # meets this custom rule, and then `_backward`'s clear error, not the kernel's lowering.
  out, lse = attention(q, k, v, kv_lens, segment_ids, bias, opts, bwd_config, deterministic)
  return (out, lse), (q, k, v, (kv_lens, segment_ids, bias), out, lse, wanted)


def _attention_bwd(opts, bwd_config, deterministic, residuals, cotangents):
  q, k, v, masks, out, lse, wanted = residuals
  opts = dataclasses.replace(opts, bias_grad=opts.bias_grad and wanted.bias)
  dout, _ = cotangents  # The LSE is returned with stop-gradient semantics (as in jax.nn).
  if isinstance(dout, custom_derivatives.SymbolicZero):  # Only the LSE was differentiated.
    dout = jnp.zeros(dout.shape, dout.dtype)
  if not backward_in_kernels(q.shape[-1]):
    dq, dk, dv, *dbias = _blockwise_backward(q, k, v, out, lse, dout, masks, opts)
  else:
    bwd_opts = common.BackwardOptions(scale=opts.scale, mask=opts.mask,
                                      config=config_lib.resolve_backward_config(
                                          q.shape[-1], q.dtype, opts.is_causal, bwd_config,
                                          opts.segments, opts.bias_bytes(q.dtype),
                                          seq_len=q.shape[1], bias_grad=opts.bias_grad,
                                          deterministic=deterministic),
                                      interpret=opts.interpret, seq_kv=opts.seq_kv,
                                      kv_lens=opts.kv_lens, segments=opts.segments,
                                      soft_cap=opts.soft_cap, bias=opts.bias,
                                      bias_grad=opts.bias_grad, bias_is_mask=opts.bias_is_mask,
                                      max_ctas=opts.max_ctas)
    dq, dk, dv, *dbias = _backward(q, k, v, out, lse, dout, masks, bwd_opts)
  return dq, dk, dv, None, None, (dbias[0] if dbias and opts.bias_grad else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _blockwise_backward(q, k, v, out, lse, dout, masks, opts):
  """`blockwise.attention_backward` (dq, dk, dv and dbias, None without a bias), also
  refusing to be differentiated again. `masks` is (kv_lens, segment_ids, bias)."""
  kv_lens, segment_ids, bias = masks
  if opts.bias_is_mask:  # blockwise adds a bias: the mask's 0/1 bytes as 0 / −inf.
    bias = jnp.where(bias != 0, 0.0, -jnp.inf).astype(q.dtype)
  return blockwise.attention_backward(q, k, v, out, lse, dout, scale=opts.scale,
                                      mask=opts.mask, seq_kv=opts.seq_kv, kv_lens=kv_lens,
                                      segment_ids=segment_ids, soft_cap=opts.soft_cap,
                                      bias=bias)


def _blockwise_backward_fwd(q, k, v, out, lse, dout, masks, opts):
  return _blockwise_backward(q, k, v, out, lse, dout, masks, opts), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _backward(q, k, v, out, lse, dout, masks, opts):
  """The backward kernels, as a function that refuses to be differentiated again: (dq, dk,
  dv, dbias or None). `masks` is (kv_lens, segment_ids, bias)."""
  return backward_kernel.attention_backward(q, k, v, out, lse, dout, opts, *masks)


def _backward_fwd(q, k, v, out, lse, dout, masks, opts):
  return _backward(q, k, v, out, lse, dout, masks, opts), None


def _backward_bwd(opts, residuals, cotangents):
  del opts, residuals, cotangents
  raise NotImplementedError(
      "flash_attn_hopper: second derivatives through the attention kernels are not "
      "supported; use implementation='xla' for higher-order derivatives.")


_backward.defvjp(_backward_fwd, _backward_bwd)
_blockwise_backward.defvjp(_blockwise_backward_fwd, _backward_bwd)


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
