"""Context-parallel scaling: `python -m bench.ring [--tokens 131072] [--repeats 5]`.

Ring attention (`flash_attn_hopper.ring`, zig-zag, causal, bf16, D 128, 16 query heads over 4
KV heads, batch 1) over all visible GPUs at T = --tokens, against one GPU running the op at
T / n. Prints, for fwd and fwd+bwd: the median wall time (all devices, synchronized), TFLOP/s
per device (FlashAttention's count: causal halves 4·B·H·T²·D, fwd+bwd is 3.5× fwd), the
scaling efficiency (per-device TFLOP/s on n GPUs over one GPU's at T / n, which has the same
work per device only without causality; a ratio near 1 means the K/V passes hide under the
compute) and the peak memory per device. Off Hopper: a tiny smoke run in float32 on the CPU's
devices (set XLA_FLAGS=--xla_force_host_platform_device_count=2).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import flash_attn_hopper as fah
from flash_attn_hopper import ring
from bench import timing


def _program(attn, pass_name: str):
  if pass_name == "fwd":
    return jax.jit(lambda q, k, v, dout: attn(q, k, v))
  return jax.jit(lambda q, k, v, dout: jax.vjp(attn, q, k, v)[1](dout))


def _peak_gib() -> float:
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  return max(s.get("peak_bytes_in_use", 0) for s in stats) / 2**30


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=131072)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  on_gpu = fah.api.on_hopper()
  n = jax.device_count()
  t = args.tokens if on_gpu else 64 * n
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  impl = None if on_gpu else "xla"
  b, heads, kv, d = 1, 16, 4, 128
  rng = np.random.default_rng(0)
  make = lambda s, h: jnp.asarray(rng.standard_normal((b, s, h, d), np.float32), dtype)
  mesh = jax.make_mesh((n,), ("sp",))
  ring_attn = functools.partial(ring.sharded_attention, mesh, "sp", is_causal=True,
                                implementation=impl)
  one_attn = functools.partial(fah.dot_product_attention, is_causal=True, implementation=impl)
  flops = lambda seq: 4 * b * heads * seq * seq * d / 2
  print(f"{n} devices ({jax.devices()[0].device_kind}), causal zig-zag ring, B {b}, N {heads}, "
        f"K {kv}, D {d}, {jnp.dtype(dtype).name}; wall time, median of {args.repeats}")
  for pass_name, factor in (("fwd", 1.0), ("fwd+bwd", 3.5)):
    rows = {}
    for label, attn, seq, devices in (("ring", ring_attn, t, n), ("one GPU", one_attn, t // n, 1)):
      q, k, v, dout = make(seq, heads), make(seq, kv), make(seq, kv), make(seq, heads)
      ms = timing.median(timing.measure_ms("wall", _program(attn, pass_name), (q, k, v, dout),
                                           args.repeats))
      per_device = factor * flops(seq) / devices / (ms * 1e-3) / 1e12
      rows[label] = per_device
      print(f"{pass_name:8s} {label:8s} T {seq:7d}  {ms:9.3f} ms  {per_device:7.1f} TFLOP/s per "
            f"device  peak {_peak_gib():6.2f} GiB per device", flush=True)
    print(f"{pass_name:8s} scaling efficiency {rows['ring'] / rows['one GPU']:.2f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
