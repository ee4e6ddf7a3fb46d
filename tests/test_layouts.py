"""The accumulator layout helper's errors, on the CPU (the GPU test shows the helper at work)."""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest

from flash_attn_hopper import layouts


def test_a_layout_that_cannot_be_cast_back_is_named_with_the_fix():
  x = jnp.ones((64, 64), jnp.float32)
  with pytest.raises(layouts.AccumulatorLayoutError, match="WG_STRIDED.*Fix: pass the array"):
    layouts.to_accumulator_layout(x, layout=plgpu.Layout.WG_STRIDED((64, 64), vec_size=2))


@pytest.mark.parametrize("message", ["Only WGMMA layouts supported in WGMMAAccumulator",
                                     "Failed to infer a possible set of layouts. You need..."])
def test_opaque_failures_are_explained(message):
  with pytest.raises(layouts.AccumulatorLayoutError, match="to_accumulator_layout") as info:
    with layouts.explain_accumulator_errors():
      raise ValueError(message)
  assert message.split(".")[0] in str(info.value)


def test_other_errors_pass_through():
  with pytest.raises(KeyError):
    with layouts.explain_accumulator_errors():
      raise KeyError("unrelated")
