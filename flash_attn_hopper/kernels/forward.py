"""The forward attention kernel: FA3's shape in Pallas Mosaic GPU.

A CTA loops over tiles of 2·block_q query rows of one (batch, head), in the order `scheduler`
gives (persistent, or paired for causal): two compute warpgroups of block_q rows and a TMA
producer warpgroup (see `pipeline`), whose K/V ring runs on across tiles. For each tile,
each compute warpgroup runs:

    prologue   wait for its Q tile (TMA, issued under the previous tile's epilogue);
               m = −inf, l = 0, O = 0
    kv_loop    for each visited KV block (masking.kv_block_range, narrowed to the blocks
               that share a segment with the tile when segment ids come along):
                 S = Q Kᵀ                      wgmma into a fresh accumulator
                 mask S                        edge blocks of the band or a segment only
                 m, l, P, α = softmax.update   base 2, scale folded into the exponent
                 O = α·O + P V                 P from registers; O re-enters the tensor cores
    epilogue   O / l and the LSE through shared memory and TMA

With `ForwardConfig.overlap_softmax` (FA3's intra-warpgroup overlap; tuned on at D 128 and 256,
and taken only where no block needs an element mask, or under causal with the diagonal block
first, FA3's order; with a bias or a mask, by the tiles whose CTA sees every block in full),
`_attend_overlapped` runs the loop shifted by one block: S of block j and PV of block j − 1
are issued together, and the softmax of S runs while PV is on the tensor cores. The
warpgroups then take turns to issue (`Barriers.turn`) instead of meeting at the schedule
barrier twice per block.

Rows past T and keys past S are zero-filled by TMA on load and clipped on store; keys past S
are masked inside the kernel, so any T ≥ 1 and S ≥ 1 work. With segment ids, each warpgroup's
rows' ids come with its Q tile and the keys' ids stream through the ring between K and V. A
bias (or a mask) streams its tiles for the blocks the CTA does not see in full only, on a
sparse stream of its own ring positions (`pipeline.Ring`), so a fully visible block costs
nothing.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class ForwardOptions(common.AttentionOptions):
  """Static options of one forward call."""

  config: config_lib.ForwardConfig


class _Refs(NamedTuple):
  """Global and shared-memory refs of one CTA."""
  q: object
  k: object
  v: object
  o: object
  lse: object
  q_smem: object    # (compute warpgroups, block_q, D): Q in
  o_smem: object    # (compute warpgroups, block_q, D): O out; q_smem itself when it won't fit
  k_smem: object    # (num_stages, block_kv, D)
  v_smem: object
  lse_smem: object  # (compute warpgroups, block_q) float32
  p_staging: object  # interpreter only: (compute warpgroups, block_q, block_kv), else None
  masks: common.MaskInputs  # key lengths, segment ids and spans in global memory
  q_ids_smem: object = None  # segments: (compute warpgroups, block_q) int32
  ids_ring: object = None    # segments: (num_stages, block_kv) int32, the keys' ids
  bias_ring: object = None   # bias: (bias stages, compute warpgroups, block_q, block_kv)


def _ids_stream(bars: pipeline.Barriers, refs: _Refs):
  """The consumers' view of the keys' segment ids stream (`common.key_ids`), or None."""
  if refs.ids_ring is None:
    return None
  return pipeline.Stream(None, refs.ids_ring, bars.ids_ready, bars.ids_consumed)


def _logits(q_smem, k_smem, cfg: config_lib.ForwardConfig, *, before_issue=None,
            after_issue=None):
  """S = Q Kᵀ of one block into a fresh wgmma accumulator, awaited; `before_issue` and
  `after_issue` run around the issue (the warpgroups' schedule barrier or turn)."""
  def qk(s_ref):
    if before_issue is not None:
      before_issue()
    plgpu.wgmma(s_ref, q_smem, k_smem.T)
    if after_issue is not None:
      after_issue()
    return s_ref[...]

  return pl.run_scoped(qk, plgpu.ACC((cfg.block_q, cfg.block_kv), jnp.float32))


def _online_softmax(s, state, step, *, opts, q0, seq_kv, masked, bias=None, segments=None):
  """Block `step`'s raw logits into the online softmax: the bias (a loaded tile or None) and
  the soft-cap, the element mask when `masked` (with the rows' and keys' segment ids when
  given), then `softmax.update`: returns (state, p, α), the row sum not yet added."""
  s, _ = opts.logits.transform(s, bias)
  if masked:
    block_kv = opts.config.block_kv
    s = masking.apply_element_mask(s, q0, step * block_kv,
                                   masking.key_end_to_mask(seq_kv, block_kv), opts.mask,
                                   segments=segments)
  return softmax.update(state, s, opts.logits.exp2_scale)


def _kv_step(step, carry, *, refs, bars, dims, opts, wg, q0, q_ids, seq_kv, ring0, end,
             bias_s, q_smem, p_staging, masked):
  """KV block `step` of a tile for one compute warpgroup: S = QKᵀ, mask, softmax, O += PV.

  `ring0 + step` is block `step`'s ring position (the ring runs on across tiles); `end` is
  the end of this warpgroup's blocks; `q_ids` are its rows' segment ids, or None;
  `bias_s` is the bias's sparse stream (None without a bias; see `_attend`)."""
  acc, state = carry
  cfg = opts.config
  slot = pipeline.slot_of(ring0 + step, cfg.num_stages)

  # Hand the tensor cores to the other warpgroup once S is issued.
  s = _logits(q_smem, refs.k_smem.at[slot], cfg, after_issue=bars.sync_schedule)
  plgpu.barrier_arrive(bars.k_consumed.at[slot])
  k_ids = common.key_ids(_ids_stream(bars, refs), slot, load=masked)
  # A bias tile comes with the masked (edge) blocks only; see `_attend`.
  bias = common.bias_tile(bias_s, step, wg, cfg.num_stages, opts) if masked else None
  state, p, alpha = _online_softmax(s, state, step, bias=bias,
                                    segments=None if k_ids is None else (q_ids, k_ids),
                                    opts=opts, q0=q0, seq_kv=seq_kv, masked=masked)
  acc = softmax.rescale(acc, alpha)
  p16 = p.astype(dims.dtype)

  def end_softmax():
    plgpu.barrier_arrive(bars.schedule)  # Softmax done.
    plgpu.barrier_wait(bars.v_ready.at[slot])
    plgpu.barrier_wait(bars.schedule)    # The other warpgroup is off the tensor cores.

  # Where the row sum goes relative to the barriers changes register pressure and the
  # schedule. The order JAX's attention_mgpu found fastest: before them, pinned by an
  # optimization barrier, up to D 128; after them at D 256.
  if dims.head_dim <= 128:
    state = softmax.add_row_sum(state, p)
    acc, state, p16 = lax.optimization_barrier((acc, state, p16))
    end_softmax()
  else:
    end_softmax()
    state = softmax.add_row_sum(state, p)

  def wait_next_k():  # Overlaps the wait for the next K block with PV.
    nxt = step + 1
    pl.when(nxt < end)(
        lambda: plgpu.barrier_wait(
            bars.k_ready.at[pipeline.slot_of(ring0 + nxt, cfg.num_stages)]))

  acc = accumulate.matmul_accumulate(acc, p16, refs.v_smem.at[slot], staging=p_staging,
                                     while_running=wait_next_k)
  plgpu.barrier_arrive(bars.v_consumed.at[slot])
  return acc, state


def _free_kv_slot(bars: pipeline.Barriers, slot):
  """Observes a K/V slot's loads unread (every phase of a ready barrier is waited once by
  each consumer) and frees it: for a block streamed for the other warpgroup only."""
  plgpu.barrier_wait(bars.k_ready.at[slot])
  plgpu.barrier_wait(bars.v_ready.at[slot])
  plgpu.barrier_arrive(bars.k_consumed.at[slot])
  plgpu.barrier_arrive(bars.v_consumed.at[slot])


def _release_step(step, _, *, refs, bars, opts, ring0, bias_s):
  """A block streamed for the other warpgroup only (masks): free its slots, and keep the
  plain loop's beat (two schedule phases per block)."""
  slot = pipeline.slot_of(ring0 + step, opts.config.num_stages)
  common.key_ids(_ids_stream(bars, refs), slot, load=False)
  if bias_s is not None:  # Sparse: only a block the CTA does not see in full has a tile.
    pipeline.release(bias_s, step, opts.config.num_stages)
  _free_kv_slot(bars, slot)
  bars.sync_schedule()
  bars.sync_schedule()


def _kv_blocks(tile: scheduler.Tile, q0, rows: int, refs: _Refs, dims, opts: ForwardOptions):
  """The KV blocks that the rows [q0, q0 + rows) of a tile visit: the band's, narrowed to
  the blocks that share a segment with them."""
  seq_kv = common.keys_of(tile.batch, refs.masks.kv_lens, dims)
  band = masking.kv_block_range(opts.mask, q0, rows, seq_kv, opts.config.block_kv)
  return common.narrow_kv_blocks(band, refs.masks, opts, batch=tile.batch, head=tile.head,
                                 q0=q0, rows=rows)


def _cta_kv_blocks(tile: scheduler.Tile, refs: _Refs, dims: common.Dims, opts: ForwardOptions):
  """KV blocks the producer streams for a tile: every block either warpgroup visits."""
  return _kv_blocks(tile, tile.row0, opts.config.rows_per_cta, refs, dims, opts)


def _warpgroup_blocks(wg, tile: scheduler.Tile, cta: masking.BlockRange, refs: _Refs, dims,
                      opts: ForwardOptions):
  """A compute warpgroup's first row, the keys of its batch element and its own part of the
  KV blocks its CTA streams for the tile (`cta`)."""
  q0 = tile.row0 + wg * opts.config.block_q
  seq_kv = common.keys_of(tile.batch, refs.masks.kv_lens, dims)
  own = _kv_blocks(tile, q0, opts.config.block_q, refs, dims, opts).within(cta)
  return q0, seq_kv, own


def _attend(wg, tile: scheduler.Tile, cta: masking.BlockRange, ring: pipeline.Ring, q_ids,
            refs: _Refs, bars: pipeline.Barriers, dims, opts):
  """The kv_loop of one warpgroup over one tile; returns the O accumulator and softmax state.

  The CTA streams blocks [cta.first, cta.end); this warpgroup computes on its own part of
  them and releases the rest, so that both warpgroups keep the same beat on the ring."""
  cfg = opts.config
  q0, seq_kv, own = _warpgroup_blocks(wg, tile, cta, refs, dims, opts)
  if opts.bias:  # Its unmasked blocks are ones the producer streams no bias tile for.
    own = own.full_within(cta)
  ring0 = ring.kv - cta.first  # Ring position of block 0.
  bias_s = None if refs.bias_ring is None else pipeline.Stream(  # The consumers' view.
      None, refs.bias_ring, bars.bias_ready, bars.bias_consumed,
      *cta.edge_steps(base=ring.bias), cfg.bias_num_stages)
  step = functools.partial(_kv_step, refs=refs, bars=bars, dims=dims, opts=opts, wg=wg, q0=q0,
                           q_ids=q_ids, seq_kv=seq_kv, ring0=ring0, end=own.end,
                           bias_s=bias_s, q_smem=refs.q_smem.at[wg],
                           p_staging=None if refs.p_staging is None else refs.p_staging.at[wg])
  release = functools.partial(_release_step, refs=refs, bars=bars, opts=opts, ring0=ring0,
                              bias_s=bias_s)
  acc = plgpu.layout_cast(jnp.zeros((cfg.block_q, dims.head_dim), jnp.float32),
                          plgpu.Layout.WGMMA)
  carry = (acc, softmax.init(cfg.block_q))
  first_k_ready = functools.partial(  # Each step waits for the next K during its PV.
      pl.when(own.end > own.first), lambda: plgpu.barrier_wait(
          bars.k_ready.at[pipeline.slot_of(ring0 + own.first, cfg.num_stages)]))
  return common.walk_blocks(cta, own, step, release, carry, before_own=first_k_ready)


def _overlaps(opts: ForwardOptions) -> bool:
  """Whether the kernel has FA3's intra-warpgroup overlap (`_attend_overlapped`): when the
  config asks for it and no block needs an element mask (no band, key lengths or segment
  ids, and S a whole number of blocks), so that every warpgroup visits every block of its
  CTA unmasked; or when each warpgroup's one masked block can go first (`_last_first`):
  causal's diagonal block, or without a band the block that holds the keys' end. Masked
  blocks in the overlapped steps measured slower than the plain loop on the H200 (see
  `config.TUNED_FORWARD`), so other bands keep the plain loop: with a bias (a mask), a tile
  takes the overlap when its CTA sees every block in full, else the plain loop
  (`_attend_tile`)."""
  cfg = opts.config
  if not cfg.overlap_softmax or opts.segments:
    return False
  if opts.kv_lens or _ragged_keys(opts):
    return _key_end_first(opts)
  return not opts.mask.banded or _diagonal_first(opts)


def _last_first(opts: ForwardOptions) -> bool:
  """Whether the overlapped kv_loop walks a tile's blocks from the last down (FA3's order),
  so that the one block each warpgroup masks comes first, where no PV is in flight."""
  return _diagonal_first(opts) or _key_end_first(opts)


def _key_end_first(opts: ForwardOptions) -> bool:
  """Whether the only element mask is the keys' end (key lengths, or S not a whole number
  of blocks; no band, segment ids or bias): it falls on a tile's last block, which the
  overlapped loop then takes first."""
  return ((opts.kv_lens or _ragged_keys(opts)) and not opts.mask.banded and not opts.segments
          and not opts.bias)


def _ragged_keys(opts: ForwardOptions) -> bool:
  """Whether S is known and not a whole number of key blocks, so the last block is cut."""
  return opts.seq_kv is not None and opts.seq_kv % opts.config.block_kv != 0


def _diagonal_first(opts: ForwardOptions) -> bool:
  """Whether the overlapped kv_loop walks a tile's blocks from the last down, FA3's order
  under causal: the diagonal block first, element-masked in `_overlap_first` where no PV is
  in flight, then the blocks below it, which every row sees in full. That holds when every
  warpgroup's rows have their diagonals in one block (block_q divides block_kv, and the
  diagonal's offset is a whole number of blocks, ≥ 0 so that every row sees key 0), with no
  window on the left and no bias."""
  spec, cfg = opts.mask, opts.config
  return (spec.is_causal and spec.upper == 0 and spec.left is None and not opts.bias
          and spec.offset >= 0 and spec.offset % cfg.block_kv == 0
          and cfg.block_kv % cfg.block_q == 0)


def _attend_tile(wg, tile: scheduler.Tile, cta: masking.BlockRange, ring: pipeline.Ring, q_ids,
                 refs: _Refs, bars: pipeline.Barriers, dims, opts):
  """The kv_loop of one warpgroup over one tile, overlapped or plain (see `_overlaps`). Both
  warpgroups choose alike: from their CTA's blocks, `cta`."""
  overlapped = lambda: _attend_overlapped(wg, tile, cta, ring, refs, bars, dims, opts)
  plain = lambda: _attend(wg, tile, cta, ring, q_ids, refs, bars, dims, opts)
  if not _overlaps(opts):
    return plain()
  if opts.bias:
    takes_overlap = ((cta.first < cta.end) & (cta.full_lo == cta.first)
                     & (cta.full_hi == cta.end))
  elif opts.kv_lens:  # A batch element with no keys streams no block.
    takes_overlap = cta.first < cta.end
  else:
    return overlapped()

  def plain_tile():
    # Warpgroup 1's phase offset on the schedule barrier begins and ends with the tile (in
    # a kernel of one loop it spans the kernel): otherwise warpgroup 1 would wait at its
    # last block's rendezvous for warpgroup 0, which may be on to an overlapped tile and
    # waiting for warpgroup 1's turn.
    pl.when(wg == 1)(bars.sync_schedule)
    result = plain()
    pl.when(wg == 0)(bars.sync_schedule)
    return result
  return lax.cond(takes_overlap, overlapped, plain_tile)


def _softmax_block(s, state, step, *, dims, opts, q0, seq_kv, masked):
  """Block `step`'s logits into the online softmax: returns (state, P in the inputs' dtype,
  α)."""
  state, p, alpha = _online_softmax(s, state, step, opts=opts, q0=q0, seq_kv=seq_kv,
                                    masked=masked)
  p16 = p.astype(dims.dtype)
  state = softmax.add_row_sum(state, p)
  return state, p16, alpha


def _overlapped_step(i, carry, *, refs, bars, ring0, block_of, wg, q_smem, p_staging, **kw):
  """The tile's `i`-th streamed block with the PV of the one before under its softmax (FA3's
  intra-warpgroup overlap): S = QKᵀ and O += P·V are issued together, then the softmax of S
  runs while PV is on the tensor cores. `carry` is (O, state, P, α), P and α of block i − 1;
  `ring0 + i` is the block's ring position, `block_of(i)` its index among the keys'."""
  acc, state, p16, alpha = carry
  cfg = kw["opts"].config
  slot = pipeline.slot_of(ring0 + i, cfg.num_stages)
  prev = pipeline.slot_of(ring0 + i - 1, cfg.num_stages)
  plgpu.barrier_wait(bars.k_ready.at[slot])
  acc = softmax.rescale(acc, alpha)
  plgpu.barrier_wait(bars.v_ready.at[prev])

  def on_s(s):
    plgpu.barrier_arrive(bars.k_consumed.at[slot])
    return _softmax_block(s, state, block_of(i), masked=False, **kw)

  shape = (cfg.block_q, cfg.block_kv)
  bars.take_turn(wg)
  acc, (state, p16, alpha) = accumulate.matmul_beside_accumulate(
      acc, p16, refs.v_smem.at[prev], (q_smem, refs.k_smem.at[slot].T, shape), on_s,
      (state, p16, alpha), staging=p_staging, after_issue=lambda: bars.pass_turn(wg))
  plgpu.barrier_arrive(bars.v_consumed.at[prev])
  return acc, state, p16, alpha


def _overlap_first(i, *, refs, bars, ring0, block_of, wg, q_smem, **kw):
  """The first block an overlapped kv_loop computes on (the tile's `i`-th streamed): S and
  its softmax, no PV yet. Element-masked: under `_last_first` this is the diagonal block
  or the one that holds the keys' end, elsewhere a no-op, once per tile (kept as
  measured)."""
  cfg = kw["opts"].config
  slot = pipeline.slot_of(ring0 + i, cfg.num_stages)
  plgpu.barrier_wait(bars.k_ready.at[slot])

  s = _logits(q_smem, refs.k_smem.at[slot], cfg, before_issue=lambda: bars.take_turn(wg),
              after_issue=lambda: bars.pass_turn(wg))
  plgpu.barrier_arrive(bars.k_consumed.at[slot])
  return _softmax_block(s, softmax.init(cfg.block_q), block_of(i), masked=True, **kw)


def _overlap_last(acc, p16, alpha, i, *, refs, bars, ring0, opts, p_staging):
  """The PV of an overlapped kv_loop's last block (the tile's `i`-th streamed)."""
  slot = pipeline.slot_of(ring0 + i, opts.config.num_stages)
  plgpu.barrier_wait(bars.v_ready.at[slot])
  acc = accumulate.matmul_accumulate(softmax.rescale(acc, alpha), p16, refs.v_smem.at[slot],
                                     staging=p_staging)
  plgpu.barrier_arrive(bars.v_consumed.at[slot])
  return acc


def _stream_order(blocks: masking.BlockRange, opts: ForwardOptions):
  """The KV block a tile streams `i`-th: its blocks in order, or from the last down under
  `_last_first`. The producer and both compute warpgroups walk the same order."""
  if _overlaps(opts) and _last_first(opts):
    return lambda i: blocks.end - 1 - i
  return lambda i: blocks.first + i


def _release_turn(i, _, *, bars, ring0, wg, opts):
  """`_diagonal_first`'s block streamed for the other warpgroup only (its diagonal block,
  where that lies above this warpgroup's): free the slot and pass a turn, so that both
  warpgroups take as many turns per tile."""
  _free_kv_slot(bars, pipeline.slot_of(ring0 + i, opts.config.num_stages))
  bars.take_turn(wg)
  bars.pass_turn(wg)


def _attend_overlapped(wg, tile: scheduler.Tile, cta: masking.BlockRange, ring: pipeline.Ring,
                       refs: _Refs, bars: pipeline.Barriers, dims, opts):
  """`_attend` with FA3's intra-warpgroup overlap, for tiles whose blocks are all unmasked
  (`_overlaps`, `_attend_tile`), or whose one masked block per warpgroup goes first
  (`_last_first`): the first block's softmax, then per block its S beside the previous
  block's PV, then the last block's PV. The warpgroups take turns to issue
  (`Barriers.turn`): one turn per streamed block and one per tile (the last PV). The tile
  streams no bias tile (every block is fully visible), so the bias stream is not touched."""
  cfg = opts.config
  q0, seq_kv, own = _warpgroup_blocks(wg, tile, cta, refs, dims, opts)
  skip = 0  # Blocks streamed first for the other warpgroup only.
  if _diagonal_first(opts):  # Every row sees key 0: the blocks above its diagonal differ.
    skip = cta.end - own.end
  elif not (opts.bias or opts.kv_lens):  # Else `_attend_tile` checked it at run time.
    assert own == cta, "the overlapped kv_loop visits every block of its CTA"
  kw = dict(dims=dims, opts=opts, q0=q0, seq_kv=seq_kv)
  at = dict(refs=refs, bars=bars, ring0=ring.kv, wg=wg)
  block_of = _stream_order(cta, opts)
  p_staging = None if refs.p_staging is None else refs.p_staging.at[wg]
  common.fori(0, skip, functools.partial(_release_turn, bars=bars, ring0=ring.kv, wg=wg,
                                         opts=opts), None)
  acc = common.zeros_accumulator((cfg.block_q, dims.head_dim))
  state, p16, alpha = _overlap_first(skip, block_of=block_of, q_smem=refs.q_smem.at[wg],
                                     **at, **kw)
  step = functools.partial(_overlapped_step, block_of=block_of, q_smem=refs.q_smem.at[wg],
                           p_staging=p_staging, **at, **kw)
  num_blocks = cta.end - cta.first
  acc, state, p16, alpha = common.fori(skip + 1, num_blocks, step, (acc, state, p16, alpha))
  bars.take_turn(wg)
  acc = _overlap_last(acc, p16, alpha, num_blocks - 1, refs=refs, bars=bars, ring0=ring.kv,
                      opts=opts, p_staging=p_staging)
  bars.pass_turn(wg)
  return acc, state


def _load_q(wg, tile: scheduler.Tile, refs: _Refs, bars: pipeline.Barriers, block_q: int):
  """The warpgroup's Q tile, and with segment ids its rows' ids, each on its own barrier."""
  rows = pl.ds(tile.row0 + wg * block_q, block_q)
  plgpu.copy_gmem_to_smem(refs.q.at[tile.batch, rows, tile.head], refs.q_smem.at[wg],
                          bars.q_ready.at[wg])
  if refs.q_ids_smem is not None:
    plgpu.copy_gmem_to_smem(refs.masks.q_ids.at[tile.batch, rows], refs.q_ids_smem.at[wg],
                            bars.q_ids_ready.at[wg])


def _wait_q(wg, refs: _Refs, bars: pipeline.Barriers):
  """Waits for the warpgroup's Q tile; returns its rows' segment ids (registers) or None."""
  plgpu.barrier_wait(bars.q_ready.at[wg])
  if refs.q_ids_smem is None:
    return None
  plgpu.barrier_wait(bars.q_ids_ready.at[wg])
  ids = plgpu.load(refs.q_ids_smem.at[wg], layout=common.ROWS)
  pipeline.order_loads_before_tma()  # The next tile's ids land here by TMA.
  return ids


#: From this head dim on, `_store_tile` addresses its buffers through `common.unhoisted(wg)`,
#: so that LLVM computes the epilogue's addresses after the KV loop instead of holding them
#: across it (as `dkv.UNHOISTED_EPILOGUE`). ptxas, bf16 1k: D 256 spill stores 72 → 64 bytes,
#: causal 16 → 8; D 64 and 128 spill nothing either way. Interleaved A/B on the H200
#: (2026-12-02, bf16, B·T = 16k, hidden 2048, best of 5 CUPTI medians, ratio to cuDNN
#: without → with; bench/results/h200_unhoisted_epilogue_ab.log, run 4;
#: `scripts/ab_unhoisted_epilogue.py fwd`): D 256 1k 1.008 → 1.010,
#: causal 1.054 → 1.057; 4k 1.000 → 1.003, 1.074 → 1.086; 16k 0.988 → 0.996, 1.056 → 1.061.
#: D 128 lost in 4 cells of 6 (−0.3 to −1.3%), D 64 moved both ways (−0.6 to +2.1%).
UNHOISTED_EPILOGUE_MIN_HEAD_DIM = 256


def _epilogue_wg(wg, dims: common.Dims):
  """The warpgroup index that `_store_tile` addresses its buffers by
  (`UNHOISTED_EPILOGUE_MIN_HEAD_DIM`)."""
  return common.unhoisted(wg) if dims.head_dim >= UNHOISTED_EPILOGUE_MIN_HEAD_DIM else wg


def _compute_warpgroup(wg, refs: _Refs, bars: pipeline.Barriers, sched, dims, opts):
  plgpu.set_max_registers(pipeline.COMPUTE_REGISTERS, action="increase")
  cfg = opts.config
  cta = lax.axis_index("cta")
  num_items = sched.items_of(cta)
  separate_o = refs.o_smem is not refs.q_smem
  _load_q(wg, sched.tile(cta, 0), refs, bars, cfg.block_q)
  if _overlaps(opts):
    pl.when(wg == 1)(lambda: bars.pass_turn(1))  # Warpgroup 0 issues first.
  else:
    pl.when(wg == 1)(bars.sync_schedule)    # Warpgroup 1 runs one phase behind.

  def tile_body(i, ring: pipeline.Ring):
    tile = sched.tile(cta, i)
    load_next_q = functools.partial(
        pl.when(i + 1 < num_items),
        lambda: _load_q(wg, sched.tile(cta, i + 1), refs, bars, cfg.block_q))
    q_ids = _wait_q(wg, refs, bars)
    cta_blocks = _cta_kv_blocks(tile, refs, dims, opts)  # What the producer streams.
    acc, state = _attend_tile(wg, tile, cta_blocks, ring, q_ids, refs, bars, dims, opts)
    if separate_o:  # Q is free now: fetch the next tile's under this epilogue.
      load_next_q()
    out, lse = softmax.finalize(state, acc)
    _store_tile(_epilogue_wg(wg, dims), out, lse, tile, refs, dims)
    if not separate_o:  # O went out through Q's buffer: wait until TMA has read it.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      load_next_q()
    return ring.after(cta_blocks)

  lax.fori_loop(0, num_items, tile_body, pipeline.Ring.start(bias=bool(opts.bias)))
  if _overlaps(opts):  # Observe the turn warpgroup 1 passed last, so no phase goes unseen.
    pl.when(wg == 0)(lambda: bars.take_turn(0))
  else:
    pl.when(wg == 0)(bars.sync_schedule)    # Match warpgroup 1's extra phase.
  plgpu.wait_smem_to_gmem(0)


def _store_tile(wg, out, lse, tile: scheduler.Tile, refs: _Refs, dims: common.Dims):
  """O and the LSE go to shared memory, then to global memory with TMA (rows past T clip)."""
  o_smem, lse_smem = refs.o_smem.at[wg], refs.lse_smem.at[wg]
  rows = o_smem.shape[0]
  q0 = tile.row0 + wg * rows
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The previous tile's store has read them.
  o_smem[...] = out.astype(dims.dtype)
  lse_smem[...] = lse
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, refs.o.at[tile.batch, pl.ds(q0, rows), tile.head])
  plgpu.copy_smem_to_gmem(lse_smem, refs.lse.at[tile.batch, tile.head, pl.ds(q0, rows)])


