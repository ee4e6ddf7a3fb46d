"""`python -m flash_attn_hopper`: the quick start's main job.

On a Hopper GPU it runs the short benchmark (`python -m bench --quick`, from the repository
root). Elsewhere it runs the real forward kernel on small shapes through the Mosaic GPU
interpreter and compares each with the float32 reference, printing one line per shape.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from flash_attn_hopper import api
from flash_attn_hopper import hardware
from flash_attn_hopper import testing
from flash_attn_hopper import workloads


def _interpret_check() -> int:
  rng = np.random.default_rng(0)
  print("No Hopper GPU: running the forward kernel through the Mosaic GPU interpreter.")
  failures = 0
  for w in workloads.INTERPRET_SHAPES:
    for is_causal in (False, True):
      q, k, v = testing.random_qkv(rng, w, "bfloat16")
      start = time.perf_counter()
      out, lse = api.dot_product_attention(q, k, v, is_causal=is_causal, interpret=True,
                                           return_residual=True)
      seconds = time.perf_counter() - start
      try:
        testing.check_attention(out, q, k, v, actual_lse=lse, is_causal=is_causal)
        verdict = "ok"
      except AssertionError as e:
        verdict, failures = f"FAIL: {e}", failures + 1
      print(f"  {w.name:22s} causal={is_causal!s:5s} bf16  {seconds:6.1f} s  {verdict}")
  print("all shapes match the reference" if not failures else f"{failures} shapes failed")
  return 1 if failures else 0


def main(argv=None) -> int:
  if not hardware.on_hopper():
    return _interpret_check()
  try:
    from bench import cli  # The benchmark lives beside the package, in the repository.
  except ImportError:
    print("Hopper GPU found, but the benchmark is not importable: run from the repository "
          "root (bash scripts/main.sh does).", file=sys.stderr)
    return 1
  return cli.main(["--quick", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
  sys.exit(main())
