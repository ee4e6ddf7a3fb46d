"""A/B on a Hopper GPU: the forward with and without `ForwardConfig.overlap_softmax` on the
race grid's cells (B·T = 16k tokens, hidden 2048), interleaved, CUPTI device time:
  PYTHONPATH=. python3 scripts/ab_forward_overlap.py [head dims] [seq lens] [dtype]
e.g. `64,128,256 1024,4096,16384 float16`. Prints both times per cell, the largest difference
between the two outputs, and at T = 1k both errors against jax.nn in float32."""
import dataclasses, sys, statistics
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
import flash_attn_hopper as fah
from flash_attn_hopper import config as config_lib
dims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64,128,256").split(",")]
seqs = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1024,4096,16384").split(",")]
dtype = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "float16")
rng = np.random.default_rng(0)
def ms(fn, *a):
  _, runs = profiler.measure(fn, aggregate=False, iterations=10)(*a)
  return statistics.median(sum(t for _, t in run) for run in runs)
rows = []
for d in dims:
  for t in seqs:
    b, h = 16384 // t, 2048 // d
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), dtype) for _ in range(3))
    for causal in (False, True):
      base = config_lib.resolve_forward_config(d, dtype, causal, None, seq_len=t)
      fns = {o: jax.jit(lambda q, k, v, o=o: fah.dot_product_attention(
          q, k, v, is_causal=causal, config=dataclasses.replace(base, overlap_softmax=o)))
             for o in (False, True)}
      outs = {o: f(q, k, v) for o, f in fns.items()}
      diff = float(jnp.max(jnp.abs(outs[True].astype(jnp.float32) - outs[False].astype(jnp.float32))))
      err = ""
      if t == 1024:
        ref = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=causal)
        err = " err_off %.2e err_on %.2e" % tuple(float(jnp.max(jnp.abs(outs[o].astype(jnp.float32) - ref))) for o in (False, True))
      times = {False: [], True: []}
      for _ in range(2):
        for o in (False, True):
          times[o].append(ms(fns[o], q, k, v))
      flops = 4 * b * h * t * t * d / (2 if causal else 1)
      off, on = min(times[False]), min(times[True])
      print(f"D {d:3d} T {t:5d} causal {causal!s:5s} off {off:.3f} ms ({flops/off/1e9:.0f}) on {on:.3f} ms ({flops/on/1e9:.0f})  on/off speed {off/on:.3f}  maxdiff {diff:.1e}{err}  {times}", flush=True)
