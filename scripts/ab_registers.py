"""A/B on a Hopper GPU: the setmaxnreg split (pipeline.PRODUCER_REGISTERS / COMPUTE_REGISTERS),
each side compiled in one process by swapping the two constants, interleaved with cuDNN on the
same inputs, CUPTI device time:
  PYTHONPATH=. python3 scripts/ab_registers.py [dims] [seqs] [dtype] [sides e.g. 40/232,24/240]
B·T = 16k tokens, hidden 2048, causal and not. Per cell it prints ptxas -v of every kernel
compiled for each side (between "--- ptxas" lines; spills show as "spill stores"), then the
forward's and fwd+bwd's median ms per side (best of 3 rounds of 10-run medians), the ratio to
cuDNN and each kernel's time, and whether the sides' outputs and gradients are bitwise equal.
The output is long: grep it for "^fwd" and "spill"."""
import functools, os, sys
import jax, jax.numpy as jnp
import flash_attn_hopper as fah
from flash_attn_hopper import pipeline
from ab_common import fwd_bwd, race_inputs, timings

dims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64,128,256").split(",")]
seqs = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4096").split(",")]
dtype = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
SIDES = [tuple(int(v) for v in s.split("/"))
         for s in (sys.argv[4] if len(sys.argv) > 4 else "40/232,24/240").split(",")]


def cell(d, t, causal):
  q, k, v, dout = race_inputs(d, t, causal, dtype)
  cud = functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                          is_causal=causal)
  fns = {"cudnn": (jax.jit(cud), fwd_bwd(cud))}
  for prod, comp in SIDES:
    pipeline.PRODUCER_REGISTERS, pipeline.COMPUTE_REGISTERS = prod, comp
    jax.clear_caches()
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    print(f"--- ptxas for {prod}/{comp} D {d} T {t} causal {causal}", flush=True)
    ours = functools.partial(fah.dot_product_attention, is_causal=causal)
    fns[f"{prod}/{comp}"] = (jax.jit(ours).lower(q, k, v).compile(),
                             fwd_bwd(ours).lower(q, k, v, dout).compile())
    os.environ.pop("MOSAIC_GPU_DUMP_PTXAS")
    print("--- end ptxas", flush=True)
  names = [n for n in fns if n != "cudnn"]
  outs = {n: (fns[n][0](q, k, v), fns[n][1](q, k, v, dout)[1]) for n in names}
  same = all(bool(jnp.all(a == b)) for n in names
             for a, b in zip((outs[n][0], *outs[n][1]), (outs[names[0]][0], *outs[names[0]][1])))
  best = {n: [(float("inf"), {}), (float("inf"), {})] for n in fns}
  for _ in range(3):
    for n, pair in fns.items():
      for i, f in enumerate(pair):
        r = timings(f, q, k, v, *(dout,) * i, kernels=("fwd", "dq", "dkv"))
        if r[0] < best[n][i][0]:
          best[n][i] = r
  for i, pas in enumerate(("fwd", "fwd+bwd")):
    base = best["cudnn"][i][0]
    print(f"{pas} D {d} T {t} {'causal' if causal else 'full'} {dtype.name} (same bits: {same}):"
          f" cudnn {base:.3f} ms | " + " | ".join(
              f"{n}: {best[n][i][0]:.3f} ms ({base / best[n][i][0]:.3f}x; " + ", ".join(
                  f"{k} {v:.3f}" for k, v in best[n][i][1].items() if v) + ")"
              for n in names), flush=True)


for d in dims:
  for t in seqs:
    for causal in (False, True):
      cell(d, t, causal)
