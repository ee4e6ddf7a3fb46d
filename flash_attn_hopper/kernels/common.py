"""Pieces the attention kernels share: problem sizes, static options, shared-memory tiles,
one-shot matmuls and the producer warpgroup's whole life."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from flash_attn_hopper import config as config_lib
from flash_attn_hopper import hardware
from flash_attn_hopper import layouts
from flash_attn_hopper import masking
from flash_attn_hopper import pipeline
from flash_attn_hopper import scheduler
from flash_attn_hopper import softmax


class Dims(NamedTuple):
  """Problem sizes as the kernel sees them (arrays may be padded past seq_q / seq_kv)."""
  batch: int
  seq_q: int
  seq_kv: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: jnp.dtype

  @property
  def group(self) -> int:
    """Query heads per KV head (GQA)."""
    return self.num_q_heads // self.num_kv_heads

  @classmethod
  def of(cls, q, k, opts) -> "Dims":
    b, t, n, d = q.shape
    seq_kv = k.shape[1] if opts.seq_kv is None else opts.seq_kv
    return cls(b, t, seq_kv, n, k.shape[2], d, q.dtype)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Static options that every kernel call takes (hashable: part of the jit cache key)."""

  scale: float
  mask: masking.MaskSpec
  config: object  # the kernel's own config dataclass
  interpret: bool = False
  #: Keys that count when K/V were padded along S; None means all of them.
  seq_kv: int | None = None
  #: Whether a (B,) int32 array of keys per batch element comes with K/V
  #: (`key_value_seq_lengths`); the keys past it are masked and their blocks skipped.
  kv_lens: bool = False
  #: Whether segment ids (`masking.SegmentIds`, padded like Q and K/V) and their block spans
  #: (`masking.segment_spans`) come with the inputs; keys of another segment are masked and
  #: blocks that share no segment with a tile are skipped.
  segments: bool = False
  #: Gemma 2's logits soft-cap (cap·tanh(x / cap) of the scaled logits), or None.
  soft_cap: float | None = None
  #: Whether an additive bias of the scaled logits comes along (`mask` arrives as one, −inf
  #: where masked): None, or whether it varies over (batch, head); see `MaskInputs.bias`.
  bias: tuple[bool, bool] | None = None
  #: Whether the bias's gradient is wanted (a user's `bias`, not only a `mask`): the dQ
  #: kernel then writes dS out (`kernels/dq.py`).
  bias_grad: bool = False
  #: Whether the bias input is a `mask` alone, as uint8 (1: visible): its tiles take one byte
  #: per entry instead of two, and the kernels turn them into 0 / −inf (`bias_values`).
  bias_is_mask: bool = False
  #: Upper bound on persistent CTAs; None means one per SM.
  max_ctas: int | None = None

  def bias_dtype(self, dtype):
    """The dtype of the bias tiles for inputs of `dtype` (None without a bias)."""
    if not self.bias:
      return None
    return jnp.dtype(jnp.uint8) if self.bias_is_mask else jnp.dtype(dtype)

  def bias_bytes(self, dtype) -> int:
    """Bytes per bias entry in shared memory (0 without a bias), for the configs' budgets."""
    return 0 if not self.bias else self.bias_dtype(dtype).itemsize

  @property
  def is_causal(self) -> bool:
    return self.mask.is_causal

  @property
  def logits(self) -> softmax.Logits:
    """How the kernels turn raw logits into the softmax's input (scale, soft-cap)."""
    return softmax.Logits(self.scale, self.soft_cap)


@dataclasses.dataclass(frozen=True)
class BackwardOptions(AttentionOptions):
  """Static options of one backward call."""

  config: config_lib.BackwardConfig


#: A tile's cost past its blocks, for the balanced tails (`ForwardConfig.balanced_tail`,
#: `BackwardConfig.balanced_tail`): its per-tile loads and epilogue, taken as one block's time
#: (a guess; in the list-scheduling model of the race grid, 0 to 1 block moves the balance by
#: under 1%). It keeps every cost positive, so that every CTA gets a tile.
TILE_FIXED_BLOCKS = 1


