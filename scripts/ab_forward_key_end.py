"""A/B on a Hopper GPU: the forward under key lengths (and a ragged S) with the overlapped
kv_loop taking the block that holds the keys' end first (`forward._key_end_first`, new)
against the plain loop (old), interleaved with cuDNN on the same inputs, CUPTI device time:
  PYTHONPATH=. python3 scripts/ab_forward_key_end.py [head dims] [seq lens] [dtype]
e.g. `128,256 1024,4096,16384 bfloat16`. B·T = 16k tokens, hidden 2048; key lengths drawn
in [T/2, T] (0.8·T + 3 at batch 1), then S = T − 37 without lengths. Prints each side's
median ms (best of 3 rounds), its ratio to cuDNN, and its largest difference to cuDNN's
output."""
import functools, statistics, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
import flash_attn_hopper as fah
from flash_attn_hopper.kernels import forward

NEW = forward._key_end_first
OLD = lambda opts: False  # `_overlaps` then keeps the plain loop for the keys' end.
dims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "128,256").split(",")]
seqs = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1024,4096,16384").split(",")]
dtype = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "bfloat16")


def ms(fn, *a):
  _, runs = profiler.measure(fn, aggregate=False, iterations=10)(*a)
  return statistics.median(sum(t for _, t in run) for run in runs)


def cell(d, t, lengths: bool):
  rng = np.random.default_rng(0)
  b, h = 16384 // t, 2048 // d
  s = t if lengths else t - 37
  q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), dtype) for _ in range(2))
  kw = {}
  if lengths:
    lens = rng.integers(t // 2, t + 1, size=b) if b > 1 else np.array([int(0.8 * t) + 3])
    kw = dict(key_value_seq_lengths=jnp.asarray(lens, jnp.int32))
  fns = {}
  try:
    fns["cudnn"] = jax.jit(functools.partial(jax.nn.dot_product_attention,
                                             implementation="cudnn", **kw)).lower(
        q, k, v).compile()
  except Exception as e:  # noqa: BLE001 (then the ratios are to the old side)
    print(f"cudnn: {str(e).splitlines()[0][:160]}")
  for name, helper in (("old", OLD), ("new", NEW)):
    forward._key_end_first = helper
    jax.clear_caches()
    fns[name] = jax.jit(functools.partial(fah.dot_product_attention, **kw)).lower(
        q, k, v).compile()
  forward._key_end_first = NEW
  peer = "cudnn" if "cudnn" in fns else "old"
  ref = fns[peer](q, k, v).astype(jnp.float32)
  errs = {n: float(jnp.max(jnp.abs(f(q, k, v).astype(jnp.float32) - ref)))
          for n, f in fns.items()}
  times = {n: [] for n in fns}
  for _ in range(3):
    for n, f in fns.items():
      times[n].append(ms(f, q, k, v))
  base = min(times[peer])
  what = "key lengths" if lengths else f"S = {s}"
  print(f"fwd D {d} T {t} {what} {dtype.name}: " + " | ".join(
      f"{n}: {min(ts):.4f} ms ({base / min(ts):.3f}x {peer}, err {errs[n]:.1e})"
      for n, ts in times.items()), flush=True)


for d in dims:
  for t in seqs:
    for lengths in (True, False):
      cell(d, t, lengths)
