"""The attention implementations the benchmark races, each a function (q, k, v, workload) -> out.

A `Peer` bundles that function with what the runner needs to know about it:

- `limits(workload, pass_name)` returns why the peer cannot run a cell (skipped, with the reason
  in the report), or None. Limits known in advance are declared here so that the report says
  why; anything else a peer refuses is caught per cell by the runner.
- `fixed_scale`: the logit scale a peer always applies because it takes no `scale` argument
  (JAX's Mosaic GPU FlashAttention applies none, i.e. 1.0). The runner then feeds it q
  pre-multiplied by scale / fixed_scale, computed outside the timed region, so every peer sees
  the same softmax; its numerics are checked on exactly those inputs.

Every import of an optional package happens lazily, inside `available_peers` or a peer's
function, so this module imports on a machine without a GPU or without the peers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

from flash_attn_hopper.workloads import Workload

OURS = "ours"
PEER_NAMES = ("cudnn", "xla", "mgpu", "tokamax")
PASSES = ("fwd", "bwd", "fwdbwd")


def _no_limits(workload: Workload, pass_name: str) -> str | None:
  del workload, pass_name
  return None


@dataclasses.dataclass(frozen=True)
class Peer:
  """One implementation under test."""

  name: str
  fn: Callable  # (q, k, v, workload) -> out, traceable under jax.jit / jax.vjp.
  limits: Callable[[Workload, str], str | None] = _no_limits
  fixed_scale: float | None = None
  description: str = ""


def workload_scale(workload: Workload) -> float:
  """The logit scale every cell uses: 1/sqrt(D), `jax.nn`'s default."""
  return 1.0 / math.sqrt(workload.head_dim)


# --- ours --------------------------------------------------------------------------------------

def _ours_fn(q, k, v, workload: Workload, *, interpret: bool, backward_config=None,
             deterministic: bool = True):
  """Our kernel, forced (no fallback), imported lazily so a missing op fails one cell only."""
  import flash_attn_hopper  # pylint: disable=import-outside-toplevel
  op = getattr(flash_attn_hopper, "dot_product_attention", None)
  if op is None:
    raise ImportError("flash_attn_hopper.dot_product_attention does not exist yet")
  extra = {} if backward_config is None else {"backward_config": backward_config}
  if not deterministic:
    extra["deterministic"] = False
  return op(q, k, v, scale=workload_scale(workload), is_causal=workload.is_causal,
            implementation="flash_attn_hopper", interpret=interpret, **extra)


def ours_peer(interpret: bool = False, backward_config=None, deterministic: bool = True) -> Peer:
  """Our kernel; `interpret` runs it in Pallas interpret mode (for CPU smoke runs);
  `backward_config` and `deterministic` are passed to the op (None: its tuned config)."""
  return Peer(OURS, functools.partial(_ours_fn, interpret=interpret,
                                      backward_config=backward_config,
                                      deterministic=deterministic),
              description="flash_attn_hopper (implementation='flash_attn_hopper')"
              + (", interpret=True" if interpret else "")
              + ("" if backward_config is None else f", backward_config={backward_config}")
              + ("" if deterministic else ", deterministic=False"))


# --- jax.nn: cuDNN and XLA ---------------------------------------------------------------------

def _jax_nn_fn(q, k, v, workload: Workload, *, implementation: str):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.nn.dot_product_attention(q, k, v, scale=workload_scale(workload),
                                      is_causal=workload.is_causal,
                                      implementation=implementation)


def _cudnn_limits(workload: Workload, pass_name: str) -> str | None:
  del pass_name
  if workload.dtype not in ("float16", "bfloat16"):
    return "cuDNN flash attention takes fp16/bf16 only"
  return None


def _cudnn_peer() -> Peer:
  return Peer("cudnn", functools.partial(_jax_nn_fn, implementation="cudnn"),
              limits=_cudnn_limits,
              description="jax.nn.dot_product_attention(implementation='cudnn')")


def _xla_peer() -> Peer:
  return Peer("xla", functools.partial(_jax_nn_fn, implementation="xla"),
              description="jax.nn.dot_product_attention(implementation='xla')")


# --- JAX's Mosaic GPU FlashAttention3 (jax.experimental.pallas.ops.gpu.attention_mgpu) ----------

MGPU_BLOCK_Q = 64


