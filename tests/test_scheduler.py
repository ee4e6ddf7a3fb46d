"""The tile schedules cover every (batch, head, Q tile) exactly once, and the backward kernels
take the persistent ones where the tuned table says."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from flash_attn_hopper import config as config_lib
from flash_attn_hopper import masking
from flash_attn_hopper import scheduler
from flash_attn_hopper.kernels import common


def _tiles(sched, costs=None):
  """How often each (batch, head, row0) is run, and each CTA's work: the tiles' `costs` (by
  Q tile), by default a causal tile's blocks, Q tile + 1."""
  if sched.table is not None:  # Read as the kernel reads its ref.
    sched, rest = sched.bind([np.asarray(sched.table, np.int32)])
    assert rest == []
  seen = collections.Counter()
  work = []
  for cta in range(sched.num_ctas):
    blocks = 0
    for i in range(int(sched.items_of(cta))):
      t = sched.tile(cta, i)
      seen[(int(t.batch), int(t.head), int(t.row0))] += 1
      q_tile = int(t.row0) // sched.rows_per_tile
      blocks += q_tile + 1 if costs is None else costs[q_tile]
    work.append(blocks)
  return seen, work


@pytest.mark.parametrize("num_q_tiles", (1, 2, 7, 8))
@pytest.mark.parametrize("paired", (False, True))
def test_every_tile_once(num_q_tiles, paired):
  sched = scheduler.make(num_q_tiles, num_heads=3, batch=2, rows_per_tile=128, max_ctas=5,
                         paired=paired)
  seen, _ = _tiles(sched)
  expected = {(b, h, q * 128) for b in range(2) for h in range(3) for q in range(num_q_tiles)}
  assert set(seen) == expected
  assert all(count == 1 for count in seen.values())


def test_paired_schedule_balances_causal_work():
  sched = scheduler.make(8, num_heads=2, batch=1, rows_per_tile=128, max_ctas=132,
                         paired=True)
  _, work = _tiles(sched)
  assert set(work) == {8 + 1}  # Tile p and its mirror 7 − p: p + 1 + 8 − p blocks.


def test_even_pairs_are_dealt_to_persistent_ctas():
  # 4 pairs per head, 12 pairs in all over 5 CTAs: 3, 3, 2, 2, 2 pairs of 9 blocks each.
  sched = scheduler.make(8, num_heads=3, batch=1, rows_per_tile=128, max_ctas=5, paired=True)
  assert sched.num_ctas == 5
  _, work = _tiles(sched)
  assert work == [27, 27, 18, 18, 18]


def test_odd_tile_counts_take_one_pair_per_cta():
  sched = scheduler.make(7, num_heads=2, batch=1, rows_per_tile=128, max_ctas=3, paired=True)
  assert sched.num_ctas == 8  # 4 items per head, the middle one a single tile.
  _, work = _tiles(sched)
  assert sorted(work) == [4, 4, 8, 8, 8, 8, 8, 8]  # The middle tile 3 alone: 4 blocks.


@pytest.mark.parametrize("num_q_tiles, num_heads, batch, max_ctas", [
    (8, 3, 1, 5),       # 12 pairs on 5 CTAs: all of them in the tail.
    (2, 7, 1, 2),       # The interpreter's case (test_forward_interpret): one round dealt.
    (16, 5, 3, 7),      # 120 pairs on 7: fifteen rounds dealt, the rest in the tail.
    (8, 32, 16, 132),   # The race grid's D 64 causal 1k: 2048 pairs on 132.
])
def test_balanced_tail_runs_every_tile_once(num_q_tiles, num_heads, batch, max_ctas):
  sched = scheduler.balanced_pairs(num_q_tiles, num_heads, batch, 128, max_ctas,
                                   costs=[q + 1 for q in range(num_q_tiles)])
  assert sched.table is not None and len(sched.inputs()) == 1
  seen, _ = _tiles(sched)
  assert set(seen) == {(b, h, q * 128) for b in range(batch) for h in range(num_heads)
                       for q in range(num_q_tiles)}
  assert all(count == 1 for count in seen.values())


