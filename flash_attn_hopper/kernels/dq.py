"""The dQ kernel: for a tile of queries, stream the K/V blocks it saw in the forward.

A tile is 2·block_q query rows of one (batch, query head), like the forward's: each compute
warpgroup loads its Q, dO, LSE and δ once, and the producer streams K and V through the same
ring as the forward's, over the same KV block range (`masking.kv_block_range`). A CTA runs
one tile, or on persistent CTAs several (`common.backward_schedule`), the ring running on
across them and the next tile's loads going under the epilogue. A KV block here is
`BackwardConfig.dq_keys` keys (`block_kv`, or `dq_block_kv` where the ring wants smaller
blocks to take two stages: D 256):

    per KV block:
      S = Q Kᵀ, dP = dO Vᵀ      issued together
      P = 2^(c·S − LSE)         from the forward's LSE, while the tensor cores compute dP;
                                element mask on boundary blocks only (band, lengths,
                                segment ids: the keys' ids stream between K and V)
      dS = P ∘ (dP − δ)
      dQ += dS K                scaled once at the end
      dS out                    with the bias's gradient only (`_store_ds`)

With `opts.bias_grad` the kernel also writes dS, the gradient of the biased logits, (B, N, T, S)
in the bias's dtype: each warpgroup stores its visited blocks through a staging tile and TMA
(the store of a block runs under the next block's matmuls), then zeros into every block it
did not visit (`_zero_unvisited_ds`), so that no entry is left unwritten. Above
`config.DS_STAGING_MAX_HEAD_DIM` the staging tiles do not fit, and each thread stores its
fragment from registers. The array is padded to whole tiles (a TMA store's box must divide
it), and `dq` slices it to (T, S); `backward` sums it over the bias's broadcast dimensions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from flash_attn_hopper import accumulate
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import hardware
from flash_attn_hopper import masking
from flash_attn_hopper import pipeline
from flash_attn_hopper import scheduler
from flash_attn_hopper import softmax
from flash_attn_hopper.kernels import common

# S and dP are issued together at every head dim, and 2^(S − LSE) runs under dP. Measured on
# the H200 (2026-11-30, bf16, fwd+bwd, one A/B run each) against one matmul at a time: the dQ
# kernel took 4.63 against 5.15 ms at D 128, 16k non-causal, and 2.77 against 3.11 ms at
# D 64, 16k causal. At D 256, where the (block_q, 256) float32 dQ accumulator alone takes 128
# registers a thread, it lost with 64-key blocks (4k: 1.21 against 1.03 ms causal, 2.07
# against 2.13 non-causal), and pays since the kernel runs on 32-key blocks
# (`BackwardConfig.dq_block_kv`; S and dP take 16 registers a thread each): 2026-12-03,
# bf16 fwd+bwd, B·T = 16k, hidden 2048, dQ ms one at a time → together, by
# `scripts/ab_switches.py` on the switch this note replaces
# (bench/results/h200_dq_overlap_d256_ab.log, gradients bitwise equal): 1k 0.352 → 0.350,
# causal 0.214 → 0.209; 4k 1.264 → 1.255, causal 0.690 → 0.648; 16k 5.536 → 5.325, causal
# 2.622 → 2.537. ptxas, causal 4k on persistent CTAs: spills 132 / 180 → 148 / 196 bytes;
# non-causal none either way.

#: K and V of a step share one (ready, consumed) barrier pair: one wait a step (S then starts
#: only once V has landed too) and one arrival, after dQ += dS K, instead of a pair each (the
#: keys' ids and the bias keep their own). Only at the head dims where it measured faster: on
#: the H200 (jax 0.11.2, 2026-12-03, bf16 fwd+bwd, B·T = 16k, hidden 2048, interleaved with
#: cuDNN, CUPTI; bench/results/h200_dq_shared_kv_ab.log) by
#:   PYTHONPATH=.:scripts python3 scripts/ab_switches.py fwdbwd 64,128,256 4096,16384
#:       bfloat16 both base,kernels.dq.SHARED_KV_BARRIERS=True
#: on c785e8e, where the switch was off and covered every head dim (the same A/B now:
#: `base,kernels.dq.SHARED_KV_BARRIERS_HEAD_DIMS=(64,128,256)`, against D 128 only). dQ ms,
#: a pair each → shared: D 128 4k 1.123 → 1.074, causal 0.590 → 0.590; 16k 4.769 → 4.426,
#: causal 2.227 → 2.080. D 64 lost (4k 1.368 → 1.428, 16k causal 2.820 → 3.028), and
#: D 256 was mixed (4k 1.283 → 1.312, causal 0.695 → 0.666; 16k 5.469 → 5.683).
SHARED_KV_BARRIERS = True
SHARED_KV_BARRIERS_HEAD_DIMS = frozenset({128})


def shares_kv_barriers(head_dim: int) -> bool:
  """Whether K and V of a step share one barrier pair (`SHARED_KV_BARRIERS`) at this head
  dim."""
  return SHARED_KV_BARRIERS and head_dim in SHARED_KV_BARRIERS_HEAD_DIMS


def operand_swizzle(cfg, dtype) -> int:
  """The swizzle (bytes) of the kernel's wgmma operand tiles: Q, dO, K and V. dQ += dS K
  contracts over a KV block's `dq_keys` rows, and Mosaic GPU issues a contraction in groups
  of one swizzle row, so the row must not be wider than the block (32 two-byte keys: 64
  bytes); S = Q Kᵀ needs Q's swizzle to match K's, and dP = dO Vᵀ dO's V's."""
  return min(hardware.SWIZZLE_BYTES, cfg.dq_keys * jnp.dtype(dtype).itemsize)


class _Refs(NamedTuple):
  q: object
  k: object
  v: object
  do: object
  lse: object        # (B, N, T_pad) float32, log2 units
  delta: object      # (B, N, T_pad) float32
  dq: object
  q_smem: object     # (compute warpgroups, block_q, D): Q, then dQ out
  do_smem: object
  lse_smem: object   # (compute warpgroups, block_q)
  delta_smem: object
  k_ring: object     # (dq stages, dq keys, D)
  v_ring: object
  staging: object    # interpreter only: (compute warpgroups, block_q, dq keys), else None
  masks: common.MaskInputs  # key lengths, segment ids and spans in global memory
  q_ids_smem: object = None  # segments: (compute warpgroups, block_q) int32
  ids_ring: object = None    # segments: (dq stages, dq keys) int32, the keys' ids
  ds: object = None          # bias_grad: (B, N, T, S) dS out, in the bias's dtype
  ds_smem: object = None     # bias_grad, D ≤ 128: (compute warpgroups, block_q, dq keys)
  bias_ring: object = None   # bias: (dq stages, compute warpgroups, block_q, dq keys)


def _kv_step(step, carry, *, wg, tile, q0, q_ids, seq_kv, ring0, lse, delta, k_s, v_s, ids_s,
             bias_s, refs: _Refs, staging, q_smem, do_smem, dims, opts, masked):
  """KV block `step` (at ring position ring0 + step) against this warpgroup's queries."""
  cfg = opts.config
  slot = pipeline.slot_of(ring0 + step, cfg.dq_stages)
  plgpu.barrier_wait(k_s.ready.at[slot])

  def probabilities(s):  # Under dP, when the two are issued together.
    bias = common.bias_tile(bias_s, ring0 + step, wg, cfg.dq_stages, opts) if masked else None
    s, cap_grad = opts.logits.transform(s, bias)
    k_ids = common.key_ids(ids_s, slot, load=masked)
    if masked:
      s = masking.apply_element_mask(s, q0, step * cfg.dq_keys,
                                     masking.key_end_to_mask(seq_kv, cfg.dq_keys), opts.mask,
                                     segments=None if k_ids is None else (q_ids, k_ids))
    return softmax.recompute(s, lse, opts.logits.exp2_scale), cap_grad

  shape = (cfg.block_q, cfg.dq_keys)
  k_slot, v_slot = refs.k_ring.at[slot], refs.v_ring.at[slot]
  shared = v_s.ready is k_s.ready  # (`shares_kv_barriers`: V landed with K.)
  wait_v = lambda: None if shared else plgpu.barrier_wait(v_s.ready.at[slot])
  (p, cap_grad), dp = common.overlapped_matmuls(
      (q_smem, k_slot.T, shape), (do_smem, v_slot.T, shape), probabilities,
      before_second=wait_v)
  if not shared:
    plgpu.barrier_arrive(v_s.consumed.at[slot])
  ds = softmax.logits_grad(p, dp, delta, cap_grad=cap_grad).astype(dims.dtype)
  if refs.ds is not None:
    _store_ds(ds, _ds_block(refs, tile, q0, step, cfg), refs.ds_smem, wg)
  carry = accumulate.matmul_accumulate(carry, ds, refs.k_ring.at[slot], staging=staging)
  plgpu.barrier_arrive(k_s.consumed.at[slot])
  return carry


