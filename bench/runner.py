"""Runs cells: one (workload, pass, peer) each, checked against the reference, then timed.

A cell ends in one status:
- "ok": the numerics check passed (or was turned off) and the cell was timed.
- "FAIL": an error above tolerance; the cell is not timed and has no TFLOP/s.
- "n/a": the peer raised NotImplementedError (e.g. our backward before it lands).
- "skip": the peer declares it cannot run this cell (reason in `note`).
- "error": anything else the peer, the reference or the timer raised (message in `note`).

Nothing here prints; `iter_cells` yields results for the CLI to report.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import traceback
from typing import Iterator

from bench import numerics, passes, timing
from bench.inputs import WorkloadInputs
from bench.peers import Peer
from flash_attn_hopper.workloads import Workload

NOTE_CHARS = 2000


@dataclasses.dataclass
class CellResult:
  """What one cell measured."""

  workload: Workload
  pass_name: str
  peer: str
  status: str
  flops: float
  times_ms: list[float] = dataclasses.field(default_factory=list)
  median_ms: float | None = None
  tflops: float | None = None
  errors: dict[str, float] = dataclasses.field(default_factory=dict)
  tolerances: dict[str, float] = dataclasses.field(default_factory=dict)
  checked: bool = False
  note: str = ""

  def to_json(self) -> dict:
    record = dataclasses.asdict(self)
    record["workload"] = dataclasses.asdict(self.workload)
    record["errors"] = {k: (v if v != float("inf") else "inf") for k, v in self.errors.items()}
    return record


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The run-wide settings a cell needs."""

  passes: tuple[str, ...]
  repeats: int
  timer: str
  check: bool
  seed: int = 0


def _describe(e: BaseException) -> str:
  """The exception's type and message; where it was raised when the message is empty."""
  message = str(e).strip()
  text = f"{type(e).__name__}: {message}" if message else type(e).__name__
  if not message and e.__traceback__ is not None:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    text += f" at {os.path.basename(frame.filename)}:{frame.lineno} ({frame.line})"
  return text[:NOTE_CHARS]


def _check(result: CellResult, prepared_outputs: dict, inputs: WorkloadInputs, peer: Peer):
  """Fills the cell's errors; sets status FAIL when one is above tolerance."""
  units = numerics.check_units(inputs.workload)
  try:
    refs = inputs.references(peer)
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(f"the reference failed: {_describe(e)}") from e
  outs = [numerics.peer_unit(u, prepared_outputs) for u in units]
  result.errors = numerics.relative_errors(outs, refs)
  result.tolerances = {n: numerics.tolerance(inputs.workload.dtype, n) for n in result.errors}
  result.checked = True
  bad = numerics.failures(result.errors, inputs.workload.dtype)
  if bad:
    result.status = "FAIL"
    result.note = "; ".join(f"{n} rel err {e:.2e} > tol {t:.1e}" for n, (e, t) in bad.items())


def _time(result: CellResult, prepared: passes.Prepared, config: RunConfig):
  result.times_ms = timing.measure_ms(config.timer, prepared.fn, prepared.args, config.repeats)
  result.median_ms = timing.median(result.times_ms)
  result.tflops = result.flops / (result.median_ms * 1e-3) / 1e12
  result.status = "ok"


def run_cell(peer: Peer, pass_name: str, inputs: WorkloadInputs, config: RunConfig) -> CellResult:
  """Checks, then times, one cell; every exception becomes the cell's status."""
  w = inputs.workload
  flops = w.forward_flops() * passes.FLOP_MULTIPLIER[pass_name]
  result = CellResult(w, pass_name, peer.name, "error", flops)
  reason = peer.limits(w, pass_name)
  if reason:
    result.status, result.note = "skip", reason
    return result
  forward = _bind(peer, w)
  try:
    prepared = passes.prepare(pass_name, forward, inputs.q_for(peer), inputs.k, inputs.v,
                              inputs.cotangent)
    outputs = prepared.name_outputs(prepared.run())
    if config.check:
      _check(result, outputs, inputs, peer)
      if result.status == "FAIL":
        return result
    del outputs
    _time(result, prepared, config)
    if not config.check:
      result.note = "unchecked (--no-check)"
  except NotImplementedError as e:
    result.status, result.note = "n/a", _describe(e)
  except Exception as e:  # pylint: disable=broad-except  # One cell must not stop the run.
    result.status, result.note = "error", _describe(e)
  return result


def _bind(peer: Peer, w: Workload):
  """The peer's forward as a function of (q, k, v) only, for jit and vjp."""
  def forward(q, k, v):
    return peer.fn(q, k, v, w)
  forward.__name__ = f"{peer.name}_{w.name}"
  return forward


def count_cells(workloads, config: RunConfig, peers) -> int:
  return len(workloads) * len(config.passes) * len(peers)


def iter_cells(workloads: list[Workload], peers: list[Peer],
               config: RunConfig) -> Iterator[CellResult]:
  """Yields every cell's result, workload by workload (inputs shared within a workload)."""
  with_grads = any(passes.needs_grads(p) for p in config.passes)
  for w in workloads:
    inputs = WorkloadInputs(w, config.seed, with_grads)
    for pass_name in config.passes:
      for peer in peers:
        yield run_cell(peer, pass_name, inputs, config)
    del inputs
    gc.collect()  # Frees this workload's device arrays before the next one's.
