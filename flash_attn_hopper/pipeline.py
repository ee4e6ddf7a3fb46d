"""Warp specialization and the K/V shared-memory pipeline of the attention kernels.

A CTA runs three warpgroups (FA3's shape)::

    warpgroup 0, 1  compute   Q tile of block_q rows each: S = QKᵀ, softmax, O += PV
    warpgroup 2     producer  TMA loads of K and V blocks into a ring of `num_stages` slots

    producer:  wait consumed[slot] ─► TMA K,V ─► arrives ready[slot] (transaction count)
    compute:   wait ready[slot]    ─► wgmma  ─► arrive consumed[slot] (one per compute warpgroup)

The register file is rebalanced with `setmaxnreg`: the producer keeps few registers and the
compute warpgroups take the rest, which the accumulators need.
"""

from __future__ import annotations

import dataclasses

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from flash_attn_hopper import hardware

#: Compute warpgroups per CTA. Two let one warpgroup's softmax hide under the other's matmuls.
NUM_COMPUTE_WARPGROUPS = 2
#: The TMA producer is the warpgroup after the compute ones.
PRODUCER_WARPGROUP = NUM_COMPUTE_WARPGROUPS
NUM_WARPGROUPS = NUM_COMPUTE_WARPGROUPS + 1

#: Registers per thread after rebalancing. The producer only issues copies: 40 is setmaxnreg's
#: practical floor that still holds its loop state. The compute warpgroups take what is left
#: of the 64K-register file, rounded down to setmaxnreg's granularity of 8:
#: 2·128·232 + 128·40 = 64,512 ≤ 65,536.
PRODUCER_REGISTERS = 40
COMPUTE_REGISTERS = 232
assert (NUM_COMPUTE_WARPGROUPS * COMPUTE_REGISTERS + PRODUCER_REGISTERS) * \
    hardware.WARPGROUP_THREADS <= hardware.REGISTERS_PER_SM


@dataclasses.dataclass(frozen=True)
class Barriers:
  """The forward kernel's barriers, by purpose.

  Attributes:
    q_ready: one per compute warpgroup; its Q tile landed in shared memory.
    k_ready, v_ready: one per stage; the K (V) block of that slot landed.
    k_consumed, v_consumed: one per stage; both compute warpgroups are done reading the slot,
      so the producer may overwrite it.
    schedule: orders the two compute warpgroups' tensor-core work (FA3's ping-pong): each
      warpgroup passes it once after issuing QKᵀ and once after its softmax, and warpgroup 1
      starts one phase behind, so one warpgroup's softmax overlaps the other's matmuls.
  """

  q_ready: object
  k_ready: object
  v_ready: object
  k_consumed: object
  v_consumed: object
  schedule: object

  @staticmethod
  def types(num_stages: int) -> tuple:
    """The scratch types that `pl.run_scoped` allocates, in the order of the fields."""
    per_wg = NUM_COMPUTE_WARPGROUPS
    return (
        plgpu.Barrier(num_barriers=per_wg),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=per_wg, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=per_wg, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=per_wg),
    )

  def sync_schedule(self):
    """Both compute warpgroups pass the schedule barrier (see the class docstring)."""
    plgpu.barrier_arrive(self.schedule)
    plgpu.barrier_wait(self.schedule)


def slot_of(step, num_stages: int):
  """The ring slot that holds KV step `step`."""
  return step % num_stages


def produce_kv(k_src, v_src, k_smem, v_smem, barriers: Barriers, first_step, num_steps,
               num_stages: int, block_kv: int):
  """The producer's part of one tile: streams `num_steps` K/V blocks through the ring.

  `first_step` counts the blocks streamed before this tile (the ring continues across the
  tiles of a persistent CTA). `k_src(rows)` / `v_src(rows)` give the global-memory view of the
  rows `pl.ds` selects; rows past the sequence end are zero-filled by TMA.
  """
  @pl.loop(0, num_steps)
  def _load(step):
    ring_step = first_step + step
    slot = slot_of(ring_step, num_stages)
    # The loop index keeps the row offset traced, so a slice past S is TMA's to fill, not a
    # static indexing error.
    rows = pl.ds(step * block_kv, block_kv)
    refill = ring_step >= num_stages  # The first pass over the ring has nothing to wait for.
    # K first: the consumers need K before V.
    pl.when(refill)(lambda: plgpu.barrier_wait(barriers.k_consumed.at[slot]))
    plgpu.copy_gmem_to_smem(k_src(rows), k_smem.at[slot], barriers.k_ready.at[slot])
    pl.when(refill)(lambda: plgpu.barrier_wait(barriers.v_consumed.at[slot]))
    plgpu.copy_gmem_to_smem(v_src(rows), v_smem.at[slot], barriers.v_ready.at[slot])


def drain(barriers: Barriers, total_steps, num_stages: int):
  """Waits for the last use of every slot, so that no phase of a consumed barrier goes
  unobserved and no read of the ring is in flight when the CTA exits."""
  @pl.loop(jnp.maximum(total_steps - num_stages, 0), total_steps)
  def _drain(step):
    slot = slot_of(step, num_stages)
    plgpu.barrier_wait(barriers.k_consumed.at[slot])
    plgpu.barrier_wait(barriers.v_consumed.at[slot])