def test_balanced_tail_evens_out_the_last_round():
  # D 64 causal at 1k on the H200: 128-row tiles, 256-key blocks (tile q visits ⌈(q + 1) / 2⌉),
  # 2048 pairs of 5 blocks on 132 CTAs. Whole pairs: 16 rounds, 80 blocks for the busiest CTA
  # against a mean of 77.6; balanced, 78.
  costs = [(q + 2) // 2 for q in range(8)]
  whole = scheduler.make(8, 32, 16, 128, max_ctas=132, paired=True)
  balanced = scheduler.balanced_pairs(8, 32, 16, 128, max_ctas=132, costs=costs)
  _, whole_work = _tiles(whole, costs)
  _, balanced_work = _tiles(balanced, costs)
  assert sum(whole_work) == sum(balanced_work) == 2048 * 5
  assert max(whole_work) == 80 and max(balanced_work) == 78
  assert balanced.dealt_rounds == 13  # 2048 // 132 − TAIL_ROUNDS


@pytest.mark.parametrize("num_q_tiles, num_heads", [(8, 33), (7, 4)])
def test_balanced_tail_is_the_paired_schedule_where_nothing_is_left_over(num_q_tiles,
                                                                         num_heads):
  # 4 · 33 · 8 = 1056 pairs fill 8 rounds of 132; an odd tile count takes one pair a CTA.
  sched = scheduler.balanced_pairs(num_q_tiles, num_heads, 8, 128, max_ctas=132,
                                   costs=[1] * num_q_tiles)
  assert sched == scheduler.make(num_q_tiles, num_heads, 8, 128, max_ctas=132, paired=True)
  assert sched.inputs() == ()


def test_balanced_tail_gives_every_cta_a_tile():
  # 6 pairs of 4-tile heads on 5 CTAs, no round dealt: 12 tiles, every CTA runs one or more.
  sched = scheduler.balanced_pairs(4, 3, 1, 128, max_ctas=5, costs=[1, 1, 2, 2])
  table = np.asarray(sched.table).reshape(sched.num_ctas, sched.table_width)
  assert sched.dealt_rounds == 0 and table[:, 0].min() >= 1 and table[:, 0].sum() == 12
  with pytest.raises(ValueError, match="positive cost"):
    scheduler.balanced_pairs(4, 3, 1, 128, max_ctas=5, costs=[0, 1, 2, 2])


def test_persistent_schedule_caps_ctas():
  sched = scheduler.make(64, num_heads=16, batch=4, rows_per_tile=128, max_ctas=132,
                         paired=False)
  assert sched.num_ctas == 132


@pytest.mark.parametrize("descending", (False, True))
def test_one_cta_per_tile(descending):
  sched = scheduler.per_tile(4, num_heads=3, batch=2, rows_per_tile=64, descending=descending)
  assert sched.num_ctas == 24 and not sched.persistent
  seen, _ = _tiles(sched)
  assert set(seen) == {(b, h, q * 64) for b in range(2) for h in range(3) for q in range(4)}
  assert all(count == 1 for count in seen.values())
  first = [int(sched.tile(cta, 0).row0) // 64 for cta in range(4)]  # One head's tiles.
  assert first == ([3, 2, 1, 0] if descending else [0, 1, 2, 3])


def _backward_opts(is_causal=False, **kw):
  return common.BackwardOptions(scale=0.125, mask=masking.MaskSpec(is_causal=is_causal),
                                config=config_lib.BackwardConfig(), max_ctas=132, **kw)


@pytest.mark.parametrize("kernel, d, causal, steps, persistent", [
    ("dq", 128, True, 32, True), ("dq", 128, True, 33, False),
    ("dq", 128, False, 16, True), ("dq", 128, False, 32, False),
    ("dkv", 64, True, 64, True), ("dkv", 64, False, 8, False),
    ("dkv", 96, True, 8, False),  # A head dim the table has not measured.
])
def test_backward_schedule_follows_the_tuned_table(kernel, d, causal, steps, persistent):
  sched = common.backward_schedule(kernel, 8, 4, 2, 128, steps=steps, stages=2, head_dim=d,
                                   opts=_backward_opts(causal))
  assert sched.persistent == persistent
  assert sched.paired == (persistent and causal)


@pytest.mark.parametrize("why", ["one_stage", "bias", "segments"])
def test_backward_schedule_keeps_one_cta_per_tile(why):
  kw = {"bias": dict(bias=(False, False)), "segments": dict(segments=True)}.get(why, {})
  sched = common.backward_schedule("dkv", 8, 4, 2, 128, steps=8,
                                   stages=1 if why == "one_stage" else 2, head_dim=64,
                                   opts=_backward_opts(True, **kw))
  assert not sched.persistent and sched.num_ctas == 8 * 4 * 2


def _causal_band(key0, keys=128, seq=1024, block=64):
  """A dK/dV tile's query blocks under causal (the first key tiles see the most queries)."""
  return masking.q_block_range(masking.MaskSpec(is_causal=True), key0, keys, seq, block)


def test_band_costs_count_each_tiles_blocks():
  # 128-key tiles of a 1k causal dK/dV over 64-row query blocks: tile j sees blocks 2j to 15,
  # twice over in groups of 2, plus one block for its loads and epilogue.
  costs = common.band_costs(8, 128, _causal_band, per_block=2)
  assert costs == [2 * (16 - 2 * j) + common.TILE_FIXED_BLOCKS for j in range(8)]


@pytest.mark.parametrize("balanced", [True, False])
def test_backward_schedule_balances_its_tail_when_asked(balanced):
  # 8 key tiles of 7 heads: 28 pairs on 5 CTAs, three rounds dealt whole (5 − TAIL_ROUNDS)
  # and the rest from the table; without the flag, the paired schedule.
  opts = _backward_opts(True)
  opts = dataclasses.replace(opts, max_ctas=5, config=config_lib.BackwardConfig(
      balanced_tail=balanced))
  sched = common.backward_schedule(
      "dkv", 8, 7, 1, 128, steps=16, stages=2, head_dim=64, opts=opts,
      costs=lambda: common.band_costs(8, 128, _causal_band))
  assert sched.persistent and sched.paired
  assert (sched.table is not None) == balanced
  seen, _ = _tiles(sched)
  assert sorted(seen) == sorted((0, h, q * 128) for h in range(7) for q in range(8))
  assert set(seen.values()) == {1}
  if balanced:
    assert sched.dealt_rounds == 28 // 5 - scheduler.TAIL_ROUNDS


def test_a_balanced_tail_without_costs_is_refused():
  with pytest.raises(ValueError, match="costs="):
    scheduler.persistent(8, 7, 1, 128, 5, paired=True, balanced_tail=True)


def test_tile_costs_of_query_and_key_tiles():
  mask = masking.MaskSpec(is_causal=True)
  # 128-row query tiles of a 1k causal band over 64-key blocks: tile i sees blocks 0 to 2i+1.
  assert common.query_tile_costs(mask, 8, 128, 1024, 64) == [
      2 * (i + 1) + common.TILE_FIXED_BLOCKS for i in range(8)]
  assert common.key_tile_costs(mask, 8, 128, 1024, 64, group=2) == common.band_costs(
      8, 128, _causal_band, per_block=2)