def _ds_block(refs: _Refs, tile: scheduler.Tile, q0, block, cfg):
  """The global-memory view of dS for this warpgroup's rows and KV block `block`."""
  return refs.ds.at[tile.batch, tile.head, pl.ds(q0, cfg.block_q),
                    pl.ds(block * cfg.dq_keys, cfg.dq_keys)]


def _store_ds(ds, dst, ds_smem, wg):
  """One block of dS out: through warpgroup `wg`'s staging tile, once the previous block's
  store has read it, the copy running on while the warpgroup goes on; without staging
  tiles (`ds_smem` None), each thread's fragment straight from registers."""
  if ds_smem is None:
    dst[...] = ds
    return
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  ds_smem.at[wg][...] = ds
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ds_smem.at[wg], dst)


def _zero_unvisited_ds(own: masking.BlockRange, tile: scheduler.Tile, q0, refs: _Refs, wg, dims,
                       opts):
  """Zeros into this warpgroup's dS blocks outside its own run (P = 0 there): from the
  staging tile, filled with zeros once, or (without staging tiles) from registers."""
  cfg = opts.config
  zeros = common.zeros_accumulator((cfg.block_q, cfg.dq_keys)).astype(dims.dtype)
  if refs.ds_smem is not None:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    refs.ds_smem.at[wg][...] = zeros
    plgpu.commit_smem()

  def zero(dst):
    if refs.ds_smem is None:
      dst[...] = zeros
    else:
      plgpu.copy_smem_to_gmem(refs.ds_smem.at[wg], dst)

  @pl.loop(0, pl.cdiv(refs.ds.shape[3], cfg.dq_keys))
  def _zero(block):
    pl.when(jnp.logical_or(block < own.first, block >= own.end))(
        lambda: zero(_ds_block(refs, tile, q0, block, cfg)))


