"""Windows, the bottom-right causal alignment, sequence lengths and segment ids through the real
kernels (interpreter), forward and backward, against the float32 reference with jax.nn's
semantics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import masking
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

pytestmark = pytest.mark.interpret

# Small blocks so that the band crosses several of them and CTAs loop over several tiles.
CONFIG = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2)

def _check_forward_and_gradients(rng, q, k, v, config, **kw):
  """The interpreted kernel's output (and LSE), then its gradients for a random cotangent,
  against the float32 reference with the same arguments."""
  attn = functools.partial(fah.dot_product_attention, interpret=True, config=config)
  out, lse = attn(q, k, v, return_residual=True, **kw)
  testing.check_attention(out, q, k, v, actual_lse=lse, **kw)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  grads = testing.gradients(attn, q, k, v, dout, **kw)  # With a bias, its gradient too.
  testing.check_gradients(grads, q, k, v, dout, **kw)


CASES = [
    # (T, S, is_causal, local_window_size, causal_alignment)
    (250, 250, True, (70, 0), "top_left"),        # sliding window, as in Mistral
    (200, 330, False, (50, 30), "top_left"),      # two-sided window, T < S
    (300, 100, True, (20, 5), "top_left"),        # queries past the window's reach see nothing
    (330, 200, True, None, "bottom_right"),       # T > S: the first 130 queries see nothing
    (200, 330, True, 40, "bottom_right"),         # chunked prefill with a window
]


@pytest.mark.parametrize("t, s, is_causal, window, alignment", CASES)
def test_forward_and_gradients_match_reference(rng, t, s, is_causal, window, alignment):
  w = workloads.Workload("masks", batch=1, seq_q=t, seq_kv=s, num_q_heads=2, num_kv_heads=1,
                         head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  _check_forward_and_gradients(rng, q, k, v, CONFIG, is_causal=is_causal,
                               local_window_size=window, causal_alignment=alignment)


@pytest.mark.parametrize("is_causal, window", [(False, None), (True, (40, 0))])
def test_sequence_lengths_match_reference(rng, is_causal, window):
  # Three batch elements: a short one, one with no keys at all, one at full length. The
  # short one's first dK/dV tile (128 keys) lies within its length, unmasked; the next
  # straddles it, masked on every step.
  w = workloads.Workload("lens", batch=3, seq_q=150, seq_kv=200, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "float16")
  kw = dict(is_causal=is_causal, local_window_size=window,
            query_seq_lengths=jnp.array([70, 150, 1], jnp.int32),
            key_value_seq_lengths=jnp.array([150, 0, 200], jnp.int32))
  # Rows past a query's length see no key, as in jax.nn: LSE −inf (the op sets it).
  _check_forward_and_gradients(rng, q, k, v, CONFIG, **kw)


def test_key_lengths_under_vmap(rng):
  w = workloads.Workload("lens", batch=2, seq_q=100, seq_kv=130, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  qkv = [testing.random_qkv(rng, w, "bfloat16") for _ in range(2)]
  q, k, v = (jnp.stack(x) for x in zip(*qkv))
  lens = jnp.array([[50, 130], [7, 0]], jnp.int32)
  attn = lambda q, k, v, lens: fah.dot_product_attention(q, k, v, key_value_seq_lengths=lens,
                                                          interpret=True)
  out = jax.vmap(attn)(q, k, v, lens)
  for i in range(2):
    testing.check_attention(out[i], q[i], k[i], v[i], key_value_seq_lengths=lens[i])


def _gqa_inputs(rng, batch: int, t: int, s: int, d: int):
  """bf16 q, k, v with 4 query heads over 2 KV heads."""
  w = workloads.Workload("gqa", batch=batch, seq_q=t, seq_kv=s, num_q_heads=4, num_kv_heads=2,
                         head_dim=d)
  return testing.random_qkv(rng, w, "bfloat16")


def _config(d: int):
  """The small test blocks where they fit; D 256 keeps its tuned config."""
  return CONFIG if d < 256 else None


def _packed(rng, batch: int, length: int, docs: int):
  """Sorted ids of `docs` contiguous documents of random lengths (some may be 1 long)."""
  cuts = [np.sort(rng.choice(np.arange(1, length), docs - 1, replace=False)) for _ in range(batch)]
  ids = [np.repeat(np.arange(docs), np.diff(np.concatenate([[0], c, [length]]))) for c in cuts]
  return jnp.asarray(np.stack(ids), jnp.int32)


def _segment_cases(rng, t, s, layout):
  """(B, T) and (B, S) ids for a named layout."""
  if layout == "packed":  # self-attention over packed documents, one of them a single token
    ids = np.array(_packed(rng, 2, t, 5))
    ids[0, 40:] += 1
    ids[0, 41:] += 1  # token 40 of batch element 0 is a document of its own
    return fah.SegmentIds(jnp.asarray(ids), jnp.asarray(ids))
  if layout == "missing":  # cross-attention; some query segments have no keys at all
    q = _packed(rng, 2, t, 4)
    kv = _packed(rng, 2, s, 3)
    return fah.SegmentIds(q, kv)
  assert layout == "unsorted"  # ids need not be contiguous: the kernels mask, skip less
  return fah.SegmentIds(jnp.asarray(rng.integers(0, 3, (2, t)), jnp.int32),
                        jnp.asarray(rng.integers(0, 3, (2, s)), jnp.int32))


SEGMENT_CASES = [
    # (T, S, D, is_causal, layout, other masks)
    (300, 300, 64, True, "packed", {}),
    (200, 330, 64, False, "missing", dict(key_value_seq_lengths=jnp.array([300, 120]))),
    (260, 260, 64, False, "unsorted", {}),
    (250, 250, 64, True, "packed", dict(local_window_size=(60, 0))),
    (200, 200, 128, True, "packed", {}),
    (130, 130, 256, False, "packed", {}),
]


@pytest.mark.parametrize("t, s, d, is_causal, layout, extra", SEGMENT_CASES)
def test_segment_ids_match_reference(rng, t, s, d, is_causal, layout, extra):
  q, k, v = _gqa_inputs(rng, 2, t, s, d)
  _check_forward_and_gradients(rng, q, k, v, _config(d), is_causal=is_causal,
                               segment_ids=_segment_cases(rng, t, s, layout), **extra)


def test_segment_ids_skip_blocks_across_documents():
  """Packed documents: each Q tile's KV range covers its own documents only."""
  ids = jnp.repeat(jnp.arange(4), 256)[None]             # 4 documents of 256 tokens
  spans = np.asarray(masking.segment_spans(ids, ids, 64, 128))[0]
  for block, (first, full_lo, full_hi, end) in enumerate(spans):
    doc = block * 64 // 256
    assert (first, end) == (2 * doc, 2 * doc + 2)        # two KV blocks per document
    assert (full_lo, full_hi) == (first, end)            # all fully inside the document


