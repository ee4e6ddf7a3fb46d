"""The dQ kernel: for a tile of queries, stream the K/V blocks it saw in the forward.

A CTA owns 2·block_q query rows of one (batch, query head), like the forward: each compute
warpgroup loads its Q, dO, LSE and δ once, and the producer streams K and V through the same
ring as the forward's, over the same KV block range (`masking.kv_block_range`):

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
from flash_attn_hopper import masking
from flash_attn_hopper import pipeline
from flash_attn_hopper import softmax
from flash_attn_hopper.kernels import common

#: Up to this head dim S and dP are issued together and 2^(S − LSE) runs under dP. Measured
#: on the H200 (2026-11-30, bf16, fwd+bwd, one A/B run each): the dQ kernel took 4.63 against
#: 5.15 ms at D 128, 16k non-causal, and 2.77 against 3.11 ms at D 64, 16k causal; at D 256,
#: 4k, where the (block_q, 256) float32 dQ accumulator alone takes 128 registers a thread, 1.21
#: against 1.03 ms causal (and 2.07 against 2.13 non-causal), so D 256 keeps one matmul in
#: flight.
OVERLAP_MAX_HEAD_DIM = 128


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
  k_ring: object     # (dq stages, block_kv, D)
  v_ring: object
  staging: object    # interpreter only: (compute warpgroups, block_q, block_kv), else None
  masks: common.MaskInputs  # key lengths, segment ids and spans in global memory
  q_ids_smem: object = None  # segments: (compute warpgroups, block_q) int32
  ids_ring: object = None    # segments: (dq stages, block_kv) int32, the keys' ids
  ds: object = None          # bias_grad: (B, N, T, S) dS out, in the bias's dtype
  ds_smem: object = None     # bias_grad, D ≤ 128: (compute warpgroups, block_q, block_kv)


class _Tile(NamedTuple):
  batch: jax.Array
  head: jax.Array
  row0: jax.Array


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
      s = masking.apply_element_mask(s, q0, step * cfg.block_kv,
                                     masking.key_end_to_mask(seq_kv, cfg.block_kv), opts.mask,
                                     segments=None if k_ids is None else (q_ids, k_ids))
    return softmax.recompute(s, lse, opts.logits.exp2_scale), cap_grad

  shape = (cfg.block_q, cfg.block_kv)
  k_slot, v_slot = refs.k_ring.at[slot], refs.v_ring.at[slot]
  wait_v = lambda: plgpu.barrier_wait(v_s.ready.at[slot])
  if dims.head_dim <= OVERLAP_MAX_HEAD_DIM:
    (p, cap_grad), dp = common.overlapped_matmuls(
        (q_smem, k_slot.T, shape), (do_smem, v_slot.T, shape), probabilities,
        before_second=wait_v)
  else:
    p, cap_grad = probabilities(common.matmul(q_smem, k_slot.T, shape))
    wait_v()
    dp = common.matmul(do_smem, v_slot.T, shape)
  plgpu.barrier_arrive(v_s.consumed.at[slot])
  ds = softmax.logits_grad(p, dp, delta, cap_grad=cap_grad).astype(dims.dtype)
  if refs.ds is not None:
    _store_ds(ds, _ds_block(refs, tile, q0, step, cfg), refs.ds_smem, wg)
  carry = accumulate.matmul_accumulate(carry, ds, refs.k_ring.at[slot], staging=staging)
  plgpu.barrier_arrive(k_s.consumed.at[slot])
  return carry


def _ds_block(refs: _Refs, tile: "_Tile", q0, block, cfg):
  """The global-memory view of dS for this warpgroup's rows and KV block `block`."""
  return refs.ds.at[tile.batch, tile.head, pl.ds(q0, cfg.block_q),
                    pl.ds(block * cfg.block_kv, cfg.block_kv)]


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


def _zero_unvisited_ds(own: masking.BlockRange, tile: "_Tile", q0, refs: _Refs, wg, dims,
                       opts):
  """Zeros into this warpgroup's dS blocks outside its own run (P = 0 there): from the
  staging tile, filled with zeros once, or (without staging tiles) from registers."""
  cfg = opts.config
  zeros = common.zeros_accumulator((cfg.block_q, cfg.block_kv)).astype(dims.dtype)
  if refs.ds_smem is not None:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    refs.ds_smem.at[wg][...] = zeros
    plgpu.commit_smem()

  def zero(dst):
    if refs.ds_smem is None:
      dst[...] = zeros
    else:
      plgpu.copy_smem_to_gmem(refs.ds_smem.at[wg], dst)

  @pl.loop(0, pl.cdiv(refs.ds.shape[3], cfg.block_kv))
  def _zero(block):
    pl.when(jnp.logical_or(block < own.first, block >= own.end))(
        lambda: zero(_ds_block(refs, tile, q0, block, cfg)))


