"""Windows and the bottom-right causal alignment through the real kernels (interpreter), forward
and backward, against the float32 reference with jax.nn's semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

pytestmark = pytest.mark.interpret

# Small blocks so that the band crosses several of them and CTAs loop over several tiles.
CONFIG = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2)

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
  kw = dict(is_causal=is_causal, local_window_size=window, causal_alignment=alignment)
  out, lse = fah.dot_product_attention(q, k, v, interpret=True, config=CONFIG,
                                       return_residual=True, **kw)
  testing.check_attention(out, q, k, v, actual_lse=lse, **kw)
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  f = lambda q, k, v: fah.dot_product_attention(q, k, v, interpret=True, config=CONFIG, **kw)
  grads = jax.vjp(f, q, k, v)[1](dout)
  testing.check_gradients(grads, q, k, v, dout, **kw)


@pytest.mark.parametrize("is_causal, window", [(False, None), (True, (40, 0))])
def test_sequence_lengths_match_reference(rng, is_causal, window):
  # Three batch elements: a short one, one with no keys at all, one at full length.
  w = workloads.Workload("lens", batch=3, seq_q=150, seq_kv=200, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "float16")
  kw = dict(is_causal=is_causal, local_window_size=window,
            query_seq_lengths=jnp.array([70, 150, 1], jnp.int32),
            key_value_seq_lengths=jnp.array([90, 0, 200], jnp.int32))
  out = fah.dot_product_attention(q, k, v, interpret=True, config=CONFIG, **kw)
  testing.check_attention(out, q, k, v, **kw)
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float16)
  f = lambda q, k, v: fah.dot_product_attention(q, k, v, interpret=True, config=CONFIG, **kw)
  grads = jax.vjp(f, q, k, v)[1](dout)
  testing.check_gradients(grads, q, k, v, dout, **kw)


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
