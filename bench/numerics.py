"""Checks a cell's output (and gradients) against the float32 reference, on a cheap slice.

The full float32 reference at 16k tokens needs B·N·T·S·4 bytes of logits (tens of GiB), so the
check runs on "units": a unit is one (batch element, KV head) pair with all the query heads
that share that KV head. A unit is self-contained: its output and dq depend only on its q heads,
and its dk/dv collect every query head that reads that KV head, so its gradients are exact. Two
units are checked, the first (batch 0, KV head 0) and the last (batch B-1, KV head K-1), so a
wrong batch or head offset in a kernel shows. Within a unit the query heads are processed in
chunks sized to a memory budget (dk/dv summed over chunks), so even T = S = 16k costs a few GiB.

The error is relative in norm, ‖x − ref‖ / ‖ref‖, per tensor, over both units.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from flash_attn_hopper.reference import attention_reference
from flash_attn_hopper.workloads import Workload

# Relative-error tolerances by input dtype. Forward: the output; gradients: dq, dk, dv.
FWD_TOL = {"float16": 5e-3, "bfloat16": 2e-2, "float32": 2e-3}
GRAD_TOL = {"float16": 1.5e-2, "bfloat16": 5e-2, "float32": 5e-3}
# Bytes of float32 (T, S) arrays the reference may hold at once (logits, probs, their cotangents).
REFERENCE_BUDGET_BYTES = 4 << 30


def tolerance(dtype: str, tensor: str) -> float:
  """The relative tolerance of one checked tensor ("out", "dq", "dk", "dv")."""
  table = FWD_TOL if tensor == "out" else GRAD_TOL
  return table.get(dtype, table["float32"])


@dataclasses.dataclass(frozen=True)
class Unit:
  """One batch element, one KV head and the query heads [q_start, q_stop) that read it."""

  batch: int
  kv_head: int
  q_start: int
  q_stop: int


def check_units(w: Workload) -> list[Unit]:
  """The first and the last (batch, KV head) of the workload."""
  group = w.num_q_heads // w.num_kv_heads
  units = []
  for b, kv in ((0, 0), (w.batch - 1, w.num_kv_heads - 1)):
    unit = Unit(b, kv, kv * group, (kv + 1) * group)
    if unit not in units:
      units.append(unit)
  return units


def heads_per_chunk(w: Workload, grads: bool) -> int:
  """How many query heads the reference handles at once within the memory budget."""
  arrays = 6 if grads else 3
  per_head = w.seq_q * w.seq_kv * 4 * arrays
  group = w.num_q_heads // w.num_kv_heads
  return max(1, min(group, REFERENCE_BUDGET_BYTES // per_head))


@functools.partial(jax.jit, static_argnames=("scale", "is_causal"))
def _reference_forward(q, k, v, *, scale, is_causal):
  return {"out": attention_reference(q, k, v, scale=scale, is_causal=is_causal)}


@functools.partial(jax.jit, static_argnames=("scale", "is_causal"))
def _reference_grads(q, k, v, cotangent, *, scale, is_causal):
  fn = functools.partial(attention_reference, scale=scale, is_causal=is_causal)
  out, vjp_fn = jax.vjp(fn, q, k, v)
  dq, dk, dv = vjp_fn(cotangent)
  return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def _f32(x):
  return x.astype(jnp.float32)


def _unit_inputs(unit: Unit, q, k, v, cotangent, start: int, stop: int):
  """float32 slices (1, T, heads, D) / (1, S, 1, D) of one unit's query-head chunk."""
  b, kv = unit.batch, unit.kv_head
  return (_f32(q[b:b + 1, :, start:stop]), _f32(k[b:b + 1, :, kv:kv + 1]),
          _f32(v[b:b + 1, :, kv:kv + 1]), _f32(cotangent[b:b + 1, :, start:stop]))


def reference_unit(unit: Unit, w: Workload, inputs, scale: float, grads: bool) -> dict:
  """The float32 reference of one unit: out/dq (T, heads, D), dk/dv (S, D) when `grads`."""
  q, k, v, cotangent = inputs
  chunk = heads_per_chunk(w, grads)
  parts = []
  for start in range(unit.q_start, unit.q_stop, chunk):
    qs, ks, vs, cts = _unit_inputs(unit, q, k, v, cotangent, start, min(start + chunk,
                                                                        unit.q_stop))
    if grads:
      parts.append(_reference_grads(qs, ks, vs, cts, scale=scale, is_causal=w.is_causal))
    else:
      parts.append(_reference_forward(qs, ks, vs, scale=scale, is_causal=w.is_causal))
  ref = {name: jnp.concatenate([p[name][0] for p in parts], axis=1)
         for name in ("out", "dq") if name in parts[0]}
  ref.update({name: sum(p[name][0, :, 0] for p in parts)
              for name in ("dk", "dv") if name in parts[0]})
  return ref


def peer_unit(unit: Unit, outputs: dict) -> dict:
  """The same slices of a peer's outputs, in float32."""
  sliced = {}
  for name, x in outputs.items():
    if name in ("out", "dq"):
      sliced[name] = _f32(x[unit.batch, :, unit.q_start:unit.q_stop])
    else:
      sliced[name] = _f32(x[unit.batch, :, unit.kv_head])
  return sliced


def relative_errors(units_outputs: list[dict], units_refs: list[dict]) -> dict[str, float]:
  """‖x − ref‖ / ‖ref‖ per tensor, accumulated over units. NaN/inf give inf."""
  errors = {}
  for name in units_outputs[0]:
    diff = sum(float(jnp.sum(jnp.square(o[name] - r[name])))
               for o, r in zip(units_outputs, units_refs))
    norm = sum(float(jnp.sum(jnp.square(r[name]))) for r in units_refs)
    err = math.sqrt(diff / norm) if norm > 0 else math.sqrt(diff)
    errors[name] = err if math.isfinite(err) else math.inf
  return errors


def failures(errors: dict[str, float], dtype: str) -> dict[str, tuple[float, float]]:
  """The tensors whose error is above tolerance: name -> (error, tolerance)."""
  return {name: (err, tolerance(dtype, name)) for name, err in errors.items()
          if not err <= tolerance(dtype, name)}
