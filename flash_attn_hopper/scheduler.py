"""The tile scheduler: which (batch, head, Q tile) each CTA works on, in order.

Three schedules, all numbering a head's Q tiles fastest so that CTAs running side by side
share one (batch, head)'s K/V in L2:

- persistent (no mask, every tile costs the same): at most one CTA per SM, each looping over
  work items `cta, cta + num_ctas, ...`. The producer streams K/V for the next tile while the
  compute warpgroups finish the current one, the next Q loads under the epilogue, and the CTA
  launch and register rebalancing are paid once.
- paired (causal, where tile i costs i + 1 blocks): work items are a tile and its mirror,
  longest first, ``(n − 1 − p, p)``, so that every pair costs the same n + 1 blocks. A
  static round-robin over tiles of unequal cost measured 0.6–0.7× of cuDNN at 16k on an
  H200. With an even number of tiles per head every item is a full pair, so the pairs are
  dealt round-robin to persistent CTAs, as above; with an odd number, the middle tile is a
  pair of one, and each CTA takes one pair and leaves the balancing to the hardware.
- one per tile (`per_tile`): a CTA per work item, as a plain grid launches them, optionally
  longest first. The backward kernels take it where persistence did not pay
  (`kernels/common.backward_schedule`).

A tile here is any CTA's run of rows along one sequence: the dK/dV kernel's are key tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Tile(NamedTuple):
  """One work item: a batch, a query head and the first query row of a CTA tile."""
  batch: jax.Array
  head: jax.Array
  row0: jax.Array


class TileScheduler(NamedTuple):
  num_q_tiles: int   # CTA tiles along T
  num_heads: int
  batch: int
  rows_per_tile: int
  num_ctas: int
  paired: bool
  #: One CTA per work item (`per_tile`), so `items_of` is 1; with `descending`, a head's last
  #: tile goes first (the longest under a causal bound, for the dQ kernel).
  one_per_tile: bool = False
  descending: bool = False

  @property
  def persistent(self) -> bool:
    """Whether a CTA may run more than one work item."""
    return not self.one_per_tile

  def items_of(self, cta):
    """How many work items CTA `cta` runs (at least one)."""
    if self.one_per_tile:
      return 1
    if self.paired and not self._persistent_pairs:
      pair = cta % self._pairs_per_head
      return jnp.where(2 * pair + 1 == self.num_q_tiles, 1, 2)
    items = self.num_q_tiles * self.num_heads * self.batch
    if self.paired:  # Whole pairs, dealt round-robin.
      pairs = items // 2
      return 2 * ((pairs - cta + self.num_ctas - 1) // self.num_ctas)
    return (items - cta + self.num_ctas - 1) // self.num_ctas

  @property
  def _pairs_per_head(self) -> int:
    return (self.num_q_tiles + 1) // 2

  @property
  def _persistent_pairs(self) -> bool:
    return self.num_q_tiles % 2 == 0

  def tile(self, cta, i) -> Tile:
    """The `i`-th work item of CTA `cta`."""
    if self.paired:
      item = cta + i // 2 * self.num_ctas if self._persistent_pairs else cta
      pair = item % self._pairs_per_head
      q_tile = jnp.where(i % 2 == 0, self.num_q_tiles - 1 - pair, pair)
      head_batch = item // self._pairs_per_head
    else:
      item = cta + i * self.num_ctas
      q_tile = item % self.num_q_tiles
      if self.descending:
        q_tile = self.num_q_tiles - 1 - q_tile
      head_batch = item // self.num_q_tiles
    return Tile(batch=head_batch // self.num_heads, head=head_batch % self.num_heads,
                row0=q_tile * self.rows_per_tile)


def make(num_q_tiles: int, num_heads: int, batch: int, rows_per_tile: int, max_ctas: int,
         paired: bool) -> TileScheduler:
  """The paired schedule for causal attention, else the persistent one; at most `max_ctas`
  persistent CTAs."""
  pairs = (num_q_tiles + 1) // 2 * num_heads * batch
  if paired and num_q_tiles % 2:
    num_ctas = pairs
  elif paired:
    num_ctas = max(1, min(pairs, max_ctas))
  else:
    num_ctas = max(1, min(num_q_tiles * num_heads * batch, max_ctas))
  return TileScheduler(num_q_tiles, num_heads, batch, rows_per_tile, num_ctas, paired)


def per_tile(num_q_tiles: int, num_heads: int, batch: int, rows_per_tile: int,
             descending: bool = False) -> TileScheduler:
  """One CTA per tile, a head's tiles numbered fastest (longest first with `descending`)."""
  return TileScheduler(num_q_tiles, num_heads, batch, rows_per_tile,
                       num_q_tiles * num_heads * batch, paired=False, one_per_tile=True,
                       descending=descending)
