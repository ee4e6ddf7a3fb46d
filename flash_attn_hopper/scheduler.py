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
- balanced pairs (`balanced_pairs`, opt-in): the paired schedule whose last rounds are
  dealt as single tiles, longest first, to the least loaded CTA. Dealt whole, P pairs on C
  CTAs take ⌈P/C⌉ rounds where P/C of work is done: the race grid's causal cells have 512,
  1024 or 2048 pairs on 132 SMs, so 3% of the SM time goes idle in the last round. The
  kernel reads this schedule from a small table (`inputs`, `bind`).

The kernels take a schedule from `persistent` (the first, second or last, decided there for
the forward and the backward alike) or `per_tile`. A tile here is any CTA's run of rows along
one sequence: the dK/dV kernel's are key tiles.
"""

from __future__ import annotations

import heapq
from typing import Callable, NamedTuple, Sequence

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
  #: The balanced tail (`balanced_pairs`): each CTA runs `dealt_rounds` pairs as `paired`
  #: deals them, then the tiles of its row of `table` (`table_width` int32s a CTA, flattened:
  #: their count, then each as head_batch · num_q_tiles + Q tile). A tuple, so that the
  #: schedule stays hashable; the kernel gets it as an input (`inputs`) and reads it through
  #: `table_ref` (`bind`).
  table: tuple[int, ...] | None = None
  table_width: int = 0
  dealt_rounds: int = 0
  table_ref: object = None

  @property
  def persistent(self) -> bool:
    """Whether a CTA may run more than one work item."""
    return not self.one_per_tile

  def inputs(self) -> tuple:
    """The kernel inputs this schedule needs: its table, if it has one."""
    return () if self.table is None else (jnp.asarray(self.table, jnp.int32),)

  def bind(self, refs: Sequence) -> tuple["TileScheduler", list]:
    """This schedule reading its table from the first of a kernel's `refs` (in the order of
    `inputs`), and the refs after it."""
    refs = list(refs)
    if self.table is None:
      return self, refs
    return self._replace(table_ref=refs.pop(0)), refs

  def items_of(self, cta):
    """How many work items CTA `cta` runs (at least one)."""
    if self.one_per_tile:
      return 1
    if self.table_ref is not None:
      return 2 * self.dealt_rounds + self.table_ref[cta * self.table_width]
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
      if self.table_ref is not None:  # Past the dealt pairs, the CTA's row of the table.
        tail = i - 2 * self.dealt_rounds
        tile = self.table_ref[cta * self.table_width + 1 + jnp.maximum(tail, 0)]
        q_tile = jnp.where(tail >= 0, tile % self.num_q_tiles, q_tile)
        head_batch = jnp.where(tail >= 0, tile // self.num_q_tiles, head_batch)
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


#: Rounds of whole pairs that `balanced_pairs` leaves to its tail besides the last, partial
#: one. In a list-scheduling model of the race grid's causal forward cells (tile cost = its KV
#: blocks), one round left the busiest CTA up to 1.7% over the mean (D 128 at 1k, tiles of 1
#: to 8 blocks in pairs of 9), two at most 0.8% (D 256 at 1k aside, whose longest tile is 16
#: of a pair's 18 blocks: 3% either way); dealing whole pairs, 3.1%.
TAIL_ROUNDS = 2


def balanced_pairs(num_q_tiles: int, num_heads: int, batch: int, rows_per_tile: int,
                   max_ctas: int, costs: Sequence[float]) -> TileScheduler:
  """The paired schedule (`make`) with its tail balanced: the pairs past its first
  ⌊pairs / CTAs⌋ − TAIL_ROUNDS rounds are split into their tiles, and each tile, longest
  first, goes to the CTA with the least work so far. `costs[q]` is Q tile q's work, in any
  unit (its KV blocks, say), and positive, so that every CTA gets a tile. Where the pairs fill
  whole rounds, or a head has an odd number of tiles (one pair a CTA, balanced by the
  hardware), this is `make`'s schedule."""
  if len(costs) != num_q_tiles or min(costs) <= 0:
    raise ValueError(f"balanced_pairs needs a positive cost for each of the {num_q_tiles} "
                     f"Q tiles; got {list(costs)}")
  base = make(num_q_tiles, num_heads, batch, rows_per_tile, max_ctas, paired=True)
  ctas, half = base.num_ctas, num_q_tiles // 2
  pairs = half * num_heads * batch
  if num_q_tiles % 2 or pairs % ctas == 0:
    return base
  dealt = max(pairs // ctas - TAIL_ROUNDS, 0)
  tail = []
  for item in range(dealt * ctas, pairs):  # As `tile` numbers them: the longer tile first.
    head_batch, pair = divmod(item, half)
    tail += [head_batch * num_q_tiles + num_q_tiles - 1 - pair, head_batch * num_q_tiles + pair]
  tail.sort(key=lambda tile: -costs[tile % num_q_tiles])  # Stable: ties keep that order.
  rows = [[] for _ in range(ctas)]
  loads = [(0.0, cta) for cta in range(ctas)]  # Equal after the dealt rounds.
  for tile in tail:
    load, cta = heapq.heappop(loads)
    rows[cta].append(tile)
    heapq.heappush(loads, (load + costs[tile % num_q_tiles], cta))
  width = 1 + max(len(row) for row in rows)
  table = []
  for row in rows:  # Its count, its tiles, then zeros to the width.
    table += [len(row), *row] + [0] * (width - 1 - len(row))
  return base._replace(table=tuple(table), table_width=width, dealt_rounds=dealt)


def persistent(num_q_tiles: int, num_heads: int, batch: int, rows_per_tile: int,
               max_ctas: int, *, paired: bool, balanced_tail: bool = False,
               costs: Callable[[], Sequence[float]] | None = None) -> TileScheduler:
  """The persistent CTAs' schedule, forward and backward alike: mirror pairs where `paired`
  (their tail balanced by `costs()`, each tile's work, with `balanced_tail`: see
  `balanced_pairs`), else `make`'s round-robin. `costs` is called only when it is used."""
  if not (paired and balanced_tail):
    return make(num_q_tiles, num_heads, batch, rows_per_tile, max_ctas, paired)
  if costs is None:
    raise ValueError("a balanced tail (balanced_tail=True) needs the tiles' costs: pass "
                     "costs=, a callable returning each tile's work")
  return balanced_pairs(num_q_tiles, num_heads, batch, rows_per_tile, max_ctas, costs())


def per_tile(num_q_tiles: int, num_heads: int, batch: int, rows_per_tile: int,
             descending: bool = False) -> TileScheduler:
  """One CTA per tile, a head's tiles numbered fastest (longest first with `descending`)."""
  return TileScheduler(num_q_tiles, num_heads, batch, rows_per_tile,
                       num_q_tiles * num_heads * batch, paired=False, one_per_tile=True,
                       descending=descending)