def _producer_warpgroup(refs: _Refs, bars: pipeline.Barriers, sched, dims, opts):
  cfg = opts.config

  def tile_streams(tile: scheduler.Tile, ring: pipeline.Ring):
    kv_head = tile.head // dims.group  # GQA: no repeated K/V.
    blocks = _cta_kv_blocks(tile, refs, dims, opts)
    block_of = _stream_order(blocks, opts)
    rows = lambda step: pl.ds(block_of(step) * cfg.block_kv, cfg.block_kv)
    streams = bars.kv_streams(lambda step: refs.k.at[tile.batch, rows(step), kv_head],
                              lambda step: refs.v.at[tile.batch, rows(step), kv_head],
                              refs.k_smem, refs.v_smem,
                              lambda step: refs.masks.kv_ids.at[tile.batch, rows(step)],
                              refs.ids_ring,
                              lambda step: common.bias_block(refs.masks, opts, tile.batch,
                                                             tile.head, tile.row0, rows(step)),
                              refs.bias_ring,
                              # No tile where the bias is zero for every row of the CTA.
                              *blocks.edge_steps(first=blocks.first, base=ring.bias),
                              cfg.bias_num_stages)
    return streams, blocks.end - blocks.first, lambda: ring.after(blocks)

  common.produce_tiles(
      sched, tile_streams,
      bars.kv_streams(None, None, refs.k_smem, refs.v_smem, None, refs.ids_ring, None,
                      refs.bias_ring, bias_position=lambda step: step,
                      bias_stages=cfg.bias_num_stages),
      cfg.num_stages, bias=bool(opts.bias))