def _release_step(step, _, *, ring0, streams, num_stages):
  """A block streamed for the other warpgroup only (masks): observe it and free its slot
  (a sparse stream's only when it streamed the block), once per barrier pair."""
  for stream in pipeline.first_per_barrier(streams, lambda s: s.ready):
    pipeline.release(stream, ring0 + step, num_stages)


#: Per-warpgroup tile loads, each on its own barrier: Q, dO, the LSE, δ (and the rows' ids).
def _tile_copies(opts) -> int:
  return 5 if opts.segments else 4


#: Q's place among the tile loads: dQ leaves through Q's buffer, so a persistent CTA loads the
#: next tile's Q last, once that store has read it; the others load under the epilogue.
_Q_LOAD = 0


def _issue_tile_loads(wg, tile: scheduler.Tile, refs: _Refs, tile_ready, opts, which):
  """Starts the loads `which` (indices, `_Q_LOAD` first) of this warpgroup's rows of `tile`:
  Q, dO, the LSE and δ (and their segment ids), each on its own barrier."""
  rows = pl.ds(tile.row0 + wg * opts.config.block_q, opts.config.block_q)
  copies = [(refs.q.at[tile.batch, rows, tile.head], refs.q_smem.at[wg]),
            (refs.do.at[tile.batch, rows, tile.head], refs.do_smem.at[wg]),
            (refs.lse.at[tile.batch, tile.head, rows], refs.lse_smem.at[wg]),
            (refs.delta.at[tile.batch, tile.head, rows], refs.delta_smem.at[wg])]
  if opts.segments:
    copies.append((refs.masks.q_ids.at[tile.batch, rows], refs.q_ids_smem.at[wg]))
  assert len(copies) == _tile_copies(opts)
  common.issue_tile_loads(copies, tile_ready, wg, which)


