"""Warp specialization and the K/V shared-memory pipeline of the attention kernels.

A CTA runs three warpgroups (FA3's shape)::

    warpgroup 0, 1  compute   Q tile of block_q rows each: S = QKᵀ, softmax, O += PV
    warpgroup 2     producer  TMA loads of K and V blocks into a ring of `num_stages` slots

    producer:  wait consumed[slot] ─► TMA K,V ─► arrives ready[slot] (transaction count)
    compute:   wait ready[slot]    ─► wgmma  ─► arrive consumed[slot] (one per compute warpgroup)

A slot that the compute warpgroups read with ordinary loads instead (a bias tile, segment ids,
the LSE) is freed through `free_after_loads`: loads and TMA are different memory proxies, and
the fence between them is what keeps the next copy from landing under the loads.

The same ring carries other tensors in the backward kernels: a `Stream` is one of them.

The register file is rebalanced with `setmaxnreg`: the producer keeps few registers and the
compute warpgroups take the rest, which the accumulators need.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jaxlib.mlir.dialects import nvvm

from flash_attn_hopper import hardware

#: Compute warpgroups per CTA. Two let one warpgroup's softmax hide under the other's matmuls.
NUM_COMPUTE_WARPGROUPS = 2
#: The TMA producer is the warpgroup after the compute ones.
PRODUCER_WARPGROUP = NUM_COMPUTE_WARPGROUPS
NUM_WARPGROUPS = NUM_COMPUTE_WARPGROUPS + 1

#: Registers a thread gets at launch: the register file split over the CTA's threads, in
#: setmaxnreg's granularity of 8 (168 for three warpgroups, ptxas's "Used 168 registers").
#: setmaxnreg then moves registers between warpgroups within that pool.
LAUNCH_REGISTERS = (hardware.REGISTERS_PER_SM
                    // (NUM_WARPGROUPS * hardware.WARPGROUP_THREADS) // 8 * 8)

#: Registers per thread after rebalancing (FA3's split). The producer only issues copies and
#: keeps setmaxnreg's minimum, 24; the compute warpgroups take the rest of the launch pool:
#: 2·128·240 + 128·24 = 64,512 = 384·168. Against the earlier 40 / 232, interleaved on the
#: H200 (2026-12-02, bf16, B·T = 16k, hidden 2048, 4k; `scripts/ab_registers.py`,
#: bench/results/h200_registers_ab.log; outputs bitwise equal), fwd+bwd went 0.870 → 0.889
#: (D 128), 0.914 → 0.941 (D 128 causal), 0.946 → 0.970 (D 256) and 0.960 → 0.968 (D 64)
#: times cuDNN, 0.939 → 0.933 at D 64 causal. The dK/dV kernel at D 128 ran 5% faster (its
#: spill stores: 48 → 0 bytes, causal 192 → 156), dQ at D 256 4% (360 → 320).
PRODUCER_REGISTERS = 24
COMPUTE_REGISTERS = 240
assert (NUM_COMPUTE_WARPGROUPS * COMPUTE_REGISTERS + PRODUCER_REGISTERS) <= \
    NUM_WARPGROUPS * LAUNCH_REGISTERS


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
    q_ids_ready, ids_ready, ids_consumed: segment ids only (see below); None otherwise.
  """

  q_ready: object
  k_ready: object
  v_ready: object
  k_consumed: object
  v_consumed: object
  schedule: object
  #: With segment ids only: one per compute warpgroup, its Q tile's ids landed; and the
  #: (ready, consumed) pair of the ring of the keys' ids, a third stream beside K and V.
  q_ids_ready: object = None
  ids_ready: object = None
  ids_consumed: object = None
  #: With a bias only: the (ready, consumed) pair of the ring of bias tiles.
  bias_ready: object = None
  bias_consumed: object = None
  #: With the intra-warpgroup overlap only: one barrier per compute warpgroup, "your turn to
  #: issue matmuls" (FA3's scheduler barrier): a warpgroup waits for its turn, issues, and
  #: hands the turn to the other, so only the issuing alternates and the softmaxes overlap.
  turn: object = None

  @staticmethod
  def types(num_stages: int, segments: bool = False, bias: bool = False,
            turns: bool = False, bias_stages: int | None = None) -> tuple:
    """The scratch types that `pl.run_scoped` allocates, in the order of the fields (the
    bias's ring `bias_stages` deep, None: `num_stages`)."""
    per_wg = NUM_COMPUTE_WARPGROUPS
    k_ready, k_consumed = stream_barrier_types(num_stages)
    v_ready, v_consumed = stream_barrier_types(num_stages)
    base = (plgpu.Barrier(num_barriers=per_wg), k_ready, v_ready, k_consumed, v_consumed,
            plgpu.Barrier(num_arrivals=per_wg))
    ids = (plgpu.Barrier(num_barriers=per_wg), *stream_barrier_types(num_stages))
    no_ids = (None, None, None)
    return (*base, *(ids if segments else no_ids),
            *(stream_barrier_types(bias_stages or num_stages) if bias else (None, None)),
            *((plgpu.Barrier(num_barriers=per_wg),) if turns else ()))

  def kv_streams(self, k_src, v_src, k_smem, v_smem, ids_src=None, ids_smem=None,
                 bias_src=None, bias_smem=None, bias_needed=None,
                 bias_position=None, bias_stages=None) -> tuple:
    """K then V, each `src(step)` a block view, as ring streams; with segment ids, the keys'
    ids stream between them, and with a bias its tiles (the mask and the bias are needed
    before P V), a sparse stream of the steps `bias_needed(step)` says, at ring positions
    `bias_position(step)` of its own ring, `bias_stages` deep (see `Stream`)."""
    streams = [Stream(k_src, k_smem, self.k_ready, self.k_consumed)]
    if self.ids_ready is not None:
      streams.append(Stream(ids_src, ids_smem, self.ids_ready, self.ids_consumed))
    if self.bias_ready is not None:
      streams.append(Stream(bias_src, bias_smem, self.bias_ready, self.bias_consumed,
                            bias_needed, bias_position, bias_stages))
    streams.append(Stream(v_src, v_smem, self.v_ready, self.v_consumed))
    return tuple(streams)

  def take_turn(self, wg):
    """Waits until it is warpgroup `wg`'s turn to issue matmuls (see `turn`)."""
    plgpu.barrier_wait(self.turn.at[wg])

  def pass_turn(self, wg):
    """Hands the turn to issue matmuls to the other compute warpgroup."""
    plgpu.barrier_arrive(self.turn.at[1 - wg])

  def sync_schedule(self):
    """Both compute warpgroups pass the schedule barrier (see the class docstring)."""
    plgpu.barrier_arrive(self.schedule)
    plgpu.barrier_wait(self.schedule)


