"""Run by tests/test_ring.py in a fresh process with two CPU devices: the op under jit with
Q/K/V sharded over batch or heads (explicit mesh axes) runs the kernel per shard, inside a
shard_map, and the compiled program gathers nothing. Compiled, not run: the Mosaic GPU
interpreter deadlocks when two devices run interpreted kernels at once (a GPU runs it:
tests/test_ring_gpu.py). Prints one line per case; exits non-zero on a failure."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flash_attn_hopper as fah


def main() -> int:
  mesh = jax.make_mesh((2,), ("d",))
  rng = np.random.default_rng(0)
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  q, k, v = make(2, 128, 4, 64), make(2, 128, 2, 64), make(2, 128, 2, 64)
  attn = lambda q, k, v: fah.dot_product_attention(q, k, v, is_causal=True, interpret=True)
  failed = 0
  for name, spec, local in (("batch", P("d"), (1, 128, 4, 64)),
                            ("heads", P(None, None, "d"), (2, 128, 2, 64))):
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    jaxpr = str(jax.make_jaxpr(attn)(*args))
    hlo = jax.jit(attn).lower(*args).compile().as_text()
    local_q = "bf16[" + ",".join(map(str, local)) + "]"
    checks = {"shard_map in the program": "shard_map" in jaxpr,
              f"the kernel sees {local_q}": local_q in jaxpr,
              "no all-gather": "all-gather" not in hlo,
              "no all-to-all": "all-to-all" not in hlo}
    failed += not all(checks.values())
    print(f"{name:6s} " + ", ".join(f"{c}: {'ok' if ok else 'FAIL'}" for c, ok in checks.items()))
  try:
    sharded_t = [jax.device_put(x, NamedSharding(mesh, P(None, "d"))) for x in (q, k, v)]
    jax.jit(attn).lower(*sharded_t)
    print("T sharded: no error FAIL")
    failed += 1
  except ValueError as e:
    ok = "ring_attention" in str(e)
    failed += not ok
    print(f"T sharded: the error names ring_attention: {'ok' if ok else 'FAIL'}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
