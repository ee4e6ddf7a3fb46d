"""The three timed passes, built from a peer's forward function.

- fwd: `jit(f)(q, k, v)`.
- bwd: the backward alone. The forward and its residuals are computed once, outside the timed
  region, by `jax.vjp` of the jitted forward; what is timed is a jit of the vjp function applied
  to a random cotangent, so only the backward's kernels run.
- fwdbwd: `jit` of forward + vjp with the same cotangent, returning the output and the three
  gradients (what a training step runs).

Each builder returns a `Prepared`: the jitted function, its arguments, and a way to name the
result's arrays for the numerics check ("out", "dq", "dk", "dv").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

GRAD_NAMES = ("dq", "dk", "dv")
# Backward cost relative to the forward, FlashAttention's convention.
FLOP_MULTIPLIER = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


@dataclasses.dataclass
class Prepared:
  """A pass ready to run: `fn(*args)` is what gets timed."""

  fn: Callable
  args: tuple
  name_outputs: Callable[[Any], dict[str, jax.Array]]

  def run(self):
    """Runs once (compiling on first use) and waits for the result."""
    return jax.block_until_ready(self.fn(*self.args))


def _apply_vjp(vjp_fn, cotangent):
  return vjp_fn(cotangent)


def _forward_backward(forward, q, k, v, cotangent):
  out, vjp_fn = jax.vjp(forward, q, k, v)
  return out, vjp_fn(cotangent)


def _grads(result) -> dict[str, jax.Array]:
  return dict(zip(GRAD_NAMES, result))


def _out_and_grads(result) -> dict[str, jax.Array]:
  out, grads = result
  return {"out": out, **_grads(grads)}


def prepare(pass_name: str, forward: Callable, q, k, v, cotangent) -> Prepared:
  """Builds the timed function of `pass_name` for `forward(q, k, v) -> out`."""
  if pass_name == "fwd":
    return Prepared(jax.jit(forward), (q, k, v), lambda out: {"out": out})
  if pass_name == "bwd":
    _, vjp_fn = jax.vjp(jax.jit(forward), q, k, v)  # Residuals: outside the timed region.
    return Prepared(jax.jit(_apply_vjp), (vjp_fn, cotangent), _grads)
  if pass_name == "fwdbwd":
    return Prepared(jax.jit(functools.partial(_forward_backward, forward)),
                    (q, k, v, cotangent), _out_and_grads)
  raise ValueError(f"unknown pass {pass_name!r}")


def needs_grads(pass_name: str) -> bool:
  return pass_name != "fwd"
