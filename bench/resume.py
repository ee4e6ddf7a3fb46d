"""Finishing a run that its time budget cut short (`--resume JSON`).

A device call has ten minutes, and a full grid after the GPU tests may not fit in one. The
JSON of the cut run (rewritten after every cell) lists what ran. `split` keeps each planned
workload that ran every planned pass and peer there, and plans the rest again in full: a row
of the table, ours and each peer on one pass, then always comes from one run, so its ratio is
measured in the same run as the brief asks. A workload cut halfway runs again from the start.
"""

from __future__ import annotations

import dataclasses
import json

from bench.runner import CellResult
from flash_attn_hopper.workloads import Workload

#: The earlier run's metadata that must equal this run's for its cells to count beside them.
MUST_MATCH = ("device", "jax", "timer", "repeats", "checked")


def _cell(record: dict) -> CellResult:
  fields = {f.name for f in dataclasses.fields(CellResult)}
  record = {k: v for k, v in record.items() if k in fields}
  record["workload"] = Workload(**record["workload"])
  record["errors"] = {k: float(v) for k, v in record.get("errors", {}).items()}
  return CellResult(**record)


def load(path: str, meta: dict) -> tuple[list[CellResult], dict]:
  """The cells of an earlier run's JSON and its metadata; raises SystemExit, naming the
  field, when that run's `MUST_MATCH` metadata differs from this run's `meta`."""
  with open(path) as f:
    doc = json.load(f)
  for field in MUST_MATCH:
    if doc["meta"].get(field) != meta.get(field):
      raise SystemExit(f"bench: --resume {path}: its {field} is {doc['meta'].get(field)!r}, "
                       f"this run's is {meta.get(field)!r}; run the grid afresh")
  return [_cell(record) for record in doc["cells"]], doc["meta"]


def split(workloads: list[Workload], passes, peer_names, earlier: list[CellResult]
          ) -> tuple[list[CellResult], list[Workload]]:
  """(the earlier cells to keep, the workloads still to run): a workload is kept when the
  earlier run has every one of its (pass, peer) cells."""
  done: dict[Workload, dict] = {}
  for r in earlier:
    done.setdefault(r.workload, {})[(r.pass_name, r.peer)] = r
  wanted = [(p, peer) for p in passes for peer in peer_names]
  kept, todo = [], []
  for w in workloads:
    cells = done.get(w, {})
    if all(key in cells for key in wanted):
      kept += [cells[key] for key in wanted]
    else:
      todo.append(w)
  return kept, todo