def _mgpu_blocks(head_dim: int) -> dict:
  """TuningConfig fields, as in JAX's own benchmark and tests for that kernel."""
  fwd_kv = 128 if head_dim <= 128 else 64
  if head_dim <= 128:  # (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv), 2 compute WGs.
    bwd = dict(block_q_dq=64, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=64,
               compute_wgs_bwd=2)
  else:
    bwd = dict(block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64,
               compute_wgs_bwd=1)
  return dict(block_q=MGPU_BLOCK_Q, block_kv=fwd_kv, max_concurrent_steps=2, **bwd)


def _mgpu_bwd_limits(workload: Workload) -> str | None:
  if workload.is_causal:
    return "mgpu has no causal backward"
  b = _mgpu_blocks(workload.head_dim)
  t, s, wgs = workload.seq_q, workload.seq_kv, b["compute_wgs_bwd"]
  if t % (b["block_q_dq"] * wgs) or t % b["block_q_dkv"]:
    return f"mgpu bwd needs T a multiple of {max(b['block_q_dq'] * wgs, b['block_q_dkv'])}"
  if s % (b["block_kv_dkv"] * wgs) or s % b["block_kv_dq"]:
    return f"mgpu bwd needs S a multiple of {max(b['block_kv_dkv'] * wgs, b['block_kv_dq'])}"
  return None


def _cuda_runtime_version() -> int | None:
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel
    return cuda_versions.cuda_runtime_get_version() if cuda_versions else None
  except Exception:  # pylint: disable=broad-except  # No CUDA here: the cell will say so.
    return None


def _mgpu_limits(workload: Workload, pass_name: str) -> str | None:
  """What attention_mgpu cannot do, so the report says why rather than an error."""
  cuda = _cuda_runtime_version()
  if workload.is_causal and cuda is not None and 12080 <= cuda < 12091:
    return "mgpu refuses causal on CUDA 12.8.0-12.9.0 (a ptxas miscompilation)"
  if workload.dtype != "float16":
    return "mgpu is fp16 only (its SMEM scratch buffers are hard-coded fp16)"
  if workload.head_dim % 64 or workload.head_dim > 256:
    return "mgpu needs head_dim a multiple of 64, at most 256"
  b = _mgpu_blocks(workload.head_dim)
  if workload.seq_q % (2 * b["block_q"]):
    return f"mgpu needs T a multiple of {2 * b['block_q']}"
  if workload.seq_kv % b["block_kv"]:
    return f"mgpu needs S a multiple of {b['block_kv']}"
  if pass_name in ("bwd", "fwdbwd"):
    return _mgpu_bwd_limits(workload)
  return None


def _mgpu_fn(q, k, v, workload: Workload):
  # pylint: disable-next=import-outside-toplevel
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(causal=workload.is_causal,
                                       **_mgpu_blocks(workload.head_dim))
  return attention_mgpu.attention(q, k, v, config, False)


def _mgpu_peer() -> Peer:
  # pylint: disable-next=import-outside-toplevel,unused-import
  from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: F401
  return Peer("mgpu", _mgpu_fn, limits=_mgpu_limits, fixed_scale=1.0,
              description="jax.experimental.pallas.ops.gpu.attention_mgpu.attention "
              "(no scale argument: fed q pre-scaled by 1/sqrt(D))")


# --- tokamax -----------------------------------------------------------------------------------

def _tokamax_fn(q, k, v, workload: Workload):
  import tokamax  # pylint: disable=import-outside-toplevel
  return tokamax.dot_product_attention(q, k, v, scale=workload_scale(workload),
                                       is_causal=workload.is_causal, implementation="mosaic")


def _tokamax_peer() -> Peer:
  import tokamax  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  return Peer("tokamax", _tokamax_fn,
              description="tokamax.dot_product_attention(implementation='mosaic')")


_FACTORIES = {"cudnn": _cudnn_peer, "xla": _xla_peer, "mgpu": _mgpu_peer,
              "tokamax": _tokamax_peer}


def available_peers(names=PEER_NAMES) -> tuple[dict[str, Peer], dict[str, str]]:
  """The peers among `names` that import here, and why each of the others does not."""
  peers, missing = {}, {}
  for name in names:
    try:
      peers[name] = _FACTORIES[name]()
    except Exception as e:  # pylint: disable=broad-except  # ImportError and friends.
      missing[name] = f"{type(e).__name__}: {e}"
  return peers, missing