def _cta_body(refs: _Refs, bars: pipeline.Barriers, *, sched, dims: common.Dims, opts):
  common.specialize(lambda wg: _compute_warpgroup(wg, refs, bars, sched, dims, opts),
                    lambda: _producer_warpgroup(refs, bars, sched, dims, opts))


def _entry(q_ref, k_ref, v_ref, *rest, sched, dims: common.Dims, opts: ForwardOptions):
  masks, rest = common.MaskInputs.split(rest, opts)
  sched, (o_ref, lse_ref) = sched.bind(rest)
  cfg = opts.config
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  itemsize = jnp.dtype(dims.dtype).itemsize
  separate_o = cfg.separate_o(dims.head_dim, itemsize, segments=opts.segments,
                              bias_bytes=opts.bias_bytes(dims.dtype))
  scratch = (
      common.smem_tile((wgs, cfg.block_q, dims.head_dim), dims.dtype),
      common.smem_tile((wgs, cfg.block_q, dims.head_dim), dims.dtype) if separate_o else None,
      common.smem_tile((cfg.num_stages, cfg.block_kv, dims.head_dim), dims.dtype),
      common.smem_tile((cfg.num_stages, cfg.block_kv, dims.head_dim), dims.dtype),
      plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
      plgpu.SMEM((wgs, cfg.block_q), jnp.int32) if opts.segments else None,
      plgpu.SMEM((cfg.num_stages, cfg.block_kv), jnp.int32) if opts.segments else None,
      common.smem_tile((cfg.bias_stages, wgs, cfg.block_q, cfg.block_kv),
                       opts.bias_dtype(dims.dtype)) if opts.bias else None,
  )
  staging = accumulate.staging_types(wgs, (cfg.block_q, cfg.block_kv), dims.dtype,
                                     interpret=opts.interpret)

  def scoped(q_smem, o_smem, k_smem, v_smem, lse_smem, q_ids_smem, ids_ring, bias_ring,
             *rest):
    p_staging = rest[0] if staging else None
    barriers = pipeline.Barriers(*rest[len(staging):])
    refs = _Refs(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem,
                 q_smem if o_smem is None else o_smem, k_smem, v_smem, lse_smem, p_staging,
                 masks, q_ids_smem, ids_ring, bias_ring)
    _cta_body(refs, barriers, sched=sched, dims=dims, opts=opts)

  pl.run_scoped(scoped, *scratch, *staging,
                *pipeline.Barriers.types(cfg.num_stages, segments=opts.segments,
                                         bias=bool(opts.bias), turns=_overlaps(opts),
                                         bias_stages=cfg.bias_stages),
                collective_axes="wg")