def slot_of(step, num_stages: int):
  """The ring slot that holds KV step `step`."""
  return step % num_stages


class Stream(NamedTuple):
  """One tensor that the producer streams through the ring, a block per step.

  Attributes:
    src: step -> the global-memory view of that step's block (`step` is traced, so a block
      past the end of the array is TMA's to zero-fill, not a static indexing error).
    smem: the ring, (num_stages, *block).
    ready: one barrier per stage: the block of that slot landed.
    consumed: one barrier per stage, one arrival per compute warpgroup: the slot may be reused.
      Dense streams that every step reads may share one pair (`stream_barrier_types`'
      `copies`): ready then completes when all their blocks landed, and consumers free the
      slot once, after their last read of any of them. Waits go through `wait_ready`.
    needed: None (every step is copied), or step -> whether its block is copied. A step
      whose block is not needed still completes its slot's `ready` phase (the producer
      arrives without a copy), so that every barrier keeps one phase per step and consumers
      observe the slot as usual; they must not read it (a mask's fully visible tiles).
    position: with `needed`, makes the stream sparse: step -> its ring position counted over
      the needed steps only (and the steps of earlier tiles). Only needed blocks touch the
      ring: the producer copies them to the slots of their positions, consumers observe
      those steps alone, and a step that needs no block costs no barrier traffic (a bias
      tile skipped on a fully visible block). `drain` then takes the needed steps' total.
    stages: the depth of the stream's own ring when it differs from the shared one (None:
      the same): a sparse stream's positions run on their own, a dense stream's steps take
      slot step % stages. Its slots may then be fewer (a bias's ring at D 256, where two
      stages of it do not fit beside the other rings).
  """
  src: Callable
  smem: object
  ready: object
  consumed: object
  needed: Callable | None = None
  position: Callable | None = None
  stages: int | None = None


