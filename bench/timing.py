"""Device time of a jitted function: CUPTI kernel time on GPU, wall clock elsewhere.

The "cupti" timer uses `jax.experimental.mosaic.gpu.profiler.measure`, which runs the function
once to warm up, then `repeats` times under CUPTI, and returns for each run the summed device
time of the kernels it launched (host overhead and launch gaps excluded). The "wall" timer is
the fallback off GPU (CPU smoke runs): host wall clock around a call and `block_until_ready`.
Both return one time per repeat, in milliseconds; the caller takes the median.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax

TIMERS = ("auto", "cupti", "wall")


def _cupti_times(fn: Callable, args: tuple, repeats: int) -> list[float]:
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  _, times = profiler.measure(fn, iterations=repeats)(*args)
  if times is None:
    raise RuntimeError("CUPTI saw no kernel launched by the timed function")
  return [float(t) for t in (times if isinstance(times, list) else [times])]


def _wall_times(fn: Callable, args: tuple, repeats: int) -> list[float]:
  jax.block_until_ready(fn(*args))  # Warm-up, as measure() does.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return times


def resolve_timer(kind: str) -> str:
  """'auto' becomes 'cupti' when the default device is a GPU and the profiler imports."""
  if kind != "auto":
    return kind
  if jax.default_backend() != "gpu":
    return "wall"
  try:
    # pylint: disable-next=import-outside-toplevel,unused-import
    from jax.experimental.mosaic.gpu import profiler  # noqa: F401
  except ImportError:
    return "wall"
  return "cupti"


def measure_ms(timer: str, fn: Callable, args: tuple, repeats: int) -> list[float]:
  """`repeats` times of `fn(*args)` in ms with the resolved `timer` ("cupti" or "wall")."""
  if timer == "cupti":
    return _cupti_times(fn, args, repeats)
  if timer == "wall":
    return _wall_times(fn, args, repeats)
  raise ValueError(f"unknown timer {timer!r}")


def median(times: list[float]) -> float:
  return statistics.median(times)
