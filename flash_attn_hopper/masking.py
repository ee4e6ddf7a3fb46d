"""Masks at two levels, shared by every kernel.

What is visible is a `MaskSpec`: a band around a diagonal. Query i's diagonal key is
d = i + offset (offset 0: top-left alignment, as in `jax.nn`; offset S − T: bottom-right, as
FlashAttention aligns causal attention for decoding). Key j is visible to query i when

    d − left ≤ j ≤ d + right,   j < seq_kv

where `left`/`right` come from `local_window_size` (None: unbounded) and causal caps right at 0.

Block level: which KV blocks a Q tile visits, and which of those need element masks; and, for
the dK/dV kernel, which Q blocks a KV tile visits. For the Q rows [q0, q0 + rows)::

    keys:    [0 ......................................... S)
    blocks:  (skipped) |edge|edge| full | full |edge|edge| (skipped)
                       first     full_lo       full_hi   end

Blocks [full_lo, full_hi) are visible to every row of the tile and need no element mask; the
others in [first, end) straddle an edge of the band or the end of the keys; the rest are never
loaded. Element level: `apply_element_mask`, on those edge blocks only.

Packed sequences add `SegmentIds`: query i sees key j only when their ids are equal. They are
data, not static: `segment_spans` reduces them, per block, to ranges of blocks (outside the
kernels, in O(T·S / block²)), which the kernels intersect with the band's `BlockRange`s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The visible band (see the module docstring). Static: part of the kernels' jit key.

  Attributes:
    is_causal: keys past the diagonal are invisible (caps `right` at 0).
    left, right: window sizes before and after the diagonal (`local_window_size`); None is
      unbounded.
    offset: the diagonal's shift, S − T for bottom-right alignment; 0 is top-left.
  """
  is_causal: bool = False
  left: int | None = None
  right: int | None = None
  offset: int = 0

  def __post_init__(self):
    for name in ("left", "right"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 0):
        raise ValueError(f"MaskSpec.{name} must be None or an int >= 0, got {value!r}")

  @property
  def upper(self) -> int | None:
    """How far past the diagonal a visible key may be (None: unbounded)."""
    if self.is_causal:
      return 0 if self.right is None else min(self.right, 0)
    return self.right

  def without_idle_edges(self, seq_q: int, seq_kv: int) -> "MaskSpec":
    """The same band with each window side that masks no key of a (seq_q, seq_kv) problem
    dropped (set to None), so that a window wider than the sequence runs as the unwindowed
    kernel does (paired causal schedule, no edge blocks). The left side is idle when the
    last query's diagonal, seq_q − 1 + offset, is within `left` of key 0; the right side
    when the first query's, `offset`, is within `right` of key seq_kv − 1."""
    idle_left = self.left is not None and seq_q - 1 + self.offset - self.left <= 0
    left = None if idle_left else self.left
    right = None if self.right is not None and self.offset + self.right >= seq_kv - 1 \
        else self.right
    return dataclasses.replace(self, left=left, right=right)

  @property
  def cost_grows_along_queries(self) -> bool:
    """Whether a query tile's visible keys grow with its row (bounded above, not on the
    left: causal). A key tile's visible queries then shrink with its key, so either kernel's
    tiles pair with their mirror to even the work (`scheduler`)."""
    return self.upper is not None and self.left is None

  @property
  def banded(self) -> bool:
    """Whether anything but the end of the keys is masked."""
    return self.upper is not None or self.left is not None

  def visible(self, q_ids, k_ids):
    """Whether key k_ids is visible to query q_ids (arrays that broadcast), or None if all
    are (keys past seq_kv aside)."""
    conditions = []
    diag = q_ids + self.offset
    if self.upper is not None:
      conditions.append(k_ids <= diag + self.upper)
    if self.left is not None:
      conditions.append(k_ids >= diag - self.left)
    if not conditions:
      return None
    return conditions[0] if len(conditions) == 1 else jnp.logical_and(*conditions)


class SegmentIds(NamedTuple):
  """Packed sequences: int32 ids of each query's (B, T) and each key's (B, S) segment.

  Query i of batch element b sees key j only when q[b, i] == kv[b, j] (and the band and the
  lengths allow it). Ids need not be sorted or contiguous; contiguous documents (packing)
  let the kernels skip whole blocks.
  """
  q: jax.Array
  kv: jax.Array


