"""`attention_fn` adapters for flax: `flax.nnx.MultiHeadAttention` and
`flax.linen.MultiHeadDotProductAttention`.

    from flax import nnx
    import flash_attn_hopper as fah

    layer = nnx.MultiHeadAttention(num_heads=16, in_features=2048, dtype=jnp.bfloat16,
                                   attention_fn=fah.flax_attention_fn(), rngs=nnx.Rngs(0))

The adapter takes every keyword argument the two modules pass to their `attention_fn`
(flax's `dot_product_attention` signature). What the kernels cannot do gets a clear error
naming it: attention dropout, sowing the attention weights (there are none to sow: the kernel
never forms them), custom einsums and `input_positions`. Inputs are promoted to `dtype` as
flax does; `precision` is accepted and ignored (the kernel multiplies in the input dtype with
float32 accumulation); the softmax is always in float32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from flash_attn_hopper import api


def _refuse(name: str, why: str):
  raise NotImplementedError(f"flash_attn_hopper's attention_fn does not support {name}: {why}")


def _attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
               dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
               precision=None, module=None, promote_dtype=None, is_causal=False,
               input_positions=None, force_fp32_for_softmax=False,
               qk_attn_weights_einsum=None, attn_weights_value_einsum=None, *,
               implementation=None, interpret=False, config=None):
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
  if dropout_rate > 0.0 and not deterministic:
    _refuse("attention dropout", "set dropout_rate=0 or deterministic=True, or drop the "
            "adapter for this module")
  if module is not None:
    _refuse("sowing attention weights (sow_weights=True)",
            "the kernel never materializes the attention matrix")
  if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
    _refuse("custom einsums", "remove qk_attn_weights_einsum / attn_weights_value_einsum")
  if input_positions is not None:
    _refuse("input_positions", "pass the equivalent mask or lengths instead")
  if promote_dtype is not None:
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
  elif dtype is not None:
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  return api.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                   is_causal=is_causal, implementation=implementation,
                                   interpret=interpret, config=config)


def flax_attention_fn(*, implementation=None, interpret=False, config=None):
  """An `attention_fn` for flax's attention modules that runs `dot_product_attention`.

  Args:
    implementation, interpret, config: as in `dot_product_attention`.
  """
  return functools.partial(_attention, implementation=implementation, interpret=interpret,
                           config=config)
