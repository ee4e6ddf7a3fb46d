"""The PTX, SASS and ptxas notes of every kernel in fwd+bwd cells, on a Hopper GPU:
  PYTHONPATH=.:scripts python3 scripts/sass_dump.py DIR [dims] [seqs] [dtype]
      [full|causal|both] [side]
e.g. `$OUT/dump 64,128 4096 bfloat16 full base`; a side is as `scripts/ab_switches.py` takes
it. Each cell is compiled in this process with Mosaic GPU's dumps on (MOSAIC_GPU_DUMP_TO,
one folder per cell: `<kernel>.ptx`, `<kernel>.ptxas` and its MLIR). Then each `.ptx` goes
through ptxas and nvdisasm (`CUDA_BIN`, default /usr/local/cuda-13.0/bin; Mosaic GPU's own
MOSAIC_GPU_DUMP_SASS did not find nvdisasm there) into `<kernel>.sass`, and this prints, per
kernel, ptxas's notes beyond its usual summary (wgmma serialized, arrives injected) and the
counts of `summarize`. Keep DIR out of $OUT or pack it: the MLIR dumps run to megabytes.

`python3 scripts/sass_dump.py --summarize FILE.sass` prints the wgmma issues, their waits,
the mbarrier ops and the branches in program order, with the MUFU.EX2 between them counted:
where ptxas put the exponentials relative to the waits (bench/NOTES.md, twenty-eighth
session)."""
from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import sys

_USUAL = re.compile(r"Compiling entry|Function properties|bytes stack frame|Used \d+ registers"
                    r"|^\s*$|Compile time")
_MARKS = re.compile(r"\b(HGMMA\S*|WARPGROUP\.\S+|BAR\.SYNC\S*|SYNCS\.\S+|BRA)\b")


def notes(ptxas_text: str) -> list[str]:
  """ptxas's lines beyond the per-kernel summary (properties, spills, registers)."""
  return [line for line in ptxas_text.splitlines() if not _USUAL.search(line)]


def summarize(sass: str) -> str:
  """The marks (`_MARKS`) in program order, address first, runs of MUFU.EX2 between them
  folded into one count; then the totals per opcode family."""
  lines, counts, exps = [], {}, 0
  for line in sass.splitlines():
    if "MUFU.EX2" in line:
      exps += 1
    elif m := _MARKS.search(line):
      if exps:
        lines.append(f"    ... {exps} MUFU.EX2")
      counts[m.group(1).split(".")[0]] = counts.get(m.group(1).split(".")[0], 0) + 1
      lines.append(re.sub(r"\s+", " ", line.split(";")[0]).strip())
      exps = 0
  return "\n".join(lines + [f"counts: {counts}"])


def disassemble(ptx: str, cuda_bin: str) -> str:
  """`<kernel>.ptx` → `<kernel>.sass` (ptxas for sm_90a, then nvdisasm); the SASS's path."""
  base = ptx.removesuffix(".ptx")
  subprocess.run([f"{cuda_bin}/ptxas", "-arch=sm_90a", "-O3", ptx, "-o", base + ".cubin"],
                 check=True)
  with open(base + ".sass", "w") as out:
    subprocess.run([f"{cuda_bin}/nvdisasm", "-c", base + ".cubin"], stdout=out, check=True)
  os.remove(base + ".cubin")
  return base + ".sass"


def main(argv):
  if argv[1] == "--summarize":
    with open(argv[2]) as f:
      print(summarize(f.read()))
    return
  import jax
  import numpy as np
  import flash_attn_hopper as fah
  from ab_common import fwd_bwd, grid_args, race_inputs
  from ab_switches import switched

  root = argv[1]
  dims, seqs, dtype, causal_modes, rest = grid_args(argv, 2, "64,128", "4096", "full")
  side = rest[0] if rest else "base"
  cuda_bin = os.environ.get("CUDA_BIN", "/usr/local/cuda-13.0/bin")
  os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")
  rng = np.random.default_rng(0)
  for d in dims:
    for t in seqs:
      for causal in causal_modes:
        cell = os.path.join(root, f"D{d}_T{t}_{'causal' if causal else 'full'}")
        os.makedirs(cell, exist_ok=True)
        os.environ["MOSAIC_GPU_DUMP_TO"] = cell
        q, k, v, dout = race_inputs(d, t, causal, dtype, rng)
        grads = fwd_bwd(functools.partial(fah.dot_product_attention, is_causal=causal))
        jax.clear_caches()
        with switched(side):
          grads.lower(q, k, v, dout).compile()
        for ptx in sorted(glob.glob(os.path.join(cell, "*.ptx"))):
          with open(ptx.removesuffix(".ptx") + ".ptxas") as f:
            kernel_notes = notes(f.read())
          with open(disassemble(ptx, cuda_bin)) as f:
            counts = summarize(f.read()).splitlines()[-1]
          print(f"{os.path.basename(cell)} {os.path.basename(ptx)} ({side}): {counts}",
                *(f"\n    {n[:300]}" for n in kernel_notes), flush=True)


if __name__ == "__main__":
  main(sys.argv)
