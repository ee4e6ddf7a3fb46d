"""The dK/dV kernel for wide heads (D 256): the two compute warpgroups split the work by role.

`dkv` gives each compute warpgroup its own block of keys and both of their accumulators,
dK and dV, (block_kv, D) float32 each: at D 256 that is 2 × 128 registers a thread, over the
240 it has. Here a tile is ONE block of 64 keys of one (batch, KV head), and each compute
warpgroup keeps one accumulator. A CTA runs one tile or, on persistent CTAs, several
(`common.backward_schedule`), its ring and Pᵀ slots running on across them. The producer
streams Q, dO, the LSE and δ of every query block of every query head of the KV head's
group, as in `dkv` (GQA is summed here, in a fixed order: deterministic); both compute
warpgroups read every slot of that ring:

    per step (query head h, query block j):
      warpgroup 0 (dV)                       warpgroup 1 (dK)
        Sᵀ = K Qᵀ                              dPᵀ = V dOᵀ
        Pᵀ = 2^(c·Sᵀ − LSE), masked
        wait p_consumed[step % 2]
        p_smem[step % 2] = Pᵀ ──p_ready──────► wait p_ready[step % 2]; read Pᵀ
        dV += Pᵀ dO            ◄─p_consumed── arrive p_consumed[step % 2]
                                               dSᵀ = Pᵀ ∘ (dPᵀ − δ)
                                               dK += dSᵀ Q     (scaled once at the end)

Pᵀ crosses in float16 (`P_DTYPE`) through two shared-memory slots, so warpgroup 0 may run up
to two steps ahead. With a logits soft-cap, dSᵀ also takes the cap's derivative, which only
warpgroup 0 has (it holds Sᵀ): it hands over Pᵀ times that derivative instead of Pᵀ.

Masks: the query blocks a key block meets come from the band (`masking.q_block_range`, with
the blocks that need no element mask), narrowed by the segments' spans; element
masks run on the edge blocks only, and with key lengths on every block of the one key block
that straddles its batch element's length (a block past it runs no step: dK = dV = 0). Keys
past S and queries past T need no mask: TMA zero-fills their rows, δ is padded with zeros,
so they add nothing, and the rows past S are clipped on store.

A `mask` (uint8 tiles, `opts.bias_is_mask`) streams as a fifth ring of (BLOCK_KV, block_q)
tiles (transposed, as in `dkv`), narrows the query blocks to those it leaves visible to some
query head of the group, and is applied, with the element masks, on the blocks it does not
leave wholly visible for the step's head; elsewhere no tile is copied. A bias (two bytes an
entry) streams the same way, in a ring one slot deep (`bias_stages`): two slots do not fit
beside the other rings at D 256.

Shared memory at D 256, 16-bit, block_q 64, two stages (`smem_bytes`): the Q and dO ring
2·2·64·256·2 = 128 KiB, K and V 64 KiB, the two Pᵀ slots 16 KiB, the LSE and δ ring 1 KiB:
209 KiB of the 219 KiB budget; segment ids add 0.75 KiB and a mask's ring 8 KiB (217.75 KiB
with both), a bias's 16 KiB with two slots, so it takes one (8 KiB).
"""

from __future__ import annotations

import dataclasses
import enum
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
from flash_attn_hopper.kernels import dkv as dkv_kernel

#: Keys per CTA: one wgmma M. Each warpgroup's (BLOCK_KV, D) float32 accumulator then takes
#: 128 registers a thread at D 256, which leaves room for a step's (BLOCK_KV, block_q) blocks.
BLOCK_KV = hardware.WGMMA_ROWS

#: Pᵀ slots between the two compute warpgroups: with two, warpgroup 0 writes step s + 1's
#: Pᵀ while warpgroup 1 still reads step s's.
P_SLOTS = 2

#: The dtype Pᵀ crosses in, whatever the inputs': its entries lie in [0, 1], where float16
#: keeps 3 more mantissa bits than bfloat16 (below 2⁻¹⁴, its subnormals still round to within
#: 2⁻²⁵). Handed over in bfloat16, dK's error on a CPU test (bfloat16, GQA, causal, T = S =
#: 256) was 1.5× that of `dkv`, which keeps Pᵀ in float32; in float16, no larger. Float32
#: slots (32 KiB) would overflow shared memory at D 256.
P_DTYPE = jnp.float16


