"""`scripts/sass_dump.py`'s reading of ptxas notes and SASS listings (the dump itself needs a
GPU: Mosaic GPU runs ptxas when compiling)."""

from __future__ import annotations

import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).parent.parent / "scripts" / "sass_dump.py"
_spec = importlib.util.spec_from_file_location("sass_dump", _PATH)
sass_dump = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_dump)
_spec = importlib.util.spec_from_file_location("ab_common", _PATH.with_name("ab_common.py"))
ab_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_common)

# Cut from nvdisasm's listing of the D 64 dK/dV kernel on the H200 (2026-12-04): Sᵀ and dPᵀ
# issued, the wait for Sᵀ, exponentials, the wait for dPᵀ, more exponentials, a barrier.
SASS = """\
        /*1910*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR28], R88, gsb0 ;
        /*1920*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR44], RZ, !UPT ;
        /*1950*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR40], R24, gsb0 ;
        /*1960*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*1970*/                   FFMA R3, R88, UR4, -R5 ;
        /*1980*/                   MUFU.EX2 R88, R3 ;
        /*1990*/                   MUFU.EX2 R89, R4 ;
        /*2280*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*2290*/                   MUFU.EX2 R90, R6 ;
        /*3640*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR19+0x10], RZ ;
        /*3670*/               @P0 BRA `(.L_x_8) ;
"""


def test_summarize_counts_the_exponentials_between_the_waits():
  lines = sass_dump.summarize(SASS).splitlines()
  assert lines[3] == "/*1960*/ WARPGROUP.DEPBAR.LE gsb0, 0x1"
  assert lines[4:7] == ["    ... 2 MUFU.EX2", "/*2280*/ WARPGROUP.DEPBAR.LE gsb0, 0x0",
                        "    ... 1 MUFU.EX2"]
  assert lines[-2] == "/*3670*/ @P0 BRA `(.L_x_8)"
  assert lines[-1] == "counts: {'HGMMA': 3, 'WARPGROUP': 2, 'SYNCS': 1, 'BRA': 1}"


def test_notes_keep_what_the_summary_lines_do_not_say():
  spec = importlib.util.spec_from_file_location("test_ptxas_report",
                                                pathlib.Path(__file__).with_name(
                                                    "test_ptxas_report.py"))
  ptxas_tests = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ptxas_tests)
  lines = ptxas_tests.SAMPLE.splitlines()  # ptxas -v on the H200: three kernels, one spill
  assert sass_dump.notes(ptxas_tests.SAMPLE) == [lines[0], lines[9]]
  assert "(C7519)" in lines[0] and "Registers are spilled" in lines[9]


def test_grid_args_fill_in_defaults_and_pass_on_the_rest():
  dims, seqs, dtype, causal, rest = ab_common.grid_args(["x", "DIR", "64,128"], 2, "256",
                                                        "4096", "full")
  assert (dims, seqs, str(dtype), causal, rest) == ([64, 128], [4096], "bfloat16", (False,), [])
  *_, dtype, causal, rest = ab_common.grid_args(
      ["x", "fwd", "64", "1024", "float16", "both", "base,a=1"], 2)
  assert (str(dtype), causal, rest) == ("float16", (False, True), ["base,a=1"])
