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
"""

from __future__ import annotations

import dataclasses
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


def _cdiv(a, b):
  return (a + b - 1) // b


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
  """The Q blocks that see any of the keys [k0, k0 + keys) (for the dK/dV kernel). Its
  `full_*` are not computed: the dK/dV kernel masks every block of a banded spec."""
  if not spec.banded:
    return BlockRange(0, 0, 0, _cdiv(seq_q, block_q))
  # Query i sees key j when j − upper ≤ i + offset ≤ j + left.
  lo, hi = 0, seq_q
  if spec.upper is not None:
    lo = jnp.maximum(k0 - spec.upper - spec.offset, 0)
  if spec.left is not None:
    hi = jnp.clip(k0 + keys - 1 + spec.left - spec.offset + 1, 0, seq_q)
  first = lo // block_q
  end = jnp.where(hi > lo, _cdiv(hi, block_q), first)
  return BlockRange(first, first, first, end)


def empty_rows(spec: MaskSpec, seq_q: int, seq_kv: int, kv_lens=None):
  """The queries that see no key at all, in O(T): a (T,) numpy bool array, or with `kv_lens`
  ((B,) keys per batch element, traced) a (B, T) jax array."""
  xp = np if kv_lens is None else jnp
  diag = xp.arange(seq_q) + spec.offset
  last = seq_kv - 1 if kv_lens is None else jnp.minimum(kv_lens, seq_kv)[:, None] - 1
  lo = xp.zeros_like(diag) if spec.left is None else xp.maximum(diag - spec.left, 0)
  hi = last if spec.upper is None else xp.minimum(diag + spec.upper, last)
  return xp.broadcast_to(hi < lo, np.shape(hi < lo))


def apply_element_mask(s, q0, k0, seq_kv: int | None, spec: MaskSpec, *, key_axis: int = 1):
  """Sets the logits of invisible (query, key) pairs of one block to −inf.

  `s` is a logit block in `Layout.WGMMA` of queries q0.. and keys k0..: (queries, keys) with
  `key_axis=1`, or the transposed (keys, queries) block of the dK/dV kernel with `key_axis=0`.
  Keys at or past `seq_kv` are invisible (None: no such keys), and so is what `spec` masks.
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
  if not conditions:
    return s
  visible = conditions[0] if len(conditions) == 1 else jnp.logical_and(*conditions)
  return jnp.where(visible, s, -jnp.inf)