SOFT_CAP_CASES = [
    # (T, S, D, is_causal, logits_soft_cap, other arguments)
    (200, 200, 64, True, 2.0, dict(scale=0.5)),    # logits well past the cap
    (150, 230, 128, False, 5.0, dict(local_window_size=(40, 40))),
    (140, 140, 64, True, 3.0, dict(segment_ids=jnp.repeat(jnp.arange(4), 35))),
    (130, 130, 256, True, 2.0, dict(scale=0.3)),   # D 256: the split dK/dV kernel
]


@pytest.mark.parametrize("t, s, d, is_causal, cap, extra", SOFT_CAP_CASES)
def test_soft_cap_matches_reference(rng, t, s, d, is_causal, cap, extra):
  q, k, v = _gqa_inputs(rng, 1, t, s, d)
  _check_forward_and_gradients(rng, q, k, v, _config(d), is_causal=is_causal,
                               logits_soft_cap=cap, **extra)


def _bias_cases(rng, t, s, name):
  """(bias, mask) of a named layout for batch 2, 4 query heads."""
  # In the inputs' dtype: the kernels round a bias to it (a float32 one would differ from the
  # float32 reference by that rounding, which dbias shows, and the naive implementation by
  # less, as jax.nn promotes the logits to float32 instead).
  bias = jnp.asarray(rng.standard_normal((2, 1, t, s)), jnp.bfloat16)  # per batch, all heads
  mask = jnp.asarray(rng.random((1, 4, t, s)) > 0.3)                    # per head
  mask = mask.at[0, 1, 5].set(False)                                   # a row that sees nothing
  mask = mask & (jnp.arange(s) < s // 2)                                # whole blocks skipped
  lengths = np.array([s, s // 3])[:, None, None, None]
  padding = jnp.asarray(np.arange(s)[None, None, None, :] < lengths)
  # Causal as a mask, shifted, with the last keys cut: blocks fully visible (no bias tile
  # streamed), blocks on the edge, and blocks skipped.
  shifted = (np.arange(s)[None, :] <= np.arange(t)[:, None] + 10) & (np.arange(s) < s - 30)
  # Only the first and the last 64 query rows carry a bias / hide keys: the blocks between
  # are free, and under causal a KV tile past the first starts its query blocks past 0, so
  # the dK/dV kernel's free run is offset within its steps (and a stale or skipped tile
  # would show).
  edge_rows = (np.arange(t) < 64) | (np.arange(t) >= t - 64)
  edge_bias = jnp.where(jnp.asarray(edge_rows)[:, None], bias[:1, :1], 0.0)
  edge_mask = ~jnp.asarray(edge_rows)[:, None] | jnp.asarray(rng.random((t, s)) > 0.3)
  return {"bias": dict(bias=bias), "mask": dict(mask=mask),
          "edge rows bias": dict(bias=edge_bias), "edge rows mask": dict(mask=edge_mask),
          "both": dict(bias=bias, mask=mask), "key padding": dict(mask=padding),
          "visible blocks": dict(mask=jnp.asarray(shifted)[None, None])}[name]


BIAS_CASES = [
    # (T, S, D, is_causal, layout)
    (200, 300, 64, False, "bias"),
    (200, 300, 64, True, "mask"),
    (150, 150, 128, False, "both"),
    (130, 200, 64, False, "key padding"),  # (B, 1, 1, S): broadcast over heads and queries
    (300, 320, 64, False, "visible blocks"),
    (320, 320, 64, True, "edge rows bias"),
    (320, 320, 64, True, "edge rows mask"),
    (130, 150, 256, True, "mask"),  # D 256: one-byte mask tiles fit beside K and V
    (130, 150, 256, False, "both"),  # D 256: a one-slot ring of bias tiles; `blockwise` grads
]


@pytest.mark.parametrize("t, s, d, is_causal, layout", BIAS_CASES)
def test_bias_and_mask_match_reference(rng, t, s, d, is_causal, layout):
  q, k, v = _gqa_inputs(rng, 2, t, s, d)
  kw = dict(is_causal=is_causal, **_bias_cases(rng, t, s, layout))
  # 64-row blocks make fully visible blocks of "visible blocks" for rows 128 on.
  _check_forward_and_gradients(rng, q, k, v, CONFIG if layout == "visible blocks" else None,
                               **kw)


def test_mask_with_overlapped_tiles(rng):
  """FA3's overlap beside a mask (forced at D 64): a tile whose CTA sees every block in full
  takes the overlapped loop, the others the plain loop, and the sparse stream of bias tiles
  carries its ring positions across a persistent CTA's tiles. Tiles of 128 rows: the first
  is half masked, the second fully visible, the third sees no key (no block streamed), the
  fourth masked and cut by T."""
  t, s = 428, 448
  q, k, v = _gqa_inputs(rng, 2, t, s, 64)
  rows = np.arange(t)[:, None]
  masked_rows = (rows < 64) | (rows >= 384)
  mask = np.where(masked_rows, rng.random((t, s)) > 0.3, rows < 256)
  cfg = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2, overlap_softmax=True)
  _check_forward_and_gradients(rng, q, k, v, cfg, mask=jnp.asarray(mask)[None, None])


def test_constant_bias_writes_no_ds(rng, monkeypatch):
  """A bias that is not differentiated (ALiBi's, say) runs the backward kernels without dS;
  a differentiated one with it (`autodiff`'s symbolic zeros)."""
  from flash_attn_hopper.kernels import dq as dq_kernel
  real, wrote_ds = dq_kernel.dq, []
  monkeypatch.setattr(dq_kernel, "dq", lambda *args, **kwargs: (
      wrote_ds.append(args[6].bias_grad), real(*args, **kwargs))[1])
  q, k, v = _gqa_inputs(rng, 2, 130, 150, 64)
  kw = dict(is_causal=True, bias=jnp.asarray(rng.standard_normal((1, 4, 130, 150)),
                                             jnp.bfloat16))
  attn = functools.partial(fah.dot_product_attention, interpret=True, config=CONFIG, **kw)
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  grads = jax.vjp(attn, q, k, v)[1](dout)
  testing.check_gradients(grads, q, k, v, dout, **kw)
  jax.vjp(lambda q, bias: fah.dot_product_attention(q, k, v, bias, interpret=True,
                                                   config=CONFIG, is_causal=True),
          q, kw["bias"])[1](dout)
  assert wrote_ds == [False, True]


def test_mask_gradients_come_from_the_backward_kernels(rng, monkeypatch):
  """A mask alone (no bias to differentiate) streams its tiles through the dQ and dK/dV
  kernels; `blockwise` must not run."""
  from flash_attn_hopper import blockwise

  def refuse(*args, **kwargs):
    raise AssertionError("blockwise ran for a mask")
  monkeypatch.setattr(blockwise, "attention_backward", refuse)
  q, k, v = _gqa_inputs(rng, 1, 150, 190, 64)
  mask = jnp.asarray(rng.random((1, 4, 150, 190)) > 0.4) & (jnp.arange(190) < 120)
  _check_forward_and_gradients(rng, q, k, v, CONFIG, mask=mask, is_causal=True)
