"""The accumulator layout rule, in one place.

An array that becomes a wgmma accumulator again (`plgpu.ACC.init(x)`, or a store into an ACC
ref) is lowered to Mosaic GPU's `WGMMAAccumulator.from_registers`, which accepts only two
register layouts::

    WGMMA_LAYOUT            the layout wgmma results come back in (16- or 32-bit values)
    WGMMA_LAYOUT_ACC_32BIT  its 32-bit accumulator variant, which from_registers converts to

Anything else fails, and it fails in one of two opaque ways: Pallas's layout inference rejects
the kernel first ("Failed to infer a possible set of layouts"), or, in hand-written Mosaic GPU,
`from_registers` raises "Only WGMMA layouts supported in WGMMAAccumulator".

What was seen on an H200 with jax 0.11.2 (one warpgroup, `pl.run_state(f)(plgpu.ACC.init(x))`):
x in `Layout.WGMMA` works; x cast to `WGMMA_TRANSPOSED` and back to `WGMMA` works; x left in
`WGMMA_TRANSPOSED` or `WG_STRIDED`, or cast to `Layout._WGMMA_ACC_32BIT`, is rejected by layout
inference; a `WG_STRIDED` array cannot be cast back to `WGMMA` at all.

So every accumulator path of every kernel goes through `to_accumulator_layout`; the kernels
re-enter accumulators only through `accumulate.matmul_accumulate` (its pair, the pair around
a fresh product, and `matmul_beside_accumulate`), which call it.
"""

from __future__ import annotations

import contextlib

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa

#: Pallas layouts that cast to `Layout.WGMMA` in registers.
_CASTS_TO_WGMMA = (plgpu.Layout.WGMMA, plgpu.Layout.WGMMA_TRANSPOSED, plgpu.Layout.WG_SPLAT)

#: The messages of the two opaque failures that a wrong accumulator layout produces.
_OPAQUE_MESSAGES = ("Only WGMMA layouts supported in WGMMAAccumulator",
                    "Failed to infer a possible set of layouts")

_FIX = ("Fix: pass the array through flash_attn_hopper.layouts.to_accumulator_layout(x) right "
        "before plgpu.ACC.init(x) or a store into an ACC ref, and keep accumulators in "
        "plgpu.Layout.WGMMA (an array in WGMMA_TRANSPOSED casts back; one in WG_STRIDED does "
        "not: compute on a copy instead of moving the accumulator there).")


class AccumulatorLayoutError(ValueError):
  """An array cannot become a wgmma accumulator in the register layout it is in."""


def _layout_name(layout) -> str:
  base = getattr(layout, "layout_cls", layout)
  return getattr(base, "name", None) or repr(layout)


def _mosaic_target(x: "mgpu.FragmentedArray"):
  bitwidth = mgpu.utils.bitwidth(x.mlir_dtype)
  return fa.WGMMA_LAYOUT_ACC_32BIT if bitwidth == 32 else fa.WGMMA_LAYOUT


def to_accumulator_layout(x, *, layout=None):
  """Returns `x` in the layout that `WGMMAAccumulator.from_registers` accepts.

  Works at both levels:
  - a Mosaic GPU `FragmentedArray` is converted with `to_layout`, to `WGMMA_LAYOUT_ACC_32BIT`
    for 32-bit values and `WGMMA_LAYOUT` for 16-bit ones;
  - a Pallas array is cast to `plgpu.Layout.WGMMA` (which `from_registers` then turns into
    `WGMMA_LAYOUT_ACC_32BIT` for float32).

  Args:
    x: the array about to become an accumulator.
    layout: for a Pallas array, the `plgpu.Layout` the kernel last put it in, if not WGMMA.
      Pallas arrays carry no layout at trace time, so this is how a layout that cannot be cast
      back (`WG_STRIDED`) is caught here, with a clear message, instead of deep in lowering.

  Raises:
    AccumulatorLayoutError: naming the layout found and the fix, when `x` cannot be converted.
  """
  if isinstance(x, fa.FragmentedArray):
    target = _mosaic_target(x)
    if x.layout == target:
      return x
    try:
      return x.to_layout(target)
    except (NotImplementedError, ValueError) as e:
      raise AccumulatorLayoutError(
          f"cannot move a {x.mlir_dtype} accumulator from layout {x.layout} to {target}: {e}. "
          + _FIX) from e
  if layout is not None and getattr(layout, "layout_cls", layout) not in _CASTS_TO_WGMMA:
    raise AccumulatorLayoutError(
        f"an array in plgpu.Layout.{_layout_name(layout)} cannot be cast back to "
        f"plgpu.Layout.WGMMA, so it cannot become a wgmma accumulator. " + _FIX)
  return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


@contextlib.contextmanager
def explain_accumulator_errors():
  """Re-raises the two opaque wrong-accumulator-layout failures with the fix attached.

  Wrap the call (or jit compilation) of a Mosaic GPU kernel in it.
  """
  try:
    yield
  except AccumulatorLayoutError:
    raise
  except Exception as e:  # The lowering raises several exception types.
    if not any(m in str(e) for m in _OPAQUE_MESSAGES):
      raise
    raise AccumulatorLayoutError(
        f"a wgmma accumulator was built from an array in a non-WGMMA register layout "
        f"({type(e).__name__}: {str(e).splitlines()[0]}). " + _FIX) from e
