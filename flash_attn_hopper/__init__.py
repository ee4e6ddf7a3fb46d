"""flash_attn_hopper: FlashAttention for JAX on NVIDIA Hopper, in Pallas Mosaic GPU."""

from flash_attn_hopper.api import dot_product_attention
from flash_attn_hopper.config import BackwardConfig, ForwardConfig
from flash_attn_hopper.flax_attention import flax_attention_fn
from flash_attn_hopper.layouts import AccumulatorLayoutError, to_accumulator_layout
from flash_attn_hopper.masking import SegmentIds
from flash_attn_hopper.reference import attention_reference
from flash_attn_hopper.ring import ring_attention, sharded_attention

__all__ = ["dot_product_attention", "attention_reference", "ForwardConfig", "flax_attention_fn",
           "AccumulatorLayoutError", "to_accumulator_layout", "SegmentIds",
           "BackwardConfig", "ring_attention", "sharded_attention"]
__version__ = "0.1.0"
