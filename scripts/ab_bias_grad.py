"""What a bias costs: fwd+bwd with its gradient, our kernels (the dQ kernel writes dS) against
`blockwise` (the XLA backward that gave a bias's gradients before), cuDNN and XLA through
`jax.nn.dot_product_attention`, in interleaved rounds in one process. Needs a GPU (CUPTI).

    PYTHONPATH=. python3 scripts/ab_bias_grad.py [--seq-lens 4096,8192] [--rounds 4]
    PYTHONPATH=. python3 scripts/ab_bias_grad.py --head-dim 256 --forward

B 1, N 16 over 4, bf16, a (1, 16, T, T) bias, gradients of q, k, v and the bias for a random
cotangent; also the same with the bias held constant (gradients of q, k, v only). With
`--forward`, the forward alone, beside our kernel without a bias. Prints the median device ms
(all kernels of the program) of each side and its ratio to ours.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

import flash_attn_hopper as fah
from flash_attn_hopper import autodiff


@contextlib.contextmanager
def _blockwise_backward():
  """Traces the op with its gradients from `blockwise`, as before the kernels wrote dS."""
  saved = autodiff.backward_in_kernels
  autodiff.backward_in_kernels = lambda head_dim: False
  try:
    yield
  finally:
    autodiff.backward_in_kernels = saved


def _attention(impl: str, q, k, v, bias):
  if impl in ("cudnn", "xla"):
    return jax.nn.dot_product_attention(q, k, v, bias, implementation=impl)
  return fah.dot_product_attention(q, k, v, None if impl == "ours, no bias" else bias,
                                   implementation="flash_attn_hopper")


def _program(impl: str, bias_grad: bool | None):
  """fwd+bwd (gradients of the bias too when `bias_grad`), or the forward (None)."""
  if bias_grad is None:
    return jax.jit(lambda q, k, v, bias, dout: _attention(impl, q, k, v, bias))

  def loss(q, k, v, bias, dout):
    out = _attention(impl, q, k, v, bias)
    return jnp.vdot(out.astype(jnp.float32), dout.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if bias_grad else (0, 1, 2)))


def _total_ms(fn, args, repeats: int) -> list[float]:
  _, runs = profiler.measure(fn, aggregate=False, iterations=repeats)(*args)
  return [sum(ms for _, ms in run) for run in runs]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", default="4096,8192")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--forward", action="store_true", help="time the forward alone")
  args = parser.parse_args()
  modes = (None,) if args.forward else (True, False)
  impls = ("ours", "ours, no bias", "cudnn", "xla") if args.forward else (
      "ours", "blockwise", "cudnn", "xla")
  rng = np.random.default_rng(0)
  for t in map(int, args.seq_lens.split(",")):
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    d = args.head_dim
    inputs = (make(1, t, 16, d), make(1, t, 4, d), make(1, t, 4, d), make(1, 16, t, t),
              make(1, t, 16, d))
    for bias_grad in modes:
      sides = {}
      for impl in impls:
        fn = _program(impl, bias_grad)
        try:
          with _blockwise_backward() if impl == "blockwise" else contextlib.nullcontext():
            jax.block_until_ready(fn(*inputs))
        except Exception as e:  # A peer that cannot take this case is reported, not timed.
          print(f"  {impl}: not run ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
          continue
        sides[impl] = (fn, [])
      for _ in range(args.rounds):
        for fn, times in sides.values():
          times.extend(_total_ms(fn, inputs, args.repeats))
      what = {None: "forward", True: "fwd+bwd, gradients of q, k, v and bias",
              False: "fwd+bwd, gradients of q, k, v (constant bias)"}[bias_grad]
      print(f"\nT {t}, D {d}, {what}:")
      ours = float(np.median(sides["ours"][1]))
      for impl, (_, times) in sides.items():
        ms = float(np.median(times))
        print(f"  {impl:14} {ms:9.3f} ms   ours is {ms / ours:5.2f}× faster", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