class Ring(NamedTuple):
  """Ring positions at the start of a tile, for a CTA whose rings run on across its tiles
  (a persistent CTA): the shared ring's, and a sparse bias stream's (None without one),
  which counts only the blocks that got a tile (`Stream.position`)."""
  kv: jax.Array
  bias: jax.Array | None

  @classmethod
  def start(cls, bias: bool = False) -> "Ring":
    return cls(jnp.int32(0), jnp.int32(0) if bias else None)

  def after(self, blocks) -> "Ring":
    """The positions after a tile that streamed `blocks` (a `masking.BlockRange`) in full,
    with tiles of the sparse stream for the blocks outside its full run."""
    return Ring(self.kv + (blocks.end - blocks.first),
                None if self.bias is None else self.bias + blocks.edge_count(blocks.end))

  def advance(self, steps) -> "Ring":
    """The positions after a tile of `steps` steps of dense streams only."""
    return self._replace(kv=self.kv + steps)


def stages_of(stream: Stream, num_stages: int) -> int:
  """The depth of `stream`'s ring: its own `stages`, else the shared `num_stages`."""
  return num_stages if stream.stages is None else stream.stages


def stream_slot(stream: Stream, step, num_stages: int):
  """The slot of a dense stream's step `step` in its own ring."""
  return slot_of(step, stages_of(stream, num_stages))


def stream_barrier_types(num_stages: int, copies: int = 1) -> tuple:
  """The (ready, consumed) barrier types of one stream, or of `copies` dense streams that
  share them (`Stream`): each copy arrives on ready once, with its bytes, and each compute
  warpgroup on consumed once per step for all of them."""
  return (plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WARPGROUPS, num_barriers=num_stages))


def ring_barrier_types(num_stages: int, copies) -> tuple:
  """The (ready, consumed) barrier types of a ring's streams, flat and in order: a pair per
  entry of `copies`, each the number of dense streams sharing that pair
  (`stream_barrier_types`)."""
  return tuple(b for n in copies for b in stream_barrier_types(num_stages, n))


def first_per_barrier(streams, barrier) -> list:
  """The streams of `streams`, in order, whose `barrier(stream)` (their `ready` or their
  `consumed`) no earlier stream has, by identity. A wait flips the waiting thread's phase bit
  of its barrier, so streams that share a barrier must be waited on once a step: through the
  first of them."""
  seen = {}
  for stream in streams:
    seen.setdefault(id(barrier(stream)), stream)
  return list(seen.values())


def wait_ready(streams, slot):
  """A consumer's wait for `slot` of each of `streams`, once per distinct barrier."""
  for stream in first_per_barrier(streams, lambda s: s.ready):
    plgpu.barrier_wait(stream.ready.at[slot])


def produce(streams, first_step, num_steps, num_stages: int):
  """The producer's part of one tile: streams `num_steps` blocks of each stream.

  `first_step` counts the steps streamed before this tile (the ring runs on across the tiles
  of a persistent CTA). Streams are issued in order at each step: put first what the
  consumers need first.
  """
  # Streams that share barriers wait for their slot once, through the first of them.
  dense = [s for s in streams if s.position is None]
  waiters = {id(s) for s in first_per_barrier(dense, lambda s: s.consumed)}

  @pl.loop(0, num_steps)
  def _load(step):
    ring_step = first_step + step
    slot = slot_of(ring_step, num_stages)
    refill = ring_step >= num_stages  # The first pass over the ring has nothing to wait for.
    for stream in streams:
      if stream.position is not None:
        pl.when(stream.needed(step))(
            lambda stream=stream: _copy_sparse(stream, step, num_stages))
        continue
      own_slot, own_refill = slot, refill
      if stream.stages is not None:  # A ring of its own depth.
        own_slot = slot_of(ring_step, stream.stages)
        own_refill = ring_step >= stream.stages
      _copy_dense(stream, step, own_slot, own_refill, wait=id(stream) in waiters)


