"""A/B on a Hopper GPU: the forward under several `ForwardConfig`s (with --backward, fwd+bwd
under several `BackwardConfig`s), and cuDNN, on the race grid's cells (B·T = 16k tokens,
hidden 2048), interleaved over rounds, CUPTI device time:
  PYTHONPATH=.:scripts python3 scripts/ab_configs.py --head-dim 64 --seq-lens 1024,4096 \
      --causal both --configs tuned 128,64,2 128,64,2,o [--dtype float16] [--rounds 3]
  PYTHONPATH=.:scripts python3 scripts/ab_configs.py --backward --configs tuned 64,64,3 128,64,2
A config is `tuned` (what the op resolves to) or BLOCK_Q,BLOCK_KV,STAGES, with `,o` for the
forward's overlap_softmax, or a fourth number for the backward's dq_num_stages (and a fifth for
its dq_block_kv: `64,64,2,2,32`, a sixth for its dq_block_q, `-` for a None: `128,64,2,-,-,64`),
or `,f` for its fused_dq (the five-matmul backward; `fused` alone is the op's
`deterministic=False`). A config ending in `,b` (before any `,x`) turns on its balanced_tail
(`tuned,b`: the tuned config with it; not `fused`, which runs one CTA per tile). A forward
config (`tuned` too) ending in `,x` is sized against a tight shared-memory budget
(`TIGHT_RESERVE_BYTES`). Each config's output (gradients) is checked against cuDNN's before it
is timed; the line per cell gives each config's best-of-rounds median time, TFLOP/s and ratio
to cuDNN (with --backward, also the dQ and dK/dV kernels' ms in that round)."""
import argparse
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import flash_attn_hopper as fah
from bench.autotune import CHECK_ATOL, max_diff, timed_program
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import hardware
from ab_common import timings

TOKENS, HIDDEN = 16384, 2048

#: `,x`: the forward is sized against all but this much of the 227 KiB, not the config's
#: 8 KiB reserve. Lowered for CUDA (no reduction scratch, `kernels/common.py`), the forward
#: takes 616 bytes past its tiles at D 128 (its barriers and the LSE tiles' 1 KiB alignment),
#: so 1 KiB admits (64, 128, 3) at D 128 and O's own tiles beside (64, 256, 3) at D 64.
TIGHT_RESERVE_BYTES = 1024


@contextlib.contextmanager
def smem_budget(tight: bool):
  """The config module's shared-memory budget, tight (`,x`) or as it stands, while a config
  is resolved and traced."""
  saved = config_lib.SMEM_BUDGET
  if tight:
    config_lib.SMEM_BUDGET = hardware.SMEM_BYTES_PER_CTA - TIGHT_RESERVE_BYTES
  try:
    yield
  finally:
    config_lib.SMEM_BUDGET = saved


def suffixes(name: str, backward: bool) -> tuple[str, bool, bool]:
  """A config's name without its `,x` (forward only) and `,b` endings, and whether each was
  there."""
  tight = not backward and name.endswith(",x")
  name = name.removesuffix(",x") if tight else name
  balanced = name.endswith(",b")
  name = name.removesuffix(",b")
  if balanced and name == "fused":
    raise SystemExit("fused,b: the five-matmul backward runs one CTA per tile, so it has no "
                     "tail to balance; drop the ',b'")
  return name, tight, balanced


def parse_config(text: str, backward: bool):
  if text in ("tuned", "fused"):
    return None
  parts = text.split(",")
  bq, bkv, stages = (int(x) for x in parts[:3])
  if backward:
    fused = parts[-1] == "f"
    parts = parts[:-1] if fused else parts
    optional = [None if x == "-" else int(x) for x in parts[3:]] + [None] * 3
    return fah.BackwardConfig(block_q=bq, block_kv=bkv, num_stages=stages,
                              dq_num_stages=optional[0], dq_block_kv=optional[1],
                              dq_block_q=optional[2], fused_dq=fused)
  return fah.ForwardConfig(block_q=bq, block_kv=bkv, num_stages=stages,
                           overlap_softmax="o" in parts[3:])


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--seq-lens", default="1024,4096,16384")
  p.add_argument("--causal", default="both", choices=("both", "yes", "no"))
  p.add_argument("--dtype", default="float16")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--configs", nargs="+", default=["tuned"])
  p.add_argument("--backward", action="store_true", help="time fwd+bwd under BackwardConfigs")
  a = p.parse_args()
  d, dtype = a.head_dim, jnp.dtype(a.dtype)
  rng = np.random.default_rng(0)
  for t in (int(x) for x in a.seq_lens.split(",")):
    b, h = TOKENS // t, HIDDEN // d
    q, k, v, dout = (jnp.asarray(rng.standard_normal((b, t, h, d)), dtype) for _ in range(4))
    args = (q, k, v, dout)
    for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]:
      cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                implementation="cudnn")
      fns = {"cudnn": timed_program(cudnn, a.backward)}
      for name in a.configs:
        base, tight, balanced = suffixes(name, a.backward)
        cfg = parse_config(base, a.backward)
        with smem_budget(tight):
          if a.backward:
            if balanced:
              cfg = dataclasses.replace(
                  cfg or config_lib.resolve_backward_config(d, dtype, causal, seq_len=t),
                  balanced_tail=True)
            kw = {"backward_config": cfg, "deterministic": base != "fused"}
          else:
            cfg = config_lib.resolve_forward_config(d, dtype, causal, cfg, seq_len=t)
            if balanced:
              cfg = dataclasses.replace(cfg, balanced_tail=True)
            kw = {"config": cfg}
          ours = functools.partial(fah.dot_product_attention, is_causal=causal, **kw)
          fns[name] = timed_program(ours, a.backward)
          fns[name](*args)  # Traced (and compiled) under the budget.
      expected = fns["cudnn"](*args)
      scale = max(float(jnp.max(jnp.abs(g))) for g in expected) if a.backward else 1.0
      errors = {n: max_diff(f(*args), expected) / scale for n, f in fns.items()}
      kernels = ("dq", "dkv") if a.backward else ()
      times = {n: [] for n in fns if errors[n] <= CHECK_ATOL}
      for _ in range(a.rounds):
        for n in times:
          times[n].append(timings(fns[n], *args, kernels=kernels))
      flops = 4 * b * h * t * t * d / (2 if causal else 1) * (3.5 if a.backward else 1)
      base = min(times["cudnn"])[0]
      cells = []
      for n in fns:
        if n not in times:
          cells.append(f"{n}: WRONG (max diff {errors[n]:.2e})")
          continue
        best, parts = min(times[n], key=lambda r: r[0])
        split = "".join(f" {k} {ms:.3f}" for k, ms in parts.items()) if n != "cudnn" else ""
        cells.append(f"{n}: {best:.3f} ms{split} {flops / best / 1e9:.0f} ({base / best:.3f}x)")
      kind = "fwd+bwd" if a.backward else "fwd"
      print(f"{kind} D {d} T {t} causal {causal}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
  main()
