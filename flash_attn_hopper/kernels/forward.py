"""The forward attention kernel: FA3's shape in Pallas Mosaic GPU.

One CTA owns 2·block_q query rows of one (batch, head): two compute warpgroups of block_q rows
and a TMA producer warpgroup (see `pipeline`). Each compute warpgroup runs:

    prologue   load its Q tile once (TMA); m = −inf, l = 0, O = 0
    kv_loop    for each visited KV block (masking.kv_block_range):
                 S = Q Kᵀ                      wgmma into a fresh accumulator
                 mask S                        boundary blocks only
                 m, l, P, α = softmax.update   base 2, scale folded into the exponent
                 O = α·O + P V                 P from registers; O re-enters the tensor cores
    epilogue   O / l and the LSE through shared memory and TMA

Rows past T and keys past S are zero-filled by TMA on load and clipped on store; keys past S
are masked inside the kernel, so any T ≥ 1 and S ≥ 1 work.
"""

from __future__ import annotations

import contextlib
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
from flash_attn_hopper import layouts
from flash_attn_hopper import masking
from flash_attn_hopper import pipeline
from flash_attn_hopper import softmax


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
  """Static options of one forward call (hashable: part of the jit cache key)."""

  scale: float
  is_causal: bool
  config: config_lib.ForwardConfig
  interpret: bool = False
  #: Keys that count when K/V were padded along S (tiny S); None means all of them.
  seq_kv: int | None = None


class _Dims(NamedTuple):
  batch: int
  seq_q: int
  seq_kv: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: jnp.dtype


class _Refs(NamedTuple):
  """Global and shared-memory refs of one CTA."""
  q: object
  k: object
  v: object
  o: object
  lse: object
  q_smem: object    # (compute warpgroups, block_q, D): Q in, then O out
  k_smem: object    # (num_stages, block_kv, D)
  v_smem: object
  lse_smem: object  # (compute warpgroups, block_q) float32
  p_staging: object  # interpreter only: (compute warpgroups, block_q, block_kv), else None


class _Tile(NamedTuple):
  """Where a CTA works: its batch, query head and first query row."""
  batch: jax.Array
  head: jax.Array
  row0: jax.Array


def _kv_step(step, carry, *, refs, bars, dims, opts, q0, n_visit, q_smem, p_staging, masked):
  """One KV block for one compute warpgroup: S = QKᵀ, mask, softmax, O += PV."""
  acc, state = carry
  cfg = opts.config
  slot = pipeline.slot_of(step, cfg.num_stages)

  def qk(s_ref):
    plgpu.wgmma(s_ref, q_smem, refs.k_smem.at[slot].T)
    bars.sync_schedule()  # Hand the tensor cores to the other warpgroup.
    return s_ref[...]

  s = pl.run_scoped(qk, plgpu.ACC((cfg.block_q, cfg.block_kv), jnp.float32))
  plgpu.barrier_arrive(bars.k_consumed.at[slot])
  if masked:
    s = masking.apply_element_mask(s, q0, step * cfg.block_kv, dims.seq_kv, opts.is_causal)
  state, p, alpha = softmax.update(state, s, opts.scale * softmax.LOG2E)
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
    pl.when(nxt < n_visit)(
        lambda: plgpu.barrier_wait(bars.k_ready.at[pipeline.slot_of(nxt, cfg.num_stages)]))

  acc = accumulate.matmul_accumulate(acc, p16, refs.v_smem.at[slot], staging=p_staging,
                                     while_running=wait_next_k)
  plgpu.barrier_arrive(bars.v_consumed.at[slot])
  return acc, state


def _release_step(step, _, *, bars, opts):
  """A block streamed for the other warpgroup only (causal): free its slot, keep the beat."""
  slot = pipeline.slot_of(step, opts.config.num_stages)
  # Observe the loads (every phase of a ready barrier is waited once by each consumer).
  plgpu.barrier_wait(bars.k_ready.at[slot])
  plgpu.barrier_wait(bars.v_ready.at[slot])
  plgpu.barrier_arrive(bars.k_consumed.at[slot])
  plgpu.barrier_arrive(bars.v_consumed.at[slot])
  bars.sync_schedule()
  bars.sync_schedule()


