"""Run by tests/test_ring.py in a fresh process with several CPU devices (XLA_FLAGS must be
set before JAX starts): ring attention over a 1-D mesh against the single-device reference,
forward and gradients. Prints one line per case and exits non-zero on a mismatch."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import flash_attn_hopper as fah
from flash_attn_hopper import ring

TOL = 2e-4  # float32 end to end: only summation order differs from the reference


def main() -> int:
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("sp",))
  rng = np.random.default_rng(0)
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  t = 16 * n
  cases = {
      "zigzag causal, GQA": dict(is_causal=True, layout="zigzag"),
      "contiguous causal": dict(is_causal=True, layout="contiguous"),
      "zigzag, not causal, segment ids": dict(layout="zigzag", segments=True),
      "contiguous causal, segment ids": dict(is_causal=True, layout="contiguous", segments=True),
  }
  failed = 0
  for name, kw in cases.items():
    q, k, v, dout = make(2, t, 4, 32), make(2, t, 2, 32), make(2, t, 2, 32), make(2, t, 4, 32)
    segments = None
    if kw.pop("segments", False):
      ids = jnp.asarray(np.sort(rng.integers(0, 4, (2, t))), jnp.int32)
      segments = (ids, ids)
    causal = kw.get("is_causal", False)
    attn = lambda q, k, v: ring.sharded_attention(mesh, "sp", q, k, v, segment_ids=segments,
                                                  implementation="xla", **kw)
    ref = lambda q, k, v: fah.attention_reference(
        q, k, v, is_causal=causal, segment_ids=None if segments is None else segments)
    out, vjp = jax.vjp(jax.jit(attn), q, k, v)
    ref_out, ref_vjp = jax.vjp(ref, q, k, v)
    errors = [float(jnp.max(jnp.abs(a - b))) for a, b in
              zip((out, *vjp(dout)), (ref_out, *ref_vjp(dout)))]
    ok = max(errors) < TOL
    failed += not ok
    print(f"{name:36s} {n} devices  max errors out/dq/dk/dv "
          + " ".join(f"{e:.1e}" for e in errors) + ("" if ok else "  FAIL"), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
