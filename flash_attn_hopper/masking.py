"""Masks at two levels, shared by every kernel.

Block level: which KV blocks a Q tile must visit, and which of those need element masks.
Element level: applied only on those boundary blocks.

Causal alignment is top-left, as in `jax.nn.dot_product_attention`: query i sees key j when
j <= i, for any T and S. For a Q tile of rows [q0, q0 + rows) and KV blocks of `block_kv` keys::

    keys:    [0 ........................ S)
    blocks:  | full | full | full |edge|edge|  (skipped)
             0       n_full               n_visit

`n_full` blocks are visible to every row of the tile and need no element mask; blocks
[n_full, n_visit) straddle the diagonal or the end of the keys and get an element mask; blocks
past n_visit are never loaded.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp


class KvBlockRange(NamedTuple):
  n_full: jax.Array | int   # blocks [0, n_full) need no element mask
  n_visit: jax.Array | int  # blocks [n_full, n_visit) need one; the rest are skipped


def _cdiv(a, b):
  return (a + b - 1) // b


def kv_block_range(q0, rows: int, seq_kv: int, block_kv: int, is_causal: bool) -> KvBlockRange:
  """The KV blocks that the Q rows [q0, q0 + rows) visit (q0 may be traced)."""
  keys_full = seq_kv // block_kv        # blocks without a key past S
  keys_visit = _cdiv(seq_kv, block_kv)
  if not is_causal:
    return KvBlockRange(keys_full, keys_visit)
  # The tile's first row q0 sees keys [0, q0]; its last row sees [0, q0 + rows - 1].
  n_full = jnp.minimum((q0 + 1) // block_kv, keys_full)
  n_visit = jnp.minimum(_cdiv(q0 + rows, block_kv), keys_visit)
  return KvBlockRange(n_full, n_visit)


def apply_element_mask(s, q0, k0, seq_kv: int | None, is_causal: bool, *, key_axis: int = 1):
  """Sets the logits of invisible (query, key) pairs of one block to −inf.

  `s` is a logit block in `Layout.WGMMA` of queries q0.. and keys k0..: (queries, keys) with
  `key_axis=1`, or the transposed (keys, queries) block of the dK/dV kernel with `key_axis=0`.
  Keys at or past `seq_kv` are invisible (None: no such keys); with `is_causal`, so are keys
  past the query.
  """
  shape = s.shape
  iota = lambda axis: plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)
  k_ids = k0 + iota(key_axis)
  conditions = []
  if seq_kv is not None:
    conditions.append(k_ids < seq_kv)
  if is_causal:
    conditions.append(k_ids <= q0 + iota(1 - key_axis))
  if not conditions:
    return s
  visible = conditions[0] if len(conditions) == 1 else jnp.logical_and(*conditions)
  return jnp.where(visible, s, -jnp.inf)