def _release_step(step, _, *, ring0, streams, num_stages):
  """A block streamed for the other warpgroup only (masks): observe it and free its slot
  (a sparse stream's only when it streamed the block)."""
  for stream in streams:
    pipeline.release(stream, ring0 + step, num_stages)


#: Per-warpgroup tile loads, each on its own barrier: Q, dO, the LSE, δ (and the rows' ids).
def _tile_copies(opts) -> int:
  return 5 if opts.segments else 4


def _load_tile(wg, tile: _Tile, refs: _Refs, tile_ready, opts):
  """Q, dO, the LSE and δ of this warpgroup's rows (and their segment ids), each on its own
  barrier."""
  q0 = tile.row0 + wg * opts.config.block_q
  rows = pl.ds(q0, opts.config.block_q)
  copies = [(refs.q.at[tile.batch, rows, tile.head], refs.q_smem),
            (refs.do.at[tile.batch, rows, tile.head], refs.do_smem),
            (refs.lse.at[tile.batch, tile.head, rows], refs.lse_smem),
            (refs.delta.at[tile.batch, tile.head, rows], refs.delta_smem)]
  if opts.segments:
    copies.append((refs.masks.q_ids.at[tile.batch, rows], refs.q_ids_smem))
  n = _tile_copies(opts)
  for i, (src, dst) in enumerate(copies):
    plgpu.copy_gmem_to_smem(src, dst.at[wg], tile_ready.at[n * wg + i])
  for i in range(len(copies)):
    plgpu.barrier_wait(tile_ready.at[n * wg + i])
  return q0


