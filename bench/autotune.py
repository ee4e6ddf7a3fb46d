"""Autotune the kernels' block sizes: `python -m bench.autotune [--backward]`.

For each (head dim, causal) it times every `ForwardConfig` (with --backward: every
`BackwardConfig`, timing fwd+bwd) that fits shared memory on the race grid's shapes (B·T = 16k
tokens, hidden 2048), checks each candidate's output (gradients) against cuDNN's before its
time counts, and prints the winner by geometric mean over T, as a `TUNED_FORWARD`
(`TUNED_BACKWARD`) entry to paste into flash_attn_hopper/config.py with the provenance printed
beside it. Full timings go to --out as JSON.

Usage:
  python -m bench.autotune [--backward] [--head-dims 64,128,256] [--seq-lens 1024,4096]
                           [--dtype float16] [--block-q 64] [--block-kv 64,128,192,256]
                           [--repeats 10]
                           [--out bench/results/autotune.json]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flash_attn_hopper as fah
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import workloads
from bench import timing

BLOCK_Q = (64,)
BLOCK_KV = (64, 128, 192, 256)
NUM_STAGES = (2, 3)
#: The backward's candidates: block_q and block_kv of both kernels (dQ and dK/dV share them,
#: except that dQ also tries 64-row tiles beside a larger block_q: `dq_block_q`).
BACKWARD_BLOCKS = (64, 128)
#: Max abs difference from cuDNN's output a candidate may show (half-precision outputs of O(1)).
CHECK_ATOL = 2e-2


def candidates(head_dim: int, dtype, block_kvs=BLOCK_KV, backward: bool = False,
               block_qs=BLOCK_Q) -> list:
  itemsize = np.dtype(dtype).itemsize
  if backward:  # dQ's ring on 32-key blocks, or one stage deep, only where the shared one
    # does not fit (D 256).
    configs = [[fah.BackwardConfig(block_q=bq, block_kv=bkv, num_stages=n, dq_num_stages=dq,
                                   dq_block_kv=keys, dq_block_q=rows)
                for dq, keys in ((None, None), (None, 32), (1, None))]
               for bq, bkv in itertools.product(BACKWARD_BLOCKS, repeat=2) for n in NUM_STAGES
               for rows in (None, *(r for r in BACKWARD_BLOCKS if r < bq))]
  else:
    configs = [[fah.ForwardConfig(block_q=bq, block_kv=bkv, num_stages=n, overlap_softmax=o)]
               for bq, bkv, n, o in itertools.product(block_qs, block_kvs, NUM_STAGES,
                                                      (False, True))]
  out = []
  for choices in configs:
    for cfg in choices:
      try:
        cfg.check_fits(head_dim, itemsize)
      except ValueError:
        continue
      out.append(cfg)
      break
  return out


def _inputs(w: workloads.Workload):
  """q, k, v and an output cotangent."""
  keys = jax.random.split(jax.random.key(0), 4)
  return tuple(jax.random.normal(kk, s, w.dtype)
               for kk, s in zip(keys, (w.q_shape, w.kv_shape, w.kv_shape, w.q_shape)))


def timed_program(attention, backward: bool = False):
  """The timed function of (q, k, v, dout) for attention(q, k, v): the forward, or fwd+bwd
  (the gradients)."""
  if backward:
    return jax.jit(lambda q, k, v, dout: jax.vjp(attention, q, k, v)[1](dout))
  return jax.jit(lambda q, k, v, dout: attention(q, k, v))


def _program(w, implementation: str, cfg=None, backward: bool = False):
  kw = {} if cfg is None else {"backward_config" if backward else "config": cfg}
  attn = lambda q, k, v: fah.dot_product_attention(q, k, v, is_causal=w.is_causal,
                                                   implementation=implementation, **kw)
  return timed_program(attn, backward)


def max_diff(a, b) -> float:
  """The largest absolute difference between two pytrees of arrays, in float32."""
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _time_candidate(w, cfg, args, expected, repeats, backward=False):
  fn = _program(w, "flash_attn_hopper", cfg, backward)
  # Gradients are larger than outputs: the backward's check scales with them.
  atol = CHECK_ATOL * (max(float(jnp.max(jnp.abs(g))) for g in expected) if backward else 1)
  try:
    err = max_diff(fn(*args), expected)
    if not err <= atol:
      return None, f"wrong output (max diff {err:.3g} from cuDNN)"
    ms = timing.median(timing.measure_ms("cupti", fn, args, repeats))
  except Exception as e:  # A candidate that fails to compile loses; the sweep goes on.
    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  flops = w.forward_flops() * (3.5 if backward else 1.0)
  return flops / (ms * 1e-3) / 1e12, None


def tune(head_dim: int, is_causal: bool, seq_lens, dtype, repeats: int, block_kvs,
         backward: bool = False, block_qs=BLOCK_Q) -> dict:
  grid = [w for w in workloads.hidden_2048_grid(seq_lens=seq_lens, head_dims=(head_dim,),
                                                causal=(is_causal,), dtypes=(dtype,))]
  cands = candidates(head_dim, dtype, block_kvs, backward, block_qs)
  table = {str(c): {} for c in cands}
  for w in grid:
    args = _inputs(w)
    expected = _program(w, "cudnn", backward=backward)(*args)
    for c in cands:
      tflops, error = _time_candidate(w, c, args, expected, repeats, backward)
      table[str(c)][w.seq_q] = tflops if error is None else error
      print(f"D{head_dim} causal={is_causal} T={w.seq_q} {c}: "
            f"{error or f'{tflops:.1f} TFLOP/s'}", flush=True)
  scores = {}
  for c in cands:
    vals = list(table[str(c)].values())
    if all(isinstance(v, float) for v in vals):
      scores[c] = math.exp(sum(math.log(v) for v in vals) / len(vals))
  best = max(scores, key=scores.get) if scores else None
  return {"head_dim": head_dim, "is_causal": is_causal, "best": str(best),
          "best_config": best, "geomean_tflops": scores.get(best), "table": table}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--backward", action="store_true",
                 help="tune BackwardConfig (timing fwd+bwd) instead of ForwardConfig")
  p.add_argument("--head-dims", default=None,
                 help="default 64,128,256 (forward) or 64,128 (the backward kernels' dims)")
  p.add_argument("--seq-lens", default="1024,4096")
  p.add_argument("--causal", default="both", choices=("both", "yes", "no"))
  p.add_argument("--dtype", default="float16", choices=config_lib.SUPPORTED_DTYPES)
  p.add_argument("--block-q", default=",".join(map(str, BLOCK_Q)),
                 help="the forward's query rows per compute warpgroup (default 64)")
  p.add_argument("--block-kv", default=",".join(map(str, BLOCK_KV)))
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--out", default="bench/results/autotune.json")
  args = p.parse_args(argv)
  head_dims = [int(x) for x in (args.head_dims or
                                ("64,128" if args.backward else "64,128,256")).split(",")]
  seq_lens = tuple(int(x) for x in args.seq_lens.split(","))
  causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  block_kvs = tuple(int(x) for x in args.block_kv.split(","))
  block_qs = tuple(int(x) for x in args.block_q.split(","))
  results = [tune(d, c, seq_lens, args.dtype, args.repeats, block_kvs, args.backward, block_qs)
             for d in head_dims for c in causal]
  provenance = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "date": datetime.date.today().isoformat(),
                "command": "python -m bench.autotune " + " ".join(argv or sys.argv[1:])}
  table = "TUNED_BACKWARD" if args.backward else "TUNED_FORWARD"
  print(f"# {table}: tuned on {provenance['device']}, jax {provenance['jax']}, "
        f"{provenance['date']}: {provenance['command']}")
  for r in results:
    cfg = r["best_config"]
    print(f"    ({r['head_dim']}, {r['is_causal']}): {cfg!r},  "
          f"# geomean {r['geomean_tflops'] or float('nan'):.1f} TFLOP/s"
          f"{' fwd+bwd' if args.backward else ''}")
  for r in results:
    r.pop("best_config")
  with open(args.out, "w") as f:
    json.dump({"provenance": provenance, "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
