"""dQ inside the dK/dV kernel, FA3's five-matmul backward (`BackwardConfig.fused_dq`, which
the op's `deterministic=False` takes where it measured faster): no dQ kernel recomputes S
and dP.

Each step of `kernels/dkv.py` (query head h, query block j) leaves both compute warpgroups
with their dSᵀ (block_kv keys × block_q queries). Then::

    warpgroup w:  dSᵀ_w ─► ds_smem[step % 2, w]                  (input dtype)
                  issue dV += Pᵀ dO
    both:         sync (`ds_ready`: both tiles are in shared memory)
    warpgroup w:  issue dQ_w = Σ_i (dSᵀ_i)ᵀ K_i[:, cols_w]        (block_q × 64, float32)
                  issue dK += dSᵀ Q
                  once dQ_w is done (dK still running):
                  dQ_w ─► staging[w] ─► TMA reduce-add into acc[b, rows of j, h, cols_w]

FA3's order (`accumulate.matmul_accumulate_pair_around`): the product's staging hides under
dK. Issued after dK and dV and awaited alone, the same step was up to 4% slower at D 128 4k
(`bench/NOTES.md`).

The accumulator is float32 (B, T_acc, N, D), zeroed by XLA and handed to the kernel as a
ref (`jax.new_ref`), so the kernel adds into it in place. The KV tiles that see a query
block add into it in whatever order their CTAs get there, so dQ's bits may differ from run
to run (float addition does not associate), as in FA3's and cuDNN's default backward; dK
and dV keep their fixed order. Any mask works: no tile needs to know which others add.

Columns (`config.FUSED_DQ_COLUMNS`): at D 128 each warpgroup computes one half of dQ's
columns every step (a whole block_q × D float32 partial would not fit in registers beside
its dK and dV). At D 64 a half would slice K's B operand inside a swizzle row, which wgmma
cannot do: there the warpgroups take turns, warpgroup s % 2 computing step s.

A warpgroup reuses its staging tile one add later, once TMA has read it
(`wait_smem_to_gmem(wait_read_only=True)`, right before the next write, so the read hides
under a whole step). The dSᵀ tiles are double-buffered: a warpgroup writes slot s % 2 at
step s only after both passed step s − 1's sync, so the other is done with step s − 2's.

The adds go through `accumulate.add_to_global`, which in the interpreter (no TMA reductions
in jax 0.11.2) is a read-modify-write.

On the H200 (`bench/NOTES.md`, twelfth session) the dSᵀ stores and the sync cost nothing
measurable and the product about what a matmul costs; materializing the float32 product and
adding it cost the most (about 3 ms of an 11 ms kernel at D 128, 16k), so the five matmuls
beat the seven only at long sequences (`config.TUNED_BACKWARD_FUSED`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from flash_attn_hopper import accumulate
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import pipeline
from flash_attn_hopper.kernels import common


class Buffers(NamedTuple):
  ds_smem: object   # (FUSED_DQ_DS_BUFFERS, compute warpgroups, block_kv, block_q), input dtype
  staging: object   # (compute warpgroups, block_q, FUSED_DQ_COLUMNS) float32, for TMA
  ds_ready: object  # barrier, one arrival per compute warpgroup: both dSᵀ tiles are stored
  acc: object       # (B, T_acc, N, D) float32 in global memory, T_acc = whole query blocks


def accumulator(q, block_q: int):
  """The zeroed float32 accumulator for padded queries `q`, as a ref the kernel adds into."""
  b, t, n, d = q.shape
  return jax.new_ref(jnp.zeros((b, pl.cdiv(t, block_q) * block_q, n, d), jnp.float32))


def finalize(acc, *, seq_q: int, scale: float, dtype):
  """dQ (B, seq_q, N, D) in `dtype` from the accumulator: scaled once, padding dropped."""
  return (acc[:, :seq_q] * scale).astype(dtype)


def smem_types(dims: common.Dims, cfg: config_lib.BackwardConfig) -> tuple:
  """(dSᵀ tiles, dQ staging, the dSᵀ barrier); `BackwardConfig.fused_dq_smem_bytes` counts
  the first two."""
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  return (common.smem_tile((config_lib.FUSED_DQ_DS_BUFFERS, wgs, cfg.block_kv, cfg.block_q),
                           dims.dtype),
          common.smem_tile((wgs, cfg.block_q, config_lib.FUSED_DQ_COLUMNS), jnp.float32),
          plgpu.Barrier(num_arrivals=wgs))


def column_parts(head_dim: int) -> int:
  """dQ's column blocks (one per warpgroup at D 128; one, taken in turns, at D 64)."""
  return head_dim // config_lib.FUSED_DQ_COLUMNS