def _attend_tile(wg, tile: scheduler.Tile, cta: masking.BlockRange, ring: pipeline.Ring,
                 refs: _Refs, streams, tile_ready, seq_kv, dims, opts, persistent: bool):
  """dQ (float32, unscaled) of one warpgroup's rows of a tile, once its loads landed: its
  own blocks of the CTA's [cta.first, cta.end), the others released (as in the forward).
  `persistent`: the next tile's loads may land in the buffers read here."""
  cfg = opts.config
  common.wait_tile_loads(tile_ready, wg, _tile_copies(opts))
  q0 = tile.row0 + wg * cfg.block_q
  k_s, *extra, v_s = streams  # K, (the keys' ids,) (the bias,) V
  ids_s = extra.pop(0) if opts.segments else None
  bias_s = extra.pop(0) if opts.bias else None
  q_ids = plgpu.load(refs.q_ids_smem.at[wg], layout=common.ROWS) if opts.segments else None
  lse = plgpu.load(refs.lse_smem.at[wg], layout=common.ROWS)
  delta = plgpu.load(refs.delta_smem.at[wg], layout=common.ROWS)
  if persistent:  # The next tile's LSE and δ land here by TMA.
    pipeline.order_loads_before_tma()
  ring0 = ring.kv - cta.first  # The ring position of block 0.
  step = functools.partial(
      _kv_step, wg=wg, tile=tile, q0=q0, q_ids=q_ids, seq_kv=seq_kv, ring0=ring0, lse=lse,
      delta=delta, k_s=k_s, v_s=v_s, ids_s=ids_s, bias_s=bias_s, refs=refs,
      staging=None if refs.staging is None else refs.staging.at[wg],
      q_smem=refs.q_smem.at[wg], do_smem=refs.do_smem.at[wg], dims=dims, opts=opts)
  own = _kv_blocks(tile, q0, cfg.block_q, seq_kv, refs, opts).within(cta)
  if opts.bias:  # Its unmasked blocks are ones the producer streams no bias tile for.
    own = own.full_within(cta)
  release = functools.partial(_release_step, ring0=ring0, streams=streams,
                              num_stages=cfg.dq_stages)
  dq = common.zeros_accumulator((cfg.block_q, dims.head_dim))
  dq = common.walk_blocks(cta, own, step, release, dq)
  if refs.ds is not None:
    _zero_unvisited_ds(own, tile, q0, refs, wg, dims, opts)
  return dq


def _store_dq(wg, dq, tile: scheduler.Tile, refs: _Refs, dims, opts):
  """dQ out through Q's buffer (Q is no longer read), by TMA; rows past T clip."""
  q_smem = refs.q_smem.at[wg]
  q_smem[...] = (dq * opts.scale).astype(dims.dtype)
  plgpu.commit_smem()
  rows = pl.ds(tile.row0 + wg * opts.config.block_q, opts.config.block_q)
  plgpu.copy_smem_to_gmem(q_smem, refs.dq.at[tile.batch, rows, tile.head])


def _compute_warpgroup(wg, refs: _Refs, ring_barriers, tile_ready, sched, dims, opts):
  """One warpgroup's rows of each of its CTA's tiles. A persistent CTA loads the next tile's
  dO, LSE and δ under this tile's epilogue, and its Q once dQ has left through Q's buffer."""
  plgpu.set_max_registers(pipeline.COMPUTE_REGISTERS, action="increase")
  cta = lax.axis_index("cta")
  num_items = sched.items_of(cta)
  loads = range(_tile_copies(opts))
  _issue_tile_loads(wg, sched.tile(cta, 0), refs, tile_ready, opts, loads)

  def tile_body(i, ring: pipeline.Ring):
    tile = sched.tile(cta, i)
    seq_kv = common.keys_of(tile.batch, refs.masks.kv_lens, dims)
    blocks = _cta_kv_blocks(tile, seq_kv, refs, opts)
    streams = _streams(tile, blocks, ring, refs, ring_barriers, dims, opts)
    dq = _attend_tile(wg, tile, blocks, ring, refs, streams, tile_ready, seq_kv, dims, opts,
                      sched.persistent)
    load_next = lambda which: pl.when(i + 1 < num_items)(lambda: _issue_tile_loads(
        wg, sched.tile(cta, i + 1), refs, tile_ready, opts, which))
    if sched.persistent:
      load_next([j for j in loads if j != _Q_LOAD])
    _store_dq(wg, dq, tile, refs, dims, opts)
    if sched.persistent:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      load_next([_Q_LOAD])
    return ring.after(blocks)

  lax.fori_loop(0, num_items, tile_body, pipeline.Ring.start(bias=bool(opts.bias)))
  plgpu.wait_smem_to_gmem(0)


def _kv_blocks(tile: scheduler.Tile, q0, rows: int, seq_kv, refs: _Refs,
               opts) -> masking.BlockRange:
  """The KV blocks the rows [q0, q0 + rows) saw in the forward: the band's, narrowed by
  segments and a mask."""
  band = masking.kv_block_range(opts.mask, q0, rows, seq_kv, opts.config.dq_keys)
  return common.narrow_kv_blocks(band, refs.masks, opts, batch=tile.batch, head=tile.head,
                                 q0=q0, rows=rows)


