"""dQ inside the dK/dV kernel (opt-in prototype: `BackwardConfig.fused_dq`), FA3's five
matmuls instead of seven: no dQ kernel recomputes S and dP.

Each step of `kernels/dkv.py` (query head h, query block j) leaves both compute warpgroups
with their dSᵀ (block_kv keys × block_q queries). Then::

    warpgroup w:  dSᵀ_w ─► ds_smem[step % 2, w]              (input dtype)
    both:         sync (`ds_ready`: both tiles are in shared memory)
    warpgroup w:  dQ_w = Σ_i (dSᵀ_i)ᵀ K_i[:, cols_w]          (block_q × 64, float32)
                  dQ_w ─► staging[w] ─► ordered add into acc[b, rows of j, h, cols_w]

At D 128 each warpgroup computes half of dQ's columns (a whole block_q × D float32 partial
would not fit beside its dK and dV), over all 2·block_kv keys of the CTA. At D 64 a half
would slice K's B operand inside a swizzle row, which wgmma cannot do: there the warpgroups
take turns (step s: warpgroup s % 2 computes all 64 columns). `config.FUSED_DQ_COLUMNS`.

The add is ordered, so dQ is deterministic: a global-memory semaphore per (batch, query
head, query block, column half) counts the KV tiles that already added. The KV tiles that
visit query block j are a contiguous run [first_tile(j), last_tile(j)] of the band
(`q_block_range` is monotone in the tile). Each tile waits for the count of the run's tiles
that add before it (its `rank`), stores (rank 0) or TMA reduce-adds its tile, and once the
write landed signals +1 (at its next add or at the end, `SIGNAL_AT_NEXT_ADD`; never while
waiting for another tile). The order within the run:
- without a causal bound, first to last: every tile starts at query block 0, so tile t
  waits for tile t − 1 there once, and then they run one add apart;
- with one (`reversed_tiles`), last to first: a tile's query blocks start at its diagonal,
  so the tile nearest block j's diagonal reaches it first, then the next lower one a step
  or two later. First to last would hold every tile back to tile 0's pace, as slow as no
  causal skipping at all.
A tile must only wait on tiles launched before it (else the waiting CTAs can fill the GPU
while the tiles they wait on cannot start): dkv's grid is (kv_tile, kv_head, batch), whose
first index varies fastest, and with `reversed_tiles` program i runs tile num_tiles − 1 − i
(`tile_of`). The semaphores come from `pl.get_global`, which jax 0.11.2 zero-initializes on
every call.

Rank 0 stores rather than adds, so the accumulator needs no zeroing; the query blocks no
tile visits (a band or key lengths can leave some) are zeroed by `finalize`.

Not supported (the caller raises): segment ids and a bias/mask (they narrow a tile's query
blocks by data, so the visiting tiles are no longer a run of the band). Under `jax.vmap`
the kernel runs once per instance (`backward._one_call_per_instance`): instances batched
into one launch would share the semaphores.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from flash_attn_hopper import config as config_lib
from flash_attn_hopper import masking
from flash_attn_hopper import pipeline
from flash_attn_hopper.kernels import common


class Buffers(NamedTuple):
  ds_smem: object   # (FUSED_DQ_DS_BUFFERS, compute warpgroups, block_kv, block_q), input dtype
  staging: object   # (column parts, block_q, FUSED_DQ_COLUMNS) float32, for TMA
  ds_ready: object  # barrier, one arrival per compute warpgroup: both dSᵀ tiles are stored
  acc: object       # (B, T_acc, N, D) float32 in global memory, T_acc = whole query blocks
  sems: object      # (B · N · query blocks · column parts,) global semaphores, or None


def acc_rows(seq_q: int, block_q: int) -> int:
  """Rows of the float32 dQ accumulator: the query blocks the dK/dV kernel streams, whole."""
  return pl.cdiv(seq_q, block_q) * block_q


def accumulator_type(q, block_q: int) -> jax.ShapeDtypeStruct:
  """The accumulator, an extra output of the dK/dV kernel (q: the padded queries)."""
  b, t, n, d = q.shape
  return jax.ShapeDtypeStruct((b, acc_rows(t, block_q), n, d), jnp.float32)


def smem_types(dims: common.Dims, cfg: config_lib.BackwardConfig) -> tuple:
  """(dSᵀ tiles, dQ staging, the dSᵀ barrier); `BackwardConfig.fused_dq_smem_bytes` counts
  the first two."""
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  return (common.smem_tile((config_lib.FUSED_DQ_DS_BUFFERS, wgs, cfg.block_kv, cfg.block_q),
                           dims.dtype),
          common.smem_tile((column_parts(dims.head_dim), cfg.block_q,
                            config_lib.FUSED_DQ_COLUMNS), jnp.float32),
          plgpu.Barrier(num_arrivals=wgs))


def semaphores(dims: common.Dims, cfg: config_lib.BackwardConfig, *, interpret: bool):
  """The global semaphores of the ordered adds (zeroed on every call); None when
  interpreting (the interpreter has none, and runs the CTAs one after another anyway)."""
  if interpret:
    return None
  blocks = pl.cdiv(dims.seq_q, cfg.block_q)
  size = dims.batch * dims.num_q_heads * blocks * column_parts(dims.head_dim)
  return pl.get_global(plgpu.SemaphoreType.REGULAR((size,)))


def column_parts(head_dim: int) -> int:
  """The column blocks of dQ (one per warpgroup at D 128; one, taken in turns, at D 64)."""
  return head_dim // config_lib.FUSED_DQ_COLUMNS


def first_tile(spec: masking.MaskSpec, q_block, keys: int, block_q: int):
  """The first KV tile (of `keys` keys) whose band (`masking.q_block_range`) contains query
  block `q_block`. Without a left window every tile from 0 on that reaches the block does;
  with one, tile t's blocks end at cdiv(t·keys + keys + left − offset, block_q) (clipped to
  the queries), which exceeds q_block exactly when t·keys > q_block·block_q − keys − left +
  offset."""
  if spec.left is None:
    return jnp.int32(0)
  x = q_block * block_q - keys - spec.left + spec.offset
  return jnp.maximum(x // keys + 1, 0)


def reversed_tiles(spec: masking.MaskSpec) -> bool:
  """Whether the KV tiles run, and add dQ, last to first (see the module docstring): with a
  causal bound, where a tile's query blocks start at its diagonal."""
  return spec.upper is not None