def store_ds(ds, *, step, wg, buffers: Buffers):
  """Stores this warpgroup's dSᵀ (`ds`, input dtype) for both warpgroups' dQ products, and
  says so; `product` waits for the other's. (Called before dK += dSᵀ Q and dV += Pᵀ dO are
  issued, so the other warpgroup's wait hides under those matmuls.)"""
  buffers.ds_smem.at[step % config_lib.FUSED_DQ_DS_BUFFERS, wg][...] = ds
  plgpu.commit_smem()  # Visible to wgmma (the async proxy).
  plgpu.barrier_arrive(buffers.ds_ready)


def product(*, step, wg, k_smem, buffers: Buffers, dims: common.Dims, cfg):
  """(issue, shape) of this warpgroup's part of the step's dQ, for
  `accumulate.matmul_accumulate_pair_around`: `issue(ref)` waits until both dSᵀ tiles are
  stored, then issues (Σ_i (dSᵀ_i)ᵀ K_i)[:, cols] into `ref` (nothing when it is the other
  warpgroup's turn, at D 64)."""
  part, mine = _part(step, wg, dims.head_dim)
  slot = step % config_lib.FUSED_DQ_DS_BUFFERS

  def issue(acc_ref):
    plgpu.barrier_wait(buffers.ds_ready)
    def wgmmas():
      for i in range(pipeline.NUM_COMPUTE_WARPGROUPS):  # Over the CTA's key blocks.
        plgpu.wgmma(acc_ref, buffers.ds_smem.at[slot, i].T, k_smem.at[i, :, _columns(part)])
    _when(mine, wgmmas)
  return issue, (cfg.block_q, config_lib.FUSED_DQ_COLUMNS)


def add_product(dq, *, step, wg, head, q0, batch, buffers: Buffers, dims: common.Dims, opts):
  """Adds this warpgroup's part of the step's dQ (from `product`) into the accumulator's rows
  [q0, q0 + block_q) of query head `head`."""
  part, mine = _part(step, wg, dims.head_dim)
  dst = buffers.acc.at[batch, pl.ds(q0, opts.config.block_q), head, _columns(part)]
  _when(mine, lambda: accumulate.add_to_global(dq, buffers.staging.at[wg], dst,
                                               interpret=opts.interpret))


def _part(step, wg, head_dim: int):
  """(this warpgroup's column block of dQ at `step`, whether it computes one at all)."""
  if column_parts(head_dim) == pipeline.NUM_COMPUTE_WARPGROUPS:
    return wg, True
  return 0, step % pipeline.NUM_COMPUTE_WARPGROUPS == wg  # One part: taken in turns.


def _columns(part):
  width = config_lib.FUSED_DQ_COLUMNS
  start = part * width if isinstance(part, int) else pl.multiple_of(part * width, width)
  return pl.ds(start, width)


def _when(condition, f):
  """f() where `condition` holds (a Python True: always)."""
  if condition is True:
    f()
  else:
    pl.when(condition)(f)


def finish(buffers: Buffers):
  """After the last step: waits until both warpgroups are past their last dQ product, so
  each may overwrite its K tile (the other's products read it) with dK."""
  plgpu.barrier_arrive(buffers.ds_ready)
  plgpu.barrier_wait(buffers.ds_ready)
