"""The real kernels, lowered for an H100/H200 on the CPU: no GPU, no interpreter.

`jax.jit(...).lower(lowering_platforms=("cuda",))` runs the whole Pallas → Mosaic GPU lowering
(layout inference, TMA descriptors, barrier and wgmma lowering) without a device, so the
failures that the interpreter does not simulate show up in CI: a TMA copy over more than five
strided dimensions, a layout that inference cannot reconcile, an accumulator that leaves the
WGMMA layout. What it cannot catch is what happens after: ptxas (register spills), timing, and
numerics; those are the GPU tests' (`*_gpu.py`).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import flash_attn_hopper as fah
from flash_attn_hopper import api
from flash_attn_hopper import autodiff
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import hardware
from flash_attn_hopper import scheduler


@pytest.fixture
def as_if_on_hopper(monkeypatch):
  """The op's device check answers yes, so it takes the kernel path on the CPU."""
  monkeypatch.setattr(api, "on_hopper", lambda: True)


def _lower(d: int, grad: bool, *, dtype=jnp.bfloat16, t=1024, s=1024, heads=(8, 2), **kw):
  """Lowers the op (or its gradient, for all three kernels) for CUDA; raises on failure."""
  n, k_heads = heads
  q = jax.ShapeDtypeStruct((2, t, n, d), dtype)
  kv = jax.ShapeDtypeStruct((2, s, k_heads, d), dtype)

  def loss(q, k, v):
    out = fah.dot_product_attention(q, k, v, implementation="flash_attn_hopper", **kw)
    return out.astype(jnp.float32).sum()

  fn = jax.grad(loss, argnums=(0, 1, 2)) if grad else loss
  return jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


FEATURES = {
    "dense": {},
    "causal": dict(is_causal=True),
    "window": dict(is_causal=True, local_window_size=(300, 0)),
    "bottom_right_lengths": dict(
        is_causal=True, causal_alignment="bottom_right", s=2048,
        key_value_seq_lengths=jnp.array([2048, 130], jnp.int32),
        query_seq_lengths=jnp.array([1024, 1], jnp.int32)),
    "segments": dict(is_causal=True, segment_ids=jnp.zeros((2, 1024), jnp.int32)),
    "soft_cap": dict(logits_soft_cap=30.0),
    "mask": dict(mask=jnp.ones((1, 8, 1024, 1024), bool)),
    "bias": dict(bias=jnp.zeros((2, 1, 1024, 1024), jnp.bfloat16)),
    "mqa_fp16": dict(heads=(8, 1), dtype=jnp.float16),
    "tail_lengths": dict(t=1000, s=777),
    # A mask whose S is not a multiple of the TMA tiling (its tiles' columns are padded).
    "mask_tail": dict(t=1000, s=777, mask=jnp.ones((1, 8, 1000, 777), bool)),
}


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_kernels_lower_for_hopper(feature, d, grad):
  kw = dict(FEATURES[feature])
  text = _lower(d, grad, **kw)
  kernels = {"fwd"}
  if grad and d in autodiff.KERNEL_BACKWARD_HEAD_DIMS:  # (else `blockwise`'s, in XLA)
    kernels |= {"dq", "dkv_split" if d >= config_lib.SPLIT_DKV_HEAD_DIM else "dkv"}
  for name in kernels:
    assert f"flash_attn_hopper_{name}_mosaic_gpu" in text, f"no {name} kernel in the program"


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("feature", list(FEATURES))
def test_head_dim_256_backward_runs_the_split_kernel(feature):
  """At D 256 the gradients come from dQ (32-key blocks) and the split dK/dV kernel."""
  text = _lower(256, True, **dict(FEATURES[feature]))
  for name in ("fwd", "dq", "dkv_split"):
    assert f"flash_attn_hopper_{name}_mosaic_gpu" in text, f"no {name} kernel in the program"


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_balanced_tail_lowers_for_hopper(d):
  """`ForwardConfig.balanced_tail`: the forward reads its tail's tiles from a table in global
  memory. Causal at 4k, two batch elements of 8 heads: 256 pairs on 132 CTAs leave a tail."""
  assert scheduler.balanced_pairs(32, 8, 2, 128, hardware.num_sms(), [1] * 32).table
  tuned = config_lib.resolve_forward_config(d, jnp.bfloat16, True, seq_len=4096)
  cfg = dataclasses.replace(tuned, balanced_tail=True)
  text = _lower(d, False, t=4096, s=4096, is_causal=True, config=cfg)
  assert "flash_attn_hopper_fwd_mosaic_gpu" in text


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_balanced_tail_lowers_for_hopper(d, backward_schedules):
  """`BackwardConfig.balanced_tail`: both backward kernels, persistent under causal at 1k by
  the tuned table, read their tails from tables. 40 heads of two batch elements: 320 pairs of
  dQ tiles (and of dK/dV tiles; 640 of the split kernel's) on 132 CTAs leave a tail."""
  tuned = config_lib.resolve_backward_config(d, jnp.bfloat16, True, seq_len=1024)
  cfg = dataclasses.replace(tuned, balanced_tail=True)
  text = _lower(d, True, heads=(40, 40), is_causal=True, backward_config=cfg)
  split = d >= config_lib.SPLIT_DKV_HEAD_DIM
  for name in ("fwd", "dq", "dkv_split" if split else "dkv"):
    assert f"flash_attn_hopper_{name}_mosaic_gpu" in text, f"no {name} kernel in the program"
  assert [(kernel, s.table is not None) for kernel, s in backward_schedules] == [
      ("dq", True), ("dkv", True)]


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bias_gradient_lowers_for_hopper(d):
  """A differentiated bias: the dQ kernel writes dS (through staging tiles up to D 128, from
  registers at D 256), beside the dK/dV kernel's bias tiles."""
  q = jax.ShapeDtypeStruct((2, 1000, 8, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 777, 2, d), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 8, 1000, 777), jnp.bfloat16)

  def loss(q, k, v, bias):
    out = fah.dot_product_attention(q, k, v, bias, implementation="flash_attn_hopper")
    return out.astype(jnp.float32).sum()

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, kv, kv, bias).lower(
      lowering_platforms=("cuda",)).as_text()
  split = d >= config_lib.SPLIT_DKV_HEAD_DIM
  for name in ("fwd", "dq", "dkv_split" if split else "dkv"):
    assert f"flash_attn_hopper_{name}_mosaic_gpu" in text, f"no {name} kernel in the program"