def _compute_warpgroup(wg, tile: _Tile, refs: _Refs, streams, tile_ready, cta, seq_kv, dims,
                       opts):
  """One warpgroup's queries: its own blocks of the CTA's [cta.first, cta.end), the others
  released (as in the forward)."""
  plgpu.set_max_registers(pipeline.COMPUTE_REGISTERS, action="increase")
  cfg = opts.config
  q0 = _load_tile(wg, tile, refs, tile_ready, opts)
  k_s, *extra, v_s = streams  # K, (the keys' ids,) (the bias,) V
  ids_s = extra.pop(0) if opts.segments else None
  bias_s = extra.pop(0) if opts.bias else None
  q_ids = plgpu.load(refs.q_ids_smem.at[wg], layout=common.ROWS) if opts.segments else None
  ring0 = -cta.first
  step = functools.partial(
      _kv_step, wg=wg, tile=tile, q0=q0, q_ids=q_ids, seq_kv=seq_kv, ring0=ring0,
      lse=plgpu.load(refs.lse_smem.at[wg], layout=common.ROWS),
      delta=plgpu.load(refs.delta_smem.at[wg], layout=common.ROWS), k_s=k_s, v_s=v_s,
      ids_s=ids_s, bias_s=bias_s, refs=refs,
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

  q_smem = refs.q_smem.at[wg]  # Q is no longer read: dQ leaves through it.
  q_smem[...] = (dq * opts.scale).astype(dims.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, refs.dq.at[tile.batch, pl.ds(q0, cfg.block_q), tile.head])
  plgpu.wait_smem_to_gmem(0)


def _kv_blocks(tile: _Tile, q0, rows: int, seq_kv, refs: _Refs, opts) -> masking.BlockRange:
  """The KV blocks the rows [q0, q0 + rows) saw in the forward: the band's, narrowed by
  segments and a mask."""
  band = masking.kv_block_range(opts.mask, q0, rows, seq_kv, opts.config.block_kv)
  return common.narrow_kv_blocks(band, refs.masks, opts, batch=tile.batch, head=tile.head,
                                 q0=q0, rows=rows)


def _q_tile(num_q_tiles: int, opts):
  """The grid's query tile, longest first: under a causal bound the last tiles see the most
  keys, so they run first and the short ones fill the tail (a shortest-first order left the
  16k causal grid's last wave ~7% long in a list-scheduling model)."""
  index = lax.axis_index("q_tile")
  return index if opts.mask.upper is None else num_q_tiles - 1 - index


def _entry(q, k, v, do, lse, delta, *rest, dims: common.Dims, num_q_tiles: int, opts):
  masks, (dq, *ds) = common.MaskInputs.split(rest, opts)
  cfg = opts.config
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  stages = cfg.dq_stages
  scratch = (
      common.smem_tile((wgs, cfg.block_q, dims.head_dim), dims.dtype),
      common.smem_tile((wgs, cfg.block_q, dims.head_dim), dims.dtype),
      plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
      plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
      common.smem_tile((stages, cfg.block_kv, dims.head_dim), dims.dtype),
      common.smem_tile((stages, cfg.block_kv, dims.head_dim), dims.dtype),
      plgpu.SMEM((wgs, cfg.block_q), jnp.int32) if opts.segments else None,
      plgpu.SMEM((stages, cfg.block_kv), jnp.int32) if opts.segments else None,
      common.smem_tile((stages, wgs, cfg.block_q, cfg.block_kv), opts.bias_dtype(dims.dtype))
      if opts.bias else None,
      common.smem_tile((wgs, cfg.block_q, cfg.block_kv), dims.dtype)
      if ds and dims.head_dim <= config_lib.DS_STAGING_MAX_HEAD_DIM else None,
  )
  staging = accumulate.staging_types(wgs, (cfg.block_q, cfg.block_kv), dims.dtype,
                                     interpret=opts.interpret)
  num_streams = 2 + bool(opts.segments) + bool(opts.bias)  # K, (ids,) (bias,) V
  barriers = (plgpu.Barrier(num_barriers=_tile_copies(opts) * wgs),
              *(b for _ in range(num_streams) for b in pipeline.stream_barrier_types(stages)))

  def scoped(q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, q_ids_smem, ids_ring,
             bias_ring, ds_smem, *rest):
    refs = _Refs(q, k, v, do, lse, delta, dq, q_smem, do_smem, lse_smem, delta_smem, k_ring,
                 v_ring, rest[0] if staging else None, masks, q_ids_smem, ids_ring,
                 ds[0] if ds else None, ds_smem)
    tile_ready, *ring_barriers = rest[len(staging):]
    tile = _Tile(batch=lax.axis_index("batch"), head=lax.axis_index("head"),
                 row0=_q_tile(num_q_tiles, opts) * wgs * cfg.block_q)
    kv_head = tile.head // dims.group
    seq_kv = common.keys_of(tile.batch, masks.kv_lens, dims)
    cta = _kv_blocks(tile, tile.row0, wgs * cfg.block_q, seq_kv, refs, opts)
    rows = lambda step: pl.ds((cta.first + step) * cfg.block_kv, cfg.block_kv)
    srcs = [lambda step: k.at[tile.batch, rows(step), kv_head],
            lambda step: v.at[tile.batch, rows(step), kv_head]]
    rings = [k_ring, v_ring]
    if opts.bias:  # The bias and the keys' ids go between K and V.
      srcs.insert(1, lambda step: common.bias_block(masks, opts, tile.batch, tile.head,
                                                    tile.row0, rows(step)))
      rings.insert(1, bias_ring)
    if opts.segments:
      srcs.insert(1, lambda step: masks.kv_ids.at[tile.batch, rows(step)])
      rings.insert(1, ids_ring)
    sparse = [(None, None)] * len(srcs)
    if opts.bias:  # No tile where the bias is zero for every row of the CTA.
      sparse[-2] = cta.edge_steps(first=cta.first)
    streams = tuple(pipeline.Stream(*stream, *needs) for *stream, needs in zip(
        srcs, rings, ring_barriers[::2], ring_barriers[1::2], sparse))
    common.specialize(
        lambda wg: _compute_warpgroup(wg, tile, refs, streams, tile_ready, cta, seq_kv, dims,
                                      opts),
        lambda: common.producer(streams, cta.end - cta.first, stages,
                                sparse_total=cta.edge_count(cta.end)))

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
                              seq_kv=k.shape[1], block_q=cfg.block_q, block_kv=cfg.block_kv)
  masks = masks.with_bias(bias, rows=num_q_tiles * rows, row_block=cfg.block_q,
                          col_block=cfg.block_kv)
  out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
  if opts.bias_grad:  # In whole tiles: stores are not clipped at T and S (sliced below).
    shape = (num_q_tiles * rows, pl.cdiv(k.shape[1], cfg.block_kv) * cfg.block_kv)
    out_type = (out_type, jax.ShapeDtypeStruct((dims.batch, dims.num_q_heads, *shape),
                                               q.dtype))
  out = common.launch(
      functools.partial(_entry, dims=dims, num_q_tiles=num_q_tiles, opts=opts), q, k, v, do,
      lse_log2, delta,
      *masks.arrays(), out_type=out_type,
      grid=(num_q_tiles, dims.num_q_heads, dims.batch), grid_names=("q_tile", "head", "batch"),
      name="flash_attn_hopper_dq", interpret=opts.interpret)
  if opts.bias_grad:
    dq_out, ds = out
    return dq_out, ds[:, :, :q.shape[1], :k.shape[1]]
  return out
