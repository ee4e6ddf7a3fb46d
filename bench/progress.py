"""A progress bar: tqdm when it imports, else one plain line per cell on stderr."""

from __future__ import annotations

import sys


class _PlainBar:
  """The stand-in for tqdm: counts cells and writes a line per update."""

  def __init__(self, total: int, desc: str):
    self.total, self.desc, self.n, self.postfix = total, desc, 0, ""

  def set_postfix_str(self, text: str):
    self.postfix = text

  def update(self, n: int = 1):
    self.n += n
    print(f"{self.desc} [{self.n}/{self.total}] {self.postfix}", file=sys.stderr, flush=True)

  def write(self, text: str, file=sys.stderr):
    print(text, file=file, flush=True)

  def close(self):
    pass


class _SilentBar(_PlainBar):
  def update(self, n: int = 1):
    self.n += n


def make_bar(total: int, desc: str = "bench", enabled: bool = True):
  """tqdm if installed (and `enabled`), else a plain-text or silent stand-in."""
  if not enabled:
    return _SilentBar(total, desc)
  try:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    return _PlainBar(total, desc)
  return tqdm(total=total, desc=desc, unit="cell", dynamic_ncols=True, file=sys.stderr)