def _copy_dense(stream: Stream, step, slot, refill, wait: bool = True):
  """A dense stream's block `step` into `slot`, once the slot's last use is over (`refill`;
  `wait` False: a stream sharing the barrier waited for it); a block it does not need
  completes the slot's `ready` phase without data."""
  if wait:
    pl.when(refill)(lambda: plgpu.barrier_wait(stream.consumed.at[slot]))
  copy = lambda: plgpu.copy_gmem_to_smem(stream.src(step), stream.smem.at[slot],
                                         stream.ready.at[slot])
  if stream.needed is None:
    copy()
  else:
    needed = stream.needed(step)
    pl.when(needed)(copy)
    pl.when(jnp.logical_not(needed))(lambda: plgpu.barrier_arrive(stream.ready.at[slot]))


def _copy_sparse(stream: Stream, step, num_stages: int):
  """A sparse stream's needed block `step` into the slot of its own ring position."""
  position, stages = stream.position(step), stages_of(stream, num_stages)
  slot = slot_of(position, stages)
  pl.when(position >= stages)(lambda: plgpu.barrier_wait(stream.consumed.at[slot]))
  plgpu.copy_gmem_to_smem(stream.src(step), stream.smem.at[slot], stream.ready.at[slot])


#: The interpreter's settings (`common.launch`). It cannot run inline Mosaic GPU code in
#: general; this mode models a few known functions by name, among them the proxy fence below
#: (as the fence of `plgpu.commit_smem`), so that its race detector sees the fence too.
INTERPRET_PARAMS = plgpu.InterpretGPUParams(inline_mgpu="_hack_model_inline_mgpu_tokamax")


@plgpu.inline_mgpu()
def fence_async_shared_cta(_):
  """`fence.proxy.async.shared::cta` (the interpreter knows it by this name)."""
  nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)


def order_loads_before_tma():
  """Orders this thread's loads from shared memory (ld.shared, ldmatrix) before the TMA
  copies that a later arrive or barrier lets a thread issue into the same memory.

  Loads go through the generic proxy, TMA (and wgmma) through the async proxy, and PTX orders
  the two only across `fence.proxy.async`; an mbarrier arrive alone does not. Without the
  fence, on an H200 (jax 0.11.2), the D 256 forward with a bias, whose bias ring is one slot
  deep, returned wrong rows in about half of the runs: a few rows of the warpgroup that read
  a tile last, as if the next tile had landed under its loads; with the fence, none in 24
  (`scripts/probe_bias_race.py`, bench/results/h200_d256_bias_race.log). Memory read by wgmma
  alone needs no fence."""
  fence_async_shared_cta()


def free_after_loads(*consumed):
  """Frees ring slots that this warpgroup read with loads (a bias or mask tile, segment ids,
  the LSE, δ): arrives on each `consumed` barrier after `order_loads_before_tma`."""
  order_loads_before_tma()
  for barrier in consumed:
    plgpu.barrier_arrive(barrier)


def release(stream: Stream, step, num_stages: int):
  """A consumer's pass over `step` of a stream it does not read: observe the block and free
  its slot (for a sparse stream, only when the step's block was streamed)."""
  def free(slot):
    plgpu.barrier_wait(stream.ready.at[slot])
    plgpu.barrier_arrive(stream.consumed.at[slot])
  if stream.position is None:
    free(slot_of(step, num_stages))
  else:
    pl.when(stream.needed(step))(
        lambda: free(slot_of(stream.position(step), stages_of(stream, num_stages))))


def drain(streams, total_steps, num_stages: int, sparse_total=None):
  """Waits for the last use of every slot, so that no phase of a consumed barrier goes
  unobserved and no read of the ring is in flight when the CTA exits. A sparse stream
  (`Stream.position`) drains over its own positions: `sparse_total` of them."""
  distinct = first_per_barrier(streams, lambda s: s.consumed)
  shared = [s for s in distinct if s.position is None and s.stages is None]
  groups = [(shared, total_steps, num_stages)] if shared else []
  groups += [([s], total_steps if s.position is None else sparse_total, s.stages)
             for s in streams if s.stages is not None]
  groups += [([s], sparse_total, num_stages)
             for s in streams if s.position is not None and s.stages is None]
  for group, total, stages in groups:

    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _drain(step, group=group, stages=stages):
      slot = slot_of(step, stages)
      for stream in group:
        plgpu.barrier_wait(stream.consumed.at[slot])
