"""`scripts/ptxas_report.py`'s parsing of `ptxas -v` and its capture of C-level stdout (the
script itself needs a GPU: Mosaic GPU runs ptxas when compiling)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parent.parent / "scripts" / "ptxas_report.py"
_spec = importlib.util.spec_from_file_location("ptxas_report", _PATH)
ptxas_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ptxas_report)

# Shaped like Mosaic GPU's output on the H200 (2026-12-02): the forward compiled twice (alone
# and in fwd+bwd), dK/dV with a spill warning before its properties.
SAMPLE = """\
ptxas info    : (C7519) warpgroup.arrive is injected in around line 600 by compiler
ptxas info    : Compiling entry function 'flash_attn_hopper_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_attn_hopper_fwd_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas info    : Compiling entry function 'flash_attn_hopper_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_attn_hopper_fwd_mosaic_gpu_kernel
    96 bytes stack frame, 96 bytes spill stores, 124 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas warning : Registers are spilled to local memory in function 'flash_attn_hopper_dkv_mosaic_gpu_kernel', 48 bytes spill stores, 84 bytes spill loads
ptxas info    : Compiling entry function 'flash_attn_hopper_dkv_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_attn_hopper_dkv_mosaic_gpu_kernel
    56 bytes stack frame, 48 bytes spill stores, 84 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 56 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compiling entry function 'flash_attn_hopper_dq_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_attn_hopper_dq_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 160 registers, used 16 barriers, 1 bytes smem
"""


def test_parse_gives_each_kernel_its_registers_and_largest_spill():
  assert ptxas_report.parse(SAMPLE) == {
      "fwd": (168, 96, 124), "dkv": (168, 48, 84), "dq": (160, 0, 0)}


def test_parse_ignores_the_spill_warning_outside_a_kernel_block():
  warning_only = SAMPLE.splitlines()[9]
  assert "Registers are spilled" in warning_only
  assert ptxas_report.parse(warning_only) == {}


def test_captured_fd1_holds_what_c_code_prints():
  libc = ctypes.CDLL(None)
  with ptxas_report.captured_fd1() as text:
    libc.printf(b"from C: Used 7 registers\n")
    libc.fflush(None)
    os.write(1, b"from fd 1\n")
  assert "from C: Used 7 registers" in text[0] and "from fd 1" in text[0]


def test_sides_set_the_constants_they_name_and_restore_the_rest(monkeypatch):
  from flash_attn_hopper import config as config_lib
  from flash_attn_hopper import pipeline
  monkeypatch.setattr(pipeline, "PRODUCER_REGISTERS", pipeline.PRODUCER_REGISTERS)
  monkeypatch.setattr(pipeline, "COMPUTE_REGISTERS", pipeline.COMPUTE_REGISTERS)
  monkeypatch.setattr(config_lib, "PERSISTENT_BACKWARD_MAX_STEPS",
                      config_lib.PERSISTENT_BACKWARD_MAX_STEPS)
  originals = ((pipeline.PRODUCER_REGISTERS, pipeline.COMPUTE_REGISTERS),
               config_lib.PERSISTENT_BACKWARD_MAX_STEPS)
  ptxas_report._apply("regs:40/232", [128], originals)
  assert (pipeline.PRODUCER_REGISTERS, pipeline.COMPUTE_REGISTERS) == (40, 232)
  ptxas_report._apply("sched:per_tile", [128], originals)
  assert (pipeline.PRODUCER_REGISTERS, pipeline.COMPUTE_REGISTERS) == originals[0]
  assert config_lib.PERSISTENT_BACKWARD_MAX_STEPS == {}
  ptxas_report._apply("sched:persistent", [128], originals)
  assert config_lib.PERSISTENT_BACKWARD_MAX_STEPS[("dq", 128, False)] == 1 << 30
  ptxas_report._apply("sched:tuned", [128], originals)
  assert config_lib.PERSISTENT_BACKWARD_MAX_STEPS is originals[1]
  with pytest.raises(ValueError, match="unknown side"):
    ptxas_report._apply("regs", [128], originals)