def tile_of(program, num_tiles: int, spec: masking.MaskSpec):
  """The KV tile that dK/dV's program `program` (its index along the grid's kv_tile axis)
  runs: the same, or counted from the last with `reversed_tiles`."""
  return num_tiles - 1 - program if reversed_tiles(spec) else program


def last_tile(spec: masking.MaskSpec, q_block, keys: int, block_q: int, seq_q: int, seq_kv):
  """The last KV tile (of `keys` keys) whose band (`masking.q_block_range`) contains query
  block `q_block` and that has keys (`seq_kv`: the batch element's, maybe traced). Tile t's
  blocks start at max(t·keys − upper − offset, 0) // block_q and are empty from seq_q on, so
  it reaches the block exactly when t·keys < min((q_block + 1)·block_q, seq_q) + upper +
  offset."""
  live = pl.cdiv(seq_kv, keys) - 1
  if spec.upper is None:
    return jnp.int32(live)
  reach = jnp.minimum((q_block + 1) * block_q, seq_q) + spec.upper + spec.offset
  return jnp.minimum(pl.cdiv(reach, keys) - 1, live)


def rank(spec: masking.MaskSpec, tile_index, q_block, keys: int, block_q: int, seq_q: int,
         seq_kv):
  """How many of the tiles that visit query block `q_block` add into it before tile
  `tile_index` does (the order of the module docstring)."""
  if reversed_tiles(spec):
    return last_tile(spec, q_block, keys, block_q, seq_q, seq_kv) - tile_index
  return tile_index - first_tile(spec, q_block, keys, block_q)