class _Role(enum.IntEnum):
  """What each compute warpgroup owns."""
  DV = 0  # Sᵀ, Pᵀ (handed over) and the dV accumulator
  DK = 1  # dPᵀ, dSᵀ and the dK accumulator


class _TileLoad(enum.IntEnum):
  """The per-CTA loads, each on its own barrier of `tile_ready`."""
  K = 0
  V = 1
  K_IDS = 2  # segments only: the keys' segment ids


class _TileBarriers(NamedTuple):
  """The per-tile barriers. ready: `_TileLoad`'s, one each. met: persistent CTAs only, two
  arrivals (the compute warpgroups), where a tile with no step keeps them in step
  (`_meet_if_empty`)."""
  ready: object
  met: object = None

  @property
  def persistent(self) -> bool:
    return self.met is not None


class _Refs(NamedTuple):
  """Global and shared-memory refs of one CTA. The fields `dkv.query_streams` reads (the
  inputs, the rings, `masks`, `q_ids_ring`) carry the same names as `dkv._Refs`'s."""
  q: object
  k: object
  v: object
  do: object
  lse: object        # (B, N, T_pad) float32, log2 units
  delta: object      # (B, N, T_pad) float32
  dk: object
  dv: object
  k_smem: object     # (BLOCK_KV, D): K, then dK out
  v_smem: object     # (BLOCK_KV, D): V, then dV out
  q_ring: object     # (num_stages, block_q, D)
  do_ring: object
  lse_ring: object   # (num_stages, block_q)
  delta_ring: object
  p_smem: object     # (P_SLOTS, BLOCK_KV, block_q): Pᵀ from warpgroup 0 to warpgroup 1
  staging: object    # interpreter only: (compute warpgroups, BLOCK_KV, block_q), else None
  masks: common.MaskInputs  # key lengths, segment ids and spans (per key block)
  k_ids_smem: object = None  # segments: (BLOCK_KV,) int32
  q_ids_ring: object = None  # segments: (num_stages, block_q) int32, the queries' ids
  mask_ring: object = None   # mask or bias: (bias stages, 1, BLOCK_KV, block_q), transposed


class _PBarriers(NamedTuple):
  """The hand-over of Pᵀ, one barrier per slot each, one arrival (a warpgroup) each.

  ready: warpgroup 0 wrote the slot's Pᵀ. consumed: warpgroup 1 read it (and, before that,
  V for the same step), so warpgroup 0 may overwrite the slot, or at the end V's tile."""
  ready: object
  consumed: object


class _Tile(NamedTuple):
  """One CTA's keys and the query blocks that see them (the fields `dkv.step_rows` reads:
  kv_head, q_block0, steps_per_head)."""
  batch: jax.Array
  kv_head: jax.Array
  key0: jax.Array
  blocks: masking.BlockRange  # query blocks, per query head of the group
  q_block0: jax.Array
  steps_per_head: jax.Array
  seq_kv: jax.Array | int     # the batch element's keys (`key_value_seq_lengths`)


def _ring_bytes(cfg: config_lib.BackwardConfig, head_dim: int, itemsize: int) -> int:
  """The ring of Q, dO (head_dim wide) and the LSE, δ (float32), num_stages deep."""
  return cfg.num_stages * cfg.block_q * (2 * head_dim * itemsize + 2 * 4)


def smem_bytes(cfg: config_lib.BackwardConfig, head_dim: int, itemsize: int,
               segments: bool = False, bias_bytes: int = 0) -> int:
  """Shared memory the kernel allocates: K and V (then dK and dV), the Pᵀ slots, the ring of
  Q, dO, the LSE and δ (with `segments`, the keys' ids and a ring of the queries'; with
  `bias_bytes` an entry, 1 for a mask, a ring of (BLOCK_KV, block_q) tiles `bias_stages`
  deep)."""
  rest = _bytes_but_bias(cfg, head_dim, itemsize, segments)
  return rest + bias_stages(cfg, head_dim, itemsize, segments, bias_bytes) * \
      BLOCK_KV * cfg.block_q * bias_bytes


