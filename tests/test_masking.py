"""The block ranges of `masking` against a brute-force look at every (query, key) pair."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from flash_attn_hopper import masking

windows = st.one_of(st.none(), st.integers(0, 300))


@st.composite
def specs(draw):
  return masking.MaskSpec(is_causal=draw(st.booleans()), left=draw(windows),
                          right=draw(windows), offset=draw(st.integers(-400, 400)))


def _visible(spec, q_ids, k_ids, seq_kv):
  band = spec.visible(q_ids[:, None], k_ids[None, :])
  keys = np.broadcast_to(k_ids[None, :] < seq_kv, (len(q_ids), len(k_ids)))
  return np.array(keys if band is None else np.asarray(band) & keys)


def _as_ints(r):
  return masking.BlockRange(*(int(x) for x in r))


@settings(max_examples=300, deadline=None)
@given(spec=specs(), q0=st.integers(0, 600), rows=st.sampled_from([64, 128]),
       seq_kv=st.integers(1, 700), block_kv=st.sampled_from([64, 128]))
def test_kv_block_range_visits_exactly_the_visible_blocks(spec, q0, rows, seq_kv, block_kv):
  r = _as_ints(masking.kv_block_range(spec, q0, rows, seq_kv, block_kv))
  num_blocks = -(-seq_kv // block_kv)
  vis = _visible(spec, np.arange(q0, q0 + rows), np.arange(num_blocks * block_kv), seq_kv)
  per_block = vis.reshape(rows, num_blocks, block_kv)
  any_visible = per_block.any(axis=(0, 2))
  all_visible = per_block.all(axis=(0, 2))
  assert r.first <= r.full_lo <= r.full_hi <= r.end
  visited = np.zeros(num_blocks, bool)
  visited[r.first:r.end] = True
  assert not np.any(any_visible & ~visited), "a block with a visible key is skipped"
  if any_visible.any():  # The range is tight: its end blocks hold visible keys.
    assert any_visible[r.first] and any_visible[r.end - 1]
  else:
    assert r.first == r.end
  assert np.all(all_visible[r.full_lo:r.full_hi]), "an unmasked block hides a masked key"


@settings(max_examples=300, deadline=None)
@given(spec=specs(), k0=st.integers(0, 600), seq_q=st.integers(1, 700),
       block_q=st.sampled_from([64, 128]))
def test_q_block_range_visits_every_query_block_that_sees_the_keys(spec, k0, seq_q, block_q):
  keys = 128
  r = _as_ints(masking.q_block_range(spec, k0, keys, seq_q, block_q))
  num_blocks = -(-seq_q // block_q)
  vis = _visible(spec, np.arange(num_blocks * block_q), np.arange(k0, k0 + keys), 10**6)
  blocks = lambda v: v.reshape(num_blocks, block_q, keys)
  # Queries past seq_q add nothing: they count as hidden for `first`/`end`, as seeing every
  # key for the unmasked run.
  all_visible = blocks(np.where(np.arange(num_blocks * block_q)[:, None] < seq_q, vis, True))
  vis[seq_q:] = False
  any_visible = blocks(vis).any(axis=(1, 2))
  visited = np.zeros(num_blocks, bool)
  visited[r.first:r.end] = True
  assert not np.any(any_visible & ~visited)
  assert r.first <= r.full_lo <= r.full_hi <= r.end
  assert np.all(all_visible.all(axis=(1, 2))[r.full_lo:r.full_hi]), "an unmasked block hides a key"


@settings(max_examples=300, deadline=None)
@given(spec=specs(), k0=st.integers(0, 600), seq_q=st.integers(1, 700),
       seq_kv=st.integers(0, 800), block_q=st.sampled_from([64, 128]))
def test_key_lengths_leave_unmasked_only_blocks_that_see_every_key(spec, k0, seq_q, seq_kv,
                                                                   block_q):
  """The dK/dV kernel's query blocks under key lengths (`key_length_q_blocks` intersected
  with the band's): none past the length, and an unmasked block sees all the tile's keys."""
  keys = 128
  band = masking.q_block_range(spec, k0, keys, seq_q, block_q)
  r = _as_ints(band.intersect(masking.key_length_q_blocks(k0, keys, seq_kv, band.end)))
  num_blocks = -(-seq_q // block_q)
  vis = _visible(spec, np.arange(num_blocks * block_q), np.arange(k0, k0 + keys), seq_kv)
  real = np.arange(num_blocks * block_q)[:, None] < seq_q  # Padded queries add nothing.
  all_visible = np.where(real, vis, True).reshape(num_blocks, block_q, keys).all(axis=(1, 2))
  any_visible = (vis & real).reshape(num_blocks, block_q, keys).any(axis=(1, 2))
  assert r.first <= r.full_lo <= r.full_hi <= r.end
  visited = np.zeros(num_blocks, bool)
  visited[r.first:r.end] = True
  assert not np.any(any_visible & ~visited), "a block with a visible key is skipped"
  if k0 >= seq_kv:
    assert r.end == r.first, "a tile past the keys runs a step"
  assert np.all(all_visible[r.full_lo:r.full_hi]), "an unmasked block hides a masked key"


@settings(max_examples=200, deadline=None)
@given(spec=specs(), row0=st.integers(0, 600), seq_kv=st.integers(1, 700))
def test_a_warpgroup_range_within_its_cta_range_stays_inside(spec, row0, seq_kv):
  cta = masking.kv_block_range(spec, row0, 128, seq_kv, 64)
  for wg in range(2):
    own = masking.kv_block_range(spec, row0 + 64 * wg, 64, seq_kv, 64)
    clipped = _as_ints(own.within(cta))
    c = _as_ints(cta)
    assert c.first <= clipped.first <= clipped.full_lo <= clipped.full_hi <= clipped.end <= c.end
    # Clipping drops no visible block: the warpgroup's blocks were inside the CTA's.
    o = _as_ints(own)
    if o.end > o.first:
      assert (clipped.first, clipped.end) == (o.first, o.end)


@settings(max_examples=300, deadline=None)
@given(spec=specs(), q0=st.integers(0, 600), rows=st.sampled_from([64, 128]),
       seq_kv=st.integers(1, 700), block_kv=st.sampled_from([64, 128, 256]))
def test_key_end_is_dropped_only_when_no_visited_key_lies_past_it(spec, q0, rows, seq_kv,
                                                                   block_kv):
  end = masking.key_end_to_mask(seq_kv, block_kv)
  assert end is None or end == seq_kv
  if end is None:  # Every key of every block the rows visit is one of the S keys.
    r = _as_ints(masking.kv_block_range(spec, q0, rows, seq_kv, block_kv))
    assert r.end <= r.first or r.end * block_kv <= seq_kv  # (an empty range visits none)
  assert (end is None) == (seq_kv % block_kv == 0)


def test_key_end_is_kept_for_traced_key_lengths():
  seen = []
  jax.jit(lambda n: seen.append(masking.key_end_to_mask(n, 128)) or n)(256)
  assert isinstance(seen[0], jax.core.Tracer)


def test_empty_rows():
  spec = masking.MaskSpec(is_causal=True, offset=-3)  # bottom-right, T = S + 3
  assert masking.empty_rows(spec, 5, 2).tolist() == [True, True, True, False, False]
  assert not masking.empty_rows(masking.MaskSpec(), 5, 2).any()


@settings(max_examples=200, deadline=None)
@given(spec=specs(), seq_q=st.integers(1, 300), seq_kv=st.integers(1, 300))
def test_empty_rows_match_brute_force(spec, seq_q, seq_kv):
  vis = _visible(spec, np.arange(seq_q), np.arange(seq_kv), seq_kv)
  np.testing.assert_array_equal(masking.empty_rows(spec, seq_q, seq_kv), ~vis.any(axis=1))


@pytest.mark.parametrize("spec, grows", [
    (masking.MaskSpec(is_causal=True), True),
    (masking.MaskSpec(is_causal=True, offset=40), True),
    (masking.MaskSpec(right=8), True),
    (masking.MaskSpec(), False),
    (masking.MaskSpec(is_causal=True, left=16), False),
    (masking.MaskSpec(left=16), False),
])
def test_cost_grows_along_queries(spec, grows):
  assert spec.cost_grows_along_queries == grows


@settings(max_examples=200, deadline=None)
@given(spec=specs(), seq_q=st.integers(1, 300), seq_kv=st.integers(1, 300))
def test_cost_grows_along_queries_means_no_row_sees_fewer_keys(spec, seq_q, seq_kv):
  vis = _visible(spec, np.arange(seq_q), np.arange(seq_kv), seq_kv)
  if spec.cost_grows_along_queries:
    assert (np.diff(vis.sum(axis=1)) >= 0).all()  # each query sees no fewer keys
    assert (np.diff(vis.sum(axis=0)) <= 0).all()  # each key is seen by no more queries


@st.composite
def id_rows(draw, length):
  """(1, length) int32 segment ids: sorted runs (packing) or arbitrary, from few values."""
  ids = draw(st.lists(st.integers(0, 4), min_size=length, max_size=length))
  return np.array([sorted(ids) if draw(st.booleans()) else ids], np.int32)


_segment_spans = jax.jit(masking.segment_spans, static_argnums=(2, 3))


# Few lengths (each new shape compiles): whole, partial and single blocks.
@settings(max_examples=150, deadline=None)
@given(data=st.data(), seq_rows=st.sampled_from([1, 16, 37]), seq_cols=st.sampled_from([3, 16, 37]),
       row_block=st.sampled_from([1, 4, 8]), col_block=st.sampled_from([1, 4, 8]))
def test_segment_spans_cover_every_meeting_and_only_full_blocks_are_unmasked(
    data, seq_rows, seq_cols, row_block, col_block):
  rows, cols = data.draw(id_rows(seq_rows)), data.draw(id_rows(seq_cols))
  spans = np.asarray(_segment_spans(rows, cols, row_block, col_block))[0]
  row_blocks, col_blocks = -(-seq_rows // row_block), -(-seq_cols // col_block)
  assert spans.shape == (row_blocks, 4) and spans.dtype == np.int32
  same = rows[0][:, None] == cols[0][None, :]
  for r in range(row_blocks):
    first, full_lo, full_hi, end = spans[r]
    assert 0 <= first <= full_lo <= full_hi <= end <= col_blocks
    for c in range(col_blocks):
      block = same[r * row_block:(r + 1) * row_block, c * col_block:(c + 1) * col_block]
      if block.any():
        assert first <= c < end, f"row block {r} meets col block {c} outside [{first}, {end})"
      if full_lo <= c < full_hi:
        assert block.all(), f"col block {c} of row block {r} is unmasked but not all visible"


def test_as_segment_ids_forms():
  ids = np.array([0, 0, 1], np.int32)
  one = masking.as_segment_ids(ids, 2, 3, 3)
  assert one.q.shape == one.kv.shape == (2, 3) and one.q.dtype == np.int32
  pair = masking.as_segment_ids((ids, np.arange(4, dtype=np.int8)), 2, 3, 4)
  assert pair.kv.shape == (2, 4) and pair.kv.dtype == np.int32
  assert masking.as_segment_ids(None, 2, 3, 3) is None


@pytest.mark.parametrize("segment_ids, seq_kv, error, names", [
    (np.zeros(3, np.float32), 3, TypeError, "segment_ids.q"),
    ((np.zeros(3, np.int32), np.zeros(4, np.float32)), 4, TypeError, "segment_ids.kv"),
    (np.zeros((2, 4), np.int32), 4, ValueError, "segment_ids as one array"),
    ((np.zeros((3, 3), np.int32), np.zeros(4, np.int32)), 4, ValueError, "segment_ids.q"),
    ((np.zeros(3, np.int32), np.zeros((2, 5), np.int32)), 4, ValueError, "segment_ids.kv"),
    ((np.zeros(3, np.int32),), 3, ValueError, "segment_ids"),
], ids=["float_ids", "float_kv_ids", "one_array_t_ne_s", "q_batch", "kv_length", "not_a_pair"])
def test_as_segment_ids_errors_name_the_argument(segment_ids, seq_kv, error, names):
  with pytest.raises(error, match=re.escape(names)):
    masking.as_segment_ids(segment_ids, 2, 3, seq_kv)


@pytest.mark.parametrize("t, s, offset", [(7, 7, 0), (5, 9, 4), (9, 5, -4), (6, 6, 3)])
def test_idle_window_edges_drop_without_changing_what_is_visible(t, s, offset):
  q_ids, k_ids = np.arange(t)[:, None], np.arange(s)[None, :]
  for is_causal in (False, True):
    for left in (None, 0, 2, t + s):
      for right in (None, 0, 3, t + s):
        spec = masking.MaskSpec(is_causal=is_causal, left=left, right=right, offset=offset)
        lean = spec.without_idle_edges(t, s)
        visible = lambda m: np.broadcast_to(
            True if m.visible(q_ids, k_ids) is None else m.visible(q_ids, k_ids), (t, s))
        np.testing.assert_array_equal(visible(lean), visible(spec), err_msg=str(spec))
        if left is not None and left >= t + s:
          assert lean.left is None
        if right is not None and right >= t + s:
          assert lean.right is None


def _brute_force_mask_spans(visible, free, row_block, col_block, num_row_blocks):
  """[first, full_lo, full_hi, end] per row block, entry by entry (padding is neither)."""
  rows, cols = visible.shape
  ncb = -(-cols // col_block)
  vis = np.zeros((num_row_blocks * row_block, ncb * col_block), bool)
  fre = np.zeros_like(vis)
  vis[:rows, :cols], fre[:rows, :cols] = visible, free
  out = []
  for i in range(num_row_blocks):
    rs = slice(i * row_block, (i + 1) * row_block)
    may = [vis[rs, j * col_block:(j + 1) * col_block].any() for j in range(ncb)]
    full = [fre[rs, j * col_block:(j + 1) * col_block].all() for j in range(ncb)]
    hits = [j for j in range(ncb) if may[j]]
    first, end = (hits[0], hits[-1] + 1) if hits else (0, 0)
    lo = next((j for j in range(ncb) if full[j]), first)
    hi = next((j for j in range(lo, ncb) if not full[j]), ncb)
    lo = min(max(lo, first), end)
    out.append((first, lo, min(max(hi, lo), end), end))
  return np.array(out)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 300), cols=st.integers(1, 300),
       row_block=st.sampled_from([64, 128]), col_block=st.sampled_from([64, 128, 256]),
       transpose=st.booleans())
def test_table_spans_match_brute_force(data, rows, cols, row_block, col_block, transpose):
  """Spans from the block table (transposed for the dK/dV kernel's key rows)
  equal spans read entry by entry, for masks with runs of visible and of free blocks."""
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  # Coarse random structure (runs), then sparse holes, so full and partial blocks both occur.
  coarse = rng.random((-(-rows // 32), -(-cols // 32))) < data.draw(st.floats(0.2, 1.0))
  visible = np.kron(coarse, np.ones((32, 32), bool))[:rows, :cols]
  visible &= rng.random((rows, cols)) > data.draw(st.sampled_from([0.0, 0.001, 0.05]))
  free = visible & (rng.random((rows, cols)) > data.draw(st.sampled_from([0.0, 0.01])))
  blocks = (col_block, row_block) if transpose else (row_block, col_block)
  table = masking.mask_block_table(visible, free, *blocks)
  if transpose:
    table = tuple(x.T for x in table)
    visible, free = visible.T, free.T
  num_row_blocks = -(-visible.shape[0] // row_block) + data.draw(st.integers(0, 1))
  got = masking.table_spans(table, num_row_blocks)
  want = _brute_force_mask_spans(visible, free, row_block, col_block, num_row_blocks)
  np.testing.assert_array_equal(np.asarray(got), want)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 200), cols=st.integers(1, 300),
       granule=st.sampled_from([(64, 64), (64, 128), (32, 64)]),
       density=st.sampled_from([0.0, 0.5, 0.99, 1.0]))
def test_count_table_of_a_mask_equals_its_block_table(seed, rows, cols, granule, density):
  """A 0/1 mask's one-reduction table equals the any/all table of its visible entries,
  with whole blocks of ones (full), of zeros, and mixed ones."""
  rng = np.random.default_rng(seed)
  coarse = rng.random((-(-rows // 32), -(-cols // 32))) < 0.7
  mask = np.kron(coarse, np.ones((32, 32), bool))[:rows, :cols]
  mask &= rng.random((rows, cols)) < density
  want = masking.mask_block_table(mask, mask, *granule)
  got = masking.mask_count_table(mask.astype(np.uint8), *granule)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