def _cta_kv_blocks(tile: _Tile, dims: _Dims, opts: ForwardOptions):
  """KV blocks the producer streams: those of the CTA's last rows, the most."""
  cfg = opts.config
  return masking.kv_block_range(tile.row0, cfg.rows_per_cta, dims.seq_kv, cfg.block_kv,
                                opts.is_causal).n_visit


def _compute_warpgroup(wg, refs: _Refs, bars: pipeline.Barriers, tile: _Tile, dims, opts):
  plgpu.set_max_registers(pipeline.COMPUTE_REGISTERS, action="increase")
  cfg = opts.config
  q0 = tile.row0 + wg * cfg.block_q
  q_smem = refs.q_smem.at[wg]
  plgpu.copy_gmem_to_smem(refs.q.at[tile.batch, pl.ds(q0, cfg.block_q), tile.head], q_smem,
                          bars.q_ready.at[wg])
  plgpu.barrier_wait(bars.q_ready.at[wg])

  blocks = masking.kv_block_range(q0, cfg.block_q, dims.seq_kv, cfg.block_kv, opts.is_causal)
  step = functools.partial(_kv_step, refs=refs, bars=bars, dims=dims, opts=opts, q0=q0,
                           n_visit=blocks.n_visit, q_smem=q_smem,
                           p_staging=None if refs.p_staging is None else refs.p_staging.at[wg])
  acc = plgpu.layout_cast(jnp.zeros((cfg.block_q, dims.head_dim), jnp.float32),
                          plgpu.Layout.WGMMA)
  carry = (acc, softmax.init(cfg.block_q))

  plgpu.barrier_wait(bars.k_ready.at[0])  # Every tile visits at least one block.
  pl.when(wg == 1)(bars.sync_schedule)    # Warpgroup 1 runs one phase behind.
  carry = lax.fori_loop(0, blocks.n_full, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(blocks.n_full, blocks.n_visit, functools.partial(step, masked=True),
                        carry)
  lax.fori_loop(blocks.n_visit, _cta_kv_blocks(tile, dims, opts),
                functools.partial(_release_step, bars=bars, opts=opts), None)
  pl.when(wg == 0)(bars.sync_schedule)    # Match warpgroup 1's extra phase.

  out, lse = softmax.finalize(carry[1], carry[0])
  _store_tile(wg, out, lse, q0, refs, tile, dims)


def _store_tile(wg, out, lse, q0, refs: _Refs, tile: _Tile, dims: _Dims):
  """O and the LSE go to shared memory, then to global memory with TMA (rows past T clip)."""
  q_smem, lse_smem = refs.q_smem.at[wg], refs.lse_smem.at[wg]
  rows = q_smem.shape[0]
  q_smem[...] = out.astype(dims.dtype)
  lse_smem[...] = lse
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, refs.o.at[tile.batch, pl.ds(q0, rows), tile.head])
  plgpu.copy_smem_to_gmem(lse_smem, refs.lse.at[tile.batch, tile.head, pl.ds(q0, rows)])
  plgpu.wait_smem_to_gmem(0)


def _producer_warpgroup(refs: _Refs, bars: pipeline.Barriers, tile: _Tile, dims, opts):
  plgpu.set_max_registers(pipeline.PRODUCER_REGISTERS, action="decrease")
  cfg = opts.config
  kv_head = tile.head // (dims.num_q_heads // dims.num_kv_heads)  # GQA: no repeated K/V.
  pipeline.produce_kv(
      lambda rows: refs.k.at[tile.batch, rows, kv_head],
      lambda rows: refs.v.at[tile.batch, rows, kv_head],
      refs.k_smem, refs.v_smem, bars, _cta_kv_blocks(tile, dims, opts), cfg.num_stages,
      cfg.block_kv)


