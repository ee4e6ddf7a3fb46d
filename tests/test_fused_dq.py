"""The five-matmul backward (`BackwardConfig.fused_dq`, which `deterministic=False` takes where
it measured faster): dQ added up inside the dK/dV kernel (`kernels/fused_dq.py`).

Interpreted on the CPU against the float32 reference's gradients for a random cotangent,
with the dQ kernel forbidden; the config's checks and its resolution. The TMA reduce-adds
run only on the GPU (the interpreter has none): `tests/test_backward_gpu.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import testing
from flash_attn_hopper import workloads
from flash_attn_hopper.kernels import dq as dq_kernel

FUSED = config_lib.BackwardConfig(fused_dq=True)

CASES = (
    # MHA with lengths that are not multiples of any block.
    (workloads.Workload("mha_113x203_d64", batch=1, seq_q=113, seq_kv=203, num_q_heads=2,
                        num_kv_heads=2, head_dim=64), dict(scale=0.2)),
    # GQA, groups of 2, T > S, causal: D 64's warpgroups take turns.
    (workloads.Workload("gqa_200x77_d64", batch=1, seq_q=200, seq_kv=77, num_q_heads=4,
                        num_kv_heads=2, head_dim=64), dict(is_causal=True)),
    # MQA, two batch elements, D 128 (a column half per warpgroup), several KV tiles adding
    # into the same query blocks.
    (workloads.Workload("mqa_96x300_d128", batch=2, seq_q=96, seq_kv=300, num_q_heads=3,
                        num_kv_heads=1, head_dim=128), dict()),
    # D 128 causal with a window and key lengths: tiles that skip blocks and rows.
    (workloads.Workload("gqa_260x330_d128", batch=2, seq_q=260, seq_kv=330, num_q_heads=4,
                        num_kv_heads=2, head_dim=128),
     dict(is_causal=True, local_window_size=(100, 0),
          key_value_seq_lengths=np.array([330, 171], np.int32))),
)


@pytest.fixture
def no_dq_kernel(monkeypatch):
  """The separate dQ kernel must not run."""
  def refuse(*args, **kwargs):
    raise AssertionError("the dQ kernel ran with fused_dq=True")
  monkeypatch.setattr(dq_kernel, "dq", refuse)


#: The vjp of the interpreted op for a cotangent: `_grads(q, k, v, dout, **op_kwargs)`.
_grads = functools.partial(testing.gradients, functools.partial(
    fah.dot_product_attention, implementation="flash_attn_hopper", interpret=True))


@pytest.mark.interpret
@pytest.mark.usefixtures("no_dq_kernel")
@pytest.mark.parametrize("w, kwargs", CASES, ids=lambda x: getattr(x, "name", ""))
def test_gradients_match_reference(rng, w, kwargs):
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)  # A random cotangent.
  grads = _grads(q, k, v, dout, backward_config=FUSED, **kwargs)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype
  testing.check_gradients(grads, q, k, v, dout, **kwargs)


@pytest.mark.interpret
@pytest.mark.usefixtures("no_dq_kernel")
def test_segments_and_mask(rng):
  w = workloads.Workload("seg_150x150_d64", batch=2, seq_q=150, seq_kv=150, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "float16")
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  ids = testing.random_segment_ids(rng, 2, 150, 4)
  mask = rng.random((2, 1, 150, 150)) < 0.8
  kwargs = dict(segment_ids=ids, mask=mask, is_causal=True)
  grads = _grads(q, k, v, dout, backward_config=FUSED, **kwargs)
  testing.check_gradients(grads, q, k, v, dout, **kwargs)


def test_resolution():
  """`deterministic=False` takes the five matmuls exactly where the table says they won."""
  pick = lambda d, causal, t, **kw: config_lib.resolve_backward_config(
      d, jnp.bfloat16, causal, seq_len=t, **kw).fused_dq
  assert pick(128, False, 16384, deterministic=False)
  assert pick(64, True, 32768, deterministic=False)
  assert not pick(128, False, 16384)  # Deterministic by default.
  assert not pick(128, False, 4096, deterministic=False)  # Slower there.
  assert not pick(128, True, 16384, deterministic=False)
  assert not pick(256, False, 16384, deterministic=False)  # The split kernel has no room.
  assert not pick(128, False, 16384, deterministic=False, bias_grad=True)  # dS: dQ's kernel.


@pytest.mark.interpret
def test_op_takes_it_without_determinism(monkeypatch):
  """The op's `deterministic=False` reaches the resolution (here forced to always pick it)."""
  monkeypatch.setitem(config_lib.TUNED_BACKWARD_FUSED, (64, False), (1, FUSED))
  rng = np.random.default_rng(1)
  w = workloads.Workload("mha_70x90_d64", batch=1, seq_q=70, seq_kv=90, num_q_heads=2,
                         num_kv_heads=2, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  called = []
  real = dq_kernel.dq
  monkeypatch.setattr(dq_kernel, "dq", lambda *a, **kw: called.append(1) or real(*a, **kw))
  grads = _grads(q, k, v, dout, deterministic=False)
  assert not called
  testing.check_gradients(grads, q, k, v, dout)
  _grads(q, k, v, dout)  # deterministic=True: the dQ kernel runs.
  assert called


def test_config_errors_name_the_fix():
  cfg = config_lib.BackwardConfig(fused_dq=True)
  with pytest.raises(ValueError, match="fused_dq supports head_dim"):
    cfg.check_fits(256, 2)
  with pytest.raises(ValueError, match="set fused_dq=False, or stop the bias's gradient"):
    cfg.check_fits(128, 2, bias_grad=True)
  with pytest.raises(TypeError, match="BackwardConfig.fused_dq must be a bool"):
    config_lib.BackwardConfig(fused_dq=1)


@pytest.mark.interpret
@pytest.mark.usefixtures("no_dq_kernel")
def test_under_vmap(rng):
  """The accumulator ref (`jax.new_ref`) batches with the kernel under `jax.vmap`."""
  w = workloads.Workload("mha_64x130_d64", batch=1, seq_q=64, seq_kv=130, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = (jnp.stack([x, -x]) for x in testing.random_qkv(rng, w, "bfloat16"))
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  grads = jax.vmap(lambda *a: _grads(*a, backward_config=FUSED))(q, k, v, dout)
  for i in range(2):
    testing.check_gradients([g[i] for g in grads], q[i], k[i], v[i], dout[i])
