"""Why the accumulator layout helper exists, shown on the GPU.

A one-warpgroup kernel computes A·B into a wgmma accumulator, moves the result deliberately
into another register layout (WGMMA_TRANSPOSED), and makes it an accumulator again to add a
second A·B. Through `to_accumulator_layout` the result is right (2·A·B); without it, the same
kernel is rejected.
"""

from __future__ import annotations


import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from flash_attn_hopper import layouts

pytestmark = pytest.mark.gpu

M = N = K = 64


def _tile(dtype):
  swizzle = 128
  return plgpu.SMEM((M, K), dtype, transforms=(
      plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(swizzle)))


def _double_matmul(a, b, *, use_helper: bool):
  """Returns A·B + A·B, the second product accumulated onto the moved first one."""

  def body(a_ref, b_ref, out_ref, a_smem, b_smem, out_smem, barrier):
    plgpu.copy_gmem_to_smem(a_ref, a_smem, barrier.at[0])
    plgpu.copy_gmem_to_smem(b_ref, b_smem, barrier.at[1])
    plgpu.barrier_wait(barrier.at[0])
    plgpu.barrier_wait(barrier.at[1])

    def first(acc_ref):
      plgpu.wgmma(acc_ref, a_smem, b_smem)
      return acc_ref[...]
    acc = pl.run_scoped(first, plgpu.ACC((M, N), jnp.float32))
    moved = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
    if use_helper:
      moved = layouts.to_accumulator_layout(moved, layout=plgpu.Layout.WGMMA_TRANSPOSED)
    total = pl.run_state(lambda r: plgpu.wgmma(r, a_smem, b_smem))(plgpu.ACC.init(moved))
    out_smem[...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref)
    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
      scratch_types=(_tile(a.dtype), _tile(b.dtype), plgpu.SMEM((M, N), jnp.float32),
                     plgpu.Barrier(num_barriers=2)))
  return kernel(a, b)


def _inputs(rng):
  make = lambda: jnp.asarray(rng.standard_normal((M, K)), jnp.float16)
  return make(), make()


def test_helper_returns_a_moved_accumulator_to_the_wgmma_layout(rng):
  a, b = _inputs(rng)
  out = np.asarray(_double_matmul(a, b, use_helper=True))
  expected = 2 * np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-2)


def test_without_the_helper_the_same_kernel_is_rejected(rng):
  a, b = _inputs(rng)
  with pytest.raises(Exception, match="Failed to infer a possible set of layouts|"
                                      "Only WGMMA layouts supported"):
    jax.block_until_ready(_double_matmul(a, b, use_helper=False))


def test_helper_names_a_layout_it_cannot_convert(rng):
  a, b = _inputs(rng)

  def body(a_ref, out_ref, a_smem, barrier):
    plgpu.copy_gmem_to_smem(a_ref, a_smem, barrier.at[0])
    plgpu.barrier_wait(barrier.at[0])
    strided = plgpu.load(a_smem, layout=plgpu.Layout.WG_STRIDED((M, K), vec_size=8))
    layouts.to_accumulator_layout(strided.astype(jnp.float32),
                                  layout=plgpu.Layout.WG_STRIDED((M, K), vec_size=8))

  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
                        scratch_types=(plgpu.SMEM((M, K), jnp.float16),
                                       plgpu.Barrier(num_barriers=1)))
  with pytest.raises(layouts.AccumulatorLayoutError, match="WG_STRIDED.*Fix:"):
    kernel(a)