def as_segment_ids(segment_ids, batch: int, seq_q: int, seq_kv: int) -> SegmentIds | None:
  """The op's `segment_ids` argument as (B, T) and (B, S) int32 `SegmentIds`, checked.

  Accepts None; a `SegmentIds` or (q_ids, kv_ids) pair; or one array for self-attention
  (T == S), used for queries and keys alike. Each array is (B, L), or (L,) for every batch
  element."""
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be one array, or a pair (q_segment_ids, "
                       f"kv_segment_ids); got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    if seq_q != seq_kv:
      raise ValueError(f"segment_ids as one array needs T == S (self-attention); got T {seq_q} "
                       f"and S {seq_kv}: pass SegmentIds(q=..., kv=...) instead")
    q_ids = kv_ids = segment_ids

  def check(name, ids, length):
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"segment_ids.{name} must be an integer array; got dtype {ids.dtype}")
    if ids.shape not in ((batch, length), (length,)):
      raise ValueError(f"segment_ids.{name} must have shape ({batch}, {length}) or "
                       f"({length},); got {ids.shape}")
    return jnp.broadcast_to(ids.astype(jnp.int32), (batch, length))

  return SegmentIds(check("q", q_ids, seq_q), check("kv", kv_ids, seq_kv))


def pad_segment_ids(ids: SegmentIds, seq_q: int, seq_kv: int) -> SegmentIds:
  """Ids for inputs padded along T and S to seq_q and seq_kv: each row repeats its last id,
  so padding widens no block's span (padded keys are masked by length, padded rows dropped)."""
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1])), mode="edge")
  return SegmentIds(pad(ids.q, seq_q), pad(ids.kv, seq_kv))


class BlockRange(NamedTuple):
  """Blocks [first, end) are visited; [full_lo, full_hi) of them need no element mask."""
  first: jax.Array | int
  full_lo: jax.Array | int
  full_hi: jax.Array | int
  end: jax.Array | int

  def within(self, outer: "BlockRange") -> "BlockRange":
    """This range clipped to `outer` (a warpgroup's part of its CTA's). A range is empty
    where a warpgroup's rows see no key, and an empty range's `first` may lie past the
    CTA's `end`: a kernel that released [outer.first, first) would wait for a block that
    was never streamed. Without a left edge every range starts at block 0 and ends within
    its CTA's, so there is nothing to clip."""
    if isinstance(self.first, int) and isinstance(outer.first, int):
      return self
    first = jnp.clip(self.first, outer.first, outer.end)
    end = jnp.clip(self.end, first, outer.end)
    full_lo = jnp.clip(self.full_lo, first, end)
    return BlockRange(first, full_lo, jnp.clip(self.full_hi, full_lo, end), end)


  def intersect(self, other: "BlockRange") -> "BlockRange":
    """The blocks both ranges visit; a block needs no element mask only if it needs none in
    either. An empty intersection has end == first."""
    first = jnp.maximum(self.first, other.first)
    end = jnp.maximum(jnp.minimum(self.end, other.end), first)
    full_lo = jnp.clip(jnp.maximum(self.full_lo, other.full_lo), first, end)
    full_hi = jnp.clip(jnp.minimum(self.full_hi, other.full_hi), full_lo, end)
    return BlockRange(first, full_lo, full_hi, end)

  @classmethod
  def read(cls, spans_ref, *index) -> "BlockRange":
    """One row of a `segment_spans` / `table_spans` array in a kernel: `index` is
    (batch, block), or (batch, head, block) for a mask's."""
    return cls(*(spans_ref[(*index, i)] for i in range(4)))

  def union(self, other: "BlockRange") -> "BlockRange":
    """The smallest range that covers both (what a CTA of two warpgroups streams), whose
    full blocks are those full in both (a block full for every row of the CTA)."""
    first = jnp.minimum(self.first, other.first)
    end = jnp.maximum(jnp.maximum(self.end, other.end), first)
    full_lo = jnp.clip(jnp.maximum(self.full_lo, other.full_lo), first, end)
    full_hi = jnp.clip(jnp.minimum(self.full_hi, other.full_hi), full_lo, end)
    return BlockRange(first, full_lo, full_hi, end)

  def full_within(self, other: "BlockRange") -> "BlockRange":
    """The same blocks, with only those full in `other` too counted as full: a warpgroup's
    range whose unmasked blocks must be ones its CTA streams no bias tile for."""
    full_lo = jnp.clip(jnp.maximum(self.full_lo, other.full_lo), self.first, self.end)
    full_hi = jnp.clip(jnp.minimum(self.full_hi, other.full_hi), full_lo, self.end)
    return BlockRange(self.first, full_lo, full_hi, self.end)

  def edge_count(self, block):
    """How many blocks of [first, block) lie outside the full run: the position of `block`
    (traced, in [first, end]) among the blocks that need an element mask or a bias tile."""
    return (block - self.first) - (jnp.clip(block, self.full_lo, self.full_hi) - self.full_lo)

  def edge_steps(self, first=None, base=None):
    """A sparse stream over the blocks outside the full run (`pipeline.Stream.needed` and
    `.position`): step -> whether block `first + step` (`step` itself when `first` is None)
    needs a tile, and its ring position, `base` (None: 0) plus its `edge_count`."""
    block = (lambda step: step) if first is None else (lambda step: first + step)
    needed = lambda step: ~self.is_full(block(step))
    if base is None:
      return needed, lambda step: self.edge_count(block(step))
    return needed, lambda step: base + self.edge_count(block(step))

  def is_full(self, block):
    """Whether `block` (traced) lies in [full_lo, full_hi)."""
    return jnp.logical_and(block >= self.full_lo, block < self.full_hi)