def band_costs(num_tiles: int, rows: int, blocks_of: Callable[[int], masking.BlockRange],
               per_block: int = 1) -> list[int]:
  """Each tile's work for `scheduler.balanced_pairs`, in blocks: `per_block` times the
  blocks `blocks_of(row0)` visits (a static range for the tile whose first row is `row0`),
  plus TILE_FIXED_BLOCKS. Static: `key_value_seq_lengths`, known only at run time, do not
  shorten it."""
  costs = []
  with jax.ensure_compile_time_eval():  # Static tile bounds: numbers, not traced values.
    for tile in range(num_tiles):
      blocks = blocks_of(tile * rows)
      costs.append(per_block * (int(blocks.end) - int(blocks.first)) + TILE_FIXED_BLOCKS)
  return costs


def query_tile_costs(mask: masking.MaskSpec, num_tiles: int, rows: int, seq_kv: int,
                     block_kv: int) -> list[int]:
  """`band_costs` of query tiles of `rows` rows (the forward's and dQ's): the key blocks of
  `block_kv` that each visits."""
  return band_costs(num_tiles, rows, lambda row0: masking.kv_block_range(
      mask, row0, rows, seq_kv, block_kv))


def key_tile_costs(mask: masking.MaskSpec, num_tiles: int, keys: int, seq_q: int,
                   block_q: int, group: int) -> list[int]:
  """`band_costs` of key tiles of `keys` keys (dK/dV's): the query blocks of `block_q` that
  each visits, once for each of the `group` query heads sharing the KV head."""
  return band_costs(num_tiles, keys, lambda key0: masking.q_block_range(
      mask, key0, keys, seq_q, block_q), per_block=group)


def backward_schedule(kernel: str, num_tiles: int, num_heads: int, batch: int,
                      rows_per_tile: int, *, steps: int, stages: int, head_dim: int,
                      opts: BackwardOptions, descending: bool = False,
                      costs: Callable[[], list[int]] | None = None) -> scheduler.TileScheduler:
  """The tile schedule of backward kernel `kernel` ("dq" or "dkv"), whose tiles stream at
  most `steps` ring steps through `stages` slots: persistent CTAs where that paid on the
  H200 (`config.PERSISTENT_BACKWARD_MAX_STEPS`, `scheduler.persistent`: mirror pairs under a
  causal bound, their tail balanced by `costs()` with `BackwardConfig.balanced_tail`); else
  one CTA per tile (`descending`: a head's last tile first). A bias's sparse stream, segment
  ids and `BackwardConfig.fused_dq` keep one CTA per tile."""
  paired = opts.mask.cost_grows_along_queries
  limit = config_lib.PERSISTENT_BACKWARD_MAX_STEPS.get((kernel, head_dim, paired), 0)
  persistent = (steps <= limit and stages >= 2
                and not (opts.bias or opts.segments or opts.config.fused_dq))
  if not persistent:
    return scheduler.per_tile(num_tiles, num_heads, batch, rows_per_tile, descending)
  return scheduler.persistent(num_tiles, num_heads, batch, rows_per_tile,
                              opts.max_ctas or hardware.num_sms(), paired=paired,
                              balanced_tail=opts.config.balanced_tail, costs=costs)


def keys_of(batch, kv_lens_ref, dims: Dims):
  """The keys batch element `batch` attends to: its `key_value_seq_lengths` entry (read from
  global memory, capped at S), or all of them (a static int) without lengths."""
  if kv_lens_ref is None:
    return dims.seq_kv
  return jnp.clip(kv_lens_ref[batch], 0, dims.seq_kv)


#: Per-query vectors of a (queries, keys) block vary along its rows, per-key ones along its
#: columns (the softmax statistics' layout and its transpose).
ROWS = plgpu.Layout.WGMMA.reduce(1)
COLUMNS = plgpu.Layout.WGMMA.reduce(0)