def _cta_kv_blocks(tile: scheduler.Tile, seq_kv, refs: _Refs, opts) -> masking.BlockRange:
  """The KV blocks the producer streams for a tile: those of both warpgroups' rows."""
  rows = pipeline.NUM_COMPUTE_WARPGROUPS * opts.config.block_q
  return _kv_blocks(tile, tile.row0, rows, seq_kv, refs, opts)


def _streams(tile: scheduler.Tile | None, cta: masking.BlockRange | None, ring, refs: _Refs,
             ring_barriers, dims, opts) -> tuple:
  """K, (the keys' ids,) (the bias,) V of a tile's blocks `cta` as ring streams (the ids and
  the bias go between K and V: the mask is needed before dP). The bias's stream is sparse:
  no tile where it is zero for every row of the CTA. `tile` None: the streams without
  sources, for `pipeline.drain`."""
  cfg = opts.config
  rings = [refs.k_ring, refs.v_ring]
  srcs = [None, None]
  if tile is not None:
    kv_head = tile.head // dims.group
    rows = lambda step: pl.ds((cta.first + step) * cfg.dq_keys, cfg.dq_keys)
    srcs = [lambda step: refs.k.at[tile.batch, rows(step), kv_head],
            lambda step: refs.v.at[tile.batch, rows(step), kv_head]]
  sparse = [(None, None)] * 2
  pairs = list(zip(ring_barriers[::2], ring_barriers[1::2]))  # (ready, consumed)
  if shares_kv_barriers(dims.head_dim):  # V's pair is K's (`_ring_barrier_types`).
    pairs.append(pairs[0])
  if opts.bias:
    srcs.insert(1, None if tile is None else lambda step: common.bias_block(
        refs.masks, opts, tile.batch, tile.head, tile.row0, rows(step)))
    rings.insert(1, refs.bias_ring)
    sparse.insert(1, (None, lambda step: step) if tile is None
                  else cta.edge_steps(first=cta.first, base=ring.bias))
  if opts.segments:
    srcs.insert(1, None if tile is None else lambda step: refs.masks.kv_ids.at[
        tile.batch, rows(step)])
    rings.insert(1, refs.ids_ring)
    sparse.insert(1, (None, None))
  return tuple(pipeline.Stream(src, ring_smem, ready, consumed, *needs)
               for src, ring_smem, (ready, consumed), needs in zip(srcs, rings, pairs, sparse))


def _ring_barrier_types(stages: int, head_dim: int, opts) -> tuple:
  """The ring's (ready, consumed) barrier types in `_streams`' order: a pair for K, (the
  keys' ids,) (the bias,) V; where K and V share (`shares_kv_barriers`), K's pair takes both
  K's and V's copies, and V has none of its own."""
  shared = shares_kv_barriers(head_dim)
  copies = [2 if shared else 1] + [1] * (bool(opts.segments) + bool(opts.bias))
  copies += [] if shared else [1]
  return pipeline.ring_barrier_types(stages, copies)


def _producer_warpgroup(refs: _Refs, ring_barriers, sched, dims, opts):
  """Streams each tile's KV blocks through the ring, which runs on across the CTA's tiles."""
  def tile_streams(tile: scheduler.Tile, ring: pipeline.Ring):
    blocks = _cta_kv_blocks(tile, common.keys_of(tile.batch, refs.masks.kv_lens, dims), refs,
                            opts)
    streams = _streams(tile, blocks, ring, refs, ring_barriers, dims, opts)
    return streams, blocks.end - blocks.first, lambda: ring.after(blocks)

  common.produce_tiles(sched, tile_streams,
                       _streams(None, None, None, refs, ring_barriers, dims, opts),
                       opts.config.dq_stages, bias=bool(opts.bias))


