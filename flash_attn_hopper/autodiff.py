"""Autodiff wiring of the kernel attention: a `jax.custom_vjp` over the forward kernel.

Residuals are (q, k, v, out, lse). The backward kernels are not written yet, so the backward
rule raises NotImplementedError: `jax.grad` through the kernel never returns a wrong gradient.
"""

from __future__ import annotations

import functools

import jax

from flash_attn_hopper.kernels import forward as forward_kernel


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(q, k, v, opts: forward_kernel.ForwardOptions):
  """Kernel attention on canonical inputs; returns (out, lse) as `attention_forward` does."""
  return forward_kernel.attention_forward(q, k, v, opts)


def _attention_fwd(q, k, v, opts):
  out, lse = forward_kernel.attention_forward(q, k, v, opts)
  return (out, lse), (q, k, v, out, lse)


def _attention_bwd(opts, residuals, cotangents):
  del opts, residuals, cotangents
  raise NotImplementedError(
      "flash_attn_hopper: the backward kernels are not implemented yet, so gradients through "
      "implementation='flash_attn_hopper' are unavailable. Use implementation='xla' or "
      "'cudnn' to differentiate.")


attention.defvjp(_attention_fwd, _attention_bwd)