def _kernel_modules(monkeypatch, d: int, **kw) -> dict[str, str]:
  """The Mosaic GPU modules of the op's gradient program, as MLIR text by kernel name (taken
  where Mosaic GPU serializes them)."""
  import jax.experimental.mosaic.gpu.core as mosaic_core  # pylint: disable=g-import-not-at-top
  modules = {}
  serialize = mosaic_core._run_serde_pass  # pylint: disable=protected-access

  def capture(module, **kwargs):
    text = module.operation.get_asm(enable_debug_info=False)
    modules[text.split("module @flash_attn_hopper_", 1)[1].split(" ", 1)[0]] = text
    return serialize(module, **kwargs)

  monkeypatch.setattr(mosaic_core, "_run_serde_pass", capture)
  _lower(d, True, **kw)
  return modules


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("feature", ["bias", "segments"])
def test_ring_slots_read_with_loads_are_fenced(monkeypatch, feature, d):
  """A ring slot read with ordinary loads goes back to TMA only after a fence between the two
  memory proxies (`pipeline.order_loads_before_tma`; without it the D 256 bias forward raced
  on the H200). The bias's tiles and the segment ids add such slots to every kernel, so each
  kernel has more proxy fences with the feature than without. The exception: the dK/dV
  kernel's step frees its shared slot once, after one fence that covers the LSE's, δ's and
  the ids' loads alike (`dkv.shares_step_barriers`), so the ids add none there."""
  from flash_attn_hopper.kernels import dkv  # pylint: disable=g-import-not-at-top
  fences = lambda modules: {name: text.count("nvvm.fence.proxy <async.shared>")
                            for name, text in modules.items()}
  without = fences(_kernel_modules(monkeypatch, d))
  with_feature = fences(_kernel_modules(monkeypatch, d, **FEATURES[feature]))
  assert set(with_feature) == set(without) and len(without) == 3, (without, with_feature)
  for name, count in with_feature.items():
    if name == "dkv" and feature == "segments" and dkv.shares_step_barriers(d):
      assert count == without[name] > 0, f"{name}: {count} proxy fences, {without[name]} without"
      continue
    assert count > without[name], f"{name}: {count} proxy fences, {without[name]} without {feature}"


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("feature", ["dense", "window", "segments", "mask"])
def test_five_matmul_backward_lowers_for_hopper(feature, d):
  """`BackwardConfig.fused_dq`: no dQ kernel; the dK/dV kernel adds dQ with TMA reduce-adds."""
  text = _lower(d, True, backward_config=config_lib.BackwardConfig(fused_dq=True),
                **dict(FEATURES[feature]))
  assert "flash_attn_hopper_dq_mosaic_gpu" not in text
  for name in ("fwd", "dkv"):
    assert f"flash_attn_hopper_{name}_mosaic_gpu" in text, f"no {name} kernel in the program"


