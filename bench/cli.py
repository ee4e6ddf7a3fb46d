"""The benchmark's entry point: plans the cells, runs them with a progress bar, reports.

This is the only module that prints. The JSON is rewritten after every cell (with
"complete": false until the end), so a run cut short still leaves its numbers behind.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import sys
import time

from bench import grid, options, plot, progress, report, resume, timing
from bench.peers import OURS, available_peers, ours_peer
from bench.runner import RunConfig, count_cells, iter_cells


def _workloads(args) -> list:
  ws = [] if args.no_grid else grid.grid_workloads(
      args.seq_lens, args.head_dims, args.causal, args.dtypes, args.tokens, args.hidden)
  if args.models is not None:
    ws += grid.model_workloads(args.models, args.dtypes)
  return ws


def _peers(args):
  """Ours first, then the requested peers that import; the others with their reasons."""
  found, missing = available_peers(args.peers)
  ours = ours_peer(args.interpret, args.backward_config,
                   deterministic=not getattr(args, "nondeterministic", False))
  return [ours, *found.values()], missing


def _device() -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  return {"device": dev.device_kind, "platform": dev.platform, "device_count": jax.device_count(),
          "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", "?")}


def _default_tag(device: str, quick: bool) -> str:
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
  return f"{'quick_' if quick else ''}{stamp}_{slug}"


def _meta(args, argv, peers, missing, timer) -> dict:
  dev = _device()
  return {**dev, "tag": args.tag or _default_tag(dev["device"], args.quick),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "command": shlex.join(["python", "-m", "bench", *argv]), "argv": list(argv),
          "options": {k: v for k, v in vars(args).items()}, "timer": timer,
          "repeats": args.repeats, "checked": not args.no_check,
          "peers": {p.name: p.description for p in peers}, "peers_unavailable": missing,
          "flops": "forward 4*B*H*T*S*D (halved when causal); bwd 2.5x, fwdbwd 3.5x forward",
          "complete": False}


def _write(path: str, text: str):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _print_plan(workloads, peers, missing, config):
  print(f"{count_cells(workloads, config, peers)} cells: {len(workloads)} workloads x "
        f"passes {','.join(config.passes)} x peers {','.join(p.name for p in peers)}")
  for name, why in missing.items():
    print(f"  peer {name} unavailable: {why}")
  for w in workloads:
    print(f"  {w.name}: B={w.batch} T={w.seq_q} S={w.seq_kv} N={w.num_q_heads} "
          f"K={w.num_kv_heads} D={w.head_dim} causal={w.is_causal} {w.dtype} "
          f"fwd GFLOP={w.forward_flops() / 1e9:.1f}")


def _loud_fail(bar, r):
  bar.write(f"!!! FAIL {r.peer} {r.pass_name} {r.workload.name}: {r.note}", file=sys.stderr)


def _run(workloads, peers, config, args, on_result, kept=()) -> tuple[list, bool]:
  """Runs every cell with a progress bar; returns the results (after `kept`, an earlier
  run's) and whether all ran."""
  bar = progress.make_bar(count_cells(workloads, config, peers), enabled=not args.no_progress)
  results, start = list(kept), time.monotonic()
  try:
    for r in iter_cells(workloads, peers, config):
      results.append(r)
      bar.set_postfix_str(f"{r.workload.name} {r.pass_name} {r.peer}: {r.status}")
      bar.update(1)
      if r.status == "FAIL":
        _loud_fail(bar, r)
      on_result(results)
      if args.time_budget is not None and time.monotonic() - start > args.time_budget:
        bar.write(f"time budget of {args.time_budget:.0f}s spent: stopping", file=sys.stderr)
        return results, False
  finally:
    bar.close()
  return results, True


def _report(meta, results, peer_names, paths) -> None:
  header, rows = report.table_rows(results, peer_names)
  stats = report.summary(results)
  print(f"\nTFLOP/s on {meta['device']} (timer {meta['timer']}, median of {meta['repeats']})")
  print(report.format_text_table(header, rows))
  print("\nours / peer, geometric mean and worst cell:")
  print(report.format_text_table(*report.summary_rows(stats)))
  lines = report.notes(results)
  if lines:
    print("\nnotes:")
    print("\n".join(f"  {line}" for line in lines))
  _write(paths["json"], report.to_json(meta, results, stats))
  _write(paths["md"], report.to_markdown(meta, results, stats, peer_names))
  print(f"\nwrote {paths['json']}\nwrote {paths['md']}")
  _write_png(results, peer_names, paths["png"], meta)


def _write_png(results, peer_names, path, meta):
  try:
    wrote = plot.write_png(results, peer_names, path, f"{meta['device']}: {meta['tag']}")
  except ImportError as e:
    print(f"no plot: matplotlib unavailable ({e})")
    return
  print(f"wrote {path}" if wrote else "no plot: no timed cell of the T sweep")


def _fail_banner(results) -> int:
  """Prints the FAIL count loudly; exit status 1 when a cell of ours failed the check."""
  fails = [r for r in results if r.status == "FAIL"]
  if fails:
    print(f"\n!!! {len(fails)} cell(s) FAILED the numerics check "
          f"({sum(r.peer == OURS for r in fails)} of them ours)", file=sys.stderr)
  return 1 if any(r.peer == OURS for r in fails) else 0


def main(argv=None) -> int:
  """Runs the benchmark; returns the exit status."""
  import bench  # pylint: disable=import-outside-toplevel
  argv = sys.argv[1:] if argv is None else list(argv)
  args = options.resolve(options.build_parser(bench.__doc__).parse_args(argv))
  try:
    workloads = _workloads(args)
  except ValueError as e:
    raise SystemExit(f"bench: {e}") from None
  peers, missing = _peers(args)
  config = RunConfig(args.passes, args.repeats, timing.resolve_timer(args.timer),
                     not args.no_check, args.seed)
  if args.list:
    _print_plan(workloads, peers, missing, config)
    return 0
  meta = _meta(args, argv, peers, missing, config.timer)
  os.makedirs(args.out, exist_ok=True)
  paths = {ext: os.path.join(args.out, f"{meta['tag']}.{ext}") for ext in ("json", "md", "png")}
  for name, why in missing.items():
    print(f"peer {name} unavailable: {why}", file=sys.stderr)

  kept = []
  if args.resume:
    earlier, earlier_meta = resume.load(args.resume, meta)
    kept, workloads = resume.split(workloads, config.passes, [p.name for p in peers], earlier)
    meta["resumed_from"] = {"path": args.resume, "date": earlier_meta.get("date"),
                            "command": earlier_meta.get("command"), "cells_kept": len(kept)}

  def checkpoint(results):
    _write(paths["json"], report.to_json(meta, results, report.summary(results)))

  results, complete = _run(workloads, peers, config, args, checkpoint, kept)
  meta["complete"] = complete
  _report(meta, results, [p.name for p in peers], paths)
  return _fail_banner(results)