#: Whether a warpgroup signals an add's semaphore only at its next add (or at the end),
#: so that the write's round trip to L2 hides under the next step's matmuls instead of
#: stalling this one; False waits for the write right after issuing it (simplest order, for
#: a GPU session to compare or fall back to).
SIGNAL_AT_NEXT_ADD = True
#: `pending` when no add of the warpgroup awaits its signal.
NO_PENDING = -1


def add_step(dst_16, pending, *, step, head, q0, wg, tile_index, batch, seq_kv, k_smem,
             buffers: Buffers, dims: common.Dims, opts):
  """This warpgroup's part of one step's dQ: stores its dSᵀ (`dst_16`, input dtype), then
  multiplies both warpgroups' dSᵀ by its columns of K (see the module docstring) and adds the
  product into the accumulator's rows [q0, q0 + block_q) of query head `head`, in tile order.

  `pending` (int32) is the semaphore of this warpgroup's add whose signal is still owed
  (`SIGNAL_AT_NEXT_ADD`), or NO_PENDING; returns the new one."""
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  slot = step % config_lib.FUSED_DQ_DS_BUFFERS
  buffers.ds_smem.at[slot, wg][...] = dst_16
  plgpu.commit_smem()  # Visible to wgmma (the async proxy).
  plgpu.barrier_arrive(buffers.ds_ready)
  plgpu.barrier_wait(buffers.ds_ready)
  part_of = functools.partial(_product_and_add, pending=pending, slot=slot, head=head, q0=q0,
                              tile_index=tile_index, batch=batch, seq_kv=seq_kv,
                              k_smem=k_smem, buffers=buffers, dims=dims, opts=opts)
  if column_parts(dims.head_dim) == wgs:
    return part_of(wg)
  mine = step % wgs == wg  # One part, the warpgroups take turns.

  @pl.when(mine)
  def _turn():
    part_of(0)

  return jnp.where(mine, _sem_index(head, q0, 0, batch, dims, opts), pending)


def _sem_index(head, q0, part, batch, dims: common.Dims, opts):
  """The semaphore of (batch, query head, query block, column part); NO_PENDING when
  interpreting (no semaphores)."""
  if opts.interpret:
    return jnp.int32(NO_PENDING)
  blocks = pl.cdiv(dims.seq_q, opts.config.block_q)
  block = q0 // opts.config.block_q
  return (((batch * dims.num_q_heads + head) * blocks + block) * column_parts(dims.head_dim)
          + part).astype(jnp.int32)


def _product_and_add(part, *, pending, slot, head, q0, tile_index, batch, seq_kv, k_smem,
                     buffers: Buffers, dims: common.Dims, opts):
  """dQ's column block `part` of one step: (Σ_i (dSᵀ_i)ᵀ K_i)[:, cols], added in order.
  Returns the semaphore now pending (see `add_step`)."""
  cfg = opts.config
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  width = config_lib.FUSED_DQ_COLUMNS
  start = part * width if isinstance(part, int) else pl.multiple_of(part * width, width)
  cols = pl.ds(start, width)

  def run(acc_ref):
    for i in range(wgs):  # dQ = dS K over the CTA's keys: (dSᵀ_i)ᵀ K_i for each key block i.
      plgpu.wgmma(acc_ref, buffers.ds_smem.at[slot, i].T, k_smem.at[i, :, cols])
    return acc_ref[...]
  product = pl.run_scoped(run, plgpu.ACC((cfg.block_q, width), jnp.float32))

  order = rank(opts.mask, tile_index, q0 // cfg.block_q, wgs * cfg.block_kv, cfg.block_q,
               dims.seq_q, seq_kv)
  dst = buffers.acc.at[batch, pl.ds(q0, cfg.block_q), head, cols]
  sem = _sem_index(head, q0, part, batch, dims, opts)
  # A staging tile per part: at D 64 the warpgroups share one, since one starts its turn only
  # after the other's TMA read it (it passed the next dSᵀ sync, which the other reaches after).
  _add_dq_tile(product, buffers.staging.at[part], dst, buffers.sems, sem, pending, order,
               interpret=opts.interpret)
  return sem


