"""The example notebooks execute on the CPU (their kernels through the interpreter), and the
committed .ipynb files are the ones `examples/notebooks.py` builds."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
notebooks = pytest.importorskip("notebooks")  # examples/notebooks.py

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("name", list(notebooks.NOTEBOOKS))
def test_notebook_executes(name):
  nb = notebooks.execute(notebooks.build(name, notebooks.NOTEBOOKS[name]))
  errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors, errors


@pytest.mark.parametrize("name", list(notebooks.NOTEBOOKS))
def test_committed_notebook_has_the_built_cells_and_outputs(name):
  committed = json.loads((ROOT / "examples" / f"{name}.ipynb").read_text())
  built = notebooks.build(name, notebooks.NOTEBOOKS[name])
  sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
             for c in committed["cells"]]
  assert sources == [c.source for c in built.cells], "re-run `python examples/notebooks.py`"
  assert any(c.get("outputs") for c in committed["cells"]), "committed without outputs"
