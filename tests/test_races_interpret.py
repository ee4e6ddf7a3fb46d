"""The kernels under the Mosaic GPU interpreter's race detector: a happens-before check of
every shared-memory access, across warpgroups, barriers and TMA, which also tells the memory
proxies apart (ordinary loads against TMA writes, ordered only by `fence.proxy.async`).

A race here is a protocol bug that the GPU shows only now and then: on the H200 the D 256
bias forward, whose bias tiles were freed to TMA without the proxy fence, gave wrong rows in
about half of the runs (bench/results/h200_d256_bias_race.log). The detector finds that
missing fence at once on a small case (`test_the_detector_finds_a_missing_proxy_fence`).

The detector reports on stdout ("RACE DETECTED", one per pair of accesses); its state is kept
per kernel launch, so a program of several kernels is checked through that output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import pipeline
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

pytestmark = pytest.mark.interpret

#: One-slot bias ring, block_kv = block_q: the D 256 forward's shape at D 64, where warpgroup
#: 1 reads a causal tile's last bias tile alone and the producer refills the slot at once.
ONE_BIAS_SLOT = fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2, bias_num_stages=1)
RACE = "RACE DETECTED"


@pytest.fixture
def detect_races(monkeypatch):
  """The interpreter with its race detector on (`common.launch` takes pipeline's params)."""
  monkeypatch.setattr(pipeline, "INTERPRET_PARAMS",
                      dataclasses.replace(pipeline.INTERPRET_PARAMS, detect_races=True))


def _inputs(rng, t, s, d=64):
  w = workloads.Workload("races", batch=1, seq_q=t, seq_kv=s, num_q_heads=2, num_kv_heads=1,
                         head_dim=d)
  return testing.random_qkv(rng, w, "bfloat16")


def _run(q, k, v, grad: bool, **kw):
  """The op's forward, or its gradients for a random cotangent (all three kernels)."""
  attn = functools.partial(fah.dot_product_attention, interpret=True, **kw)
  if not grad:
    return jax.block_until_ready(attn(q, k, v))
  dout = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), q.dtype)
  return jax.block_until_ready(testing.gradients(attn, q, k, v, dout, **kw))


def _bias(rng, t, s):
  return jnp.asarray(rng.standard_normal((1, 2, t, s)), jnp.bfloat16)