def _add_dq_tile(part, staging, dst, sems, sem, pending, rank, *, interpret: bool):
  """dst = part (rank 0) or dst += part (rank > 0), after the `rank` earlier tiles' adds.

  On the GPU: through `staging` (shared memory) with a TMA store or bulk reduce-add, ordered
  by the semaphore `sems[sem]` (see the module docstring); `pending`'s signal is paid first.
  jax 0.11.2's interpreter has neither semaphores nor TMA reductions, but runs the grid's
  CTAs one after another in grid order, so there a plain read-modify-write of `dst` is
  race-free and in the same order; this is the only interpreter-only formulation of this
  module.
  """
  if interpret:
    pl.when(rank == 0)(lambda: dst.__setitem__(Ellipsis, part))
    pl.when(rank > 0)(lambda: dst.__setitem__(Ellipsis, dst[...] + part))
    return
  retire(sems, pending)  # (Before waiting on another tile: no wait holds an owed signal.)
  staging[...] = part
  plgpu.commit_smem()  # Visible to TMA.

  @pl.when(rank == 0)
  def _store():
    plgpu.copy_smem_to_gmem(staging, dst)

  @pl.when(rank > 0)
  def _add():
    plgpu.semaphore_wait(sems.at[sem], rank, decrement=False, memory_scope="gpu")
    plgpu.copy_smem_to_gmem(staging, dst, reduction_op="add")

  if SIGNAL_AT_NEXT_ADD:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # Only the staging tile is free.
  else:
    retire(sems, sem)


def retire(sems, pending):
  """Waits for this thread's adds to land in global memory (not only to be read), then
  signals `pending`'s semaphore, if any: the next tile may add."""
  if sems is None:
    return
  plgpu.wait_smem_to_gmem(0)
  pl.when(pending != NO_PENDING)(
      lambda: plgpu.semaphore_signal(sems.at[pending], 1, memory_scope="gpu"))


def finish(buffers: Buffers, pending):
  """After the last step: pays the warpgroup's owed signal, and waits until both warpgroups
  are past their last dQ product, so each may overwrite its K tile (the other's product read
  it) with dK."""
  if SIGNAL_AT_NEXT_ADD:
    retire(buffers.sems, pending)
  plgpu.barrier_arrive(buffers.ds_ready)
  plgpu.barrier_wait(buffers.ds_ready)


def visited_blocks(spec: masking.MaskSpec, *, num_tiles: int, keys: int, seq_q: int,
                   seq_kv: int, block_q: int, kv_lens=None, batch: int):
  """(B, query blocks) bool: whether any KV tile adds into the block (`kernels/dkv.py`'s
  `_tile`: its band, and no tile at or past the batch element's keys)."""
  key0 = jnp.arange(num_tiles, dtype=jnp.int32) * keys
  blocks = masking.q_block_range(spec, key0, keys, seq_q, block_q)
  first = jnp.broadcast_to(blocks.first, key0.shape)
  end = jnp.broadcast_to(blocks.end, key0.shape)
  j = jnp.arange(pl.cdiv(seq_q, block_q), dtype=jnp.int32)
  in_band = (first[:, None] <= j) & (j < end[:, None])  # (tiles, blocks)
  if kv_lens is None:
    return jnp.broadcast_to(jnp.any(in_band, axis=0), (batch, j.size))
  live = key0[None, :] < jnp.clip(kv_lens, 0, seq_kv)[:, None]  # (B, tiles): `keys_of`
  return jnp.any(live[:, :, None] & in_band[None], axis=1)


def finalize(acc, visited, *, seq_q: int, scale: float, dtype):
  """dQ (B, seq_q, N, D) in `dtype` from the float32 accumulator: scaled once, the blocks
  no tile visited (garbage: never written) zeroed, the rows past seq_q dropped."""
  b, rows, n, d = acc.shape
  block_q = rows // visited.shape[1]
  mask = jnp.repeat(visited, block_q, axis=1)[:, :, None, None]
  return jnp.where(mask, acc * scale, 0.0)[:, :seq_q].astype(dtype)