def _cdiv(a, b):
  return (a + b - 1) // b


def _block_bounds(ids, block: int):
  """(min, max) id of each block of `block` entries of (B, L) ids, edge-padded to whole blocks."""
  b, length = ids.shape
  n = _cdiv(length, block)
  ids = jnp.pad(ids, ((0, 0), (0, n * block - length)), mode="edge").reshape(b, n, block)
  return ids.min(axis=2), ids.max(axis=2)


def segment_spans(row_ids, col_ids, row_block: int, col_block: int):
  """For each block of rows, the blocks of columns whose segments it may meet.

  Returns (B, row blocks, 4) int32: [first, full_lo, full_hi, end] as in `BlockRange`. Column
  blocks outside [first, end) share no id with the row block; those in [full_lo, full_hi)
  hold only the row block's single id, so they need no segment mask. From each block's
  minimum and maximum id alone, so unsorted ids are handled, only less tightly. Rows are
  queries for the forward and dQ kernels, keys for the dK/dV kernel."""
  r_min, r_max = (x[:, :, None] for x in _block_bounds(row_ids, row_block))
  c_min, c_max = (x[:, None, :] for x in _block_bounds(col_ids, col_block))
  may = (r_min <= c_max) & (c_min <= r_max)
  full = (r_min == r_max) & (c_min == c_max) & (r_min == c_min)
  return _spans(may, full)


def mask_block_table(visible, free, row_granule: int, col_granule: int):
  """One pass over (..., rows, cols) booleans, `visible` (the entries a bias or mask leaves
  visible) and `free` (those where it changes nothing: a zero bias, a True mask): per
  row_granule × col_granule block, whether any entry is visible and whether all are free,
  (..., ⌈rows/rg⌉, ⌈cols/cg⌉) each. Padding is neither, so an edge block is never free."""
  *lead, rows, cols = visible.shape
  nr, nc = _cdiv(rows, row_granule), _cdiv(cols, col_granule)
  pad = [(0, 0)] * len(lead) + [(0, nr * row_granule - rows), (0, nc * col_granule - cols)]
  blocks = lambda x: jnp.pad(x, pad).reshape(*lead, nr, row_granule, nc, col_granule)
  # Along the contiguous columns first, then the rows.
  return (blocks(visible).any(axis=-1).any(axis=-2),
          blocks(free).all(axis=-1).all(axis=-2))


def mask_count_table(mask, row_granule: int, col_granule: int):
  """`mask_block_table` of a mask given as 0/1 bytes, for which visible and free are the
  same entries: one reduction (the visible entries per block) instead of two. Padding
  counts as hidden, so an edge block is never full."""
  *lead, rows, cols = mask.shape
  nr, nc = _cdiv(rows, row_granule), _cdiv(cols, col_granule)
  pad = [(0, 0)] * len(lead) + [(0, nr * row_granule - rows), (0, nc * col_granule - cols)]
  blocks = jnp.pad(mask, pad).reshape(*lead, nr, row_granule, nc, col_granule)
  counts = blocks.sum(axis=-1, dtype=jnp.int32).sum(axis=-2)
  return counts > 0, counts == row_granule * col_granule


