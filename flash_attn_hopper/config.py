"""Block sizes and pipeline depth of the forward kernel: a frozen config, a tuned table and the
one function that resolves them.

Resolution order (`resolve_forward_config`): an explicit config first, then the tuned table,
then a heuristic; each candidate is checked against the shared-memory estimate before any
compilation.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flash_attn_hopper import hardware
from flash_attn_hopper import pipeline

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = ("float16", "bfloat16")
SMEM_BUDGET = hardware.SMEM_BYTES_PER_CTA - hardware.SMEM_RESERVED_BYTES

#: From this head dim on, dK/dV runs `kernels/dkv_split.py`: one block of keys per CTA, one
#: compute warpgroup accumulating dV and the other dK (two (block_kv, D) float32 accumulators
#: a warpgroup would need 256 registers a thread at D 256, over the 240 it has).
SPLIT_DKV_HEAD_DIM = 256
#: Bytes of the two float16 Pᵀ slots that kernel hands between its warpgroups, per entry of
#: a (block_kv, block_q) block.
SPLIT_DKV_P_SLOT_BYTES = 2 * 2
#: Up to this head dim the dQ kernel writes a bias's gradient dS through a staging tile per
#: compute warpgroup and TMA. Above it the tiles do not fit (at D 256 they would take the dQ
#: kernel to 230,400 bytes), so each thread stores its dS fragment from registers into an
#: array padded to whole tiles.
DS_STAGING_MAX_HEAD_DIM = 128
#: Head dims of `BackwardConfig.fused_dq` (the two-warpgroup dK/dV kernel's; D 256 runs the
#: split kernel, which has no room for dQ's buffers).
FUSED_DQ_HEAD_DIMS = (64, 128)
#: `fused_dq` double-buffers the dSᵀ tiles that both warpgroups read, so that one
#: warpgroup's next dSᵀ never overwrites a tile the other is still multiplying.
FUSED_DQ_DS_BUFFERS = 2
#: Columns of dQ one warpgroup computes in a `fused_dq` step: K's tile is the B operand, and
#: wgmma cannot slice a B operand inside one 128-byte swizzle row (64 16-bit entries). At
#: D 128 each warpgroup takes one half of the columns every step; at D 64 the warpgroups
#: take turns, one whole step each.
FUSED_DQ_COLUMNS = 64
#: `BackwardConfig.dq_block_kv` is a multiple of this: the dQ kernel's keys per step are the
#: N of its S = Q Kᵀ and dP = dO Vᵀ wgmmas and the K of dQ += dS K, and 32 keys keep K's and
#: V's ring tiles, the keys' segment ids and a mask's one-byte tiles (32 bytes a row) in
#: shapes that TMA and the swizzled wgmma operands take.
DQ_BLOCK_KV_MULTIPLE = 32


def split_bias_stages(num_stages: int, full_bytes: int) -> int:
  """The depth of the split dK/dV kernel's ring of bias tiles, given the kernel's shared
  memory `full_bytes` with it `num_stages` deep: that, where it fits, else one slot (a
  two-byte bias at D 256: 230,400 bytes with two, 222,208 with one)."""
  return num_stages if full_bytes <= SMEM_BUDGET else 1


def _validate_tiles(cfg) -> None:
  """Checks block_q, block_kv and num_stages of a config; errors name the field."""
  name = type(cfg).__name__
  for field in ("block_q", "block_kv", "num_stages"):
    value = getattr(cfg, field)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
      raise TypeError(f"{name}.{field} must be an int, got {value!r}")
  if cfg.block_q <= 0 or cfg.block_q % hardware.WGMMA_ROWS:
    raise ValueError(f"{name}.block_q must be a positive multiple of {hardware.WGMMA_ROWS}, "
                     f"got {cfg.block_q}")
  if cfg.block_kv <= 0 or cfg.block_kv % 64:
    raise ValueError(f"{name}.block_kv must be a positive multiple of 64, got {cfg.block_kv}")
  if cfg.num_stages < 2:
    raise ValueError(f"{name}.num_stages must be at least 2, got {cfg.num_stages}")


def _validate_optional_stages(cfg, field: str) -> None:
  """Checks a ring depth that may be None (then the config's num_stages) or an int >= 1."""
  stages = getattr(cfg, field)
  if stages is not None and (not isinstance(stages, (int, np.integer))
                             or isinstance(stages, bool) or stages < 1):
    raise ValueError(f"{type(cfg).__name__}.{field} must be None or an int >= 1, got "
                     f"{stages!r}")


def _validate_optional_multiple(cfg, field: str, multiple: int) -> None:
  """Checks a block size that may be None (then the config's own) or a positive multiple
  of `multiple`."""
  value = getattr(cfg, field)
  if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                            or value <= 0 or value % multiple):
    raise ValueError(f"{type(cfg).__name__}.{field} must be None or a positive multiple of "
                     f"{multiple}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """Tile shape of the forward kernel.

  Attributes:
    block_q: query rows per compute warpgroup (the CTA covers 2·block_q rows). A multiple of
      64, the wgmma M.
    block_kv: keys per pipeline step. A multiple of 64 (the TMA/swizzle tile).
    num_stages: K/V slots in the shared-memory ring, at least 2 so that a load overlaps compute.
    overlap_softmax: FA3's intra-warpgroup overlap: each step issues S = QKᵀ of its block and
      O += PV of the block before, and runs the softmax while PV is on the tensor cores
      (one more S block in registers). Taken where no block needs an element mask, or where
      each warpgroup's one masked block can go first (causal's diagonal; without a band, the
      block holding the keys' end under key lengths or a ragged S); with a bias or a mask, by
      the tiles it leaves fully visible. Windows and segment ids keep the plain loop.
    bias_num_stages: slots of the ring of bias (or mask) tiles when it must differ from
      `num_stages` (None: the same). At D 256 a 16-bit bias fits with one: its tile is read
      before P V, so one slot still lets the next tile load under P V and the next QKᵀ.
    balanced_tail: under causal, deal the last rounds of tile pairs as single tiles, longest
      first, to the least loaded CTA (`scheduler.balanced_pairs`), instead of leaving part
      of the SMs idle in the last round. Not yet measured on a GPU: off in the tuned tables.
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  overlap_softmax: bool = False
  bias_num_stages: int | None = None
  balanced_tail: bool = False

  def __post_init__(self):
    _validate_tiles(self)
    for field in ("overlap_softmax", "balanced_tail"):
      if not isinstance(getattr(self, field), bool):
        raise TypeError(f"ForwardConfig.{field} must be a bool, got "
                        f"{getattr(self, field)!r}")
    _validate_optional_stages(self, "bias_num_stages")

  @property
  def bias_stages(self) -> int:
    """Slots of the ring of bias tiles."""
    return self.num_stages if self.bias_num_stages is None else self.bias_num_stages

  @property
  def rows_per_cta(self) -> int:
    return pipeline.NUM_COMPUTE_WARPGROUPS * self.block_q

  def smem_bytes(self, head_dim: int, itemsize: int, separate_o: bool = False,
                 segments: bool = False, bias_bytes: int = 0) -> int:
    """Shared memory the kernel allocates: Q tiles (and O tiles when `separate_o`), the K/V
    ring and the LSE tiles (and with `segments`, the int32 ids of the Q tiles and a ring of
    the keys' ids; with a bias of `bias_bytes` per element (1 for a mask), a ring of
    (CTA rows × block_kv) bias tiles)."""
    q_tiles = pipeline.NUM_COMPUTE_WARPGROUPS * self.block_q * head_dim * itemsize
    kv_ring = 2 * self.num_stages * self.block_kv * head_dim * itemsize
    lse_tiles = pipeline.NUM_COMPUTE_WARPGROUPS * self.block_q * 4
    ids = (pipeline.NUM_COMPUTE_WARPGROUPS * self.block_q + self.num_stages * self.block_kv) * 4
    bias_ring = self.bias_stages * self.rows_per_cta * self.block_kv * bias_bytes
    return q_tiles * (2 if separate_o else 1) + kv_ring + lse_tiles + \
        (ids if segments else 0) + bias_ring

  def fits(self, head_dim: int, itemsize: int, separate_o: bool = False,
           segments: bool = False, bias_bytes: int = 0) -> bool:
    """Whether the tiles fit the shared-memory budget."""
    return self.smem_bytes(head_dim, itemsize, separate_o, segments, bias_bytes) <= SMEM_BUDGET

  def separate_o(self, head_dim: int, itemsize: int, segments: bool = False,
                 bias_bytes: int = 0) -> bool:
    """Whether the kernel gives O its own tiles, so that the next Q tile loads under the
    epilogue: only when those tiles fit the budget too. The one place this is decided."""
    return self.fits(head_dim, itemsize, separate_o=True, segments=segments,
                     bias_bytes=bias_bytes)

  def check_fits(self, head_dim: int, itemsize: int, segments: bool = False,
                 bias_bytes: int = 0) -> None:
    """Raises ValueError, naming the fields to shrink, when the tiles overflow shared memory."""
    need = self.smem_bytes(head_dim, itemsize, segments=segments, bias_bytes=bias_bytes)
    budget = SMEM_BUDGET
    if need > budget:
      more = " or ForwardConfig.bias_num_stages" if bias_bytes else ""
      raise ValueError(
          f"{self} needs {need} bytes of shared memory at head_dim={head_dim}, over the "
          f"{budget}-byte budget; lower ForwardConfig.block_kv or ForwardConfig.num_stages"
          f"{more}")


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tile shape of the backward kernels (not tuned yet; see the backward issue).

  Attributes:
    block_q: query rows per compute warpgroup in dQ, and per pipeline step in dK/dV.
    block_kv: keys per pipeline step in dQ, and per compute warpgroup in dK/dV.
    num_stages: slots of each streamed tensor's shared-memory ring.
  """

  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2
  #: Stages of the dQ kernel's K/V ring when it must differ from `num_stages` (None: the
  #: same). At D 256 one stage of 64 keys is all that fits beside two warpgroups' Q and dO
  #: tiles; `dq_block_kv` 32 fits two.
  dq_num_stages: int | None = None
  #: Keys per step of the dQ kernel's K/V ring when it must differ from `block_kv` (None: the
  #: same): a multiple of DQ_BLOCK_KV_MULTIPLE. At D 256, 32 keys let that ring take two
  #: stages in the shared memory of one 64-key stage (`TUNED_BACKWARD`).
  dq_block_kv: int | None = None
  #: Query rows per compute warpgroup of the dQ kernel when they must differ from `block_q`
  #: (None: the same), a multiple of the wgmma tile's 64 rows: at D 64 causal from 4k on,
  #: dK/dV streams 128-row query blocks and dQ runs faster on 64 (`TUNED_BACKWARD_LONG`).
  dq_block_q: int | None = None
  #: FA3's five-matmul backward: no dQ kernel; the dK/dV kernel also computes dQ and adds it
  #: into a float32 accumulator with TMA reduce-adds in no fixed order, so dQ's bits may
  #: change from run to run (`kernels/fused_dq.py`). The op's `deterministic=False` takes it
  #: where it measured faster (`TUNED_BACKWARD_FUSED`). D 64 and 128, and not beside a
  #: bias's gradient (dS).
  fused_dq: bool = False
  #: Under a causal bound, where a kernel runs on persistent CTAs in mirror pairs
  #: (`kernels/common.backward_schedule`), deal the last rounds of pairs as single tiles,
  #: longest first, to the least loaded CTA (`scheduler.balanced_pairs`), as
  #: `ForwardConfig.balanced_tail` does the forward's. Not yet measured on a GPU: off in the
  #: tuned tables.
  balanced_tail: bool = False

  def __post_init__(self):
    _validate_tiles(self)
    _validate_optional_stages(self, "dq_num_stages")
    _validate_optional_multiple(self, "dq_block_kv", DQ_BLOCK_KV_MULTIPLE)
    _validate_optional_multiple(self, "dq_block_q", hardware.WGMMA_ROWS)
    for field in ("fused_dq", "balanced_tail"):
      if not isinstance(getattr(self, field), (bool, np.bool_)):
        raise TypeError(f"BackwardConfig.{field} must be a bool, got "
                        f"{getattr(self, field)!r}")
    if self.dq_block_q is not None and self.fused_dq:
      raise ValueError("BackwardConfig.dq_block_q sizes the dQ kernel, which fused_dq=True "
                       "does without; leave dq_block_q None")

  @property
  def dq_stages(self) -> int:
    """Slots of the dQ kernel's K/V ring."""
    return self.num_stages if self.dq_num_stages is None else self.dq_num_stages

  @property
  def dq_keys(self) -> int:
    """Keys per step of the dQ kernel's K/V ring."""
    return self.block_kv if self.dq_block_kv is None else self.dq_block_kv

  @property
  def dq_rows(self) -> int:
    """Query rows per compute warpgroup of the dQ kernel."""
    return self.block_q if self.dq_block_q is None else self.dq_block_q

  def for_dq(self) -> "BackwardConfig":
    """This config as the dQ kernel reads it: `block_q` is its `dq_rows`."""
    return dataclasses.replace(self, block_q=self.dq_rows, dq_block_q=None)

  def smem_bytes(self, head_dim: int, itemsize: int, segments: bool = False,
                 bias_bytes: int = 0, bias_grad: bool = False) -> int:
    """Shared memory of the larger of the two kernels.

    dQ: Q and dO tiles per compute warpgroup, their LSE and δ, and the K/V ring (with
    `bias_grad` up to DS_STAGING_MAX_HEAD_DIM, a (block_q × block_kv) staging tile of dS
    per compute warpgroup).
    dK/dV: K and V tiles per compute warpgroup, and the ring of Q, dO, LSE and δ.
    (With `segments`, each adds its int32 ids: one tile's and a ring's; with a bias, a ring
    of (2·block × block) bias tiles of `bias_bytes` per element, 1 for a mask.)
    With `fused_dq` there is no dQ kernel: the dK/dV kernel's, plus its dQ buffers."""
    if self.fused_dq:
      return (self._dkv_smem_bytes(head_dim, itemsize, segments, bias_bytes)
              + self.fused_dq_smem_bytes(itemsize))
    wgs = pipeline.NUM_COMPUTE_WARPGROUPS
    q_rows = wgs * self.dq_rows
    dq = (2 * q_rows * head_dim * itemsize + 2 * q_rows * 4
          + 2 * self.dq_stages * self.dq_keys * head_dim * itemsize
          + self.dq_stages * q_rows * self.dq_keys * bias_bytes
          + (q_rows * self.dq_keys * itemsize
             if bias_grad and head_dim <= DS_STAGING_MAX_HEAD_DIM else 0))
    if segments:
      dq += (q_rows + self.dq_stages * self.dq_keys) * 4
    return max(dq, self._dkv_smem_bytes(head_dim, itemsize, segments, bias_bytes))

  def _dkv_smem_bytes(self, head_dim: int, itemsize: int, segments: bool,
                      bias_bytes: int) -> int:
    """The dK/dV kernel's: K and V tiles, the ring of Q, dO, the LSE and δ, and from
    SPLIT_DKV_HEAD_DIM on (`kernels/dkv_split.py`, whose `smem_bytes` this mirrors; a test
    checks that they agree) one key block per CTA and the two Pᵀ slots between its
    warpgroups (and a bias ring `split_bias_stages` deep), else a key block per compute
    warpgroup."""
    split = head_dim >= SPLIT_DKV_HEAD_DIM
    kv_rows = self.block_kv * (1 if split else pipeline.NUM_COMPUTE_WARPGROUPS)
    ring = self.num_stages * self.block_q * (2 * head_dim * itemsize + 2 * 4)
    p_slots = SPLIT_DKV_P_SLOT_BYTES * kv_rows * self.block_q if split else 0
    ids = (kv_rows + self.num_stages * self.block_q) * 4 if segments else 0
    rest = 2 * kv_rows * head_dim * itemsize + ring + p_slots + ids
    bias_tile = kv_rows * self.block_q * bias_bytes
    stages = self.num_stages
    if split:
      stages = split_bias_stages(stages, rest + stages * bias_tile)
    return rest + stages * bias_tile

  def fused_dq_smem_bytes(self, itemsize: int) -> int:
    """The extra shared memory of `fused_dq` (`kernels/fused_dq.py`, whose `smem_types` this
    mirrors): two buffers of both warpgroups' dSᵀ tiles (block_kv × block_q, input dtype),
    and a float32 (block_q × FUSED_DQ_COLUMNS) staging tile of dQ per warpgroup."""
    wgs = pipeline.NUM_COMPUTE_WARPGROUPS
    ds = FUSED_DQ_DS_BUFFERS * wgs * self.block_kv * self.block_q * itemsize
    return ds + wgs * self.block_q * FUSED_DQ_COLUMNS * 4

  def check_fits(self, head_dim: int, itemsize: int, segments: bool = False,
                 bias_bytes: int = 0, bias_grad: bool = False) -> None:
    """Raises ValueError, naming the fields to shrink, when the tiles overflow shared memory
    (or `fused_dq` meets what it does not support)."""
    if self.fused_dq and head_dim not in FUSED_DQ_HEAD_DIMS:
      raise ValueError(f"BackwardConfig.fused_dq supports head_dim in {FUSED_DQ_HEAD_DIMS}, "
                       f"got head_dim={head_dim}; set fused_dq=False")
    if self.fused_dq and bias_grad:
      raise ValueError("BackwardConfig.fused_dq cannot give a bias its gradient (that needs "
                       "the dQ kernel's dS); set fused_dq=False, or stop the bias's "
                       "gradient")
    if head_dim >= SPLIT_DKV_HEAD_DIM and self.block_kv != hardware.WGMMA_ROWS:
      raise ValueError(
          f"BackwardConfig.block_kv must be {hardware.WGMMA_ROWS} at head_dim={head_dim} (the "
          f"split dK/dV kernel's one wgmma M of keys per CTA); got {self.block_kv}")
    need = self.smem_bytes(head_dim, itemsize, segments, bias_bytes, bias_grad)
    if need > SMEM_BUDGET:
      raise ValueError(
          f"{self} needs {need} bytes of shared memory at head_dim={head_dim}, over the "
          f"{SMEM_BUDGET}-byte budget; lower BackwardConfig.block_q, block_kv or num_stages, "
          f"or set dq_num_stages=1, a smaller dq_block_kv or dq_block_q (dQ's)")


# Tuned on an H200 with jax 0.11.2, 2026-11-29, float16, by
#   python -m bench.autotune --head-dims 64,128 --seq-lens 1024,4096 --block-kv 128,192,256
# (geometric mean over T of the race grid's shapes). D 128 and 256 have no other candidate
# that fits with two stages: (128, 128, 3) and (256, 128, 2) overflow shared memory.
# D 64 retuned 2026-11-30 (jax 0.11.2, H200, fp16, race grid, interleaved against cuDNN) by
#   python3 scripts/ab_configs.py --head-dim 64 --configs tuned 64,256,2 ...
# ratio to cuDNN (the old entry → this one): causal, block_kv 256 and 2 stages over 128 and 2:
# 1k 0.870 → 0.869, 2k 0.912 → 0.944, 4k 0.932 → 0.987, 8k 0.941 → 1.013, 16k 0.944 → 1.026;
# without causal, 2 stages over 3 at 1k: 0.921 → 0.997 (4k 1.008 / 1.009, 8k 1.020 / 1.011,
# 16k 1.009 / 0.966: `TUNED_FORWARD_LONG` keeps 3 from 4k on). block_q 128 lost everywhere
# (0.65–0.96×), and D 128's block_kv 64 with 3 or 4 stages lost 7–23% to its entry.
# Keys: (head_dim, is_causal).
TUNED_FORWARD: dict[tuple[int, bool], ForwardConfig] = {
    (64, False): ForwardConfig(block_q=64, block_kv=256, num_stages=2),
    (64, True): ForwardConfig(block_q=64, block_kv=256, num_stages=2),
    (128, False): ForwardConfig(block_q=64, block_kv=128, num_stages=2,   # 515.9 TFLOP/s
                                overlap_softmax=True),
    (128, True): ForwardConfig(block_q=64, block_kv=128, num_stages=2,    # 436.8
                               overlap_softmax=True),
    (256, False): ForwardConfig(block_q=64, block_kv=64, num_stages=2, overlap_softmax=True),
    (256, True): ForwardConfig(block_q=64, block_kv=64, num_stages=2, overlap_softmax=True),
}
# Long sequences that prefer another forward config: (head_dim, is_causal) → steps (from this
# many queries on, config), in ascending order, measured as above.
TUNED_FORWARD_LONG: dict[tuple[int, bool], tuple[tuple[int, ForwardConfig], ...]] = {
    (64, False): ((4096, ForwardConfig(block_q=64, block_kv=256, num_stages=3)),),
}
# overlap_softmax, from an interleaved A/B on the H200 (jax 0.11.2, 2026-11-30, fp16, B·T = 16k,
# hidden 2048, CUPTI, `python3 scripts/ab_forward_overlap.py`), forward ms without → with
# it; the outputs were bitwise equal. It pays without causal at D 128 and 256 only:
#   D 128: 1k 0.241 → 0.228, 4k 0.867 → 0.830, 16k 3.380 → 3.298
#   D 256: 1k 0.238 → 0.224, 4k 0.832 → 0.772, 16k 3.217 → 2.983
#   D 64 (block_kv 128 or 256) loses 11–28%. With element-masked blocks (causal) it lost
#   25–44%, and still 1–6% when the masked blocks were awaited before masking (ptxas injects
#   `warpgroup.arrive` around the masked step), so it is taken only without them, or under
#   causal with the diagonal block first (`forward._diagonal_first`, FA3's order), where the
#   mask runs with no PV in flight. Causal, ratio to cuDNN without → with it (2026-11-30,
#   same script and setup, `scripts/ab_configs.py --causal yes --configs tuned 64,128,2,o`):
#   D 128: 1k 1.005 → 1.043, 4k 1.050 → 1.072, 16k 1.045 → 1.059
#   D 256: 1k 0.993 → 1.043, 4k 1.039 → 1.056, 16k 1.036 → 1.047
#   D 64 (block_kv 256 or 128): 4k 0.993 → 0.730 / 0.913, 16k 1.027 → 0.800 / 0.908.


# The backward kernels' blocks, keys (head_dim, is_causal). Tuned on an H200 with jax 0.11.2,
# 2026-11-30, bfloat16, fwd+bwd timed, gradients checked against cuDNN's, by
#   python -m bench.autotune --backward --head-dims 128,64 --seq-lens 1024,4096 --repeats 5
# (bench/results/autotune_backward.json; geometric mean over T of the race grid's shapes, in
# fwd+bwd TFLOP/s, against (64, 64, 2) beside it). block_kv 128 spills registers in dQ and
# runs at half speed; block_q 128 pays only at D 64 without causal (at D 128, (128, 64, 2)
# ran at 0.52–0.60× cuDNN against the entry's 0.88–0.96×: 2026-12-04, bf16, 4k and 16k,
# causal and not, `scripts/ab_configs.py`, bench/results/h200_dkv_d128_block_q128_ab.log).
# dQ alone on 64-row tiles beside dK/dV's 128 (`dq_block_q`) pays at D 64 under causal from
# 4k (`TUNED_BACKWARD_LONG`), not without causal; at D 128, 128-row tiles halve both
# kernels' speed (2026-12-04, bench/results/h200_dq_block_q_ab.md).
# D 256: the split dK/dV kernel takes block_kv 64, and dQ's ring two stages of 32 keys
# (`dq_block_kv`) in the shared memory of the one 64-key stage it had: measured on the H200
# (jax 0.11.2, 2026-12-03, B·T = 16k, hidden 2048, CUPTI, gradients checked against cuDNN's;
# bench/results/h200_dq_32_keys_ab.log) by
#   python3 scripts/ab_configs.py --backward --head-dim 256 --configs tuned 64,64,2,2,32 ...
# fwd+bwd ms, one 64-key stage → two 32-key stages, bf16: 1k 1.220 → 1.040, 4k 4.450 → 3.651,
# 16k 17.748 → 15.895; causal 0.804 → 0.679, 2.424 → 2.056, 8.770 → 7.561 (fp16 4k 4.443 →
# 3.741, causal 2.441 → 2.090). ptxas: dQ's spills 320 / 332 bytes → none (causal 792 / 824 →
# 4 / 8).
# A tuned entry that does not fit beside segment ids or a mask gives way to the default.
TUNED_BACKWARD: dict[tuple[int, bool], BackwardConfig] = {
    (64, False): BackwardConfig(block_q=128, block_kv=64, num_stages=2),  # 368.3 (326.8)
    (64, True): BackwardConfig(block_q=64, block_kv=64, num_stages=3),    # 281.7 (271.6)
    (128, False): BackwardConfig(block_q=64, block_kv=64, num_stages=2),  # 460.9
    (128, True): BackwardConfig(block_q=64, block_kv=64, num_stages=3),   # 361.0 (348.0)
    (256, False): BackwardConfig(dq_block_kv=32), (256, True): BackwardConfig(dq_block_kv=32),
}

# The most ring steps a tile may stream for a backward kernel to run on persistent CTAs
# (`scheduler`: a CTA per SM looping over tiles, mirror pairs under causal), keys (kernel,
# head_dim, is_causal: a causal bound with no window on the left); past it, and for any key
# not here, one CTA per tile (`kernels/common.backward_schedule`). A dQ tile streams
# S / block_kv steps, a dK/dV tile group · T / block_q. Neither a bias nor segment ids go
# persistent, nor a ring of one stage. Measured on an H200 with jax 0.11.2,
# 2026-12-02, bf16 fwd+bwd, B·T = 16k, hidden 2048, each kernel's time from the same profile,
# every tile persistent against one CTA per tile, by
#   PYTHONPATH=. python3 scripts/ab_backward_schedule.py 64,128 1024,2048,4096 bfloat16
# (bench/results/h200_backward_schedule_ab.log):
#   causal: dK/dV gained 2–9% at 1k, 2k and 4k (16–64 steps); dQ gained 3–11% at 1k and 2k
#     and lost ~1% at 4k; at 16k (256 steps) fwd+bwd lost 1–4% (seventeenth session);
#   not causal, D 128: dK/dV gained 2–5% at 1k and 2k and nothing at 4k (two runs: 1.728
#     and 1.742 ms persistent against 1.763, 1.735 and 1.713 per tile); dQ gained 3% at 1k
#     only and lost 2–4% past it;
#   not causal, D 64: dQ lost 4–10%, dK/dV 0–4%.
# D 256's split dK/dV kernel (`kernels/dkv_split.py`, one 64-key block a tile), 2026-12-02,
# same setup, by `... ab_backward_schedule.py 256 1024,2048,4096 bfloat16 per_tile,persistent`
# (bench/results/h200_dkv_split_persistent_ab.log): dK/dV gained at 16, 32 and 64 steps, not
# causal 3.3%, 1.9%, 1.9%, causal 4.8%, 4.1%, 2.4% (fwd+bwd 0.7–1.7 points of cuDNN); at 16k
# (256 steps) causal dK/dV lost 1.6%. (Off at the nineteenth session's end, until the two
# warpgroups met on tiles with no step: `dkv_split._meet_if_empty`.)
# D 256's dQ on 32-key blocks (two stages; `TUNED_BACKWARD`), 2026-12-03, same setup, by
# `... ab_backward_schedule.py 256 1024,2048,4096 bfloat16 tuned,persistent`
# (bench/results/h200_dq_d256_persistent_ab.log), dQ ms per tile → persistent: causal 0.230 →
# 0.214, 0.396 → 0.371, 0.730 → 0.692 (32, 64 and 128 steps; 0.229 → 0.214 and 0.739 →
# 0.699 in a second run with the entry); not causal 0.348 → 0.356, 0.643 → 0.688, 1.250 →
# 1.413. With S and dP issued together (`kernels/dq.py`, since 2026-12-03), same setup,
# both kernels persistent at every length against the table before this entry (128 steps), by
# `... ab_backward_schedule.py 256 1024,4096,8192,16384 bfloat16 tuned,persistent`, two runs
# (bench/results/h200_dq_d256_persistent_8k_16k_ab.log; gradients bitwise equal), dQ ms:
# causal 8k (256 steps) 1.371 → 1.266 and 1.372 → 1.266 (the dK/dV kernel, 128 steps, lost
# 1% there, so it stays per tile), causal 16k (512 steps) 2.424 → 2.583 and 2.413 → 2.584;
# not causal at 8k 2.645 → 2.528 in one run and 2.508 → 2.577 in the other, flat at 1k, 4k
# and 16k: not taken.
PERSISTENT_BACKWARD_MAX_STEPS: dict[tuple[str, int, bool], int] = {
    ("dq", 64, True): 32, ("dq", 128, True): 32, ("dq", 128, False): 16,
    ("dkv", 64, True): 64, ("dkv", 128, True): 64, ("dkv", 128, False): 32,
    ("dkv", 256, True): 64, ("dkv", 256, False): 64, ("dq", 256, True): 256,
}

# Long sequences that prefer another backward config: (head_dim, is_causal) → steps (from this
# many queries on, config), in ascending order. At D 128 causal the third stage pays at 1k
# and 4k but not at 16k: in one grid run on the H200 (2026-11-30, bf16, fwd+bwd TFLOP/s) 3
# stages gave 308 / 421 / 457 at T = 1k / 4k / 16k and 2 stages 296 / 408 / 489
# (bench/results/h200_backward.md, h200_d128_causal_2stages.md). 8k is not measured: the
# crossover lies between 4k and 16k. At D 64 causal, 128-row query tiles pay from 2k on
# (H200, jax 0.11.2, 2026-12-03, bf16, B·T = 16k, hidden 2048, interleaved with cuDNN, CUPTI;
# bench/results/h200_d64_causal_block_q_ab.log), by
#   PYTHONPATH=.:scripts python3 scripts/ab_configs.py --backward --head-dim 64 --causal yes
#       --dtype bfloat16 --configs tuned 128,64,2 128,64,3
# fwd+bwd ratio to cuDNN, (64, 64, 3) → (128, 64, 2): 1k 1.018 → 0.996, 4k 0.932 → 0.948,
# 16k 0.896 → 0.955 ((128, 64, 3): 0.918, 0.938, 0.935); at 2k (2026-12-03, same setup,
# bench/results/h200_d64_causal_2k_ab.log) 0.964 → 0.982, so from 2k on. From 4k on dQ takes
# 64-row tiles beside them (`dq_block_q`; dK/dV keeps 128): dQ ms, 128 → 64 rows (2026-12-04,
# same setup, `... --configs tuned 128,64,2,-,-,64` and the reverse, two calls;
# bench/results/h200_dq_rows_ab.log, h200_dq_rows_causal_ab.log): bf16 4k 0.819 → 0.795, 16k
# 3.136 → 2.940 and 3.113 → 2.945; fp16 4k 0.836 → 0.804, 16k 3.203 → 3.006 (fwd+bwd 0.8–2.6%
# faster); at 2k 0.432 → 0.442 (bf16) and 0.436 → 0.446 (fp16), so not there. Without causal
# it paid nowhere (bf16 4k 1.388 → 1.465, 8k 2.796 → 2.922, 16k 5.806 → 5.834; fp16 8k
# 2.846 → 2.890, 16k 5.967 → 6.042; bench/results/h200_dq_block_q_ab.md has an earlier run).
_D64_CAUSAL_LONG = BackwardConfig(block_q=128, block_kv=64, num_stages=2)
TUNED_BACKWARD_LONG: dict[tuple[int, bool], tuple[tuple[int, BackwardConfig], ...]] = {
    (64, True): ((2048, _D64_CAUSAL_LONG),
                 (4096, dataclasses.replace(_D64_CAUSAL_LONG, dq_block_q=64))),
    (128, True): ((8192, BackwardConfig(block_q=64, block_kv=64, num_stages=2)),),
}


def _tuned(table: dict, long_table: dict, head_dim: int, is_causal: bool, seq_len: int):
  """The tuned entry for (head_dim, is_causal), or the last long-sequence step that
  `seq_len` queries reach; None where neither table has one."""
  key = (head_dim, bool(is_causal))
  reached = [config for start, config in long_table.get(key, ()) if seq_len >= start]
  return reached[-1] if reached else table.get(key)


# Where the five-matmul backward (`BackwardConfig.fused_dq`) beat the deterministic kernels:
# (head_dim, is_causal) → (from this many queries on, config); `deterministic=False` takes it
# there and the deterministic kernels elsewhere. Interleaved A/B on an H200, jax 0.11.2,
# 2026-12-01, bf16 fwd+bwd, B·T = 16k tokens, hidden 2048, CUPTI, best of 2 rounds, by
#   python3 scripts/ab_configs.py --backward --head-dim D --causal both --configs tuned fused
# (bench/results/h200_fused_dq_ab.log), ms deterministic → fused:
#   D 128 non-causal: 1k 1.110 → 1.358, 4k 3.718 → 3.947, 16k 15.543 → 15.104 (kept)
#   D 128 causal:     1k 0.730 → 0.980, 4k 2.043 → 2.485, 16k 7.873 → 7.925
#   D 64 non-causal:  1k 1.267 → 1.506, 4k 4.426 → 5.086, 16k 18.144 → 19.454
#   D 64 causal:      1k 0.959 → 1.014, 4k 2.635 → 2.689, 16k 9.991 → 8.941 (kept)
# 8k is not measured: the crossovers lie between 4k and 16k. Those runs issued dQ's product
# after dK and dV; in FA3's order (dV, dQ, dK, as now), the same session, the kept cells
# read 15.631 → 15.077 (D 128) and 9.770 → 9.320 (D 64 causal), D 128 non-causal 4k
# 3.783 → 3.848 and D 64 non-causal 4k 4.565 → 5.257 (still not taken;
# bench/results/h200_fused_dq_fa3_order.log).
TUNED_BACKWARD_FUSED: dict[tuple[int, bool], tuple[int, BackwardConfig]] = {
    (128, False): (16384, BackwardConfig(fused_dq=True)),
    (64, True): (16384, BackwardConfig(fused_dq=True)),
}


def _fused_config(head_dim: int, itemsize: int, is_causal: bool, segments: bool,
                  bias_bytes: int, seq_len: int) -> BackwardConfig | None:
  """The five-matmul config where it measured faster (`TUNED_BACKWARD_FUSED`) and fits;
  else None."""
  entry = TUNED_BACKWARD_FUSED.get((head_dim, bool(is_causal)))
  if entry is None or seq_len < entry[0]:
    return None
  try:
    entry[1].check_fits(head_dim, itemsize, segments, bias_bytes)
  except ValueError:
    return None
  return entry[1]


def resolve_backward_config(head_dim: int, dtype, is_causal: bool,
                            config: BackwardConfig | None = None,
                            segments: bool = False, bias_bytes: int = 0,
                            seq_len: int = 0, bias_grad: bool = False,
                            deterministic: bool = True) -> BackwardConfig:
  """Picks the backward config: explicit, else tuned (for `seq_len` queries), else the
  default; checked to fit (`bias_bytes` per element of a bias ring: 0 none, 1 a mask;
  `bias_grad`: with dS's staging tiles). Without `deterministic` (and without `bias_grad`)
  the tuned pick is the five-matmul backward where it measured faster
  (`TUNED_BACKWARD_FUSED`)."""
  itemsize = np.dtype(dtype).itemsize
  if config is None and not deterministic and not bias_grad:
    config = _fused_config(head_dim, itemsize, is_causal, segments, bias_bytes, seq_len)
  if config is None:
    config = _tuned(TUNED_BACKWARD, TUNED_BACKWARD_LONG, head_dim, is_causal, seq_len)
    config = BackwardConfig() if config is None else config
    try:
      config.check_fits(head_dim, itemsize, segments, bias_bytes, bias_grad)
    except ValueError:
      config = BackwardConfig()
  elif not isinstance(config, BackwardConfig):
    raise TypeError(f"backward_config must be a BackwardConfig, got {type(config).__name__}")
  config.check_fits(head_dim, itemsize, segments, bias_bytes, bias_grad)
  return config


def _pick(tuned: ForwardConfig | None, head_dim: int, itemsize: int, segments: bool = False,
          bias_bytes: int = 0) -> ForwardConfig:
  """The first that fits of: the tuned config, then the deepest ring of the widest KV block;
  with a bias, then each of those with a one-slot ring of bias tiles (D 256)."""
  candidates = [] if tuned is None else [tuned]
  candidates += [ForwardConfig(block_q=64, block_kv=block_kv, num_stages=num_stages)
                 for block_kv in (128, 64) for num_stages in (3, 2)]
  if bias_bytes:
    candidates += [dataclasses.replace(cfg, bias_num_stages=1) for cfg in candidates]
  for cfg in candidates:
    if cfg.fits(head_dim, itemsize, segments=segments, bias_bytes=bias_bytes):
      return cfg
  raise ValueError(f"no forward config fits shared memory at head_dim={head_dim}"
                   + (" beside a bias's tiles" if bias_bytes else ""))


def resolve_forward_config(head_dim: int, dtype, is_causal: bool,
                           config: ForwardConfig | None = None,
                           segments: bool = False, bias_bytes: int = 0,
                           seq_len: int = 0) -> ForwardConfig:
  """Picks the forward config: explicit, else tuned (for `seq_len` queries), else heuristic;
  checked to fit (with the segment ids' buffers when `segments`, the bias ring when
  `bias_bytes`). A tuned config that does not fit beside a bias gives way to the heuristic
  (`_pick`)."""
  itemsize = np.dtype(dtype).itemsize
  if config is None:
    tuned = _tuned(TUNED_FORWARD, TUNED_FORWARD_LONG, head_dim, is_causal, seq_len)
    config = _pick(tuned, head_dim, itemsize, segments, bias_bytes)
  elif not isinstance(config, ForwardConfig):
    raise TypeError(f"config must be a ForwardConfig, got {type(config).__name__}")
  config.check_fits(head_dim, itemsize, segments, bias_bytes)
  return config
