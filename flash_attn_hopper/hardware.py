"""Hopper (sm90) constants, each named once with its reason, and what the device reports."""

import functools

import jax

#: Threads in a warpgroup: four warps, the unit that issues one wgmma.
WARPGROUP_THREADS = 128

#: Rows of one wgmma instruction (M). A warpgroup's Q tile is a multiple of it.
WGMMA_ROWS = 64

#: 32-bit registers in one SM's register file; one CTA per SM gets all of them.
REGISTERS_PER_SM = 64 * 1024

#: Dynamic shared memory one CTA may use on sm90 (227 KiB, the opt-in maximum).
SMEM_BYTES_PER_CTA = 227 * 1024

#: Shared memory the configs' estimates leave free for what Mosaic GPU adds to the tiles. Its
#: barriers and alignment take 600–1,200 bytes since the kernels ask for no reduction scratch
#: (`kernels.common.REDUCTION_SCRATCH_BYTES`; tests/test_lowering.py checks it); the rest is
#: headroom that the tuned tables were measured under (a tighter budget would admit, e.g.,
#: O's own tiles beside D 64's three-stage ring: `scripts/ab_configs.py`'s `,x`).
SMEM_RESERVED_BYTES = 8 * 1024

#: Bytes per swizzle row of the 128-byte TMA/wgmma swizzle, the widest one: it makes every
#: shared-memory row read by wgmma conflict-free.
SWIZZLE_BYTES = 128

#: Dimensions a TMA copy may stride over (cuTensorMapEncodeTiled's limit). The swizzled
#: shared-memory tiling adds two to a copy's own, so a tiled copy has at most three.
TMA_MAX_DIMS = 5

#: Compute capability of the chips the kernels are written for (H100, H200, H800, H20).
HOPPER_COMPUTE_CAPABILITY = "9.0"

#: SMs of an H100/H200 SXM, for when the device does not report its count.
DEFAULT_NUM_SMS = 132


@functools.cache
def num_sms() -> int:
  """Streaming multiprocessors of the default device: the persistent kernels' CTA count."""
  return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_NUM_SMS)


@functools.cache
def on_hopper() -> bool:
  """Whether the default JAX device is an sm90 (Hopper) GPU."""
  device = jax.devices()[0]
  return (device.platform == "gpu"
          and getattr(device, "compute_capability", None) == HOPPER_COMPUTE_CAPABILITY)