def table_spans(table, num_row_blocks: int):
  """A kernel's spans from a `mask_block_table` taken at its (row, column) blocks (transposed
  for the dK/dV kernel, whose rows are keys): per block of rows, of `num_row_blocks` (the
  ones past the table's are neither visible nor free), the blocks of columns that hold any
  visible entry and the first run of blocks free throughout, (..., num_row_blocks, 4) int32
  as `segment_spans` gives. The kernels stream no bias tile for that run."""
  may, full = table
  pad = [(0, 0)] * (may.ndim - 2) + [(0, num_row_blocks - may.shape[-2]), (0, 0)]
  return _spans(jnp.pad(may, pad), jnp.pad(full, pad))


def _spans(may, full):
  """[first, full_lo, full_hi, end] along the last axis of block-pair booleans: the range
  of blocks that `may` hold anything visible, and the first run of `full` ones (None: the
  whole range)."""
  n = may.shape[-1]
  cols = jnp.arange(n)
  anywhere = may.any(axis=-1)
  first = jnp.where(anywhere, jnp.argmax(may, axis=-1), 0)
  end = jnp.where(anywhere, n - jnp.argmax(may[..., ::-1], axis=-1), first)
  if full is None:
    return jnp.stack([first, first, end, end], axis=-1).astype(jnp.int32)
  # The first run of fully visible blocks (one run when segments are contiguous).
  full_lo = jnp.where(full.any(axis=-1), jnp.argmax(full, axis=-1), first)
  after = ~full & (cols >= full_lo[..., None])
  full_hi = jnp.where(after.any(axis=-1), jnp.argmax(after, axis=-1), n)
  full_lo = jnp.clip(full_lo, first, end)
  full_hi = jnp.clip(full_hi, full_lo, end)
  return jnp.stack([first, full_lo, full_hi, end], axis=-1).astype(jnp.int32)


