"""Shared test helpers: a per-test random generator, the Hopper check and the `gpu` marker's skip.

float64 is not enabled globally; a test that needs it wraps its code in `jax.enable_x64(True)`.
"""

from __future__ import annotations

import functools
import hashlib
import os

import hypothesis
import numpy as np
import pytest

# JAX compiles on an example's first shape, so per-example deadlines only make tests flaky.
# CI derandomizes hypothesis so that a red build reproduces.
hypothesis.settings.register_profile("dev", deadline=None)
hypothesis.settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "dev")

# The Mosaic GPU interpreter runs each warpgroup as an XLA computation whose callbacks block on
# the kernel's barriers, on the threads of XLA's CPU client (one per core by default). D 256's
# split dK/dV kernel often has two of its three warpgroups blocked at once, so on a 2-core
# machine the third found no thread and the run deadlocked. XLA reads this when JAX first
# starts a backend, which is after this file is loaded.
INTERPRETER_THREADS = 8
os.environ.setdefault("PJRT_NPROC", str(INTERPRETER_THREADS))

# On the GPU, XLA autotunes each float32 reference and naive matmul fusion by compiling and
# timing its candidates: more than half of a GPU test's time (63 s against 27 s without, one
# masks test on the H200, 2026-11-30). The tests time nothing of XLA's, and the reference stays
# float32 whichever algorithm XLA picks, so they take its default. (The benchmark autotunes.)
NO_AUTOTUNE = "--xla_gpu_autotune_level=0"
if NO_AUTOTUNE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_AUTOTUNE}".strip()

@functools.cache
def hopper_status() -> tuple[bool, str]:
  """(whether the default JAX device is an sm90 GPU, a description of what was found)."""
  try:
    import jax
    devices = jax.devices()
  except Exception as e:  # A broken or absent GPU backend means "not Hopper", not a crash.
    return False, f"no usable JAX backend ({type(e).__name__}: {e})"
  from flash_attn_hopper import hardware
  device = devices[0]
  found = f"{len(devices)} x {device.platform} {device.device_kind!r}"
  capability = getattr(device, "compute_capability", None)  # "9.0" on CUDA devices.
  if capability is not None:
    found += f", compute capability {capability}"
  return hardware.on_hopper(), found


def on_hopper() -> bool:
  """Whether the default JAX device is an sm90 (Hopper) GPU."""
  return hopper_status()[0]


# The GPU tests come in two tiers. Each test compiles its own kernels (10-110 s on the GPU
# machine's CPUs, eight at a time), and a session has 30 device minutes, so the default tier
# is the one run after every kernel change (61 tests, ~210 s, with the forward grid in one
# 10-minute device call): every head dim, dtype, causality, awkward length, head layout and
# mask feature at least once. The `full` tier adds the rest of the cross product;
# FAH_GPU_FULL=1 (or --full) selects it too.
FULL_ENV = "FAH_GPU_FULL"


def pytest_addoption(parser):
  parser.addoption("--full", action="store_true", help="also run the tests marked `full`")


def _deselect_full(config, items):
  if config.getoption("--full") or os.environ.get(FULL_ENV, "") not in ("", "0"):
    return
  kept = [item for item in items if not item.get_closest_marker("full")]
  if len(kept) != len(items):
    config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("full")])
    items[:] = kept


def pytest_collection_modifyitems(config, items):
  _deselect_full(config, items)
  gpu_items = [item for item in items if item.get_closest_marker("gpu")]
  if not gpu_items:
    return
  is_hopper, found = hopper_status()
  if is_hopper:
    return
  skip = pytest.mark.skip(reason=f"needs an sm90 (Hopper) GPU; found: {found}")
  for item in gpu_items:
    item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
  """A numpy Generator seeded from the test's node id: the same every run, distinct per test."""
  digest = hashlib.sha256(request.node.nodeid.encode()).digest()
  return np.random.default_rng(int.from_bytes(digest[:8], "little"))


@pytest.fixture
def backward_schedules(monkeypatch) -> list:
  """The (kernel, `scheduler.TileScheduler`) that each backward kernel traced in this test
  took from `kernels.common.backward_schedule`, in order ("dq" before "dkv")."""
  from flash_attn_hopper.kernels import common
  taken, original = [], common.backward_schedule

  def spy(kernel, *args, **kwargs):
    taken.append((kernel, original(kernel, *args, **kwargs)))
    return taken[-1][1]
  monkeypatch.setattr(common, "backward_schedule", spy)
  return taken
