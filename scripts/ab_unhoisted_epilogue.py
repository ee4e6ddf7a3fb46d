"""A/B on a Hopper GPU: the epilogue's addresses hoisted by LLVM out of a persistent CTA's
tile loop, or computed after the step loop (`kernels.common.unhoisted`), interleaved with
cuDNN on the same inputs, CUPTI device time:
  PYTHONPATH=.:scripts python3 scripts/ab_unhoisted_epilogue.py fwd|fwdbwd [head dims] [seq lens]
      [dtype] [full|causal|both] [sides]
e.g. `fwdbwd 128 1024,4096 bfloat16 full hoisted,unhoisted,unhoisted_wide`. B·T = 16k
tokens, hidden 2048. A side sets the switches before it compiles: `hoisted` turns both off
(`dkv.UNHOISTED_EPILOGUE`, `forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM`), `unhoisted` turns both
on for every head dim, `unhoisted_wide` also gives the D 128 non-causal dK/dV kernel
persistent CTAs at every length (`config.PERSISTENT_BACKWARD_MAX_STEPS`). Prints each side's
best of rounds of 10-run medians (ms; dQ and dK/dV alone for fwdbwd), its ratio to cuDNN,
and whether the sides' outputs are bitwise equal."""
import contextlib, sys
from flash_attn_hopper import config as config_lib
from flash_attn_hopper.kernels import dkv, forward
import ab_switches

TUNED = config_lib.PERSISTENT_BACKWARD_MAX_STEPS
MIN_HEAD_DIM = forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM


@contextlib.contextmanager
def _switched(side: str):
  unhoisted = side.startswith("unhoisted")
  dkv.UNHOISTED_EPILOGUE = unhoisted
  forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM = 0 if unhoisted else 1 << 30
  config_lib.PERSISTENT_BACKWARD_MAX_STEPS = (
      {**TUNED, ("dkv", 128, False): 1 << 30} if side == "unhoisted_wide" else TUNED)
  try:
    yield
  finally:
    dkv.UNHOISTED_EPILOGUE = True
    forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM = MIN_HEAD_DIM
    config_lib.PERSISTENT_BACKWARD_MAX_STEPS = TUNED


if __name__ == "__main__":
  ab_switches.main(sys.argv, default_sides="hoisted,unhoisted", switch=_switched)