def _schedule(num_tiles: int, num_heads: int, batch: int, seq_kv: int,
              opts: ForwardOptions) -> scheduler.TileScheduler:
  """The CTAs' tiles: tile costs grow along T when the band is unbounded on the left
  (causal), so tiles go in mirror pairs, the last rounds balanced by the tiles' KV blocks
  with `ForwardConfig.balanced_tail`; else persistent CTAs."""
  cfg = opts.config
  return scheduler.persistent(
      num_tiles, num_heads, batch, cfg.rows_per_cta, opts.max_ctas or hardware.num_sms(),
      paired=opts.mask.cost_grows_along_queries,
      balanced_tail=cfg.balanced_tail, costs=lambda: common.query_tile_costs(
          opts.mask, num_tiles, cfg.rows_per_cta, seq_kv, cfg.block_kv))


def attention_forward(q, k, v, opts: ForwardOptions, kv_lens=None, segment_ids=None,
                      bias=None):
  """Runs the kernel on canonical inputs.

  Args:
    q: (B, T, N, D) float16/bfloat16, T ≥ the CTA's rows (the api pads tiny T).
    k, v: (B, S, K, D), same dtype, N % K == 0, S ≥ block_kv (the api pads tiny S).
    opts: static options.
    kv_lens: (B,) int32 keys per batch element, given exactly when `opts.kv_lens`.
    segment_ids: `masking.SegmentIds` of (B, T) and (B, S), given exactly when
      `opts.segments`.
    bias: (B|1, N|1, T, S) in q's dtype, added to the scaled logits (−inf masks; fully
      masked blocks are skipped), given exactly when `opts.bias`.

  Returns:
    out (B, T, N, D) in q's dtype, and the LSE (B, N, T_tiles) in float32 (natural log),
    where T_tiles rounds T up to whole CTA tiles.
  """
  b, t, n, _ = q.shape
  dims = common.Dims.of(q, k, opts)
  cfg = opts.config
  num_tiles = pl.cdiv(t, cfg.rows_per_cta)
  sched = _schedule(num_tiles, n, b, k.shape[1], opts)
  out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((b, n, num_tiles * cfg.rows_per_cta), jnp.float32))
  masks = common.MaskInputs.of(kv_lens, segment_ids, opts, seq_q=num_tiles * cfg.rows_per_cta,
                              seq_kv=k.shape[1], block_q=cfg.block_q, block_kv=cfg.block_kv)
  masks = masks.with_bias(bias, rows=num_tiles * cfg.rows_per_cta, row_block=cfg.block_q,
                          col_block=cfg.block_kv)
  return common.launch(
      functools.partial(_entry, sched=sched, dims=dims, opts=opts), q, k, v, *masks.arrays(),
      *sched.inputs(), out_type=out_types, grid=(sched.num_ctas,), grid_names=("cta",),
      name="flash_attn_hopper_fwd", interpret=opts.interpret)
