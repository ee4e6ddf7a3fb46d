"""Past one device, on several host CPU devices: ring attention (context parallelism) against
the single-device reference, forward and gradients, and the op sharded over batch or heads.
Each device count runs a script in its own process, since the CPU device count is fixed when
JAX starts."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import blockwise
from flash_attn_hopper import masking
from flash_attn_hopper import ring
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

HERE = pathlib.Path(__file__).parent


def _run_with_devices(script: str, num_devices: int) -> str:
  """Runs tests/<script> with `num_devices` CPU devices; returns its output, or fails."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(HERE.parent))
  proc = subprocess.run([sys.executable, str(HERE / script)], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.parametrize("num_devices", (2, 3, 4))
def test_ring_matches_the_single_device_reference(num_devices):
  out = _run_with_devices("ring_check.py", num_devices)
  assert out.count("devices") == 4, out  # every case ran


def test_batch_and_head_sharding_run_the_kernel_per_shard():
  """Under jit with explicit mesh axes over batch or heads: a shard_map around the kernel,
  local shapes, and no all-gather or all-to-all in the compiled program."""
  out = _run_with_devices("sharding_check.py", 2)
  assert out.count(": ok") == 9, out


def test_zigzag_round_trips_and_balances_causal_work():
  x = jnp.arange(16)[None]
  z = ring.zigzag(x, 4)  # 8 chunks of 2: device d holds chunks d and 7 - d
  assert z[0].tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  assert bool(jnp.all(ring.unzigzag(z, 4) == x))


def test_bad_layout_is_named():
  q = jnp.zeros((1, 8, 1, 64))
  with pytest.raises(ValueError, match="layout must be one of"):
    ring.ring_attention(q, q, q, axis_name="sp", num_devices=2, layout="striped")


def test_zigzag_balances_causal_work():
  """Every device sees the same number of visible chunk pairs (2n + 1 of its 4n)."""
  n = 4
  chunks = lambda d: (d, 2 * n - 1 - d)
  work = [sum(k <= q for q in chunks(d) for s in range(n) for k in chunks(s)) for d in range(n)]
  assert work == [2 * n + 1] * n, work


@pytest.mark.interpret
@pytest.mark.parametrize("is_causal, segmented", [(True, False), (False, True)])
def test_block_backward_kernels_match_blockwise(rng, is_causal, segmented):
  """One chunk pair's backward through the kernels (interpreted, padded as the ring pads
  them) against `blockwise`, from the same global output and LSE."""
  w = workloads.Workload("pair", batch=1, seq_q=120, seq_kv=120, num_q_heads=2,
                         num_kv_heads=1, head_dim=64)
  q, k, v = testing.random_qkv(rng, w, "bfloat16")
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  segments = None
  if segmented:
    ids = jnp.asarray(np.repeat([0, 1, 2], [50, 30, 40])[None], jnp.int32)
    segments = masking.SegmentIds(ids, ids)
  out, lse = fah.dot_product_attention(q, k, v, is_causal=is_causal, segment_ids=segments,
                                       interpret=True, return_residual=True)
  opts = ring.RingOptions("sp", 1, is_causal, "contiguous", None, None, True)
  scale = 1.0 / 8.0
  got = ring._kernel_block_backward(q, k, v, out, lse, dout, segments, is_causal, scale, opts)
  want = blockwise.attention_backward(q, k, v, out, jnp.transpose(lse, (0, 2, 1)), dout,
                                      scale=scale, mask=masking.MaskSpec(is_causal=is_causal),
                                      segment_ids=segments, grad_dtype=jnp.float32)
  for name, a, b in zip(("dq", "dk", "dv"), got, want):
    err = float(jnp.max(jnp.abs(a - b)))
    assert err < 0.02 * float(jnp.max(jnp.abs(b))), (name, err)  # bf16 outputs vs f32
