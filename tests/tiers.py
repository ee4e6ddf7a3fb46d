"""The GPU tests' two tiers (see conftest.py): which parameter sets run after every kernel change.

    tiered(cases, quick)  ->  pytest params; those for which quick(case) is false are marked `full`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import pytest


def tiered(cases: Iterable[Sequence], quick: Callable[[int, Sequence], bool]) -> list:
  """`cases` as pytest params, each marked `full` unless quick(index, case) holds."""
  return [pytest.param(*case) if quick(i, case) else pytest.param(*case, marks=pytest.mark.full)
          for i, case in enumerate(cases)]
