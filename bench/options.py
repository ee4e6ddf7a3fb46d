"""The command line: argparse, the --quick preset, and validation of the option values.

Every grid option defaults to None so that `--quick` can supply its preset for the options not
given explicitly; `resolve` turns the parsed namespace into final values.
"""

from __future__ import annotations

import argparse
import os

from bench import timing
from bench.peers import PASSES, PEER_NAMES
from flash_attn_hopper import workloads as wl

DEFAULTS = dict(passes="fwd,fwdbwd", seq_lens="512,1024,2048,4096,8192,16384",
                head_dims="64,128,256", causal="both", dtypes="float16,bfloat16")
QUICK = dict(passes="fwd", seq_lens="1024,4096", head_dims="64,128", causal="both",
             dtypes="float16,bfloat16")
DTYPES = ("float16", "bfloat16", "float32")
CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _csv(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


def _choices(text: str, allowed, what: str) -> tuple[str, ...]:
  values = tuple(_csv(text))
  bad = [v for v in values if v not in allowed]
  if bad or not values:
    raise SystemExit(f"bench: bad {what} {bad or text!r}; choose from {', '.join(allowed)}")
  return values


def _ints(text: str, what: str) -> tuple[int, ...]:
  try:
    values = tuple(int(x) for x in _csv(text))
  except ValueError:
    raise SystemExit(f"bench: {what} takes comma-separated integers, got {text!r}") from None
  if not values or min(values) < 1:
    raise SystemExit(f"bench: {what} must be positive integers, got {text!r}")
  return values


def _add_grid_options(p: argparse.ArgumentParser):
  g = p.add_argument_group("what to run")
  g.add_argument("--passes",
                 help=f"comma list of {','.join(PASSES)} (default {DEFAULTS['passes']})")
  g.add_argument("--seq-lens", help=f"T = S values (default {DEFAULTS['seq_lens']})")
  g.add_argument("--head-dims", help=f"D values (default {DEFAULTS['head_dims']})")
  g.add_argument("--causal", choices=tuple(CAUSAL), help="default both")
  g.add_argument("--dtypes",
                 help=f"comma list of {','.join(DTYPES)} (default {DEFAULTS['dtypes']})")
  g.add_argument("--models", nargs="?", const="all", default=None, metavar="NAMES",
                 help="also run workloads.MODEL_SHAPES (all, or a comma list of names)")
  g.add_argument("--no-grid", action="store_true", help="skip the T sweep (e.g. models only)")
  g.add_argument("--tokens", type=int, default=wl.TOKENS_PER_BATCH,
                 help="B*T of the grid (default %(default)s; shrink for CPU smoke runs)")
  g.add_argument("--hidden", type=int, default=wl.HIDDEN_SIZE,
                 help="heads*D of the grid (default %(default)s)")
  g.add_argument("--quick", action="store_true",
                 help="preset: T 1k,4k; D 64,128; fp16+bf16; causal both; fwd only")
  g.add_argument("--peers", help=f"comma list of {','.join(PEER_NAMES)}, or 'none' "
                 "(default: all that import); ours always runs")
  g.add_argument("--interpret", action="store_true",
                 help="run our kernel with interpret=True (CPU smoke runs)")
  g.add_argument("--backward-config", metavar="BQ,BKV,STAGES[,DQ_STAGES[,DQ_BKV[,DQ_BQ]]]",
                 default=None,
                 help="our op's backward_config for every cell (e.g. 64,64,2,2,32: at "
                      "D 256, dQ's ring two stages of 32 keys; 128,64,2,2,64,64: dQ on "
                      "64-row tiles)")
  g.add_argument("--nondeterministic", action="store_true",
                 help="our op with deterministic=False: the five-matmul backward where it "
                      "measured faster (flash_attn_hopper.config.TUNED_BACKWARD_FUSED)")


def _add_run_options(p: argparse.ArgumentParser):
  g = p.add_argument_group("how to run and report")
  g.add_argument("--repeats", type=int, default=10, help="timed runs per cell; median reported")
  g.add_argument("--timer", choices=timing.TIMERS, default="auto",
                 help="cupti (device kernel time, GPU) or wall; auto picks cupti on GPU")
  g.add_argument("--no-check", action="store_true", help="skip the numerics check")
  g.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
  g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                 help="start no new cell after this many seconds; report what ran")
  g.add_argument("--resume", metavar="JSON", default=None,
                 help="an earlier run's JSON of the same code, cut short by its "
                      "--time-budget (same device, jax, timer and repeats): its workloads "
                      "that ran every pass and peer are kept, the rest run")
  g.add_argument("--out", default=DEFAULT_OUT, help="output folder (default bench/results)")
  g.add_argument("--tag", help="file name stem (default <date>_<device>)")
  g.add_argument("--list", action="store_true", help="print the planned cells and exit")
  g.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser(description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m bench", description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  _add_grid_options(p)
  _add_run_options(p)
  return p


def _pick(args, name: str) -> str:
  given = getattr(args, name)
  if given is not None:
    return given
  return (QUICK if args.quick else DEFAULTS)[name]


def resolve(args: argparse.Namespace) -> argparse.Namespace:
  """Applies --quick and the defaults, and validates: returns final, typed values."""
  args.passes = _choices(_pick(args, "passes"), PASSES, "--passes")
  args.seq_lens = _ints(_pick(args, "seq_lens"), "--seq-lens")
  args.head_dims = _ints(_pick(args, "head_dims"), "--head-dims")
  args.causal = CAUSAL[_pick(args, "causal")]
  args.dtypes = _choices(_pick(args, "dtypes"), DTYPES, "--dtypes")
  if args.backward_config is not None:
    fields = _ints(args.backward_config, "--backward-config")
    if len(fields) not in (3, 4, 5, 6):
      raise SystemExit("--backward-config takes BQ,BKV,STAGES, then optionally DQ_STAGES, "
                       "DQ_BKV and DQ_BQ")
    import flash_attn_hopper  # pylint: disable=import-outside-toplevel
    args.backward_config = flash_attn_hopper.BackwardConfig(*fields)
  if args.peers is None or args.peers == "all":
    args.peers = PEER_NAMES
  else:
    args.peers = () if args.peers == "none" else _choices(args.peers, PEER_NAMES, "--peers")
  args.models = None if args.models is None else (
      () if args.models == "all" else tuple(_csv(args.models)))
  if args.repeats < 1:
    raise SystemExit("bench: --repeats must be at least 1")
  return args