def _cta_body(refs: _Refs, bars: pipeline.Barriers, *, dims: _Dims, opts: ForwardOptions):
  cfg = opts.config
  num_tiles = pl.cdiv(dims.seq_q, cfg.rows_per_cta)
  tile_id = lax.axis_index("q_tile")
  if opts.is_causal:  # The longest rows first: they finish last otherwise.
    tile_id = num_tiles - 1 - tile_id
  tile = _Tile(batch=lax.axis_index("batch"), head=lax.axis_index("head"),
               row0=tile_id * cfg.rows_per_cta)
  wg = lax.axis_index("wg")
  pl.when(wg < pipeline.NUM_COMPUTE_WARPGROUPS)(
      lambda: _compute_warpgroup(wg, refs, bars, tile, dims, opts))
  pl.when(wg == pipeline.PRODUCER_WARPGROUP)(
      lambda: _producer_warpgroup(refs, bars, tile, dims, opts))


def _smem_tile(shape, dtype):
  """A shared-memory tile in the 128-byte swizzle that TMA writes and wgmma reads."""
  itemsize = jnp.dtype(dtype).itemsize
  transforms = (plgpu.TilingTransform((8, hardware.SWIZZLE_BYTES // itemsize)),
                plgpu.SwizzleTransform(hardware.SWIZZLE_BYTES))
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def _entry(q_ref, k_ref, v_ref, o_ref, lse_ref, *, dims: _Dims, opts: ForwardOptions):
  cfg = opts.config
  wgs = pipeline.NUM_COMPUTE_WARPGROUPS
  scratch = (
      _smem_tile((wgs, cfg.block_q, dims.head_dim), dims.dtype),
      _smem_tile((cfg.num_stages, cfg.block_kv, dims.head_dim), dims.dtype),
      _smem_tile((cfg.num_stages, cfg.block_kv, dims.head_dim), dims.dtype),
      plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
  )
  staging = accumulate.staging_types(wgs, (cfg.block_q, cfg.block_kv), dims.dtype,
                                     interpret=opts.interpret)

  def scoped(q_smem, k_smem, v_smem, lse_smem, *rest):
    p_staging = rest[0] if staging else None
    barriers = pipeline.Barriers(*rest[len(staging):])
    refs = _Refs(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem,
                 p_staging)
    _cta_body(refs, barriers, dims=dims, opts=opts)

  pl.run_scoped(scoped, *scratch, *staging, *pipeline.Barriers.types(cfg.num_stages),
                collective_axes="wg")


def attention_forward(q, k, v, opts: ForwardOptions):
  """Runs the kernel on canonical inputs.

  Args:
    q: (B, T, N, D) float16/bfloat16, T ≥ the CTA's rows (the api pads tiny T).
    k, v: (B, S, K, D), same dtype, N % K == 0, S ≥ block_kv (the api pads tiny S).
    opts: static options.

  Returns:
    out (B, T, N, D) in q's dtype, and the LSE (B, N, T_tiles) in float32 (natural log),
    where T_tiles rounds T up to whole CTA tiles.
  """
  b, t, n, d = q.shape
  seq_kv = k.shape[1] if opts.seq_kv is None else opts.seq_kv
  dims = _Dims(b, t, seq_kv, n, k.shape[2], d, q.dtype)
  cfg = opts.config
  num_tiles = pl.cdiv(t, cfg.rows_per_cta)
  out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((b, n, num_tiles * cfg.rows_per_cta), jnp.float32))
  kernel = plgpu.kernel(
      functools.partial(_entry, dims=dims, opts=opts),
      out_type=out_types,
      grid=(num_tiles, n, b),
      grid_names=("q_tile", "head", "batch"),
      num_threads=pipeline.NUM_WARPGROUPS,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="flash_attn_hopper_fwd",
  )
  interpret = plgpu.force_gpu_interpret_mode() if opts.interpret else contextlib.nullcontext()
  with interpret, layouts.explain_accumulator_errors():
    return kernel(q, k, v)
