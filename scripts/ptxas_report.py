"""ptxas's registers and spills for every kernel of fwd+bwd cells, per side, on a Hopper GPU:
  PYTHONPATH=. python3 scripts/ptxas_report.py [dims] [seqs] [dtype] [sides]
e.g. `128,256 4096 bfloat16 regs:40/232,regs:24/240` or `64 4096 bfloat16
sched:per_tile,sched:persistent`. A side is `regs:P/C` (`pipeline.PRODUCER_REGISTERS` /
`COMPUTE_REGISTERS`) or `sched:per_tile|tuned|persistent` (`config.PERSISTENT_BACKWARD_MAX_STEPS`
empty, as it is, or every backward tile persistent), optionally followed by `+` and module
assignments as `scripts/ab_switches.py` takes them
(`sched:persistent+kernels.dkv.SHARED_STEP_BARRIERS=False`). B·T = 16k tokens, hidden 2048, causal
and not; each side is compiled in this process (caches cleared between sides).

With MOSAIC_GPU_DUMP_PTXAS set, Mosaic GPU prints `ptxas -v` on the process's stdout from C++;
this script captures file descriptor 1 around each compile and prints one line per kernel:
registers, spill stores / loads in bytes, per side. (`scripts/ab_registers.py` times sides;
this only compiles.)"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import tempfile

_PROPERTIES = re.compile(r"Function properties for (\S+)")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def short_name(function: str) -> str:
  """`flash_attn_hopper_dq_mosaic_gpu_kernel` → `dq`."""
  return function.removeprefix("flash_attn_hopper_").removesuffix("_mosaic_gpu_kernel")


def parse(text: str) -> dict[str, tuple[int, int, int]]:
  """{kernel: (registers, spill stores, spill loads)} from `ptxas -v` output; a kernel seen
  more than once keeps its largest spill (the forward alone and inside fwd+bwd)."""
  out, current = {}, None
  for line in text.splitlines():
    if m := _PROPERTIES.search(line):
      current = short_name(m.group(1))
      out.setdefault(current, (0, 0, 0))
    elif current and (m := _SPILLS.search(line)) and "stack frame" in line:
      regs, stores, loads = out[current]
      out[current] = (regs, max(stores, int(m.group(1))), max(loads, int(m.group(2))))
    elif current and (m := _REGISTERS.search(line)):
      out[current] = (int(m.group(1)), *out[current][1:])
      current = None
  return out


@contextlib.contextmanager
def captured_fd1():
  """Redirects file descriptor 1 (C++'s stdout too) to a temporary file; yields a list that
  holds the captured text on exit."""
  sys.stdout.flush()
  saved, captured = os.dup(1), []
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 1)
    try:
      yield captured
    finally:
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)
      tmp.seek(0)
      captured.append(tmp.read().decode(errors="replace"))


def _apply(side: str, dims, originals):
  """Sets the module constants that `side` names, from their `originals`."""
  from flash_attn_hopper import config as config_lib
  from flash_attn_hopper import pipeline
  regs, steps = originals
  pipeline.PRODUCER_REGISTERS, pipeline.COMPUTE_REGISTERS = regs
  config_lib.PERSISTENT_BACKWARD_MAX_STEPS = steps
  kind, _, value = side.partition(":")
  if kind == "regs" and re.fullmatch(r"\d+/\d+", value):
    pipeline.PRODUCER_REGISTERS, pipeline.COMPUTE_REGISTERS = map(int, value.split("/"))
  elif kind == "sched" and value in ("per_tile", "persistent"):
    config_lib.PERSISTENT_BACKWARD_MAX_STEPS = {} if value == "per_tile" else {
        (k, d, c): 1 << 30 for k in ("dq", "dkv") for d in dims for c in (False, True)}
  elif side != "sched:tuned":
    raise ValueError(f"unknown side {side!r}: regs:P/C or sched:per_tile|tuned|persistent")


def main(argv):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import flash_attn_hopper as fah
  from flash_attn_hopper import config as config_lib
  from flash_attn_hopper import pipeline
  from ab_common import fwd_bwd, race_inputs
  from ab_switches import switched

  dims = [int(x) for x in (argv[1] if len(argv) > 1 else "64,128,256").split(",")]
  seqs = [int(x) for x in (argv[2] if len(argv) > 2 else "4096").split(",")]
  dtype = jnp.dtype(argv[3] if len(argv) > 3 else "bfloat16")
  sides = (argv[4] if len(argv) > 4 else "regs:40/232,regs:24/240").split(",")
  originals = ((pipeline.PRODUCER_REGISTERS, pipeline.COMPUTE_REGISTERS),
               config_lib.PERSISTENT_BACKWARD_MAX_STEPS)
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  rng = np.random.default_rng(0)
  print("cell | kernel | " + " | ".join(f"{s}: regs, spill st/ld" for s in sides))
  for d in dims:
    for t in seqs:
      for causal in (False, True):
        q, k, v, dout = race_inputs(d, t, causal, dtype, rng)
        grads = fwd_bwd(functools.partial(fah.dot_product_attention, is_causal=causal))
        reports = []
        for side in sides:
          parts = side.split("+")
          base = [p for p in parts if "=" not in p] or ["sched:tuned"]
          _apply("+".join(base), dims, originals)
          jax.clear_caches()
          with switched("+".join(p for p in parts if "=" in p) or "base"), \
               captured_fd1() as text:
            grads.lower(q, k, v, dout).compile()
          reports.append(parse(text[0]))
        _apply("sched:tuned", dims, originals)
        cell = f"D {d} T {t} {'causal' if causal else 'full'}"
        for kernel in sorted(set().union(*reports)):
          print(f"{cell} | {kernel} | " + " | ".join(
              "{}, {}/{}".format(*r[kernel]) if kernel in r else "-" for r in reports),
                flush=True)


if __name__ == "__main__":
  main(sys.argv)