class MaskInputs(NamedTuple):
  """The data-dependent mask inputs of one kernel call, in global memory (each None when
  absent): keys per batch element, the segment ids of queries and keys, the block spans
  of the tiles' segments (`masking.segment_spans`, rows of whatever the kernel tiles), and
  a bias of the scaled logits, (B|1 · N|1 · T/block_q, block_q, S) in the inputs' dtype (see
  `with_bias`), with the spans of the blocks its −inf entries leave visible
  (`masking.table_spans`, (B|1, N|1, T/block_q, 4))."""
  kv_lens: object = None
  q_ids: object = None
  kv_ids: object = None
  spans: object = None
  bias: object = None
  bias_spans: object = None

  @classmethod
  def split(cls, refs, opts: "AttentionOptions"):
    """Splits a kernel's trailing refs into (MaskInputs, the rest): `kv_lens` when
    `opts.kv_lens`, then (q_ids, kv_ids, spans) when `opts.segments`, then (bias,
    bias_spans) when `opts.bias`."""
    refs = list(refs)
    kv_lens = refs.pop(0) if opts.kv_lens else None
    ids = [refs.pop(0) for _ in range(3)] if opts.segments else [None] * 3
    bias = [refs.pop(0) for _ in range(2)] if opts.bias else [None] * 2
    return cls(kv_lens, *ids, *bias), refs

  @classmethod
  def of(cls, kv_lens, segment_ids, opts: "AttentionOptions", *, seq_q: int, seq_kv: int,
         block_q: int, block_kv: int, tiles_are_keys: bool = False) -> "MaskInputs":
    """A kernel's mask inputs: the segment ids padded to seq_q and seq_kv (whole tiles), and
    their spans: per block of block_q queries the KV blocks, or with `tiles_are_keys` (the
    dK/dV kernel) per block of block_kv keys the query blocks."""
    if not opts.segments:
      return cls(kv_lens)
    ids = masking.pad_segment_ids(segment_ids, seq_q, seq_kv)
    if tiles_are_keys:
      spans = masking.segment_spans(ids.kv, ids.q, block_kv, block_q)
    else:
      spans = masking.segment_spans(ids.q, ids.kv, block_q, block_kv)
    return cls(kv_lens, ids.q, ids.kv, spans)

  def with_bias(self, bias, *, rows: int, row_block: int, col_block: int,
                tiles_are_keys: bool = False) -> "MaskInputs":
    """Adds a (B|1, N|1, T, S) bias (None: unchanged) as the kernel tiles it: rows are
    queries (transposed to keys first with `tiles_are_keys`, for the dK/dV kernel), padded
    with −inf (a mask's 0) to `rows` (whole tiles), columns to whole blocks of col_block (a
    TMA copy's box must divide the array's swizzle tiling: S = 777 failed to lower), and
    split into blocks of row_block rows, with every leading dimension folded into the block
    index: a tile is then a 3-D TMA copy (two row blocks × block rows × columns), whose
    swizzle tiling adds two dimensions to TMA's limit of five (`hardware.TMA_MAX_DIMS`);
    with the spans of column blocks its −inf entries leave."""
    if bias is None:
      return self
    is_mask = bias.dtype == jnp.uint8  # A mask alone (see `AttentionOptions.bias_is_mask`).
    # A table of the untransposed bias at the kernel's (query, key) blocks: the dQ and dK/dV
    # kernels' blocks are the same, so XLA computes their table once (common subexpression).
    # (A shared 64 × 64 table for the forward too made its pass 0.25 ms slower at 16k.)
    granule = (col_block, row_block) if tiles_are_keys else (row_block, col_block)
    if is_mask:  # 0/1 bytes: visible and free are the same entries, one count per block.
      may, full = masking.mask_count_table(bias, *granule)
    else:
      may, full = masking.mask_block_table(bias > -jnp.inf, bias == 0, *granule)
    if tiles_are_keys:
      bias, may, full = (jnp.swapaxes(x, -2, -1) for x in (bias, may, full))
    bb, nb, r, c = bias.shape
    spans = masking.table_spans((may, full), rows // row_block)
    cols = -(-c // col_block) * col_block
    bias = jnp.pad(bias, ((0, 0), (0, 0), (0, rows - r), (0, cols - c)),
                   constant_values=0 if is_mask else -jnp.inf)
    return self._replace(bias=bias.reshape(bb * nb * (rows // row_block), row_block, cols),
                         bias_spans=spans)

  def arrays(self) -> tuple:
    """The inputs that are present, in the order `split` expects."""
    return tuple(x for x in self if x is not None)


def bias_values(tile, opts: AttentionOptions):
  """A loaded bias tile as the float32 additive bias of the scaled logits: a mask's 0/1
  bytes become −inf / 0."""
  if opts.bias_is_mask:
    return jnp.where(tile != 0, 0.0, -jnp.inf)
  return tile.astype(jnp.float32)


def key_ids(ids_s, slot, load: bool):
  """With segment ids (`ids_s` is their stream), observes the slot's key ids and loads them
  when `load`; else None."""
  if ids_s is None:
    return None
  plgpu.barrier_wait(ids_s.ready.at[slot])
  if not load:
    plgpu.barrier_arrive(ids_s.consumed.at[slot])
    return None
  ids = plgpu.load(ids_s.smem.at[slot], layout=COLUMNS)
  pipeline.free_after_loads(ids_s.consumed.at[slot])
  return ids


def bias_tile(bias_s, step, wg, num_stages: int, opts: AttentionOptions):
  """With a bias (`bias_s` is its sparse stream: only the blocks a CTA does not see in full
  have a tile, see `pipeline.Stream.position`), warpgroup `wg`'s rows of step `step`'s tile,
  float32 in the logits' layout; else None."""
  if bias_s is None:
    return None
  slot = pipeline.slot_of(bias_s.position(step), pipeline.stages_of(bias_s, num_stages))
  plgpu.barrier_wait(bias_s.ready.at[slot])
  tile = bias_values(bias_s.smem.at[slot, wg][...], opts)
  pipeline.free_after_loads(bias_s.consumed.at[slot])
  return tile


def bias_index(batch, head, opts: AttentionOptions):
  """The (batch, head) of the bias a tile reads: 0 along a dimension the bias broadcasts."""
  batched, per_head = opts.bias
  return (batch if batched else 0), (head if per_head else 0)


def bias_block(masks: MaskInputs, opts: AttentionOptions, batch, head, row0, cols):
  """The global-memory view of one step's bias tile: the rows [row0, row0 + 2·block) (one
  block per compute warpgroup, `block` the kernel's row block) and the columns `cols`."""
  block = masks.bias.shape[1]
  _, num_heads, row_blocks, _ = masks.bias_spans.shape
  b, h = bias_index(batch, head, opts)
  first = (b * num_heads + h) * row_blocks + row0 // block
  return masks.bias.at[pl.ds(first, pipeline.NUM_COMPUTE_WARPGROUPS), pl.ds(0, block), cols]


def narrow_kv_blocks(band: masking.BlockRange, masks: MaskInputs, opts: AttentionOptions, *,
                     batch, head, q0, rows: int) -> masking.BlockRange:
  """A Q tile's KV blocks (the band's), narrowed to those that share a segment with its rows
  and that a mask (a −inf bias) leaves visible, from the spans in `masks`."""
  bq = opts.config.block_q
  blocks = [q0 // bq + i for i in range(rows // bq)]
  union = lambda ranges: functools.reduce(masking.BlockRange.union, ranges)
  if opts.segments:
    band = band.intersect(union([masking.BlockRange.read(masks.spans, batch, i)
                                 for i in blocks]))
  if opts.bias:
    index = bias_index(batch, head, opts)
    band = band.intersect(union([masking.BlockRange.read(masks.bias_spans, *index, i)
                                 for i in blocks]))
  return band


def smem_tile(shape, dtype, max_swizzle: int = hardware.SWIZZLE_BYTES):
  """A shared-memory tile in the swizzle that TMA writes and wgmma reads: `max_swizzle`
  bytes (128 unless a kernel needs narrower: `dq.operand_swizzle`), or the row's width when
  a row is narrower (a mask's 64 one-byte entries)."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(max_swizzle, shape[-1] * itemsize)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                plgpu.SwizzleTransform(swizzle))
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def unhoisted(x):
  """`x`, as a value that LLVM cannot hoist out of the loop it is computed in (an empty
  inline asm with side effects: `lax.optimization_barrier`). What is computed from it is
  computed where it is used.

  A persistent CTA's tile loop holds its loop invariants across the step loop inside it:
  LLVM's LICM hoisted the dK/dV epilogue's stmatrix addresses (sixteen 64-bit addresses at
  D 128, 32 registers) out of the tile loop, and ptxas then spilled around every step's
  matmuls. `dkv.UNHOISTED_EPILOGUE` and `forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM` say where
  computing them after the loop paid on the H200."""
  return lax.optimization_barrier(x)


def zeros_accumulator(shape):
  """A float32 zero array in the wgmma accumulator layout."""
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def overlapped_matmuls(first, second, on_first, before_second=lambda: None):
  """Two matmuls of shared-memory operands, each `(a_smem, b_smem, shape)`, into fresh float32
  accumulators, both issued before either is awaited. Returns `(on_first(a @ b of first),
  a @ b of second)`: the work on the first product (the backward's 2^(S − LSE)) runs while the
  tensor cores compute the second (dP), instead of between them. `before_second()` runs
  between the two issues (a barrier wait for the second's operand)."""
  def run(first_ref, second_ref):
    plgpu.wgmma(first_ref, first[0], first[1])
    before_second()
    plgpu.wgmma(second_ref, second[0], second[1])
    # Each wgmma is one commit group and groups retire in order: one left in flight is the
    # second. (The interpreter runs a wgmma when it is issued and ignores the count.)
    result = on_first(plgpu.wgmma_accumulator_load(first_ref, wait_n=1))
    return result, second_ref[...]
  return pl.run_scoped(run, plgpu.ACC(first[2], jnp.float32),
                       plgpu.ACC(second[2], jnp.float32))


def fori(lo, hi, body, carry):
  """`lax.fori_loop`, or nothing when the bounds are equal Python ints, so that a kernel emits
  no loop for a part of a block range that a mask makes statically empty."""
  if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
    return carry
  return lax.fori_loop(lo, hi, body, carry)


def walk_blocks(cta, own, step, release, carry, before_own=None):
  """One warpgroup's pass over the KV blocks its CTA streams (`masking.BlockRange`s).

  The blocks before its own and after them are `release(j, None)`d, so that both compute
  warpgroups observe every block of the shared ring; its own run `step(j, carry, masked=...)`,
  with element masks on the band's edge blocks only. `before_own()` runs once in between."""
  fori(cta.first, own.first, release, None)
  if before_own is not None:
    before_own()
  for lo, hi, masked in ((own.first, own.full_lo, True), (own.full_lo, own.full_hi, False),
                         (own.full_hi, own.end, True)):
    carry = fori(lo, hi, functools.partial(step, masked=masked), carry)
  fori(own.end, cta.end, release, None)
  return carry


def walk_head_runs(num_heads: int, steps_per_head, blocks_of, step, carry):
  """A dK/dV warpgroup's ring steps, query head by query head: head g's query blocks
  `blocks_of(g)` (a `masking.BlockRange` within the tile's [q_block0, q_block0 +
  steps_per_head)) are ring steps g·steps_per_head + (block − q_block0); its full run goes
  through `step(i, carry, masked=False)`, the blocks before and after it masked=True.
  `blocks_of` None: every step is full, one loop over them all."""
  if blocks_of is None:
    return lax.fori_loop(0, num_heads * steps_per_head, functools.partial(step, masked=False),
                         carry)

  def head(g, carry):
    b = blocks_of(g)
    base = g * steps_per_head - b.first  # the ring step of query block j is base + j
    for lo, hi, masked in ((b.first, b.full_lo, True), (b.full_lo, b.full_hi, False),
                           (b.full_hi, b.end, True)):
      carry = fori(base + lo, base + hi, functools.partial(step, masked=masked), carry)
    return carry
  return lax.fori_loop(0, num_heads, head, carry)


def issue_tile_loads(copies, tile_ready, wg, which=None):
  """Starts a compute warpgroup's per-tile TMA loads: `copies` are (source, destination)
  pairs, copy i on barrier len(copies)·wg + i of `tile_ready`; all of them, or the indices
  `which`."""
  n = len(copies)
  for i in range(n) if which is None else which:
    src, dst = copies[i]
    plgpu.copy_gmem_to_smem(src, dst, tile_ready.at[n * wg + i])


def wait_tile_loads(tile_ready, wg, count: int):
  """Waits for the `count` per-tile loads of compute warpgroup `wg` (`issue_tile_loads`)."""
  for i in range(count):
    plgpu.barrier_wait(tile_ready.at[count * wg + i])


def run_key_tiles(sched, as_tile: Callable, load: Callable, run: Callable,
                  steps_of: Callable) -> None:
  """A dK/dV compute warpgroup's loop over its CTA's key tiles (`dkv`, `dkv_split`; the
  producer's is `produce_tiles`): `as_tile(item)` makes the scheduler's work item a tile,
  `load(tile)` starts the tile loads this warpgroup owns, and `run(tile, ring0)` computes the
  tile from ring position ring0 and stores its output by TMA through those buffers. On a
  persistent CTA the next tile's loads start once that store has read them. The ring
  advances `steps_of(tile)` a tile."""
  cta = lax.axis_index("cta")
  num_items = sched.items_of(cta)
  load(as_tile(sched.tile(cta, 0)))

  def tile_body(i, ring: pipeline.Ring):
    tile = as_tile(sched.tile(cta, i))
    run(tile, ring.kv)
    if sched.persistent:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      pl.when(i + 1 < num_items)(lambda: load(as_tile(sched.tile(cta, i + 1))))
    return ring.advance(steps_of(tile))

  lax.fori_loop(0, num_items, tile_body, pipeline.Ring.start())
  plgpu.wait_smem_to_gmem(0)


def produce_tiles(sched, tile_streams: Callable, drain_streams, num_stages: int,
                  bias: bool = False):
  """The producer warpgroup of a CTA that runs the tiles `sched` deals it, its rings running
  on across them: `tile_streams(tile, ring)` gives a tile's `pipeline.Stream`s, how many
  steps it streams, and a function that returns the `pipeline.Ring` after it (called once
  they are streamed); `drain_streams` are the streams to drain at the end (`bias`: with a
  sparse bias stream, whose positions `Ring.bias` counts)."""
  plgpu.set_max_registers(pipeline.PRODUCER_REGISTERS, action="decrease")
  cta = lax.axis_index("cta")

  def tile_body(i, ring: pipeline.Ring):
    streams, num_steps, after = tile_streams(sched.tile(cta, i), ring)
    pipeline.produce(streams, ring.kv, num_steps, num_stages)
    return after()

  total = lax.fori_loop(0, sched.items_of(cta), tile_body, pipeline.Ring.start(bias=bias))
  pipeline.drain(drain_streams, total.kv, num_stages, sparse_total=total.bias)


def producer(streams, num_steps, num_stages: int, sparse_total=None):
  """A producer warpgroup that streams one tile's blocks and exits (`sparse_total`: the
  blocks a sparse stream copies, see `pipeline.drain`)."""
  plgpu.set_max_registers(pipeline.PRODUCER_REGISTERS, action="decrease")
  pipeline.produce(streams, 0, num_steps, num_stages)
  pipeline.drain(streams, num_steps, num_stages, sparse_total)


def specialize(compute: Callable, produce: Callable) -> None:
  """Runs `compute(wg)` on the compute warpgroups and `produce()` on the producer."""
  wg = lax.axis_index("wg")
  pl.when(wg < pipeline.NUM_COMPUTE_WARPGROUPS)(lambda: compute(wg))
  pl.when(wg == pipeline.PRODUCER_WARPGROUP)(produce)


#: Shared memory Pallas sets aside for reductions that cross warps (its default is 2 KiB). The
#: kernels reduce only along the rows of the WGMMA layout, within each warp's lanes, which
#: needs none, so they ask for none and the 2 KiB go to tiles. A reduction that did cross warps
#: would fail to lower ("scratch must be provided"), in CI's tests/test_lowering.py.
REDUCTION_SCRATCH_BYTES = 0


def launch(body, *args, out_type, grid, grid_names, name: str, interpret: bool):
  """Runs a warp-specialized kernel (compute warpgroups + producer) on `args`.

  With `interpret`, through the Mosaic GPU interpreter; either way, the two opaque
  wrong-accumulator-layout failures come back as `layouts.AccumulatorLayoutError`.
  """
  kernel = plgpu.kernel(
      body, out_type=out_type, grid=grid, grid_names=grid_names,
      num_threads=pipeline.NUM_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          approx_math=True, reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES),
      kernel_name=name)
  mode = (plgpu.force_gpu_interpret_mode(pipeline.INTERPRET_PARAMS) if interpret
          else contextlib.nullcontext())
  with mode, layouts.explain_accumulator_errors():
    return kernel(*args)
