"""Peak device memory of fwd+bwd at long context: `python -m bench.memory [--tokens 65536]`.

One H200, bf16, D 128, batch 1, 16 query heads over 4 KV heads, causal: the gradients of
sum(attention(q, k, v) · dout) for ours and for cuDNN (`jax.nn.dot_product_attention`), each
in its own process so that each peak is its own. Prints the peak bytes in use beside the
inputs' own size; an O(T) backward keeps the difference a small multiple of the inputs.
Off Hopper: a tiny smoke run through the XLA path.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flash_attn_hopper as fah

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128


def _measure(implementation: str, tokens: int) -> dict:
  """Runs in the child process: one fwd+bwd, then the device's peak."""
  rng = np.random.default_rng(0)
  make = lambda h: jnp.asarray(rng.standard_normal((1, tokens, h, HEAD_DIM), np.float32),
                               jnp.bfloat16)
  q, k, v, dout = make(HEADS), make(KV_HEADS), make(KV_HEADS), make(HEADS)
  attn = lambda q, k, v: fah.dot_product_attention(q, k, v, is_causal=True,
                                                   implementation=implementation)
  grads = jax.jit(lambda q, k, v, dout: jax.vjp(attn, q, k, v)[1](dout))(q, k, v, dout)
  jax.block_until_ready(grads)
  stats = jax.devices()[0].memory_stats() or {}
  inputs = sum(x.size * x.dtype.itemsize for x in (q, k, v, dout))
  return {"implementation": implementation, "tokens": tokens,
          "peak_bytes": stats.get("peak_bytes_in_use"), "input_bytes": inputs}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=65536)
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(_measure(args.child, args.tokens)))
    return 0
  on_gpu = fah.api.on_hopper()
  tokens = args.tokens if on_gpu else 256
  impls = ("flash_attn_hopper", "cudnn") if on_gpu else ("xla",)
  print(f"fwd+bwd, causal, bf16, B 1, N {HEADS}, K {KV_HEADS}, D {HEAD_DIM}, T = S = {tokens}")
  for impl in impls:
    proc = subprocess.run([sys.executable, "-m", "bench.memory", "--child", impl,
                           "--tokens", str(tokens)], capture_output=True, text=True)
    if proc.returncode:
      print(f"{impl:18s} failed: {proc.stderr.strip().splitlines()[-1][:300]}")
      continue
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = r["peak_bytes"]
    peak_text = "n/a" if peak is None else f"{peak / 2**30:7.2f} GiB"
    print(f"{impl:18s} peak {peak_text}   inputs {r['input_bytes'] / 2**30:6.2f} GiB", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