def _halves(t):
  """Segment ids of two documents of t / 2 tokens each."""
  return jnp.asarray(np.repeat([0, 1], t // 2)[None], jnp.int32)


CASES = {
    # name: (T, S, D, grad, arguments)
    "bias_one_slot_fwd": (256, 192, 64, False, lambda rng: dict(
        is_causal=True, bias=_bias(rng, 256, 192), config=ONE_BIAS_SLOT)),
    "mask_fwd": (256, 192, 64, False, lambda rng: dict(
        mask=jnp.asarray(rng.random((1, 2, 256, 192)) > 0.3))),
    "segments_fwd": (256, 256, 64, False, lambda rng: dict(
        is_causal=True, segment_ids=_halves(256),
        config=fah.ForwardConfig(block_q=64, block_kv=64, num_stages=2))),
    "bias_grad": (256, 192, 64, True, lambda rng: dict(is_causal=True, bias=_bias(rng, 256, 192))),
    "segments_grad": (256, 256, 64, True, lambda rng: dict(is_causal=True,
                                                           segment_ids=_halves(256))),
    # D 256's own kernels: the forward's and the split dK/dV kernel's one-slot bias rings.
    "bias_grad_d256": (128, 128, 256, True, lambda rng: dict(is_causal=True,
                                                             bias=_bias(rng, 128, 128))),
    # The five-matmul backward's dSᵀ stores and barriers. Its dSᵀ tiles are double-buffered
    # because the other warpgroup's wgmma reads them, but jax 0.11.2's detector does not
    # track wgmma's operand reads: with one buffer it reports nothing (tried, 2026-12-01).
    # One KV tile (S ≤ 128): CTAs of several KV tiles add into the same dQ rows in no order,
    # on the GPU with atomic TMA reduce-adds, here with a read-modify-write that is safe only
    # because the interpreter runs CTAs one by one, which the detector cannot know.
    "fused_dq_grad_d64": (320, 128, 64, True, lambda rng: dict(
        is_causal=True, causal_alignment="bottom_right",
        backward_config=fah.BackwardConfig(fused_dq=True))),
    "fused_dq_grad_d128": (192, 100, 128, True, lambda rng: dict(
        backward_config=fah.BackwardConfig(fused_dq=True))),
}


@pytest.mark.usefixtures("detect_races")
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_are_race_free(rng, capsys, name):
  t, s, d, grad, arguments = CASES[name]
  q, k, v = _inputs(rng, t, s, d)
  _run(q, k, v, grad, **arguments(rng))
  out = capsys.readouterr().out
  assert RACE not in out, out[out.index(RACE):][:3000]


@pytest.mark.usefixtures("detect_races")
def test_the_detector_finds_a_missing_proxy_fence(rng, capsys, monkeypatch):
  """Without `pipeline.order_loads_before_tma`, the bias tiles read with loads race with the
  TMA copies that refill their slot: the check above can fail."""
  monkeypatch.setattr(pipeline, "order_loads_before_tma", lambda: None)
  q, k, v = _inputs(rng, 256, 192)
  _run(q, k, v, False, is_causal=True, bias=_bias(rng, 256, 192), config=ONE_BIAS_SLOT)
  out = capsys.readouterr().out
  assert RACE in out and "bias_tile" in out, out[-2000:]



@pytest.mark.usefixtures("detect_races")
@pytest.mark.parametrize("d", (64, 256))
def test_persistent_backward_is_race_free(rng, capsys, monkeypatch, d):
  """The backward kernels on persistent CTAs, each running a causal mirror pair of tiles
  (at D 256 the split dK/dV kernel): the next tile's K and V (Q, dO, the LSE and δ in dQ)
  land by TMA in buffers the last tile read and stored from."""
  from flash_attn_hopper import config as config_lib
  monkeypatch.setattr(config_lib, "PERSISTENT_BACKWARD_MAX_STEPS",
                      {(kernel, d, True): 1 << 30 for kernel in ("dq", "dkv")})
  q, k, v = _inputs(rng, 256, 256, d)
  _run(q, k, v, True, is_causal=True)
  out = capsys.readouterr().out
  assert RACE not in out, out[out.index(RACE):][:3000]


@pytest.mark.usefixtures("detect_races")
@pytest.mark.parametrize("name", ["segments_grad", "bias_grad", "persistent_causal_grad"])
def test_dq_with_kv_on_one_barrier_pair(rng, capsys, monkeypatch, name):
  """`dq.shares_kv_barriers` (on at D 128, here switched on at D 64): K and V of a dQ step
  on one barrier pair, the keys' ids and a bias on their own, the blocks of the other
  warpgroup released once per pair, persistent CTAs draining it once. Race-free, and the
  gradients still match the reference."""
  from flash_attn_hopper import config as config_lib
  from flash_attn_hopper.kernels import dq
  monkeypatch.setattr(dq, "SHARED_KV_BARRIERS_HEAD_DIMS", {64})
  if name == "persistent_causal_grad":
    monkeypatch.setattr(config_lib, "PERSISTENT_BACKWARD_MAX_STEPS",
                        {("dq", 64, True): 1 << 30})
    t, s, kw = 256, 256, dict(is_causal=True)
  else:
    t, s, _, _, arguments = CASES[name]
    kw = arguments(rng)
  q, k, v = _inputs(rng, t, s)
  dout = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), q.dtype)
  attn = functools.partial(fah.dot_product_attention, interpret=True)
  grads = jax.block_until_ready(testing.gradients(attn, q, k, v, dout, **kw))
  out = capsys.readouterr().out
  assert RACE not in out, out[out.index(RACE):][:3000]
  testing.check_gradients(grads, q, k, v, dout, **kw)