def _bytes_but_bias(cfg: config_lib.BackwardConfig, head_dim: int, itemsize: int,
                    segments: bool) -> int:
  tiles = 2 * BLOCK_KV * head_dim * itemsize
  p_slots = P_SLOTS * BLOCK_KV * cfg.block_q * jnp.dtype(P_DTYPE).itemsize
  ids = (BLOCK_KV + cfg.num_stages * cfg.block_q) * 4 if segments else 0
  return tiles + _ring_bytes(cfg, head_dim, itemsize) + p_slots + ids


def bias_stages(cfg: config_lib.BackwardConfig, head_dim: int, itemsize: int,
                segments: bool, bias_bytes: int) -> int:
  """Slots of the ring of bias (or mask) tiles: `config_lib.split_bias_stages`'s rule."""
  full = _bytes_but_bias(cfg, head_dim, itemsize, segments) + \
      cfg.num_stages * BLOCK_KV * cfg.block_q * bias_bytes
  return config_lib.split_bias_stages(cfg.num_stages, full)


def check_config(cfg: config_lib.BackwardConfig, head_dim: int, itemsize: int,
                 segments: bool = False, bias_bytes: int = 0) -> None:
  """Raises ValueError, naming the field, when `cfg` does not suit this kernel: block_kv must
  be BLOCK_KV, and the tiles must fit the shared-memory budget."""
  if cfg.block_kv != BLOCK_KV:
    raise ValueError(f"the split dK/dV kernel takes BackwardConfig.block_kv == {BLOCK_KV} "
                     f"(one wgmma M of keys per CTA); got {cfg.block_kv}")
  need = smem_bytes(cfg, head_dim, itemsize, segments, bias_bytes)
  if need > config_lib.SMEM_BUDGET:
    raise ValueError(
        f"{cfg} needs {need} bytes of shared memory in the split dK/dV kernel at "
        f"head_dim={head_dim}, over the {config_lib.SMEM_BUDGET}-byte budget; the ring of Q, "
        f"dO, the LSE and δ takes {_ring_bytes(cfg, head_dim, itemsize)} of them: lower "
        f"BackwardConfig.block_q or BackwardConfig.num_stages")


def _may_mask(opts) -> bool:
  """Whether any step may need an element mask (else warpgroup 0 emits none)."""
  return opts.mask.banded or opts.kv_lens or opts.segments or bool(opts.bias)


