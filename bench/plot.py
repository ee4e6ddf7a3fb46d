"""The PNG: TFLOP/s against T, one panel per (pass, causal) row and head dim column.

Only the T sweep (grid workloads) is plotted; model shapes are in the tables. Each peer has a
colour, each dtype a line style; ours is drawn thicker. matplotlib is imported here only, when
the PNG is written, so the benchmark runs without it.
"""

from __future__ import annotations

import collections
import math

from bench.grid import is_grid
from bench.peers import OURS
from bench.runner import CellResult

_STYLES = ("-", "--", ":", "-.")


def _series(results: list[CellResult]) -> dict:
  """{(pass, causal): {head_dim: {(peer, dtype): [(T, TFLOP/s), ...]}}} of ok grid cells."""
  panels = collections.defaultdict(lambda: collections.defaultdict(
      lambda: collections.defaultdict(list)))
  for r in results:
    if r.status == "ok" and is_grid(r.workload):
      w = r.workload
      panels[(r.pass_name, w.is_causal)][w.head_dim][(r.peer, w.dtype)].append(
          (w.seq_q, r.tflops))
  return panels


def _draw_panel(ax, lines: dict, colors: dict, styles: dict):
  for (peer, dtype), points in sorted(lines.items()):
    xs, ys = zip(*sorted(points))
    ax.plot(xs, ys, marker="o", markersize=3, color=colors[peer], linestyle=styles[dtype],
            linewidth=2.5 if peer == OURS else 1.2, label=f"{peer} {dtype}")
  ax.set_xscale("log", base=2)
  ax.set_ylim(bottom=0)
  ax.grid(True, alpha=0.3)


def _tick_label(t: int) -> str:
  return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


def _set_ticks(axes, panels: dict):
  ts = sorted({t for p in panels.values() for d in p.values() for pts in d.values()
               for t, _ in pts})
  for ax in axes.flat:
    ax.set_xticks(ts, [_tick_label(t) for t in ts])
    ax.minorticks_off()


def _legend_and_title(fig, axes, title: str):
  """One legend for all panels, under them; the title above."""
  handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
  ncol = min(6, max(1, len(handles)))
  fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=8)
  height = fig.get_figheight()
  bottom = (0.15 + 0.25 * math.ceil(len(handles) / ncol)) / height
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, bottom, 1, 1 - 0.35 / height))


def write_png(results: list[CellResult], peer_names: list[str], path: str, title: str) -> bool:
  """Writes the plot; False when there is nothing to plot. Raises ImportError without mpl."""
  panels = _series(results)
  if not panels:
    return False
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  rows = sorted(panels)
  dims = sorted({d for p in panels.values() for d in p})
  dtypes = sorted({dt for p in panels.values() for d in p.values() for _, dt in d})
  cmap = plt.get_cmap("tab10")
  colors = {p: cmap(i % 10) for i, p in enumerate(peer_names)}
  styles = {dt: _STYLES[i % len(_STYLES)] for i, dt in enumerate(dtypes)}
  fig, axes = plt.subplots(len(rows), len(dims), squeeze=False, sharex=True,
                           figsize=(4.5 * len(dims), 3.2 * len(rows)))
  for i, row in enumerate(rows):
    for j, dim in enumerate(dims):
      ax = axes[i][j]
      _draw_panel(ax, panels[row].get(dim, {}), colors, styles)
      ax.set_title(f"{row[0]}{' causal' if row[1] else ''}, D={dim}", fontsize=9)
      if i == len(rows) - 1:
        ax.set_xlabel("T (tokens)")
      if j == 0:
        ax.set_ylabel("TFLOP/s")
  _set_ticks(axes, panels)
  _legend_and_title(fig, axes, title)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
