"""Named attention workloads: one list that feeds the tests, the benchmark and the tuning.

A workload is a shape and a mask, nothing else. The benchmark grid of the forward issue is
"B·T = 16k tokens, hidden size 2048": the batch shrinks as T grows, and the head count is
2048 // head_dim.
"""

from __future__ import annotations

import dataclasses
import itertools

TOKENS_PER_BATCH = 16 * 1024
HIDDEN_SIZE = 2048


@dataclasses.dataclass(frozen=True)
class Workload:
  """One attention problem, in `jax.nn.dot_product_attention` terms (BTNH layout)."""

  name: str
  batch: int
  seq_q: int
  seq_kv: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  is_causal: bool = False
  dtype: str = "bfloat16"

  @property
  def q_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seq_q, self.num_q_heads, self.head_dim)

  @property
  def kv_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seq_kv, self.num_kv_heads, self.head_dim)

  def forward_flops(self) -> float:
    """FlashAttention's count: 4·B·H·T·S·D, halved for causal (square problems)."""
    flops = 4.0 * self.batch * self.num_q_heads * self.seq_q * self.seq_kv * self.head_dim
    return flops / 2 if self.is_causal else flops

  def replace(self, **changes) -> "Workload":
    return dataclasses.replace(self, **changes)


def hidden_2048_grid(
    seq_lens=(1024, 4096, 16384),
    head_dims=(64, 128, 256),
    causal=(False, True),
    dtypes=("float16", "bfloat16"),
) -> list[Workload]:
  """The race grid: B·T = 16k tokens, hidden size 2048, square self-attention."""
  grid = []
  for dtype, head_dim, is_causal, seq in itertools.product(dtypes, head_dims, causal, seq_lens):
    heads = HIDDEN_SIZE // head_dim
    grid.append(Workload(
        name=f"h2048_t{seq}_d{head_dim}{'_causal' if is_causal else ''}_{dtype}",
        batch=max(1, TOKENS_PER_BATCH // seq), seq_q=seq, seq_kv=seq,
        num_q_heads=heads, num_kv_heads=heads, head_dim=head_dim,
        is_causal=is_causal, dtype=dtype))
  return grid


# Model shapes that people run.
MODEL_SHAPES = (
    # Llama-3-8B style GQA: 32 query heads over 8 KV heads, D 128, 8k context.
    Workload("gqa_32x8_d128_t8k_causal", batch=2, seq_q=8192, seq_kv=8192,
             num_q_heads=32, num_kv_heads=8, head_dim=128, is_causal=True),
    # Multi-query attention: every query head shares one KV head.
    Workload("mqa_16x1_d128_t4k", batch=4, seq_q=4096, seq_kv=4096,
             num_q_heads=16, num_kv_heads=1, head_dim=128),
    # Chunked prefill: a short query block against a long cache (T < S).
    Workload("prefill_t1k_s8k_d128", batch=4, seq_q=1024, seq_kv=8192,
             num_q_heads=16, num_kv_heads=4, head_dim=128),
)

# Small, awkward shapes for correctness: lengths that are not multiples of any block.
# Each runs in CPU interpret mode within CI's time.
INTERPRET_SHAPES = (
    Workload("mha_113x203_d64", batch=1, seq_q=113, seq_kv=203,
             num_q_heads=2, num_kv_heads=2, head_dim=64),
    Workload("gqa_128x256_d128", batch=1, seq_q=128, seq_kv=256,
             num_q_heads=4, num_kv_heads=2, head_dim=128),
    Workload("mqa_200x77_d64", batch=2, seq_q=200, seq_kv=77,
             num_q_heads=3, num_kv_heads=1, head_dim=64),
    Workload("mha_1x1_d64", batch=1, seq_q=1, seq_kv=1,
             num_q_heads=1, num_kv_heads=1, head_dim=64),
)

# Lengths the GPU tests sweep (T and S independently): blocks, block ± 1, long.
GPU_TEST_LENGTHS = (1, 113, 128, 1023, 1024, 4096, 8192)


def by_name(name: str) -> Workload:
  """Finds a named workload among the model shapes, the interpret shapes and the grid."""
  for w in (*MODEL_SHAPES, *INTERPRET_SHAPES, *hidden_2048_grid()):
    if w.name == name:
      return w
  raise KeyError(f"no workload named {name!r}")