def kv_block_range(spec: MaskSpec, q0, rows: int, seq_kv: int, block_kv: int) -> BlockRange:
  """The KV blocks that the Q rows [q0, q0 + rows) visit (q0 may be traced)."""
  if not spec.banded:  # Static: every row sees every key.
    return BlockRange(0, 0, seq_kv // block_kv, _cdiv(seq_kv, block_kv))
  last = q0 + rows - 1
  # Keys some row sees: [lo, hi); keys every row sees: [full_lo_key, full_hi_key).
  lo, full_lo_key = 0, 0
  if spec.left is not None:
    lo = jnp.maximum(q0 + spec.offset - spec.left, 0)
    full_lo_key = jnp.maximum(last + spec.offset - spec.left, 0)
  hi, full_hi_key = seq_kv, seq_kv
  if spec.upper is not None:
    hi = jnp.clip(last + spec.offset + spec.upper + 1, 0, seq_kv)
    full_hi_key = jnp.clip(q0 + spec.offset + spec.upper + 1, 0, seq_kv)
  first = lo // block_kv
  end = jnp.where(hi > lo, _cdiv(hi, block_kv), first)
  # No left edge (causal): the range starts at block 0, statically, so the kernels emit no
  # loop for a leading edge.
  full_lo = 0 if spec.left is None else jnp.clip(_cdiv(full_lo_key, block_kv), first, end)
  full_hi = jnp.clip(full_hi_key // block_kv, full_lo, end)
  return BlockRange(first, full_lo, full_hi, end)


def q_block_range(spec: MaskSpec, k0, keys: int, seq_q: int, block_q: int) -> BlockRange:
  """The Q blocks that see any of the keys [k0, k0 + keys) (for the dK/dV kernels), and
  [full_lo, full_hi) of them, whose every query sees every one of those keys (no element
  mask; queries past seq_q count as seeing them, their rows add nothing).

  Query i sees key j when j − upper ≤ i + offset ≤ j + left, so it sees all of the keys when
  k0 + keys − 1 − upper ≤ i + offset ≤ k0 + left: a block from its first query on the
  upper side, up to its last on the left."""
  if not spec.banded:
    end = _cdiv(seq_q, block_q)
    return BlockRange(0, 0, end, end)
  # Queries [lo, hi) see some of the keys; from full_lo on (up to full_hi), all of them.
  lo, hi, full_lo, full_hi = 0, seq_q, 0, seq_q
  if spec.upper is not None:
    lo = jnp.maximum(k0 - spec.upper - spec.offset, 0)
    full_lo = jnp.maximum(k0 + keys - 1 - spec.upper - spec.offset, 0)
  if spec.left is not None:
    hi = jnp.clip(k0 + keys - 1 + spec.left - spec.offset + 1, 0, seq_q)
    full_hi = k0 + spec.left - spec.offset + 1
  first = lo // block_q
  end = jnp.where(hi > lo, _cdiv(hi, block_q), first)
  full_lo = jnp.clip(_cdiv(full_lo, block_q), first, end)
  # Without a left edge, every block from full_lo to the end is full (queries past T count
  # as seeing the keys); with one, up to the last block whose last query sees them all.
  full_hi = end if spec.left is None else full_hi // block_q
  return BlockRange(first, full_lo, jnp.clip(full_hi, full_lo, end), end)


def key_length_q_blocks(k0, keys: int, seq_kv, end) -> BlockRange:
  """For the dK/dV kernels with per-batch key lengths (`seq_kv`, traced): the query blocks
  [0, end) that the keys [k0, k0 + keys) meet, all of them full when the keys lie within the
  length, none full when they straddle it (the length's compare on every step), and none at
  all when they start past it (dK = dV = 0). Intersect it with the band's range."""
  return BlockRange(0, 0, jnp.where(k0 + keys <= seq_kv, end, 0),
                    jnp.where(k0 < seq_kv, end, 0))


def empty_rows(spec: MaskSpec, seq_q: int, seq_kv: int, kv_lens=None):
  """The queries that see no key at all, in O(T): a (T,) numpy bool array, or with `kv_lens`
  ((B,) keys per batch element, traced) a (B, T) jax array."""
  xp = np if kv_lens is None else jnp
  diag = xp.arange(seq_q) + spec.offset
  last = seq_kv - 1 if kv_lens is None else jnp.minimum(kv_lens, seq_kv)[:, None] - 1
  lo = xp.zeros_like(diag) if spec.left is None else xp.maximum(diag - spec.left, 0)
  hi = last if spec.upper is None else xp.minimum(diag + spec.upper, last)
  return xp.broadcast_to(hi < lo, np.shape(hi < lo))


def same_segment(q_ids, k_ids, shape, *, key_axis: int = 1):
  """Whether each (query, key) pair of a logit block shares a segment: q_ids in the block's
  per-query layout, k_ids in its per-key layout (see `apply_element_mask`)."""
  along = lambda x, axis: jax.lax.broadcast_in_dim(x, shape, [axis])
  return along(q_ids, 1 - key_axis) == along(k_ids, key_axis)


def key_end_to_mask(seq_kv, block_kv: int):
  """The key end an element mask has to compare against (`apply_element_mask`'s `seq_kv`):
  None when no visited block holds a key past it, that is when it is a static whole number
  of blocks (the blocks end there, `kv_block_range`); else `seq_kv` (a ragged last block, or
  per-batch key lengths). The compare it saves measured 2% of the D 64 causal forward on
  the H200 (bench/NOTES.md, fifteenth session)."""
  if isinstance(seq_kv, int) and seq_kv % block_kv == 0:
    return None
  return seq_kv


def apply_element_mask(s, q0, k0, seq_kv: int | None, spec: MaskSpec, *, key_axis: int = 1,
                       segments=None):
  """Sets the logits of invisible (query, key) pairs of one block to −inf.

  `s` is a logit block in `Layout.WGMMA` of queries q0.. and keys k0..: (queries, keys) with
  `key_axis=1`, or the transposed (keys, queries) block of the dK/dV kernel with `key_axis=0`.
  Keys at or past `seq_kv` are invisible (None: no such keys), and so is what `spec` masks,
  and with `segments` (the block's (query ids, key ids), see `same_segment`) a key of
  another segment.
  """
  shape = s.shape
  iota = lambda axis: plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)
  k_ids = k0 + iota(key_axis)
  conditions = []
  if seq_kv is not None:
    conditions.append(k_ids < seq_kv)
  band = spec.visible(q0 + iota(1 - key_axis), k_ids)
  if band is not None:
    conditions.append(band)
  if segments is not None:
    conditions.append(same_segment(*segments, shape, key_axis=key_axis))
  if not conditions:
    return s
  visible = functools.reduce(jnp.logical_and, conditions)
  return jnp.where(visible, s, -jnp.inf)