def _tile(item: scheduler.Tile, masks: common.MaskInputs, dims: common.Dims, opts) -> _Tile:
  """The scheduler's work item `item` (its rows are keys, its head a KV head) as a tile."""
  cfg = opts.config
  batch, kv_head, key0 = item.batch, item.head, item.row0
  seq_kv = common.keys_of(batch, masks.kv_lens, dims)
  blocks = masking.q_block_range(opts.mask, key0, BLOCK_KV, dims.seq_q, cfg.block_q)
  if opts.segments:  # Only the query blocks that share a segment with the keys.
    blocks = blocks.intersect(masking.BlockRange.read(masks.spans, batch, key0 // BLOCK_KV))
  if opts.bias:  # And that a mask leaves visible to some query head of the group.
    heads = range(dims.group) if opts.bias[1] else range(1)
    seen = functools.reduce(masking.BlockRange.union, [
        _mask_blocks(masks, opts, batch, kv_head * dims.group + g, key0) for g in heads])
    # First and end only: which blocks it leaves wholly visible is per head (`_head_blocks`).
    blocks = blocks.intersect(masking.BlockRange(seen.first, seen.first, seen.end, seen.end))
  if opts.kv_lens:  # Masked only where the key block straddles the length.
    blocks = blocks.intersect(masking.key_length_q_blocks(key0, BLOCK_KV, seq_kv, blocks.end))
  return _Tile(batch=batch, kv_head=kv_head, key0=key0, blocks=blocks,
               q_block0=blocks.first, steps_per_head=blocks.end - blocks.first, seq_kv=seq_kv)


def _mask_blocks(masks: common.MaskInputs, opts, batch, head, key0) -> masking.BlockRange:
  """The query blocks a mask leaves visible to the keys [key0, key0 + BLOCK_KV) for query
  head `head`, and those it leaves wholly visible (no tile needed)."""
  index = common.bias_index(batch, head, opts)
  return masking.BlockRange.read(masks.bias_spans, *index, key0 // BLOCK_KV)


def _head_blocks(tile: _Tile, masks: common.MaskInputs, opts, head) -> masking.BlockRange:
  """The tile's query blocks for query head `head`: with a mask, only those it leaves wholly
  visible to the keys stay full; the others take its tile and the element masks."""
  if not opts.bias:
    return tile.blocks
  return tile.blocks.full_within(_mask_blocks(masks, opts, tile.batch, head, tile.key0))


def _mask_stream(tile: _Tile, refs: _Refs, ready, consumed, dims, opts) -> pipeline.Stream:
  """A mask's (or a bias's) transposed tiles, (this CTA's keys, the step's queries), copied
  on the steps that warpgroup 0 masks (`_head_blocks`), in a ring of its own depth."""
  masks, cfg = refs.masks, opts.config
  _, num_heads, row_blocks, _ = masks.bias_spans.shape

  def src(step):
    head, q0 = dkv_kernel.step_rows(step, tile, dims, cfg)
    b, h = common.bias_index(tile.batch, head, opts)
    first = (b * num_heads + h) * row_blocks + tile.key0 // BLOCK_KV
    return masks.bias.at[pl.ds(first, 1), pl.ds(0, BLOCK_KV), pl.ds(q0, cfg.block_q)]

  def needed(step):
    head, q0 = dkv_kernel.step_rows(step, tile, dims, cfg)
    return ~_head_blocks(tile, masks, opts, head).is_full(q0 // cfg.block_q)
  depth = refs.mask_ring.shape[0]
  return pipeline.Stream(src, refs.mask_ring, ready, consumed, needed,
                         stages=None if depth == cfg.num_stages else depth)


def _wait_ready(streams, step, num_stages: int):
  """Waits for ring step `step` of each stream, in its own ring's slot."""
  for stream in streams:
    plgpu.barrier_wait(stream.ready.at[pipeline.stream_slot(stream, step, num_stages)])


def _release(streams, step, num_stages: int, loaded: bool = False):
  """Arrives on the consumed barrier of ring step `step` of each stream (`None`s skipped);
  `loaded`: after reading some of them with loads (`pipeline.free_after_loads`)."""
  barriers = [stream.consumed.at[pipeline.stream_slot(stream, step, num_stages)]
              for stream in streams if stream is not None]
  if loaded and barriers:
    pipeline.free_after_loads(*barriers)
  else:
    for barrier in barriers:
      plgpu.barrier_arrive(barrier)


def _split_streams(streams, opts):
  """(Q, dO, LSE, δ, the queries' ids or None, the mask or None): the order
  `dkv.query_streams` builds them in."""
  q_s, do_s, lse_s, delta_s, *extra = streams
  ids_s = extra.pop(0) if opts.segments else None
  return q_s, do_s, lse_s, delta_s, ids_s, (extra.pop(0) if opts.bias else None)


def _hand_over_p(step, ring0, pt, refs: _Refs, pbar: _PBarriers):
  """Warpgroup 0's side: writes the tile's step `step` (ring position ring0 + step) Pᵀ into
  its slot once the slot's previous Pᵀ (step − P_SLOTS) was read, and signals it. (The
  previous tile's last reads were observed at its end, `_observe_last_reads`.)"""
  slot = (ring0 + step) % P_SLOTS
  pl.when(step >= P_SLOTS)(lambda: plgpu.barrier_wait(pbar.consumed.at[slot]))
  refs.p_smem.at[slot][...] = pt.astype(P_DTYPE)
  plgpu.barrier_arrive(pbar.ready.at[slot])


def _take_p(position, refs: _Refs, pbar: _PBarriers):
  """Warpgroup 1's side: waits for the Pᵀ of ring position `position`, reads it (float32)
  and frees its slot."""
  slot = position % P_SLOTS
  plgpu.barrier_wait(pbar.ready.at[slot])
  pt = refs.p_smem.at[slot][...].astype(jnp.float32)
  plgpu.barrier_arrive(pbar.consumed.at[slot])
  return pt


def _dv_step(step, dv, *, tile: _Tile, ring0, k_ids, refs: _Refs, streams, pbar, dims, opts,
             masked: bool):
  """Warpgroup 0, the tile's step `step` (ring position ring0 + step): Sᵀ, Pᵀ (masked when
  `masked`) handed over, dV += Pᵀ dO."""
  cfg = opts.config
  position = ring0 + step
  slot = pipeline.slot_of(position, cfg.num_stages)
  q_s, do_s, lse_s, delta_s, ids_s, mask_s = _split_streams(streams, opts)
  stages = cfg.num_stages
  _wait_ready(streams, position, stages)
  st = accumulate.product(refs.k_smem, refs.q_ring.at[slot].T, (BLOCK_KV, cfg.block_q))
  _release((q_s,), position, stages)  # Warpgroup 0 reads Q for Sᵀ only.
  mask_t = None  # A mask's tile comes on masked steps only (`_mask_stream`).
  if masked and mask_s is not None:
    mask_slot = pipeline.stream_slot(mask_s, position, stages)
    mask_t = common.bias_values(refs.mask_ring.at[mask_slot, 0][...], opts)
  _release((mask_s,), position, stages, loaded=mask_t is not None)
  st, cap_grad = opts.logits.transform(st, mask_t)
  if masked:
    segments = None
    if opts.segments:
      segments = (plgpu.load(refs.q_ids_ring.at[slot], layout=common.COLUMNS), k_ids)
    _, q0 = dkv_kernel.step_rows(step, tile, dims, cfg)
    st = masking.apply_element_mask(st, q0, tile.key0, tile.seq_kv if opts.kv_lens else None,
                                    opts.mask, key_axis=0, segments=segments)
  lse = plgpu.load(refs.lse_ring.at[slot], layout=common.COLUMNS)
  _release((ids_s, lse_s, delta_s), position, stages, loaded=True)  # δ is warpgroup 1's.

  pt = softmax.recompute(st, lse, opts.logits.exp2_scale, query_axis=1)
  # With a soft-cap, dSᵀ = Pᵀ ∘ cap' ∘ (dPᵀ − δ): warpgroup 1 gets Pᵀ ∘ cap'.
  _hand_over_p(step, ring0, pt if cap_grad is None else pt * cap_grad, refs, pbar)
  staging = None if refs.staging is None else refs.staging.at[_Role.DV]
  dv = accumulate.matmul_accumulate(dv, pt.astype(dims.dtype), refs.do_ring.at[slot],
                                    staging=staging)
  _release((do_s,), position, stages)
  return dv


def _dk_step(step, dk, *, ring0, refs: _Refs, streams, pbar, dims, opts):
  """Warpgroup 1, the tile's step `step` (ring position ring0 + step): dPᵀ, then Pᵀ from
  warpgroup 0; dK += dSᵀ Q."""
  cfg = opts.config
  position = ring0 + step
  slot = pipeline.slot_of(position, cfg.num_stages)
  q_s, do_s, lse_s, delta_s, ids_s, mask_s = _split_streams(streams, opts)
  stages = cfg.num_stages
  _wait_ready(streams, position, stages)
  _release((lse_s, ids_s, mask_s), position, stages)  # Warpgroup 0's.
  dpt = accumulate.product(refs.v_smem, refs.do_ring.at[slot].T, (BLOCK_KV, cfg.block_q))
  _release((do_s,), position, stages)
  delta = plgpu.load(refs.delta_ring.at[slot], layout=common.COLUMNS)
  _release((delta_s,), position, stages, loaded=True)
  # After dPᵀ: freeing the Pᵀ slot also tells warpgroup 0 that this step's V read is done.
  dst = softmax.logits_grad(_take_p(position, refs, pbar), dpt, delta, query_axis=1)
  staging = None if refs.staging is None else refs.staging.at[_Role.DK]
  dk = accumulate.matmul_accumulate(dk, dst.astype(dims.dtype), refs.q_ring.at[slot],
                                    staging=staging)
  _release((q_s,), position, stages)
  return dk


def _load_tile(role: _Role, tile: _Tile, refs: _Refs, tile_ready, opts):
  """Starts the tile loads a warpgroup owns: the buffer it writes its output through (warpgroup
  0: V, then dV; warpgroup 1: K, then dK), so that on a persistent CTA it loads the next
  tile's once its own store has read the buffer; warpgroup 0 also loads the keys' ids, which
  it alone reads."""
  rows = pl.ds(tile.key0, BLOCK_KV)
  if role == _Role.DV:
    plgpu.copy_gmem_to_smem(refs.v.at[tile.batch, rows, tile.kv_head], refs.v_smem,
                            tile_ready.at[_TileLoad.V])
    if opts.segments:
      plgpu.copy_gmem_to_smem(refs.masks.kv_ids.at[tile.batch, rows], refs.k_ids_smem,
                              tile_ready.at[_TileLoad.K_IDS])
  else:
    plgpu.copy_gmem_to_smem(refs.k.at[tile.batch, rows, tile.kv_head], refs.k_smem,
                            tile_ready.at[_TileLoad.K])


def _wait_tile(role: _Role, tile_ready, opts):
  """Both warpgroups wait for K and V: each later writes its output over one of them (dK over
  K, dV over V), which must have landed even when no step runs."""
  plgpu.barrier_wait(tile_ready.at[_TileLoad.K])
  plgpu.barrier_wait(tile_ready.at[_TileLoad.V])
  if opts.segments and role == _Role.DV:
    plgpu.barrier_wait(tile_ready.at[_TileLoad.K_IDS])


def _meet_if_empty(num_steps, barriers: _TileBarriers):
  """On a persistent CTA, each warpgroup loads the next tile's K or V once its own store has
  left, and the other must have waited for this tile's copy by then (a barrier's waits
  follow its phases). A step orders them: warpgroup 1 stores dK after the last Pᵀ, handed
  over after warpgroup 0 waited; warpgroup 0 stores dV after warpgroup 1 freed the last Pᵀ
  slot, after it waited. A tile with no step (keys past the length, or past the last query
  under causal) has none, so there both warpgroups meet after their waits."""
  if not barriers.persistent:
    return

  @pl.when(num_steps == 0)
  def _meet():
    plgpu.barrier_arrive(barriers.met)
    plgpu.barrier_wait(barriers.met)


def _store(acc, smem, dst, dtype):
  """The accumulator out through shared memory and TMA (rows past S are clipped)."""
  smem[...] = acc.astype(dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dst)


def _dv_loop(tile: _Tile, masks: common.MaskInputs, step, dv, dims, opts):
  """Warpgroup 0's steps, head by head: element masks on the edge blocks only."""
  blocks = lambda g: _head_blocks(tile, masks, opts, tile.kv_head * dims.group + g)
  return common.walk_head_runs(dims.group, tile.steps_per_head,
                               blocks if _may_mask(opts) else None, step, dv)


def _observe_last_reads(ring0, num_steps, pbar: _PBarriers):
  """Warpgroup 0 observes the last phase of each Pᵀ slot of the tile: warpgroup 1 then
  reads V no more (and the next tile's hand-overs start with free slots)."""
  @pl.loop(jnp.maximum(num_steps - P_SLOTS, 0), num_steps)
  def _last_reads(s):
    plgpu.barrier_wait(pbar.consumed.at[(ring0 + s) % P_SLOTS])


def _dv_tile(tile: _Tile, ring0, refs: _Refs, streams, pbar, tile_barriers, dims, opts):
  num_steps = dims.group * tile.steps_per_head
  _wait_tile(_Role.DV, tile_barriers.ready, opts)
  _meet_if_empty(num_steps, tile_barriers)
  # The keys' ids, per row of a (keys, queries) block.
  k_ids = plgpu.load(refs.k_ids_smem, layout=common.ROWS) if opts.segments else None
  if tile_barriers.persistent and opts.segments:  # The next tile's ids land here by TMA.
    pipeline.order_loads_before_tma()
  step = functools.partial(_dv_step, tile=tile, ring0=ring0, k_ids=k_ids, refs=refs,
                           streams=streams, pbar=pbar, dims=dims, opts=opts)
  dv = _dv_loop(tile, refs.masks, step, common.zeros_accumulator((BLOCK_KV, dims.head_dim)),
                dims, opts)
  _observe_last_reads(ring0, num_steps, pbar)
  _store(dv, refs.v_smem, refs.dv.at[tile.batch, pl.ds(tile.key0, BLOCK_KV), tile.kv_head],
         dims.dtype)


def _dk_tile(tile: _Tile, ring0, refs: _Refs, streams, pbar, tile_barriers, dims, opts):
  num_steps = dims.group * tile.steps_per_head
  _wait_tile(_Role.DK, tile_barriers.ready, opts)
  _meet_if_empty(num_steps, tile_barriers)
  step = functools.partial(_dk_step, ring0=ring0, refs=refs, streams=streams, pbar=pbar,
                           dims=dims, opts=opts)
  dk = lax.fori_loop(0, num_steps, step,
                     common.zeros_accumulator((BLOCK_KV, dims.head_dim)))
  # K is no longer read: warpgroup 0 read it last before handing over the last Pᵀ.
  _store(dk * opts.scale, refs.k_smem,
         refs.dk.at[tile.batch, pl.ds(tile.key0, BLOCK_KV), tile.kv_head], dims.dtype)


def _compute_warpgroup(role: _Role, refs: _Refs, ring_barriers, pbar, tile_barriers, sched,
                       dims, opts):
  """One warpgroup's role in each of its CTA's tiles. A persistent CTA loads the next tile's
  buffer once this warpgroup's output has left through it; the producer streams the next
  tile's queries meanwhile."""
  plgpu.set_max_registers(pipeline.COMPUTE_REGISTERS, action="increase")
  run_tile = _dv_tile if role == _Role.DV else _dk_tile

  def run(tile: _Tile, ring0):
    streams = _streams(tile, refs, ring_barriers, dims, opts)
    run_tile(tile, ring0, refs, streams, pbar, tile_barriers, dims, opts)

  common.run_key_tiles(sched, lambda item: _tile(item, refs.masks, dims, opts),
                       lambda tile: _load_tile(role, tile, refs, tile_barriers.ready, opts),
                       run,
                       lambda tile: dims.group * tile.steps_per_head)


def _compute(wg, refs: _Refs, ring_barriers, pbar, tile_barriers, sched, dims, opts):
  for role in _Role:
    pl.when(wg == role)(functools.partial(_compute_warpgroup, role, refs, ring_barriers, pbar,
                                          tile_barriers, sched, dims, opts))


def _producer_warpgroup(refs: _Refs, ring_barriers, sched, dims, opts):
  """Streams each tile's query blocks (and a mask's tiles) through the ring, which runs on
  across the CTA's tiles."""
  def tile_streams(item: scheduler.Tile, ring: pipeline.Ring):
    tile = _tile(item, refs.masks, dims, opts)
    num_steps = dims.group * tile.steps_per_head
    return (_streams(tile, refs, ring_barriers, dims, opts), num_steps,
            lambda: ring.advance(num_steps))

  # The drained streams' sources are not read (no tile).
  common.produce_tiles(sched, tile_streams, _streams(None, refs, ring_barriers, dims, opts),
                       opts.config.num_stages)


def _streams(tile: _Tile, refs: _Refs, barriers, dims, opts) -> tuple:
  """Q, dO, the LSE, δ (and the queries' ids) as `dkv` streams them, then a mask's tiles."""
  streams = dkv_kernel.query_streams(tile, refs, barriers, dims,
                                     dataclasses.replace(opts, bias=None))
  if opts.bias:
    streams += (_mask_stream(tile, refs, *barriers[len(streams)], dims, opts),)
  return streams


def _entry(q, k, v, do, lse, delta, *rest, dims: common.Dims, sched, opts):
  masks, rest = common.MaskInputs.split(rest, opts)
  sched, (dk, dv) = sched.bind(rest)
  cfg = opts.config
  stages = cfg.num_stages
  bias_ring = bias_stages(cfg, dims.head_dim, jnp.dtype(dims.dtype).itemsize, opts.segments,
                          opts.bias_bytes(dims.dtype))
  scratch = (
      common.smem_tile((BLOCK_KV, dims.head_dim), dims.dtype),
      common.smem_tile((BLOCK_KV, dims.head_dim), dims.dtype),
      common.smem_tile((stages, cfg.block_q, dims.head_dim), dims.dtype),
      common.smem_tile((stages, cfg.block_q, dims.head_dim), dims.dtype),
      plgpu.SMEM((stages, cfg.block_q), jnp.float32),
      plgpu.SMEM((stages, cfg.block_q), jnp.float32),
      common.smem_tile((P_SLOTS, BLOCK_KV, cfg.block_q), P_DTYPE),
      plgpu.SMEM((BLOCK_KV,), jnp.int32) if opts.segments else None,
      plgpu.SMEM((stages, cfg.block_q), jnp.int32) if opts.segments else None,
      common.smem_tile((bias_ring, 1, BLOCK_KV, cfg.block_q), opts.bias_dtype(dims.dtype))
      if opts.bias else None,
  )
  staging = accumulate.staging_types(pipeline.NUM_COMPUTE_WARPGROUPS, (BLOCK_KV, cfg.block_q),
                                     dims.dtype, interpret=opts.interpret)
  num_streams = 4 + bool(opts.segments)  # Q, dO, LSE, δ (, ids); then the mask's, if any
  met_type = (plgpu.Barrier(num_arrivals=pipeline.NUM_COMPUTE_WARPGROUPS),) \
      if sched.persistent else ()
  barriers = (plgpu.Barrier(num_barriers=len(_TileLoad) if opts.segments else _TileLoad.K_IDS),
              plgpu.Barrier(num_arrivals=1, num_barriers=P_SLOTS),  # Pᵀ ready
              plgpu.Barrier(num_arrivals=1, num_barriers=P_SLOTS),  # Pᵀ consumed
              *met_type,
              *pipeline.ring_barrier_types(stages, [1] * num_streams),
              *(pipeline.stream_barrier_types(bias_ring) if opts.bias else ()))

  def scoped(k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, p_smem, k_ids_smem,
             q_ids_ring, mask_ring, *rest):
    refs = _Refs(q, k, v, do, lse, delta, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring,
                 delta_ring, p_smem, rest[0] if staging else None, masks, k_ids_smem,
                 q_ids_ring, mask_ring)
    barrier_refs = rest[len(staging):]
    tile_ready, p_ready, p_consumed, *met = barrier_refs[:3 + len(met_type)]
    tile_barriers = _TileBarriers(tile_ready, *met)
    pbar = _PBarriers(p_ready, p_consumed)
    ring_barriers = barrier_refs[3 + len(met_type):]
    ring_barriers = list(zip(ring_barriers[::2], ring_barriers[1::2]))
    common.specialize(
        lambda wg: _compute(wg, refs, ring_barriers, pbar, tile_barriers, sched, dims, opts),
        lambda: _producer_warpgroup(refs, ring_barriers, sched, dims, opts))

  pl.run_scoped(scoped, *scratch, *staging, *barriers, collective_axes="wg")


def dkv(q, k, v, do, lse_log2, delta, opts: common.BackwardOptions, kv_lens=None,
        segment_ids=None, bias=None):
  """dK and dV (B, S, K, D) in K's dtype, from canonical padded inputs, as `dkv.dkv` takes
  them (see `backward`); for head dims whose two accumulators do not fit one warpgroup's
  registers (D 256).

  `opts.config` is a `BackwardConfig` with block_kv == BLOCK_KV (its block_q and num_stages
  are used; see `check_config`). A mask's or a bias's tiles stream in a ring of their own
  depth (`bias_stages`).
  """
  dims = common.Dims.of(q, k, opts)
  cfg = opts.config
  check_config(cfg, dims.head_dim, jnp.dtype(dims.dtype).itemsize, opts.segments,
               opts.bias_bytes(dims.dtype))
  num_kv_tiles = pl.cdiv(k.shape[1], BLOCK_KV)
  masks = common.MaskInputs.of(kv_lens, segment_ids, opts,
                              seq_q=pl.cdiv(q.shape[1], cfg.block_q) * cfg.block_q,
                              seq_kv=num_kv_tiles * BLOCK_KV, block_q=cfg.block_q,
                              block_kv=BLOCK_KV, tiles_are_keys=True)
  masks = masks.with_bias(bias, rows=num_kv_tiles * BLOCK_KV, row_block=BLOCK_KV,
                          col_block=cfg.block_q, tiles_are_keys=True)
  out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
  sched = common.backward_schedule("dkv", num_kv_tiles, dims.num_kv_heads, dims.batch,
                                   BLOCK_KV, steps=dims.group * pl.cdiv(q.shape[1], cfg.block_q),
                                   stages=cfg.num_stages, head_dim=dims.head_dim, opts=opts,
                                   costs=lambda: common.key_tile_costs(
                                       opts.mask, num_kv_tiles, BLOCK_KV, q.shape[1],
                                       cfg.block_q, dims.group))
  return common.launch(
      functools.partial(_entry, dims=dims, sched=sched, opts=opts), q, k, v, do, lse_log2,
      delta, *masks.arrays(), *sched.inputs(), out_type=out_type, grid=(sched.num_ctas,),
      grid_names=("cta",),
      name="flash_attn_hopper_dkv_split", interpret=opts.interpret)
