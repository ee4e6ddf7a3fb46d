"""Repeats the biased causal forward on a Hopper GPU and prints each run's max error against
jax.nn in float32: the probe of the D 256 float-bias race (bench/NOTES.md, tenth and eleventh
sessions; fixed by `pipeline.order_loads_before_tma`).
  PYTHONPATH=. python3 scripts/probe_bias_race.py [--reps 5]
Each case is (head dim, bias ring slots (None: the op's choice), T, S), B 2, N 8 over 2,
bf16, a (1, 8, T, S) bias. A right run reads about 0.01; the race showed as 0.03-0.2."""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import flash_attn_hopper as fah
from flash_attn_hopper import testing
from flash_attn_hopper import workloads

CASES = [(128, 1, 1000, 777), (128, None, 1000, 777), (256, None, 1024, 832),
         (256, None, 1000, 777), (256, None, 1024, 1024)]


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--reps", type=int, default=5)
  reps = p.parse_args().reps
  f32 = lambda x: x.astype(jnp.float32)
  for d, slots, t, s in CASES:
    rng = np.random.default_rng(1)
    w = workloads.Workload("race", batch=2, seq_q=t, seq_kv=s, num_q_heads=8, num_kv_heads=2,
                           head_dim=d)
    q, k, v = testing.random_qkv(rng, w, "bfloat16")
    bias = jnp.asarray(rng.standard_normal((1, 8, t, s)), jnp.bfloat16)
    ref = np.asarray(jax.nn.dot_product_attention(f32(q), f32(k), f32(v), bias=f32(bias),
                                                  is_causal=True))
    cfg = None if slots is None else fah.ForwardConfig(
        block_q=64, block_kv=128 if d == 128 else 64, num_stages=2, bias_num_stages=slots)
    fn = jax.jit(lambda q, k, v: fah.dot_product_attention(
        q, k, v, bias=bias, is_causal=True, implementation="flash_attn_hopper", config=cfg))
    errors = []
    for _ in range(reps):
      testing.poison_device_memory(2 * q.size * q.dtype.itemsize)
      errors.append(float(np.abs(np.asarray(f32(fn(q, k, v))) - ref).max()))
    print(f"D {d} bias slots {slots} T {t} S {s}: " + " ".join(f"{e:.3g}" for e in errors),
          flush=True)


if __name__ == "__main__":
  main()