#: The inline asm that `lax.optimization_barrier` lowers to (`kernels.common.unhoisted`).
_BARRIER = 'has_side_effects asm_dialect = att ""'


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("schedule", ["per_tile", "persistent", "paired"])
def test_dkv_epilogue_unhoisted_only_on_unpaired_persistent_ctas(monkeypatch, schedule):
  """`dkv.UNHOISTED_EPILOGUE` adds one optimization barrier to the dK/dV kernel on persistent
  CTAs without mirror pairs, and leaves the kernel that one CTA per tile or mirror pairs
  run as it was (where it was measured to lose, or has nothing to hoist out of)."""
  from flash_attn_hopper.kernels import dkv  # pylint: disable=g-import-not-at-top
  causal = schedule == "paired"
  monkeypatch.setattr(config_lib, "PERSISTENT_BACKWARD_MAX_STEPS", {} if schedule == "per_tile"
                      else {("dkv", 128, causal): 1 << 30})
  counts = []
  for unhoisted in (False, True):
    monkeypatch.setattr(dkv, "UNHOISTED_EPILOGUE", unhoisted)
    counts.append(_kernel_modules(monkeypatch, 128, is_causal=causal)["dkv"].count(_BARRIER))
  assert counts[1] - counts[0] == (1 if schedule == "persistent" else 0), counts


@pytest.mark.usefixtures("as_if_on_hopper")
def test_forward_epilogue_unhoisted_from_its_head_dim(monkeypatch):
  """The forward's epilogue goes through `common.unhoisted` from
  `forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM` on (D 256), not below it."""
  from flash_attn_hopper.kernels import forward  # pylint: disable=g-import-not-at-top
  for d in (128, 256):
    counts = []
    for min_head_dim in (1 << 30, forward.UNHOISTED_EPILOGUE_MIN_HEAD_DIM):
      monkeypatch.setattr(forward, "UNHOISTED_EPILOGUE_MIN_HEAD_DIM", min_head_dim)
      counts.append(_kernel_modules(monkeypatch, d)["fwd"].count(_BARRIER))
    assert counts[1] - counts[0] == (d >= 256), (d, counts)


@pytest.mark.usefixtures("as_if_on_hopper")
def test_dkv_step_streams_share_barriers_from_their_head_dim(monkeypatch):
  """From `dkv.SHARED_STEP_BARRIERS_MIN_HEAD_DIM` on (D 128), the dK/dV step waits once for
  Q, dO, the LSE and δ and frees their slot once (one barrier pair); at D 64 each stream
  keeps its own pair, as with the switch off."""
  from flash_attn_hopper.kernels import dkv  # pylint: disable=g-import-not-at-top
  for d in (64, 128):
    counts = []
    for shared in (False, True):
      monkeypatch.setattr(dkv, "SHARED_STEP_BARRIERS", shared)
      text = _kernel_modules(monkeypatch, d)["dkv"]
      counts.append((text.count("mbarrier.try_wait.parity"), text.count("mbarrier.init.shared")))
    if d >= 128:
      assert counts[1][0] < counts[0][0] and counts[1][1] < counts[0][1], (d, counts)
    else:
      assert counts[1] == counts[0], (d, counts)


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("feature", ["dense", "segments", "bias"])
def test_dq_kv_share_barriers_behind_their_switch(monkeypatch, feature):
  """`dq.shares_kv_barriers` puts K and V of a step on one barrier pair: fewer waits and
  barrier inits in the dQ kernel, with the keys' ids and a bias beside them; the other
  kernels wait as often as before."""
  from flash_attn_hopper.kernels import dq  # pylint: disable=g-import-not-at-top
  counts, others = [], []
  for shared in (False, True):
    monkeypatch.setattr(dq, "SHARED_KV_BARRIERS_HEAD_DIMS", {64} if shared else set())
    modules = _kernel_modules(monkeypatch, 64, **FEATURES[feature])
    text = modules["dq"]
    counts.append((text.count("mbarrier.try_wait.parity"), text.count("mbarrier.init.shared")))
    others.append({name: t.count("mbarrier.try_wait.parity") for name, t in modules.items()
                   if name != "dq"})
  assert counts[1][0] < counts[0][0] and counts[1][1] < counts[0][1], counts
  assert others[0] == others[1], others


