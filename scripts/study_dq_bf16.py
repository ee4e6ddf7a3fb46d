"""Error study (CPU): could the five-matmul backward add its dQ partial sums into a bf16
global buffer (a bf16 TMA reduce-add, each add rounded) instead of the float32 one?

It replays the kernel's arithmetic in numpy: dS rounded to bf16 for the matmul, one partial
dQ per key block of `block_kv` keys, summed in float32 (today) or in bf16 (the candidate),
and prints each one's max abs error against the float32 reference beside the naive bf16
implementation's (`testing.naive_attention`), the baseline of the tests' tolerance rule.

    PYTHONPATH=. python scripts/study_dq_bf16.py --seq-len 8192 --head-dim 128
"""

import argparse

import jax.numpy as jnp
import numpy as np

from flash_attn_hopper import reference, testing


def kernel_dq_partials(q, k, v, do, causal, block_kv):
  """The partial dQ of each key block, in float32, as (heads, T, D) arrays."""
  qf, kf, vf, dof = (np.asarray(jnp.asarray(x, jnp.float32))[0].transpose(1, 0, 2)
                     for x in (q, k, v, do))
  seq, dim = qf.shape[1], qf.shape[2]
  scale = 1 / np.sqrt(dim)
  s = np.einsum("htd,hsd->hts", qf, kf) * scale
  if causal:
    s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  delta = (dof * np.einsum("hts,hsd->htd", p, vf)).sum(-1, keepdims=True)
  ds = p * (np.einsum("htd,hsd->hts", dof, vf) - delta)
  ds = np.asarray(jnp.asarray(ds, jnp.bfloat16), np.float32)
  for j in range(0, seq, block_kv):
    yield np.einsum("hts,hsd->htd", ds[:, :, j:j + block_kv], kf[:, j:j + block_kv]) * scale


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--heads", type=int, default=2)
  parser.add_argument("--block-kv", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  shape = (1, args.seq_len, args.heads, args.head_dim)
  q, k, v, do = (jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
                 for _ in range(4))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  ref = testing.gradients(reference.attention_reference, *map(f32, (q, k, v, do)),
                          is_causal=args.causal)[0]
  naive = testing.gradients(testing.naive_attention, q, k, v, do, is_causal=args.causal)[0]
  sum32 = np.zeros(shape[2:0:-1] + shape[3:], np.float32)
  sum16 = jnp.zeros(sum32.shape, jnp.bfloat16)
  for part in kernel_dq_partials(q, k, v, do, args.causal, args.block_kv):
    sum32 += part
    sum16 = jnp.asarray(f32(sum16) + f32(jnp.asarray(part, jnp.bfloat16)), jnp.bfloat16)
  as_btnh = lambda x: jnp.asarray(np.asarray(f32(x)).transpose(1, 0, 2)[None], jnp.bfloat16)
  err = lambda x: testing.max_abs_error(x, ref)
  print(f"T={args.seq_len} D={args.head_dim} block_kv={args.block_kv} causal={args.causal}: "
        f"max|dQ| {float(np.max(np.abs(ref))):.3g}, max abs error: naive bf16 {err(naive):.3g}, "
        f"float32 sum {err(as_btnh(sum32)):.3g}, bf16 sum {err(as_btnh(sum16)):.3g}")


if __name__ == "__main__":
  main()
