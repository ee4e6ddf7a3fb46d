"""Online softmax in base 2: a small state with named operations.

The scale is folded into the exponent: with c = scale·log2(e), a logit s contributes
2^(c·s − m), where m is the running row maximum of c·s. The state lives in registers in the
row-statistics layout `plgpu.Layout.WGMMA.reduce(1)`, next to logits in `Layout.WGMMA`.

    init()            m = −inf, l = 0
    update(state, s)  m' = max(m, c·rowmax(s)); α = 2^(m − m'); p = 2^(c·s − m'); l' = α·l
    add_row_sum(state, p)  l' += Σp (separate, so that a kernel can place it around barriers)
    finalize(state, acc)  O = acc / l and LSE = ln(2)·(m + log2 l)

`finalize` is the one place that decides what a fully masked row returns: output 0, LSE −inf.

A logits soft-cap (Gemma 2's cap·tanh(x / cap) of the scaled logits x) is applied to the logit
block before anything else (`cap_logits`); the exponent's factor is then log2(e) alone
(`exp2_scale`), and the backward multiplies dS by the cap's derivative 1 − tanh².

The backward recomputes P from the saved LSE instead of keeping it (`recompute`), and turns dP
into the logits' gradient (`logits_grad`): dS = P ∘ (dP − δ), δ = rowsum(dO ∘ O).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)


class SoftmaxState(NamedTuple):
  m: jax.Array  # (rows,) float32: running max of scale·log2(e)·s
  l: jax.Array  # (rows,) float32: running sum of 2^(scale·log2(e)·s − m)


def init(rows: int) -> SoftmaxState:
  full = lambda v: plgpu.layout_cast(jnp.full((rows,), v, jnp.float32), ROW_LAYOUT)
  return SoftmaxState(m=full(-jnp.inf), l=full(0.0))


class Logits(NamedTuple):
  """How a kernel turns raw logits s = q·k into the softmax's input.

  Without a cap the scale is folded into the base-2 exponent; with one, the capped, scaled
  logits cap·tanh(scale·s / cap) go in with log2(e) alone."""
  scale: float
  soft_cap: float | None = None

  @property
  def exp2_scale(self) -> float:
    """The factor c of 2^(c·x − m) for the logits `transform` returns."""
    return LOG2E if self.soft_cap else self.scale * LOG2E

  def transform(self, s, bias=None):
    """(the logits the softmax sees, the cap's derivative 1 − tanh² or None), from raw
    logits and an optional additive bias of the scaled logits (−inf: masked, also past the
    cap)."""
    if not self.soft_cap:
      return (s if bias is None else s + bias * (1.0 / self.scale)), None
    x = s * self.scale if bias is None else s * self.scale + bias
    t = _tanh(x * (1.0 / self.soft_cap))
    capped = t * self.soft_cap
    if bias is not None:
      capped = jnp.where(bias == -jnp.inf, -jnp.inf, capped)
    return capped, 1.0 - t * t


def _tanh(x):
  """tanh from exp2: the kernels compile with approximate math, and tanh.approx.f32 (about
  2⁻¹¹ relative error) would cost a soft-capped fp16 kernel more than the fp16 inputs do;
  ex2.approx is accurate to about 2⁻²². Saturates to ±1 without NaN for large |x|."""
  return 1.0 - 2.0 / (jnp.exp2(x * (2.0 * LOG2E)) + 1.0)


def _rows(x, shape):
  return jax.lax.broadcast_in_dim(x, shape, [0])


def update(state: SoftmaxState, s, exp2_scale: float):
  """One KV block: returns the new state, the unnormalized probabilities p and the factor
  α by which the output accumulator must be rescaled. The state's l still lacks Σp: pass it
  and p to `add_row_sum`."""
  m_new = jnp.maximum(state.m, s.max(axis=1) * exp2_scale)
  # A row whose logits are all masked so far has m_new = −inf; subtracting 0 instead keeps
  # p = 2^(−inf) = 0 and α = 0 rather than NaN.
  m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(state.m - m_sub)
  p = jnp.exp2(s * exp2_scale - _rows(m_sub, s.shape))
  return SoftmaxState(m=m_new, l=state.l * alpha), p, alpha


def add_row_sum(state: SoftmaxState, p) -> SoftmaxState:
  return state._replace(l=state.l + p.sum(axis=1))


def rescale(acc, alpha):
  """acc·α, row by row."""
  return acc * _rows(alpha, acc.shape)


def finalize(state: SoftmaxState, acc):
  """The normalized output and the natural-log LSE. Fully masked rows: 0 and −inf."""
  empty = state.l == 0.0
  inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, state.l))
  out = acc * _rows(inv_l, acc.shape)
  lse = jnp.where(empty, -jnp.inf, (state.m + jnp.log2(jnp.where(empty, 1.0, state.l))) * LN2)
  return out, lse


def _along(x, shape, axis: int):
  """Broadcasts a per-query vector over a logit block whose queries run along `axis`."""
  return jax.lax.broadcast_in_dim(x, shape, [axis])


def recompute(s, lse_log2, exp2_scale: float, query_axis: int = 0):
  """P = 2^(c·s − LSE·log2(e)) for a logit block, from the forward's LSE (in log2 units).

  `query_axis` is 0 for an (queries, keys) block and 1 for the transposed (keys, queries) one.
  A fully masked row (LSE −inf, every logit −inf) gets P = 0, not NaN.
  """
  lse_log2 = jnp.where(lse_log2 == -jnp.inf, 0.0, lse_log2)
  return jnp.exp2(s * exp2_scale - _along(lse_log2, s.shape, query_axis))


def logits_grad(p, dp, delta, query_axis: int = 0, cap_grad=None):
  """dS = P ∘ (dP − δ): the gradient of the (scaled) logits, before the scale; with a soft
  cap, times its derivative `cap_grad` (from `Logits.transform`)."""
  ds = p * (dp - _along(delta, p.shape, query_axis))
  return ds if cap_grad is None else ds * cap_grad