@pytest.mark.usefixtures("as_if_on_hopper")
def test_dkv_issues_dv_before_ds_from_its_head_dim(monkeypatch):
  """From `dkv.DV_BEFORE_DS_MIN_HEAD_DIM` on (D 128), the dK/dV step waits for dPᵀ with dV
  still in flight (a wait that leaves one commit group pending, which that step had none of
  before); at D 64 its waits are the ones it had with the switch off."""
  from flash_attn_hopper.kernels import dkv  # pylint: disable=g-import-not-at-top
  waits = [f"wgmma.wait_group.sync.aligned {n};" for n in (0, 1)]
  for d in (64, 128):
    counts = []
    for min_head_dim in (1 << 30, dkv.DV_BEFORE_DS_MIN_HEAD_DIM):
      monkeypatch.setattr(dkv, "DV_BEFORE_DS_MIN_HEAD_DIM", min_head_dim)
      text = _kernel_modules(monkeypatch, d)["dkv"]
      counts.append(tuple(text.count(w) for w in waits))
    if d >= 128:
      assert counts == [(3, 0), (2, 1)], counts
    else:
      assert counts[0] == counts[1] and counts[0][1] > 0, counts


def _kernel_smem(monkeypatch, d: int, **kw) -> dict[str, int]:
  """The shared memory (bytes) that each kernel of the op's gradient program launches with,
  by kernel name (read off the modules of `_kernel_modules`)."""
  return {name: int(re.search(r"dynamic_shared_memory_size %c(\d+)_i32", text).group(1))
          for name, text in _kernel_modules(monkeypatch, d, **kw).items()}


#: What Mosaic GPU allocates past the configs' estimates: the barriers and each buffer's padding
#: to its 1 KiB alignment, 600–1,200 bytes in the race grid's configs (2026-12-05). Pallas's
#: default reduction scratch would add 2 KiB to the forward (`common.REDUCTION_SCRATCH_BYTES`).
_MOSAIC_SMEM_SLACK = 2048


@pytest.mark.usefixtures("as_if_on_hopper")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_shared_memory_estimates_match_the_kernels(monkeypatch, d, causal):
  """The configs' shared-memory estimates (which pick the tiles and whether O gets its own)
  count what the kernels allocate, short only of Mosaic's barriers and alignment, so that the
  budget's reserve (`config.SMEM_RESERVED_BYTES`) is what keeps the kernels inside 227 KiB."""
  t, dtype = 4096, jnp.bfloat16
  sizes = _kernel_smem(monkeypatch, d, is_causal=causal, t=t, s=t, dtype=dtype)
  itemsize = jnp.dtype(dtype).itemsize
  fwd = config_lib.resolve_forward_config(d, dtype, causal, seq_len=t)
  bwd = config_lib.resolve_backward_config(d, dtype, causal, seq_len=t)
  estimates = {"fwd": fwd.smem_bytes(d, itemsize, separate_o=fwd.separate_o(d, itemsize)),
               "bwd": bwd.smem_bytes(d, itemsize)}  # The larger of dQ's and dK/dV's.
  actual = {"fwd": sizes.pop("fwd"), "bwd": max(sizes.values())}
  for name, need in actual.items():
    assert 0 <= need - estimates[name] < _MOSAIC_SMEM_SLACK, (name, need, estimates[name])
    assert estimates[name] <= config_lib.SMEM_BUDGET, (name, estimates[name])
