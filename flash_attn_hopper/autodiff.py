"""Autodiff wiring of the kernel attention: a `jax.custom_vjp` over the kernels.

Residuals are (q, k, v, out, lse). The backward kernels (dQ, dK/dV) pass their tests in the
Mosaic GPU interpreter but have not yet been validated on a Hopper GPU, so on the GPU the
backward rule still raises NotImplementedError: `jax.grad` through the kernel never returns a
gradient that was not checked there.
"""

from __future__ import annotations

import functools

import jax

from flash_attn_hopper import config as config_lib
from flash_attn_hopper.kernels import backward as backward_kernel
from flash_attn_hopper.kernels import common
from flash_attn_hopper.kernels import forward as forward_kernel


#: Whether the backward kernels run outside the interpreter. False until they pass the GPU
#: tests (tests/test_backward_gpu.py, which set it for their own run) on an H200.
BACKWARD_ON_GPU = False


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(q, k, v, opts: forward_kernel.ForwardOptions):
  """Kernel attention on canonical inputs; returns (out, lse) as `attention_forward` does."""
  return forward_kernel.attention_forward(q, k, v, opts)


def _attention_fwd(q, k, v, opts):
  # Through `attention` itself, so that differentiating the residuals (a second derivative)
  # meets this custom rule, and then `_backward`'s clear error, not the kernel's lowering.
  out, lse = attention(q, k, v, opts)
  return (out, lse), (q, k, v, out, lse)


def _attention_bwd(opts, residuals, cotangents):
  if not (opts.interpret or BACKWARD_ON_GPU):
    raise NotImplementedError(
        "flash_attn_hopper: the backward kernels have not been validated on a Hopper GPU "
        "yet, so gradients through implementation='flash_attn_hopper' are unavailable. Use "
        "implementation='xla' or 'cudnn' to differentiate.")
  q, k, v, out, lse = residuals
  dout, _ = cotangents  # The LSE is returned with stop-gradient semantics (as in jax.nn).
  bwd_opts = common.BackwardOptions(scale=opts.scale, is_causal=opts.is_causal,
                                    config=config_lib.BackwardConfig(),
                                    interpret=opts.interpret,
                                    seq_kv=opts.seq_kv)
  return _backward(q, k, v, out, lse, dout, bwd_opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _backward(q, k, v, out, lse, dout, opts):
  """The backward kernels, as a function that refuses to be differentiated again."""
  return backward_kernel.attention_backward(q, k, v, out, lse, dout, opts)


def _backward_fwd(q, k, v, out, lse, dout, opts):
  return _backward(q, k, v, out, lse, dout, opts), None


def _backward_bwd(opts, residuals, cotangents):
  del opts, residuals, cotangents
  raise NotImplementedError(
      "flash_attn_hopper: second derivatives through the attention kernels are not "
      "supported; use implementation='xla' for higher-order derivatives.")


_backward.defvjp(_backward_fwd, _backward_bwd)


attention.defvjp(_attention_fwd, _attention_bwd)
