"""The benchmark's workloads, built from `flash_attn_hopper.workloads` (the project's one list).

The grid is `hidden_2048_grid` (B·T = 16k tokens, hidden 2048, square self-attention) over the
requested T, D, causal and dtypes. `tokens` and `hidden` shrink it for smoke runs: the batch
becomes tokens // T and the head count hidden // D, and the name says so. Model shapes come
from `MODEL_SHAPES`, once per requested dtype.
"""

from __future__ import annotations

import re

from flash_attn_hopper import workloads as wl
from flash_attn_hopper.workloads import Workload

_GRID_NAME = re.compile(r"h\d+_t\d+_d\d+(_|$)")  # h<hidden>_t<T>_d<D>...; model shapes differ.


def _resize(w: Workload, tokens: int, hidden: int) -> Workload:
  """The grid workload for another token count or hidden size, renamed to say so."""
  if tokens == wl.TOKENS_PER_BATCH and hidden == wl.HIDDEN_SIZE:
    return w
  heads = max(1, hidden // w.head_dim)
  name = w.name.replace(f"h{wl.HIDDEN_SIZE}_", f"h{hidden}_", 1)
  if tokens != wl.TOKENS_PER_BATCH:
    name = f"{name}_tok{tokens}"
  return w.replace(name=name, batch=max(1, tokens // w.seq_q), num_q_heads=heads,
                   num_kv_heads=heads)


def grid_workloads(seq_lens, head_dims, causal, dtypes, tokens=wl.TOKENS_PER_BATCH,
                   hidden=wl.HIDDEN_SIZE) -> list[Workload]:
  """The hidden-size grid over the given axes."""
  grid = wl.hidden_2048_grid(seq_lens=tuple(seq_lens), head_dims=tuple(head_dims),
                             causal=tuple(causal), dtypes=tuple(dtypes))
  return [_resize(w, tokens, hidden) for w in grid]


def model_workloads(names, dtypes) -> list[Workload]:
  """`MODEL_SHAPES` (all, or those named), once per dtype, the dtype appended to the name."""
  known = {w.name: w for w in wl.MODEL_SHAPES}
  unknown = [n for n in names if n not in known] if names else []
  if unknown:
    raise ValueError(f"unknown model shapes {unknown}; known: {sorted(known)}")
  chosen = [known[n] for n in names] if names else list(wl.MODEL_SHAPES)
  return [w.replace(name=f"{w.name}_{d}", dtype=d) for w in chosen for d in dtypes]


def is_grid(w: Workload) -> bool:
  """Whether `w` belongs to the T sweep (plotted against T) rather than the model shapes."""
  return bool(_GRID_NAME.match(w.name))
