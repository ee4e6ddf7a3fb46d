"""A workload's random inputs, generated on device, and its reference results, computed once.

All peers and passes of one workload share the same q, k, v and output cotangent: fresh
standard-normal draws (never zeros) from `jax.random`, seeded by the run's seed and the
workload's name so a rerun reproduces them. A peer with a fixed logit scale gets q multiplied
by scale / fixed_scale (computed here, outside any timed region) and is checked against the
reference on exactly those inputs with its fixed scale.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

from bench import numerics
from bench.peers import Peer, workload_scale
from flash_attn_hopper.workloads import Workload


class WorkloadInputs:
  """q, k, v, cotangent of one workload, and lazily its reference slices per logit scale."""

  def __init__(self, w: Workload, seed: int, with_grads: bool):
    self.workload = w
    self.with_grads = with_grads
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(w.name.encode()))
    kq, kk, kv, kc = jax.random.split(key, 4)
    dtype = jnp.dtype(w.dtype)
    self.q = jax.random.normal(kq, w.q_shape, dtype)
    self.k = jax.random.normal(kk, w.kv_shape, dtype)
    self.v = jax.random.normal(kv, w.kv_shape, dtype)
    self.cotangent = jax.random.normal(kc, w.q_shape, dtype)
    self._scaled_q = {}
    self._refs = {}

  def scale_for(self, peer: Peer) -> float:
    """The logit scale `peer` computes with on `q_for(peer)`."""
    return workload_scale(self.workload) if peer.fixed_scale is None else peer.fixed_scale

  def q_for(self, peer: Peer):
    """q as fed to `peer`: pre-scaled for a peer that applies a fixed scale of its own."""
    if peer.fixed_scale is None:
      return self.q
    if peer.fixed_scale not in self._scaled_q:
      factor = workload_scale(self.workload) / peer.fixed_scale
      self._scaled_q[peer.fixed_scale] = jax.block_until_ready(
          (self.q.astype(jnp.float32) * factor).astype(self.q.dtype))
    return self._scaled_q[peer.fixed_scale]

  def references(self, peer: Peer) -> list[dict]:
    """The reference slices (one dict per check unit) for `peer`'s inputs and scale."""
    key = peer.fixed_scale
    if key not in self._refs:
      inputs = (self.q_for(peer), self.k, self.v, self.cotangent)
      self._refs[key] = [
          jax.block_until_ready(numerics.reference_unit(
              unit, self.workload, inputs, self.scale_for(peer), self.with_grads))
          for unit in numerics.check_units(self.workload)]
    return self._refs[key]
