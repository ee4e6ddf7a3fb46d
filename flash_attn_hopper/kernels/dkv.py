"""The dK/dV kernel: for a tile of keys, stream every query block that sees them.

A tile is 2·block_kv keys of one (batch, KV head), and a CTA runs one tile or, on persistent
CTAs, several (`common.backward_schedule`): each compute warpgroup keeps block_kv keys
of K and V in shared memory and their dK and dV accumulators in registers, while the producer
streams Q, dO, the LSE and δ of every query block of every query head in the KV head's group
(GQA sums over the group here, in a fixed order, so the result is deterministic):

    per step (query head h, query block j):
      Sᵀ = K Qᵀ                 logits, keys × queries
      Pᵀ = 2^(c·Sᵀ − LSE)       recomputed from the forward's LSE
      dV += Pᵀ dO
      dPᵀ = V dOᵀ
      dSᵀ = Pᵀ ∘ (dPᵀ − δ)
      dK += dSᵀ Q               scaled once at the end

Below DV_BEFORE_DS_MIN_HEAD_DIM, dV and dK are issued together once dSᵀ is computed; from
it on, dV is issued as soon as Pᵀ is, ahead of dSᵀ, which is computed while dV runs. Up to
OVERLAP_PRODUCTS_MAX_HEAD_DIM, Sᵀ and dPᵀ are issued together, and Pᵀ is computed while the
tensor cores run dPᵀ.

A band masks only the query blocks on its edges (`masking.q_block_range`: those whose every
query sees all the CTA's keys run unmasked), and key lengths only the tile whose keys
straddle the batch element's length, on every step (`masking.key_length_q_blocks`); a tile
past it runs no step (dK = dV = 0). With segment ids or a bias, every step is masked (the keys'
ids load with K and V, the queries' ids stream with Q), and with segment ids the query
blocks that share no segment with the tile are skipped. Keys past S and queries past T
need no mask: TMA zero-fills their K/V (Q/dO) rows, δ is padded with zeros, so they add
nothing, and the rows past S are clipped on store.
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
from flash_attn_hopper import masking
from flash_attn_hopper import pipeline
from flash_attn_hopper import scheduler
from flash_attn_hopper import softmax
from flash_attn_hopper.kernels import common
from flash_attn_hopper.kernels import fused_dq

#: Up to this head dim a step issues Sᵀ and dPᵀ together (2^(Sᵀ − LSE) runs under dPᵀ);
#: above it, Sᵀ runs alone. (From DV_BEFORE_DS_MIN_HEAD_DIM on, dV then goes ahead of dSᵀ;
#: the measurements below, from before that, issued dV and dK together after dSᵀ at every
#: head dim.) Interleaved A/B on the H200 (fwd+bwd bf16, 16k, dK/dV kernel, 2026-11-30, two
#: rounds each; the script is on branch dkv-d128-variants), at D 128:
#:   one matmul at a time: 8.42 / 8.49 ms non-causal, 3.88 / 3.96 causal;
#:   only Sᵀ and dPᵀ together: 7.77 / 7.77, 4.12 / 3.51;
#:   only dV and dK together: 7.36 / 7.36, 3.32 / 3.84 (kept);
#:   both (the previous session, non-causal): 7.87 against 7.39 one at a time.
#:   D 64 non-causal, both against one at a time: 7.77 against 8.83 ms.
#: At D 128 the (block_kv, D) dK and dV accumulators take 128 registers a thread, and Sᵀ with
#: dPᵀ in flight together add 64 more. (Sᵀ and dPᵀ read K and V from shared memory: holding
#: them in registers as the left operands lost 8–10% at D 64 and spilled, bench/NOTES.md,
#: twenty-fifth session.) Re-measured under the 24 / 240 register split and the shared step
#: barriers (2026-12-03, bf16 fwd+bwd, B·T = 16k, hidden 2048, `scripts/ab_switches.py`,
#: bench/results/h200_dkv_pingpong_ab.log), dK/dV ms at D 128 with Sᵀ and dPᵀ together:
#: 4k 1.578 → 1.630, causal 0.889 → 0.896; 16k 6.666 → 7.309, causal 3.327 → 3.392.
#: Other step orders were measured and dropped: FA3's ping-pong of the two warpgroups
#: (twenty-sixth session) and pipelined steps, Sᵀ of step j + 1 under step j's dK
#: (twenty-seventh; the code on branch dkv-pipelined-steps); bench/NOTES.md has their numbers.
OVERLAP_PRODUCTS_MAX_HEAD_DIM = 64

#: On persistent CTAs without mirror pairs (no causal bound), `_store` addresses its buffers
#: through `common.unhoisted(wg)`, so LLVM computes the epilogue's addresses after the step
#: loop instead of holding them across it. ptxas, D 128 1k bf16 persistent: 112 → 96 bytes of
#: spill stores. Interleaved A/B on the H200 (2026-12-02, bf16 fwd+bwd, B·T = 16k, hidden
#: 2048; bench/results/h200_unhoisted_epilogue_ab.log, `scripts/ab_unhoisted_epilogue.py`),
#: dK/dV ms hoisted → unhoisted: D 128 non-causal 1k 0.472 → 0.441 and 0.473 → 0.438 (two
#: runs; fwd+bwd 0.952 → 0.985 of cuDNN); at 4k with every tile persistent 1.815 → 1.624, and
#: 1.663 in the second run against 1.68–1.71 on one CTA per tile, so the persistent limit
#: stays. Under causal (mirror pairs) it cost 2.5–4% in both runs at D 64 and 128 (1k, 4k;
#: D 128 causal 4k 0.906 → 0.943 and 0.914 → 0.948), so paired schedules keep the hoisted
#: addresses. Unhoisting the next tile's loads as well gave the spills back (112 bytes).
UNHOISTED_EPILOGUE = True

#: From this head dim on, a step issues dV += Pᵀ dO as soon as Pᵀ is computed, ahead of dSᵀ
#: (`accumulate.products_then_accumulates`): Sᵀ, then Pᵀ, then dPᵀ and dV issued back to back,
#: dSᵀ computed while dV runs, then dK. Below it, dV and dK are issued together after dSᵀ.
#: Interleaved A/B on the H200 (2026-12-04, fwd+bwd, B·T = 16k, hidden 2048,
#: `scripts/ab_switches.py`, bench/results/h200_dkv_dv_before_ds_ab.log; gradients bitwise
#: equal), dK/dV ms together after dSᵀ → dV first:
#:   D 128 bf16: 4k 1.589 → 1.518, causal 0.890 → 0.866; 16k 7.004 → 6.443, causal 3.358 →
#:   3.130. fp16: 4k 1.645 → 1.557, 16k 7.116 → 6.775.
#:   D 64 bf16, Sᵀ and dPᵀ issued together: 4k 1.746 → 1.848, causal 1.032 → 1.066; 16k
#:   7.145 → 7.522, causal 3.755 → 3.770. With Sᵀ alone first, as at D 128: 4k 1.744 →
#:   1.955, 16k 7.174 → 7.975.
#: At D 128, Sᵀ and dPᵀ issued together before dV (as kept → that): 4k 1.459 → 1.657, 16k
#: 6.327 → 7.074. dSᵀ from the rounded Pᵀ (fewer registers live) lost at both head dims
#: (D 128 16k 7.399). The five-matmul step (`_fused_step`) keeps FA3's order at every head
#: dim: dV first there, its dQ part issued before dK, made dK/dV slower at D 128 16k, bf16
#: 10.566 → 10.840 ms, fp16 10.872 → 11.208 (2026-12-04, `ab_switches.py ... --nondeterministic`,
#: bench/results/h200_fused_dq_dv_first_ab.log; the code on branch fused-dv-first).
DV_BEFORE_DS_MIN_HEAD_DIM = 128

#: The dense query streams of a step (Q, dO, the LSE, δ and the queries' segment ids) share
#: one (ready, consumed) barrier pair: one wait and one arrival a step for all of them, and
#: one phase word in registers instead of one per stream (`pipeline.stream_barrier_types`'
#: `copies`). A bias keeps its own pair (it streams only where needed).
#: Interleaved A/B on the H200 (2026-12-03, bf16 fwd+bwd, B·T = 16k, hidden 2048, non-causal;
#: bench/results/h200_shared_step_barriers_ab.log, `scripts/ab_switches.py`), dK/dV ms
#: separate → shared: D 128 4k 1.683 → 1.586 and 1.690 → 1.583, 16k 7.099 → 6.858 and
#: 7.188 → 6.927; D 64 4k 1.818 → 1.848, 1.763 → 1.833 and 1.778 → 1.822, 16k 7.241 → 7.426
#: and 7.209 → 7.429 (1k and causal within ±1.5% at both). ptxas, 1k persistent CTAs: D 128
#: spill loads 124 → 100 bytes, causal 156/216 → 144/208, D 64 32/60 → 0/0. So from D 128 on.
SHARED_STEP_BARRIERS = True
SHARED_STEP_BARRIERS_MIN_HEAD_DIM = 128


class _Refs(NamedTuple):
  q: object
  k: object
  v: object
  do: object
  lse: object       # (B, N, T_pad) float32, log2 units
  delta: object     # (B, N, T_pad) float32
  dk: object
  dv: object
  k_smem: object    # (compute warpgroups, block_kv, D): K, then dK out
  v_smem: object    # (compute warpgroups, block_kv, D): V, then dV out
  q_ring: object    # (num_stages, block_q, D)
  do_ring: object
  lse_ring: object  # (num_stages, block_q)
  delta_ring: object
  staging: object   # interpreter only: (compute warpgroups, block_kv, block_q), else None
  masks: common.MaskInputs  # key lengths, segment ids and spans (per key block)
  k_ids_smem: object = None  # segments: (compute warpgroups, block_kv) int32
  q_ids_ring: object = None  # segments: (num_stages, block_q) int32, the queries' ids
  bias_ring: object = None   # bias: (num_stages, compute warpgroups, block_kv, block_q), Bᵀ
  fused: fused_dq.Buffers | None = None  # `BackwardConfig.fused_dq`: dQ's buffers


class _Tile(NamedTuple):
  batch: jax.Array
  kv_head: jax.Array
  key0: jax.Array     # the CTA's first key
  q_block0: jax.Array  # the first query block that sees any of its keys
  steps_per_head: jax.Array
  seq_kv: jax.Array | int  # the batch element's keys (`key_value_seq_lengths`)
  band: masking.BlockRange  # query blocks of the band and lengths; [full_lo, full_hi) unmasked


def _tile(item: scheduler.Tile, masks: common.MaskInputs, dims: common.Dims,
          opts: common.BackwardOptions) -> _Tile:
  """The scheduler's work item `item` (its rows are keys, its head a KV head) as a tile."""
  cfg = opts.config
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  key0, batch, kv_head = item.row0, item.batch, item.head
  seq_kv = common.keys_of(batch, masks.kv_lens, dims)
  band = masking.q_block_range(opts.mask, key0, wgs * cfg.block_kv, dims.seq_q, cfg.block_q)
  if opts.kv_lens:  # No step past the keys; every step masked where they straddle them.
    band = band.intersect(
        masking.key_length_q_blocks(key0, wgs * cfg.block_kv, seq_kv, band.end))
  blocks = band
  if opts.segments:  # Only the query blocks that share a segment with the keys.
    spans = [masking.BlockRange.read(masks.spans, batch, key0 // cfg.block_kv + i)
             for i in range(wgs)]
    blocks = blocks.intersect(functools.reduce(masking.BlockRange.union, spans))
  if opts.bias:  # And that a mask leaves visible to them, for some head of the group.
    heads = range(dims.group) if opts.bias[1] else range(1)
    blocks = blocks.intersect(functools.reduce(masking.BlockRange.union, [
        _bias_q_blocks(masks, opts, batch, kv_head * dims.group + g, key0) for g in heads]))
  steps = blocks.end - blocks.first
  return _Tile(batch=batch, kv_head=kv_head, key0=key0,
               q_block0=jnp.int32(blocks.first), steps_per_head=steps, seq_kv=seq_kv,
               band=band)


def _bias_q_blocks(masks: common.MaskInputs, opts, batch, head, key0) -> masking.BlockRange:
  """The query blocks a (transposed) bias leaves visible to the CTA's keys [key0, …) for
  query head `head`, and those where it is zero for all of them (no tile streamed)."""
  block = opts.config.block_kv
  index = common.bias_index(batch, head, opts)
  return functools.reduce(masking.BlockRange.union, [
      masking.BlockRange.read(masks.bias_spans, *index, key0 // block + i)
      for i in range(pipeline.NUM_COMPUTE_WARPGROUPS)])


def _bias_needed(step, tile: _Tile, masks: common.MaskInputs, dims, opts):
  """Whether step `step` streams a bias tile: not where the bias is zero for all the CTA's
  keys (a mask's fully visible block)."""
  head, q0 = step_rows(step, tile, dims, opts.config)
  blocks = _bias_q_blocks(masks, opts, tile.batch, head, tile.key0)
  return ~blocks.is_full(q0 // opts.config.block_q)


def _free_blocks(tile: _Tile, masks: common.MaskInputs, dims, opts, g) -> masking.BlockRange:
  """Query head g's blocks of the tile, full where the bias leaves them free for all the
  CTA's keys: the producer streams no tile for those (`_bias_needed`)."""
  steps = tile.q_block0 + tile.steps_per_head
  blocks = masking.BlockRange(tile.q_block0, tile.q_block0, steps, steps)
  head = tile.kv_head * dims.group + g
  return blocks.full_within(_bias_q_blocks(masks, opts, tile.batch, head, tile.key0))


def step_rows(step, tile: _Tile, dims, cfg):
  """The query head and query rows of ring step `step` (also `dkv_split`'s)."""
  per_head = jnp.maximum(tile.steps_per_head, 1)  # A tile no query sees runs no step.
  g, j = step // per_head, step % per_head
  head = tile.kv_head * dims.group + g
  return head, (tile.q_block0 + j) * cfg.block_q


def _edges_only(opts) -> bool:
  """Whether only the edge blocks of `_Tile.band` take an element mask: a band or key
  lengths, with no segment ids or bias beside them (those mask every step). Measured on the
  H200 in the fifteenth session (the band) and the sixteenth (key lengths; bench/NOTES.md)."""
  return (opts.mask.banded or opts.kv_lens) and not (opts.segments or opts.bias)


def _q_step(step, carry, *, wg, tile, k_ids, ring0, refs: _Refs, streams, dims, opts,
            masked: bool):
  """One query block against this warpgroup's keys (`k_ids`: their segment ids, or None),
  at ring position ring0 + step.
  With a bias, `masked` says whether the producer streamed a tile for it (`_free_blocks`),
  and element masks (band, lengths, segments) run on every step; under `_edges_only`, it
  says whether the block is on an edge of `_Tile.band` (element-masked)."""
  dk, dv = carry
  cfg = opts.config
  slot = pipeline.slot_of(ring0 + step, cfg.num_stages)
  q_s, do_s, lse_s, delta_s, *extra = streams  # (and the queries' ids, the bias)
  ids_s = extra.pop(0) if opts.segments else None
  bias_s = extra.pop(0) if opts.bias else None
  pipeline.wait_ready(streams, slot)
  bias_t = _bias_rows(bias_s, slot, wg, refs, opts, masked)
  shared = shares_step_barriers(dims.head_dim)

  def loaded(stream):  # Its slot, read with loads, is free (shared: once, at the end).
    if not shared:
      pipeline.free_after_loads(stream.consumed.at[slot])

  def probabilities(st):  # Under dPᵀ, when the two are issued together.
    st, cap_grad = opts.logits.transform(st, bias_t)
    segments = None
    if opts.segments:
      segments = (plgpu.load(refs.q_ids_ring.at[slot], layout=common.COLUMNS), k_ids)
      loaded(ids_s)
    element_masked = masked or not _edges_only(opts)
    if element_masked and (opts.mask.banded or opts.kv_lens or opts.segments):
      _, q0 = step_rows(step, tile, dims, cfg)
      key0 = tile.key0 + wg * cfg.block_kv
      seq_kv = tile.seq_kv if opts.kv_lens else None
      st = masking.apply_element_mask(st, q0, key0, seq_kv, opts.mask, key_axis=0,
                                      segments=segments)
    lse = plgpu.load(refs.lse_ring.at[slot], layout=common.COLUMNS)
    loaded(lse_s)
    return softmax.recompute(st, lse, opts.logits.exp2_scale, query_axis=1), cap_grad

  def logits_grad(pt, dpt, cap_grad):
    delta = plgpu.load(refs.delta_ring.at[slot], layout=common.COLUMNS)
    loaded(delta_s)
    return softmax.logits_grad(pt, dpt, delta, query_axis=1, cap_grad=cap_grad)

  dk, dv = _matmuls(dk, dv, probabilities, logits_grad, step=step, wg=wg, tile=tile,
                    slot=slot, refs=refs, dims=dims, opts=opts)
  if shared:  # After the LSE's and δ's loads, and dK's and dV's matmuls.
    pipeline.free_after_loads(q_s.consumed.at[slot])
  else:
    plgpu.barrier_arrive(do_s.consumed.at[slot])
    plgpu.barrier_arrive(q_s.consumed.at[slot])
  return dk, dv


def _bias_rows(bias_s, slot, wg, refs: _Refs, opts, masked: bool):
  """This warpgroup's keys' rows of the transposed bias tile, when the producer streamed one
  (`masked`), else None; either way the bias slot is handed back."""
  if bias_s is None:
    return None
  if not masked:
    plgpu.barrier_arrive(bias_s.consumed.at[slot])
    return None
  bias_t = common.bias_values(refs.bias_ring.at[slot, wg][...], opts)
  pipeline.free_after_loads(bias_s.consumed.at[slot])
  return bias_t


def _matmuls(dk, dv, probabilities, logits_grad, *, step, wg, tile, slot, refs: _Refs, dims,
             opts):
  """Sᵀ and dPᵀ, then dV += Pᵀ dO and dK += dSᵀ Q, in the order that pays at this head dim:
  dV before dSᵀ from D 128 (`DV_BEFORE_DS_MIN_HEAD_DIM`), Sᵀ and dPᵀ overlapped up to D 64,
  and dQ's part between dV and dK on the five-matmul path (`_fused_step`)."""
  cfg = opts.config
  k_smem, v_smem = refs.k_smem.at[wg], refs.v_smem.at[wg]
  staging = None if refs.staging is None else refs.staging.at[wg]
  shape = (cfg.block_kv, cfg.block_q)
  q_slot, do_slot = refs.q_ring.at[slot], refs.do_ring.at[slot]
  products = ((k_smem, q_slot.T, shape), (v_smem, do_slot.T, shape))  # Sᵀ, dPᵀ
  if refs.fused is None and dims.head_dim >= DV_BEFORE_DS_MIN_HEAD_DIM:  # Sᵀ alone first.
    def dv_operand(st):  # Pᵀ rounded for dV; in float32, with the cap's derivative, for dSᵀ.
      pt, cap_grad = probabilities(st)
      return pt.astype(dims.dtype), (pt, cap_grad)
    dv, dk = accumulate.products_then_accumulates(
        (dv, dk), *products, dv_operand,
        lambda dpt, kept: logits_grad(kept[0], dpt, kept[1]).astype(dims.dtype),
        (do_slot, q_slot), staging=staging)
  else:
    if dims.head_dim <= OVERLAP_PRODUCTS_MAX_HEAD_DIM:
      (pt, cap_grad), dpt = common.overlapped_matmuls(*products, probabilities)
    else:
      pt, cap_grad = probabilities(accumulate.product(*products[0]))
      dpt = accumulate.product(*products[1])
    dst = logits_grad(pt, dpt, cap_grad).astype(dims.dtype)
    if refs.fused is None:
      dk, dv = accumulate.matmul_accumulate_pair(
          (dk, dv), (dst, pt.astype(dims.dtype)), (q_slot, do_slot), staging=staging)
    else:
      dk, dv = _fused_step(dk, dv, pt.astype(dims.dtype), dst, step=step, wg=wg, tile=tile,
                           refs=refs, q_slot=q_slot, do_slot=do_slot, staging=staging,
                           dims=dims, opts=opts)
  return dk, dv


def _fused_step(dk, dv, pt, dst, *, step, wg, tile, refs: _Refs, q_slot, do_slot, staging,
                dims, opts):
  """dV and dK with dQ's part between them (`BackwardConfig.fused_dq`), FA3's order: dV, then
  dQ's part (from both warpgroups' dSᵀ), then dK. `pt` is rounded to the inputs' dtype."""
  cfg = opts.config
  fused_dq.store_ds(dst, step=step, wg=wg, buffers=refs.fused)
  head, q0 = step_rows(step, tile, dims, cfg)
  add = functools.partial(fused_dq.add_product, step=step, wg=wg, head=head, q0=q0,
                          batch=tile.batch, buffers=refs.fused, dims=dims, opts=opts)
  dv, dk = accumulate.matmul_accumulate_pair_around(
      (dv, dk), (pt, dst), (do_slot, q_slot),
      fused_dq.product(step=step, wg=wg, k_smem=refs.k_smem, buffers=refs.fused, dims=dims,
                       cfg=cfg), add, staging=staging)
  return dk, dv


def shares_step_barriers(head_dim: int) -> bool:
  """Whether the step's dense query streams share one barrier pair (`SHARED_STEP_BARRIERS`)
  at this head dim."""
  return SHARED_STEP_BARRIERS and head_dim >= SHARED_STEP_BARRIERS_MIN_HEAD_DIM


def _tile_copies(opts) -> int:
  """Per-warpgroup tile loads, each on its own barrier: K, V (and the keys' segment ids)."""
  return 3 if opts.segments else 2


def _issue_tile_loads(wg, tile: _Tile, refs: _Refs, tile_ready, opts):
  """Starts the loads of this warpgroup's keys of `tile`: K, V (and their segment ids), each
  on its own barrier."""
  rows = pl.ds(tile.key0 + wg * opts.config.block_kv, opts.config.block_kv)
  copies = [(refs.k.at[tile.batch, rows, tile.kv_head], refs.k_smem.at[wg]),
            (refs.v.at[tile.batch, rows, tile.kv_head], refs.v_smem.at[wg])]
  if opts.segments:
    copies.append((refs.masks.kv_ids.at[tile.batch, rows], refs.k_ids_smem.at[wg]))
  assert len(copies) == _tile_copies(opts)
  common.issue_tile_loads(copies, tile_ready, wg)


def _attend_tile(wg, tile: _Tile, ring0, refs: _Refs, streams, tile_ready, dims, opts,
                 persistent: bool):
  """dK and dV (float32, dK unscaled) of one warpgroup's keys of a tile, once its loads
  landed: every step of every query head in the group. `persistent`: the next tile's loads
  may land in the buffers read here."""
  cfg = opts.config
  common.wait_tile_loads(tile_ready, wg, _tile_copies(opts))
  # The keys' ids, per row of a (keys, queries) block.
  k_ids = plgpu.load(refs.k_ids_smem.at[wg], layout=common.ROWS) if opts.segments else None
  if persistent and opts.segments:  # The next tile's ids land here by TMA.
    pipeline.order_loads_before_tma()
  zeros = common.zeros_accumulator((cfg.block_kv, dims.head_dim))
  step = functools.partial(_q_step, wg=wg, tile=tile, k_ids=k_ids, ring0=ring0, refs=refs,
                           streams=streams, dims=dims, opts=opts)
  blocks_of = None  # Every step alike.
  if opts.bias:
    blocks_of = lambda g: _free_blocks(tile, refs.masks, dims, opts, g)  # No bias tile read.
  elif _edges_only(opts):
    blocks_of = lambda g: tile.band  # The same blocks for every query head.
  dk, dv = common.walk_head_runs(dims.group, tile.steps_per_head, blocks_of, step,
                                 (zeros, zeros))
  if refs.fused is not None:  # The other warpgroup's dQ products read this K tile.
    fused_dq.finish(refs.fused)
  return dk, dv


def _store(wg, dk, dv, tile: _Tile, refs: _Refs, dims, opts):
  """dK and dV out through K's and V's buffers (no longer read), by TMA; rows past S clip."""
  rows = pl.ds(tile.key0 + wg * opts.config.block_kv, opts.config.block_kv)
  k_smem, v_smem = refs.k_smem.at[wg], refs.v_smem.at[wg]
  k_smem[...] = (dk * opts.scale).astype(dims.dtype)
  v_smem[...] = dv.astype(dims.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(k_smem, refs.dk.at[tile.batch, rows, tile.kv_head])
  plgpu.copy_smem_to_gmem(v_smem, refs.dv.at[tile.batch, rows, tile.kv_head])


def _epilogue_wg(wg, sched: scheduler.TileScheduler):
  """The warpgroup index that `_store` addresses its buffers by: on persistent CTAs without
  mirror pairs, one that keeps the epilogue's addresses out of the step loop
  (`UNHOISTED_EPILOGUE`)."""
  if UNHOISTED_EPILOGUE and sched.persistent and not sched.paired:
    return common.unhoisted(wg)
  return wg


def _compute_warpgroup(wg, refs: _Refs, ring_barriers, tile_ready, sched, dims, opts):
  """One warpgroup's keys of each of its CTA's tiles. A persistent CTA loads the next
  tile's K and V once dK and dV have left through their buffers; the producer streams the
  next tile's queries meanwhile."""
  plgpu.set_max_registers(pipeline.COMPUTE_REGISTERS, action="increase")
  shared = shares_step_barriers(dims.head_dim)

  def run(tile: _Tile, ring0):
    streams = query_streams(tile, refs, ring_barriers, dims, opts, shared)
    dk, dv = _attend_tile(wg, tile, ring0, refs, streams, tile_ready, dims, opts,
                          sched.persistent)
    _store(_epilogue_wg(wg, sched), dk, dv, tile, refs, dims, opts)

  common.run_key_tiles(sched, lambda item: _tile(item, refs.masks, dims, opts),
                       lambda tile: _issue_tile_loads(wg, tile, refs, tile_ready, opts), run,
                       lambda tile: dims.group * tile.steps_per_head)


def _producer_warpgroup(refs: _Refs, ring_barriers, sched, dims, opts):
  """Streams each tile's query blocks through the ring, which runs on across the CTA's
  tiles."""
  shared = shares_step_barriers(dims.head_dim)

  def tile_streams(item: scheduler.Tile, ring: pipeline.Ring):
    tile = _tile(item, refs.masks, dims, opts)
    num_steps = dims.group * tile.steps_per_head
    streams = query_streams(tile, refs, ring_barriers, dims, opts, shared)
    return streams, num_steps, lambda: ring.advance(num_steps)

  # The drained streams' sources are not read (no tile).
  drained = query_streams(None, refs, ring_barriers, dims, opts, shared)
  common.produce_tiles(sched, tile_streams, drained, opts.config.num_stages)


def query_streams(tile: _Tile, refs: _Refs, barriers, dims, opts, shared: bool = False
                  ) -> tuple:
  """Q, dO, the LSE, δ (and the queries' segment ids) of each step's query block, then the
  bias's, on the (ready, consumed) pairs `barriers`: one pair per stream, or with `shared`,
  one for all but the bias (`ring_barrier_types`). Shared with `dkv_split`, whose refs and
  tiles carry the fields read here under the same names."""
  cfg = opts.config

  def rows(step):
    head, q0 = step_rows(step, tile, dims, cfg)
    return head, pl.ds(q0, cfg.block_q)

  def block(ref):
    return lambda step: ref.at[tile.batch, rows(step)[1], rows(step)[0]]

  def vector(ref):
    return lambda step: ref.at[tile.batch, rows(step)[0], rows(step)[1]]

  srcs = [block(refs.q), block(refs.do), vector(refs.lse), vector(refs.delta)]
  rings = [refs.q_ring, refs.do_ring, refs.lse_ring, refs.delta_ring]
  if opts.segments:
    srcs.append(lambda step: refs.masks.q_ids.at[tile.batch, rows(step)[1]])
    rings.append(refs.q_ids_ring)
  needed = [None] * len(srcs)
  if opts.bias:  # Bᵀ: this CTA's keys (a block per compute warpgroup) × the step's queries.
    srcs.append(lambda step: common.bias_block(refs.masks, opts, tile.batch, rows(step)[0],
                                               tile.key0, rows(step)[1]))
    rings.append(refs.bias_ring)
    needed.append(lambda step: _bias_needed(step, tile, refs.masks, dims, opts))
  barriers = list(barriers)  # (`dkv_split` passes its mask's pair after these)
  if shared:
    barriers[:1] = barriers[:1] * (len(srcs) - bool(opts.bias))
  return tuple(pipeline.Stream(src, ring, ready, consumed, need) for src, ring,
               (ready, consumed), need in zip(srcs, rings, barriers, needed))


def ring_barrier_types(stages: int, opts, shared: bool = False) -> tuple:
  """The ring's (ready, consumed) barrier types, in `query_streams`' order: a pair per
  stream, or with `shared` one for the dense streams and the bias's own."""
  dense = 4 + bool(opts.segments)
  pairs = [1] * dense if not shared else [dense]
  pairs += [1] * bool(opts.bias)
  return pipeline.ring_barrier_types(stages, pairs)


def _entry(q, k, v, do, lse, delta, *rest, dims: common.Dims, sched, opts):
  masks, rest = common.MaskInputs.split(rest, opts)
  sched, outs = sched.bind(rest)
  *dq_acc, dk, dv = outs  # (dQ's float32 accumulator, an input ref, with `fused_dq`)
  cfg = opts.config
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  stages = cfg.num_stages
  scratch = (
      common.smem_tile((wgs, cfg.block_kv, dims.head_dim), dims.dtype),
      common.smem_tile((wgs, cfg.block_kv, dims.head_dim), dims.dtype),
      common.smem_tile((stages, cfg.block_q, dims.head_dim), dims.dtype),
      common.smem_tile((stages, cfg.block_q, dims.head_dim), dims.dtype),
      plgpu.SMEM((stages, cfg.block_q), jnp.float32),
      plgpu.SMEM((stages, cfg.block_q), jnp.float32),
      plgpu.SMEM((wgs, cfg.block_kv), jnp.int32) if opts.segments else None,
      plgpu.SMEM((stages, cfg.block_q), jnp.int32) if opts.segments else None,
      common.smem_tile((stages, wgs, cfg.block_kv, cfg.block_q), opts.bias_dtype(dims.dtype))
      if opts.bias else None,
  )
  staging = accumulate.staging_types(wgs, (cfg.block_kv, cfg.block_q), dims.dtype,
                                     interpret=opts.interpret)
  barriers = (plgpu.Barrier(num_barriers=_tile_copies(opts) * wgs),
              *ring_barrier_types(stages, opts, shares_step_barriers(dims.head_dim)))
  fused = fused_dq.smem_types(dims, cfg) if cfg.fused_dq else ()

  def scoped(k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, k_ids_smem, q_ids_ring,
             bias_ring, *rest):
    rest = list(rest)
    buffers = None
    if fused:
      buffers = fused_dq.Buffers(*rest[-len(fused):], dq_acc[0])
      del rest[-len(fused):]
    refs = _Refs(q, k, v, do, lse, delta, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring,
                 delta_ring, rest[0] if staging else None, masks, k_ids_smem, q_ids_ring,
                 bias_ring, buffers)
    tile_ready, *ring_barriers = rest[len(staging):]
    barriers = list(zip(ring_barriers[::2], ring_barriers[1::2]))
    common.specialize(
        lambda wg: _compute_warpgroup(wg, refs, barriers, tile_ready, sched, dims, opts),
        lambda: _producer_warpgroup(refs, barriers, sched, dims, opts))

  pl.run_scoped(scoped, *scratch, *staging, *barriers, *fused, collective_axes="wg")


def dkv(q, k, v, do, lse_log2, delta, opts: common.BackwardOptions, kv_lens=None,
        segment_ids=None, bias=None, dq_acc=None):
  """dK and dV (B, S, K, D) in K's dtype, from canonical padded inputs (see `backward`).

  With `opts.config.fused_dq`, also adds dQ (unscaled, float32) into `dq_acc`, a ref from
  `fused_dq.accumulator`."""
  dims = common.Dims.of(q, k, opts)
  cfg = opts.config
  keys = pipeline.NUM_COMPUTE_WARPGROUPS * cfg.block_kv
  num_kv_tiles = pl.cdiv(k.shape[1], keys)
  masks = common.MaskInputs.of(kv_lens, segment_ids, opts,
                              seq_q=pl.cdiv(q.shape[1], cfg.block_q) * cfg.block_q,
                              seq_kv=num_kv_tiles * keys, block_q=cfg.block_q,
                              block_kv=cfg.block_kv, tiles_are_keys=True)
  masks = masks.with_bias(bias, rows=num_kv_tiles * keys, row_block=cfg.block_kv,
                          col_block=cfg.block_q, tiles_are_keys=True)
  out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
  # Under causal the first key tiles see the most queries, so one CTA per tile runs them
  # first as it is; persistent CTAs pair them with their mirrors.
  sched = common.backward_schedule("dkv", num_kv_tiles, dims.num_kv_heads, dims.batch, keys,
                                   steps=dims.group * pl.cdiv(q.shape[1], cfg.block_q),
                                   stages=cfg.num_stages, head_dim=dims.head_dim, opts=opts,
                                   costs=lambda: common.key_tile_costs(
                                       opts.mask, num_kv_tiles, keys, q.shape[1], cfg.block_q,
                                       dims.group))
  return common.launch(
      functools.partial(_entry, dims=dims, sched=sched, opts=opts), q, k, v, do, lse_log2,
      delta, *masks.arrays(), *sched.inputs(), *([] if dq_acc is None else [dq_acc]),
      out_type=out_type,
      grid=(sched.num_ctas,), grid_names=("cta",), name="flash_attn_hopper_dkv",
      interpret=opts.interpret)
