"""The speed table of the masks issue: `python -m bench.masks [--tokens 32768] [--repeats 10]`.

Times four things in one run on a Hopper GPU, forward and forward+backward, bf16, D 128,
16 query heads over 4 KV heads:

- sliding window: a 1k causal window at T = S = 32k, against dense causal over the same T (the
  window's cost should follow the window: ≥ 5× faster);
- a window that leaves every tile fully visible (left = right = T): against no mask at all
  (its overhead should stay under 3%);
- padding: key_value_seq_lengths at half of S for every batch element, against no lengths;
- packed sequences: 8 equal causal documents at T = S = 16k (`--packed-tokens`), as segment ids,
  against dense causal over the same T (the documents should cost about 1/8 of it);
- an all-True `mask` (no block skipped, no tile streamed; the op's XLA preparation of the
  bool array still copies it to one-byte tiles) and the causal mask given as a `mask`
  (blocks above the diagonal skipped, the diagonal's tiles streamed), at the packed pair's
  T, against no mask and `is_causal` (what a data mask costs over the static band);
- the packed documents (not causal) given as a block-diagonal `mask`, against the same
  documents as segment ids;
- the all-True mask shared by `--layers` chained layers (each layer's output the next one's
  queries), as a model's step uses one mask: its preparation is paid once per step, not per
  layer.

Each line prints the two medians and their ratio, the two sides timed in interleaved rounds;
off Hopper, tiny shapes run in interpret mode
with the wall-clock timer (a smoke run only).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import flash_attn_hopper as fah
from bench import programs
from bench import timing

#: Documents packed into one sequence for the segment-ids pair: equal and contiguous.
PACKED_DOCUMENTS = 8


def _time_pair(fns, args, timer: str, repeats: int, rounds: int) -> list[float]:
  """The median ms of each of `fns` on its `args`, timed in `rounds` interleaved rounds of
  ⌈repeats / rounds⌉ runs: the GPU's clock drifts by up to ~10% within a run, and timing one
  side after the other put that drift into the ratio (a fully visible window, the very
  kernel of its baseline, read 0.90× that way on the H200)."""
  fns = [jax.jit(fn) for fn in fns]
  for fn, a in zip(fns, args):
    jax.block_until_ready(fn(*a))
  per_round = -(-repeats // rounds)
  times = [[] for _ in fns]
  for _ in range(rounds):
    for fn, a, out in zip(fns, args, times):
      out.extend(timing.measure_ms(timer, fn, a, per_round))
  return [timing.median(t) for t in times]


def _split_arrays(kw: dict) -> tuple[dict, dict]:
  """The op's keyword arguments split into static ones and arrays (passed to the program)."""
  arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
  return {k: v for k, v in kw.items() if k not in arrays}, arrays


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=32768, help="T = S")
  parser.add_argument("--packed-tokens", type=int, default=16384, help="T = S when packed")
  parser.add_argument("--window", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=5,
                      help="interleaved rounds over which the repeats are spread")
  parser.add_argument("--timer", default="auto", choices=timing.TIMERS)
  parser.add_argument("--layers", type=int, default=8, help="layers sharing one mask")
  parser.add_argument("--only", default="", help="run the pairs whose name contains this")
  args = parser.parse_args()
  on_gpu = fah.api.on_hopper()
  t = args.tokens if on_gpu else 256
  t_packed = args.packed_tokens if on_gpu else 256
  window = args.window if on_gpu else 64
  timer = timing.resolve_timer(args.timer)
  rng = np.random.default_rng(0)
  make = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
  b, n, kv, d = 1, 16, 4, 128
  half = jnp.full((b,), t // 2, jnp.int32)
  docs = PACKED_DOCUMENTS
  documents = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), -(-t_packed // docs))[:t_packed]
  all_true = jnp.ones((t_packed, t_packed), bool)
  # name: (T = S, the masked op's arguments, the baseline's[, layers]).
  pairs = {
      f"window {window} causal vs dense causal": (
          t, dict(is_causal=True, local_window_size=(window, 0)), dict(is_causal=True)),
      "fully visible window vs no mask": (t, dict(local_window_size=(t, t)), {}),
      "kv lengths S/2 vs none": (t, dict(key_value_seq_lengths=half), {}),
      f"packed: {docs} causal documents vs dense causal": (
          t_packed, dict(segment_ids=documents, is_causal=True), dict(is_causal=True)),
      "all-True mask vs no mask": (t_packed, dict(mask=all_true), {}),
      f"{docs} documents as a mask vs as segment ids": (
          t_packed, dict(mask=documents[:, None] == documents[None, :]),
          dict(segment_ids=documents)),
      "causal as a mask vs is_causal": (
          t_packed, dict(mask=jnp.tri(t_packed, dtype=bool)), dict(is_causal=True)),
      f"all-True mask vs no mask, {args.layers} layers": (
          t_packed, dict(mask=all_true), {}, args.layers),
  }
  print(f"B {b}, N {n}, K {kv}, D {d}, bf16, timer {timer}, median of {args.repeats} (ms)")
  inputs = {}
  for name, (seq, masked, base, *layers) in pairs.items():
    if args.only not in name:
      continue
    layers = layers[0] if layers else 1
    if seq not in inputs:
      inputs[seq] = (make((b, seq, n, d)), make((b, seq, kv, d)), make((b, seq, kv, d)),
                     make((b, seq, n, d)))
    for pass_name in programs.PASSES:
      sides = [_split_arrays(kw) for kw in (masked, base)]
      t_masked, t_base = _time_pair(
          [programs.program(pass_name, layers=layers, interpret=not on_gpu, **kw)
           for kw, _ in sides], [(*inputs[seq], arrays) for _, arrays in sides],
          timer, args.repeats, args.rounds)
      print(f"{name:44s} T {seq:6d} {pass_name:8s} {t_masked:9.3f} {t_base:9.3f}  "
            f"base/masked {t_base / t_masked:5.2f}x", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
