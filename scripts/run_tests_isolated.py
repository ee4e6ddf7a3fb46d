"""Runs each GPU test in its own process, several at a time, each under its own time limit.

A kernel that deadlocks hangs its process inside the driver, where pytest's own timeout cannot
reach it, and it slows every other process that shares the GPU. One process per test bounds
the damage to that test, names it, and lets the rest finish. A test that runs out of its
share of GPU memory is printed as RETRY and runs again at the end, alone:

    python3 scripts/run_tests_isolated.py --jobs 8 --timeout 120 --log OUT/gpu_tests.log \
        [--skip-passed OLD_LOG] [pytest selection ...]

The summary (one line per test: PASSED, FAILED or TIMEOUT, and its seconds) is printed and
written at the head of the log, followed by the output of every test that did not pass.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import time


def _collect(selection: list[str]) -> list[str]:
  out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "-m", "gpu", *selection],
                       capture_output=True, text=True, check=False).stdout
  return [line.strip() for line in out.splitlines() if "::" in line]


def _passed_in(log: str) -> set[str]:
  """Tests that passed in a log of this script ("PASSED  1.0s id") or of pytest -v."""
  with open(log) as f:
    text = f.read()
  ours = re.findall(r"^PASSED\s+\S+s\s+(\S+)$", text, re.M)
  pytest_v = re.findall(r"^(\S+::\S+) PASSED", text, re.M)
  return set(ours) | set(pytest_v)


def _run_one(test_id: str, timeout: float, mem_fraction: float) -> tuple[str, str, float, str]:
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{mem_fraction:.3f}")
  start = time.monotonic()
  try:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "gpu", test_id], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
    output = proc.stdout + proc.stderr
    status = "FAILED" if proc.returncode else (
        "SKIPPED" if re.search(r"\b1 skipped\b", output) else "PASSED")
  except subprocess.TimeoutExpired as e:
    status = "TIMEOUT"
    output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else \
        (e.stdout or "")
  return test_id, status, time.monotonic() - start, output


def _out_of_memory(status: str, output: str) -> bool:
  """A failure from running out of this process's slice of GPU memory (run again alone)."""
  return status == "FAILED" and "RESOURCE_EXHAUSTED" in output


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--jobs", type=int, default=8)
  parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds for the whole run: no test runs past it")
  parser.add_argument("--log", required=True)
  parser.add_argument("--skip-passed", default=None, help="a previous log: skip what passed")
  parser.add_argument("selection", nargs="*", default=["tests"])
  args = parser.parse_args()

  tests = _collect(args.selection)
  if args.skip_passed and os.path.exists(args.skip_passed):
    done = _passed_in(args.skip_passed)
    tests = [t for t in tests if t not in done]
  deadline = None if args.budget is None else time.monotonic() + args.budget
  results = []
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    def guarded(test_id):
      left = args.timeout if deadline is None else deadline - time.monotonic()
      if left <= 0:
        return test_id, "NOT RUN", 0.0, ""
      return _run_one(test_id, min(args.timeout, left), 0.9 / args.jobs)
    for test_id, status, seconds, output in pool.map(guarded, tests):
      if _out_of_memory(status, output):  # Not a verdict yet: see below.
        print(f"{'RETRY':8s} {seconds:6.1f}s {test_id} (out of its share of GPU memory; "
              "runs again alone at the end)", flush=True)
      else:
        print(f"{status:8s} {seconds:6.1f}s {test_id}", flush=True)
      results.append((test_id, status, seconds, output))

  # A test that ran out of its slice of GPU memory runs again at the end, alone, with all of it.
  for n, (test_id, status, _, output) in enumerate(results):
    left = args.timeout if deadline is None else deadline - time.monotonic()
    if _out_of_memory(status, output) and left > 0:
      results[n] = _run_one(test_id, min(args.timeout, left), 0.9)
      print(f"{results[n][1]:8s} {results[n][2]:6.1f}s {test_id} (again, alone)", flush=True)

  counts = {s: sum(r[1] == s for r in results)
            for s in ("PASSED", "FAILED", "TIMEOUT", "SKIPPED", "NOT RUN")}
  summary = ", ".join(f"{n} {s.lower()}" for s, n in counts.items())
  with open(args.log, "w") as f:
    f.write(f"gpu tests: {summary}\n")
    for test_id, status, seconds, _ in results:
      f.write(f"{status:8s} {seconds:6.1f}s {test_id}\n")
    for test_id, status, _, output in results:
      if status in ("FAILED", "TIMEOUT"):
        f.write(f"\n===== {status} {test_id}\n{output[-6000:]}\n")
  print(f"gpu tests: {summary}")
  return 0 if counts["PASSED"] + counts["SKIPPED"] == len(results) else 1


if __name__ == "__main__":
  sys.exit(main())
