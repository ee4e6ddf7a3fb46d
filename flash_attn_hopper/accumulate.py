"""Accumulation: O += P·V with O re-entering the tensor cores, dQ's float32 parts added into
global memory, and the interpreter-only formulations of both.

On the GPU, the running output re-enters wgmma as its accumulator (`plgpu.ACC.init`, through
`layouts.to_accumulator_layout`) and P comes straight from registers, so neither the add nor
a trip through shared memory costs anything.

jax 0.11.2's Mosaic GPU interpreter (`plgpu.force_gpu_interpret_mode`), which CI uses to run
the real kernels on a CPU, lacks three things this needs: `pl.run_state(f)(plgpu.ACC.init(x))`,
a store into an ACC ref, and a wgmma whose left operand is in registers. With
`interpret=True` the left operand is staged through shared memory, the product goes into a
fresh zero accumulator (`pl.run_scoped(f, plgpu.ACC(...))`) and is added in registers: the
same sum. It has no TMA reductions either: `add_to_global` adds with a read-modify-write
there, which is race-free because the interpreter runs the grid's CTAs one after another.
This module is the only place that branches on the interpreter. (The interpreter also skips
one instruction, the fence between memory proxies of `pipeline.order_loads_before_tma`,
through `pipeline.INTERPRET_PARAMS`: it simulates a single proxy, and the kernels' code
stays the same.)
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from flash_attn_hopper import layouts


def staging_types(num_buffers: int, shape, dtype, *, interpret: bool) -> tuple:
  """Shared memory the interpreter's formulation stages the left operand in: one
  `(num_buffers, *shape)` buffer when interpreting, none on the GPU. The kernel allocates it
  with its other scratch (the interpreter only allows collective allocations)."""
  return (plgpu.SMEM((num_buffers, *shape), dtype),) if interpret else ()


def product(a_smem, b_smem, shape):
  """a @ b of two shared-memory operands into a fresh float32 accumulator, as an array (the
  wait for it included)."""
  def run(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    return acc_ref[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def matmul_accumulate(acc, lhs, rhs_smem, *, staging=None, while_running=lambda: None):
  """Returns acc + lhs @ rhs_smem (float32), running `while_running()` during the matmul.

  Args:
    acc: (M, N) float32 accumulator in `Layout.WGMMA`.
    lhs: (M, K) 16-bit array in registers (`Layout.WGMMA`).
    rhs_smem: (K, N) shared-memory ref.
    staging: None on the GPU; when interpreting, an (M, K) shared-memory ref from
      `staging_types`, and the interpreter's formulation is taken (see the module docstring).
    while_running: work to overlap with the asynchronous matmul (e.g. a barrier wait).
  """
  if staging is None:
    def issue(acc_ref):
      plgpu.wgmma(acc_ref, lhs, rhs_smem)
      while_running()
    return pl.run_state(issue)(plgpu.ACC.init(layouts.to_accumulator_layout(acc)))

  staging[...] = lhs
  plgpu.commit_smem()

  def fresh(acc_ref):
    plgpu.wgmma(acc_ref, staging, rhs_smem)
    while_running()
    return acc_ref[...]
  return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


def matmul_accumulate_pair(accs, lhss, rhss_smem, *, staging=None):
  """Returns `(acc + lhs @ rhs for each of two)`, both matmuls issued before either is
  awaited (the dK/dV kernel's dV += Pᵀ dO and dK += dSᵀ Q), so the tensor cores run them
  back to back. Arguments as in `matmul_accumulate`, in pairs; when interpreting, the two
  run one after the other through the one `staging` buffer."""
  if staging is not None:
    return tuple(matmul_accumulate(acc, lhs, rhs, staging=staging)
                 for acc, lhs, rhs in zip(accs, lhss, rhss_smem))

  def issue(acc_refs):
    for acc_ref, lhs, rhs in zip(acc_refs, lhss, rhss_smem):
      plgpu.wgmma(acc_ref, lhs, rhs)
  return pl.run_state(issue)(
      tuple(plgpu.ACC.init(layouts.to_accumulator_layout(acc)) for acc in accs))


def matmul_accumulate_pair_around(accs, lhss, rhss_smem, fresh, on_fresh, *, staging=None):
  """FA3's dQ order in its backward step: issues acc0 += lhs0 @ rhs0, then a fresh product
  (`fresh` is `(issue, shape)`: `issue(ref)` issues it into a fresh float32 accumulator of
  `shape`, and may wait on a barrier first), then acc1 += lhs1 @ rhs1, and runs
  `on_fresh(product)` as soon as the fresh product is done, while acc1's matmul is still on
  the tensor cores. Returns `(acc0 + lhs0 @ rhs0, acc1 + lhs1 @ rhs1)`. When interpreting
  (`staging` given), the three run one after the other: the same sums."""
  issue_fresh, shape = fresh
  if staging is not None:
    acc0 = matmul_accumulate(accs[0], lhss[0], rhss_smem[0], staging=staging)
    on_fresh(pl.run_scoped(lambda ref: (issue_fresh(ref), ref[...])[1],
                           plgpu.ACC(shape, jnp.float32)))
    return acc0, matmul_accumulate(accs[1], lhss[1], rhss_smem[1], staging=staging)

  def issue(acc_refs):
    def scoped(fresh_ref):
      plgpu.wgmma(acc_refs[0], lhss[0], rhss_smem[0])
      issue_fresh(fresh_ref)
      plgpu.wgmma(acc_refs[1], lhss[1], rhss_smem[1])
      # Commit groups retire in order: with one left in flight, the fresh product is done.
      on_fresh(plgpu.wgmma_accumulator_load(fresh_ref, wait_n=1))
    pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32))
  return pl.run_state(issue)(
      tuple(plgpu.ACC.init(layouts.to_accumulator_layout(acc)) for acc in accs))


def products_then_accumulates(accs, first, second, on_first, on_second, rhss_smem, *,
                              staging=None):
  """The dK/dV step with dV issued before dS exists: two fresh products of shared-memory
  operands (`first`, `second`: `(a_smem, b_smem, shape)`, Sᵀ and dPᵀ), then two accumulates
  whose left operands come from them (dV += Pᵀ dO, dK += dSᵀ Q).

  The first product is awaited and `on_first(it)` returns `(lhs0, state)`. Then the second
  product and acc0 += lhs0 @ rhs0 are issued back to back, `on_second(second product, state)`
  (which returns lhs1) runs while acc0's matmul is on the tensor cores, and acc1 += lhs1 @
  rhs1 is issued. Returns `(acc0 + lhs0 @ rhs0, acc1 + lhs1 @ rhs1)`. When interpreting
  (`staging` given), the four run one after the other: the same sums."""
  if staging is not None:
    lhs0, state = on_first(product(*first))
    acc0 = matmul_accumulate(accs[0], lhs0, rhss_smem[0], staging=staging)
    lhs1 = on_second(product(*second), state)
    return acc0, matmul_accumulate(accs[1], lhs1, rhss_smem[1], staging=staging)

  def issue(acc_refs):
    def scoped(first_ref, second_ref):
      plgpu.wgmma(first_ref, first[0], first[1])
      lhs0, state = on_first(plgpu.wgmma_accumulator_load(first_ref, wait_n=0))
      plgpu.wgmma(second_ref, second[0], second[1])
      plgpu.wgmma(acc_refs[0], lhs0, rhss_smem[0])
      # Commit groups retire in order: with one left in flight (acc0's), the second is done.
      lhs1 = on_second(plgpu.wgmma_accumulator_load(second_ref, wait_n=1), state)
      plgpu.wgmma(acc_refs[1], lhs1, rhss_smem[1])
    pl.run_scoped(scoped, plgpu.ACC(first[2], jnp.float32), plgpu.ACC(second[2], jnp.float32))
  return pl.run_state(issue)(
      tuple(plgpu.ACC.init(layouts.to_accumulator_layout(acc)) for acc in accs))


def matmul_beside_accumulate(acc, lhs, rhs_smem, fresh, on_fresh, like, *, staging=None,
                             after_issue=lambda: None):
  """FA3's intra-warpgroup overlap: issues a fresh product `a @ b` of shared-memory operands
  (`fresh` is `(a_smem, b_smem, shape)`), then acc + lhs @ rhs_smem, and runs `on_fresh` on
  the fresh product while the accumulate is still on the tensor cores.

  Returns `(acc + lhs @ rhs_smem, on_fresh(a @ b))`. `like` is a pytree of arrays shaped,
  typed and laid out as `on_fresh`'s result (its value is not used): on the GPU the result
  leaves the accumulator's scope through refs initialized from it. `after_issue()` runs once
  both matmuls are issued. When interpreting (`staging` given), the fresh product is
  computed, `on_fresh` run, and then the accumulate, one after the other: the same sums."""
  a_smem, b_smem, shape = fresh
  if staging is not None:
    s = product(a_smem, b_smem, shape)
    after_issue()
    result = on_fresh(s)
    return matmul_accumulate(acc, lhs, rhs_smem, staging=staging), result

  def issue(refs):
    acc_ref, out_refs = refs

    def scoped(s_ref):
      plgpu.wgmma(s_ref, a_smem, b_smem)
      plgpu.wgmma(acc_ref, lhs, rhs_smem)
      after_issue()
      # Commit groups retire in order: with one left in flight, the fresh product is done.
      return on_fresh(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
    result = pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32))
    for ref, value in zip(jax.tree.leaves(out_refs), jax.tree.leaves(result)):
      ref[...] = value
  acc, result = pl.run_state(issue)(
      (plgpu.ACC.init(layouts.to_accumulator_layout(acc)), like))
  return acc, result


def add_to_global(part, staging, dst, *, interpret: bool):
  """dst += part (float32, `Layout.WGMMA`) in global memory, in no fixed order with other
  CTAs' adds: through `staging` (a shared-memory tile shaped like `part`) and a TMA bulk
  reduce-add on the GPU, a read-modify-write in the interpreter (see the module docstring).
  The warpgroup reuses `staging` only once TMA has read its last add, waited for right before
  the next write so that the read hides under whatever ran in between."""
  if interpret:
    dst[...] = dst[...] + part
    return
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  staging[...] = part
  plgpu.commit_smem()  # Visible to TMA.
  plgpu.copy_smem_to_gmem(staging, dst, reduction_op="add")