def _entry(q, k, v, do, lse, delta, *rest, dims: common.Dims, sched, opts):
  masks, rest = common.MaskInputs.split(rest, opts)
  sched, (dq, *ds) = sched.bind(rest)
  cfg = opts.config
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  stages = cfg.dq_stages
  operand = functools.partial(common.smem_tile, dtype=dims.dtype,
                              max_swizzle=operand_swizzle(cfg, dims.dtype))
  scratch = (
      operand((wgs, cfg.block_q, dims.head_dim)),
      operand((wgs, cfg.block_q, dims.head_dim)),
      plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
      plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
      operand((stages, cfg.dq_keys, dims.head_dim)),
      operand((stages, cfg.dq_keys, dims.head_dim)),
      plgpu.SMEM((wgs, cfg.block_q), jnp.int32) if opts.segments else None,
      plgpu.SMEM((stages, cfg.dq_keys), jnp.int32) if opts.segments else None,
      common.smem_tile((stages, wgs, cfg.block_q, cfg.dq_keys), opts.bias_dtype(dims.dtype))
      if opts.bias else None,
      common.smem_tile((wgs, cfg.block_q, cfg.dq_keys), dims.dtype)
      if ds and dims.head_dim <= config_lib.DS_STAGING_MAX_HEAD_DIM else None,
  )
  staging = accumulate.staging_types(wgs, (cfg.block_q, cfg.dq_keys), dims.dtype,
                                     interpret=opts.interpret)
  barriers = (plgpu.Barrier(num_barriers=_tile_copies(opts) * wgs),
              *_ring_barrier_types(stages, dims.head_dim, opts))

  def scoped(q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, q_ids_smem, ids_ring,
             bias_ring, ds_smem, *rest):
    refs = _Refs(q, k, v, do, lse, delta, dq, q_smem, do_smem, lse_smem, delta_smem, k_ring,
                 v_ring, rest[0] if staging else None, masks, q_ids_smem, ids_ring,
                 ds[0] if ds else None, ds_smem, bias_ring)
    tile_ready, *ring_barriers = rest[len(staging):]
    common.specialize(
        lambda wg: _compute_warpgroup(wg, refs, ring_barriers, tile_ready, sched, dims, opts),
        lambda: _producer_warpgroup(refs, ring_barriers, sched, dims, opts))

  pl.run_scoped(scoped, *scratch, *staging, *barriers, collective_axes="wg")


def dq(q, k, v, do, lse_log2, delta, opts: common.BackwardOptions, kv_lens=None,
       segment_ids=None, bias=None):
  """dQ (B, T, N, D) in Q's dtype, from canonical padded inputs (see `backward`); with
  `opts.bias_grad`, (dQ, dS), dS (B, N, T, S) in Q's dtype (the bias's)."""
  dims = common.Dims.of(q, k, opts)
  cfg = opts.config
  rows = pipeline.NUM_COMPUTE_WARPGROUPS * cfg.block_q
  num_q_tiles = pl.cdiv(q.shape[1], rows)
  masks = common.MaskInputs.of(kv_lens, segment_ids, opts, seq_q=num_q_tiles * rows,
                              seq_kv=k.shape[1], block_q=cfg.block_q, block_kv=cfg.dq_keys)
  masks = masks.with_bias(bias, rows=num_q_tiles * rows, row_block=cfg.block_q,
                          col_block=cfg.dq_keys)
  out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
  if opts.bias_grad:  # In whole tiles: stores are not clipped at T and S (sliced below).
    shape = (num_q_tiles * rows, pl.cdiv(k.shape[1], cfg.dq_keys) * cfg.dq_keys)
    out_type = (out_type, jax.ShapeDtypeStruct((dims.batch, dims.num_q_heads, *shape),
                                               q.dtype))
  # Under a causal bound a head's last tiles see the most keys: with one CTA per tile they go
  # first, and the short ones fill the tail (a shortest-first order left the 16k causal grid's
  # last wave ~7% long in a list-scheduling model).
  sched = common.backward_schedule("dq", num_q_tiles, dims.num_q_heads, dims.batch, rows,
                                   steps=pl.cdiv(k.shape[1], cfg.dq_keys),
                                   stages=cfg.dq_stages, head_dim=dims.head_dim, opts=opts,
                                   descending=opts.mask.upper is not None,
                                   costs=lambda: common.query_tile_costs(
                                       opts.mask, num_q_tiles, rows, k.shape[1], cfg.dq_keys))
  out = common.launch(
      functools.partial(_entry, dims=dims, sched=sched, opts=opts), q, k, v, do, lse_log2,
      delta, *masks.arrays(), *sched.inputs(), out_type=out_type, grid=(sched.num_ctas,),
      grid_names=("cta",),
      name="flash_attn_hopper_dq", interpret=opts.interpret)
  if opts.bias_grad:
    dq_out, ds = out
    return dq_out, ds[:, :, :q.shape[1], :k.shape[1]]
  return out
