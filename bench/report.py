"""Turns cell results into the table, the ratios, the summary, and the JSON/markdown files.

Ratios are ours / peer in TFLOP/s (above 1: ours is faster), only where both cells are "ok".
"Best peer" is the fastest ok peer of a cell other than ours. The summary takes, per pass and
dtype, the geometric mean of the ratio over cells and the worst (minimum) cell.
"""

from __future__ import annotations

import collections
import json
import math

from bench.peers import OURS
from bench.runner import CellResult

SHORT_STATUS = {"FAIL": "FAIL", "n/a": "n/a", "skip": "skip", "error": "err"}


def _key(r: CellResult) -> tuple[str, str]:
  return (r.workload.name, r.pass_name)


def by_cell(results: list[CellResult]) -> dict[tuple[str, str], dict[str, CellResult]]:
  """{(workload name, pass): {peer: result}}, in run order."""
  cells = {}
  for r in results:
    cells.setdefault(_key(r), {})[r.peer] = r
  return cells


def _ok_tflops(r: CellResult | None) -> float | None:
  return r.tflops if r is not None and r.status == "ok" else None


def cell_ratios(row: dict[str, CellResult]) -> dict:
  """Ours vs cuDNN and vs the best peer for one (workload, pass)."""
  ours = _ok_tflops(row.get(OURS))
  peers = {p: _ok_tflops(r) for p, r in row.items() if p != OURS and _ok_tflops(r)}
  best = max(peers, key=peers.get) if peers else None
  cudnn = peers.get("cudnn")
  return {"ours": ours, "cudnn": cudnn, "best_peer": best,
          "best": peers[best] if best else None,
          "vs_cudnn": ours / cudnn if ours and cudnn else None,
          "vs_best": ours / peers[best] if ours and best else None}


def _geomean(values: list[float]) -> float:
  return math.exp(sum(math.log(v) for v in values) / len(values))


def _stat(rows: list[dict], field: str) -> dict:
  pairs = [(r[field], r["workload"]) for r in rows if r[field]]
  if not pairs:
    return {"n": 0, "geomean": None, "min": None, "min_cell": None}
  low, cell = min(pairs)
  return {"n": len(pairs), "geomean": _geomean([v for v, _ in pairs]), "min": low,
          "min_cell": cell}


def summary(results: list[CellResult]) -> list[dict]:
  """Per (pass, dtype): geomean and minimum of ours/cuDNN and of ours/best peer."""
  groups = collections.defaultdict(list)
  for (name, pass_name), row in by_cell(results).items():
    dtype = next(iter(row.values())).workload.dtype
    groups[(pass_name, dtype)].append({"workload": name, **cell_ratios(row)})
  return [{"pass": p, "dtype": d, "vs_cudnn": _stat(rows, "vs_cudnn"),
           "vs_best": _stat(rows, "vs_best")} for (p, d), rows in groups.items()]


def _number(x: float) -> str:
  """TFLOP/s: one decimal on a GPU's scale, three significant digits below 10 (CPU runs)."""
  return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _cell_text(r: CellResult | None) -> str:
  if r is None:
    return "-"
  return _number(r.tflops) if r.status == "ok" else SHORT_STATUS[r.status]


def _ratio_text(x: float | None) -> str:
  if not x:
    return "-"
  return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def table_rows(results: list[CellResult], peer_names: list[str]) -> tuple[list[str], list[list]]:
  """The header and rows of the TFLOP/s table."""
  header = ["workload", "pass", *peer_names, "ours/cudnn", "ours/best"]
  rows = []
  for (name, pass_name), row in by_cell(results).items():
    ratios = cell_ratios(row)
    best = f"{_ratio_text(ratios['vs_best'])} ({ratios['best_peer']})" if ratios["vs_best"] \
        else "-"
    rows.append([name, pass_name, *(_cell_text(row.get(p)) for p in peer_names),
                 _ratio_text(ratios["vs_cudnn"]), best])
  return header, rows


def format_text_table(header: list[str], rows: list[list]) -> str:
  """A fixed-width table: first column left-aligned, the rest right-aligned."""
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  def line(cells):
    return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                     for i, (c, w) in enumerate(zip(cells, widths)))
  return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_markdown_table(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
  return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def summary_rows(stats: list[dict]) -> tuple[list[str], list[list]]:
  header = ["pass", "dtype", "cells", "geomean ours/cudnn", "min ours/cudnn (cell)",
            "geomean ours/best", "min ours/best (cell)"]
  rows = [[s["pass"], s["dtype"], s["vs_cudnn"]["n"], _ratio_text(s["vs_cudnn"]["geomean"]),
           f"{_ratio_text(s['vs_cudnn']['min'])} ({s['vs_cudnn']['min_cell'] or '-'})",
           _ratio_text(s["vs_best"]["geomean"]),
           f"{_ratio_text(s['vs_best']['min'])} ({s['vs_best']['min_cell'] or '-'})"]
          for s in stats]
  return header, rows


def notes(results: list[CellResult]) -> list[str]:
  """One line per FAIL cell, then the other non-ok reasons grouped with their cell counts."""
  lines = [f"FAIL  {r.peer} {r.pass_name} {r.workload.name}: {r.note}"
           for r in results if r.status == "FAIL"]
  grouped = collections.Counter((r.peer, r.status, r.note) for r in results
                                if r.status in ("skip", "n/a", "error"))
  for (peer, status, note), n in grouped.items():
    lines.append(f"{status:5} {peer} ({n} cell{'s' * (n > 1)}): {note.splitlines()[0][:300]}")
  return lines


def to_json(meta: dict, results: list[CellResult], stats: list[dict]) -> str:
  """All raw numbers, the run's metadata, per-cell ratios and the summary."""
  ratios = [{"workload": n, "pass": p, **cell_ratios(row)}
            for (n, p), row in by_cell(results).items()]
  doc = {"meta": meta, "cells": [r.to_json() for r in results], "ratios": ratios,
         "summary": stats}
  return json.dumps(doc, indent=1, default=str)


def _resumed_line(meta: dict) -> list[str]:
  earlier = meta.get("resumed_from")
  if not earlier:
    return []
  return [f"- resumed: {earlier['cells_kept']} cells from the run of {earlier['date']} "
          f"(`{earlier['command']}`); each row's cells come from one run"]


def to_markdown(meta: dict, results: list[CellResult], stats: list[dict],
                peer_names: list[str]) -> str:
  """The report as markdown: metadata, TFLOP/s table, summary, notes."""
  head = [f"# Attention benchmark: {meta.get('tag', '')}", "",
          f"- device: {meta.get('device')} ({meta.get('platform')}), jax {meta.get('jax')}",
          f"- date: {meta.get('date')}, timer: {meta.get('timer')}, "
          f"repeats: {meta.get('repeats')} (median)",
          f"- command: `{meta.get('command')}`", *_resumed_line(meta), "",
          "TFLOP/s (FlashAttention FLOP convention); FAIL = numerics check failed.", ""]
  body = [format_markdown_table(*table_rows(results, peer_names)), "", "## Summary", "",
          format_markdown_table(*summary_rows(stats)), "", "## Notes", ""]
  return "\n".join(head + body + [f"- {line}" for line in notes(results)]) + "\n"
