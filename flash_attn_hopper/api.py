"""`dot_product_attention`: `jax.nn.dot_product_attention`'s signature, on our kernels.

The wrapper canonicalizes and the kernels assume canonical input: validation, the TNH → BTNH
reshape, the choice of implementation, the padding of tiny sequences and the LSE layout all
happen here, once.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from flash_attn_hopper import autodiff
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import hardware
from flash_attn_hopper import masking
from flash_attn_hopper import reference
from flash_attn_hopper.kernels import forward as forward_kernel

#: Names `implementation` accepts. None picks ours on Hopper and XLA elsewhere.
KERNEL = "flash_attn_hopper"
IMPLEMENTATIONS = (None, KERNEL, "xla", "cudnn")
KERNEL_DTYPES = tuple(jnp.dtype(d) for d in config_lib.SUPPORTED_DTYPES)


#: Persistent CTAs when interpreting: two, so that CI runs CTAs that loop over several tiles.
INTERPRET_CTAS = 2
on_hopper = hardware.on_hopper


@functools.cache
def _warn_fallback_once() -> None:
  device = jax.devices()[0]
  warnings.warn(
      f"flash_attn_hopper: no Hopper (sm90) GPU found (default device: {device.device_kind}); "
      "dot_product_attention falls back to jax.nn's XLA implementation. Pass "
      "implementation='xla' to silence this, or interpret=True to run our kernel through the "
      "Mosaic GPU interpreter.", RuntimeWarning, stacklevel=3)


def _check_shapes(query, key, value) -> None:
  """Raises ValueError/TypeError naming the argument and what was expected."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim not in (3, 4):
      raise ValueError(f"{name} must have rank 4 (B, T, N, H) or 3 (T, N, H); got shape {x.shape}")
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(f"query, key and value must have the same rank; got shapes "
                     f"{query.shape}, {key.shape}, {value.shape}")
  if key.shape != value.shape:
    raise ValueError(f"value must have key's shape {key.shape}; got {value.shape}")
  if query.ndim == 4 and query.shape[0] != key.shape[0]:
    raise ValueError(f"query and key must have the same batch size; got {query.shape[0]} and "
                     f"{key.shape[0]}")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"query and key must have the same head dim; got {query.shape[-1]} and "
                     f"{key.shape[-1]}")
  n, k = query.shape[-2], key.shape[-2]
  if k == 0 or n % k:
    raise ValueError(f"the number of query heads ({n}) must be a multiple of the number of "
                     f"key/value heads ({k})")
  if not query.dtype == key.dtype == value.dtype:
    raise TypeError(f"query, key and value must have one dtype; got {query.dtype}, "
                    f"{key.dtype}, {value.dtype}")


def _check_kernel_support(query) -> None:
  """Raises for what the kernel cannot do, naming the argument or value."""
  if query.dtype not in KERNEL_DTYPES:
    raise TypeError(f"flash_attn_hopper's kernel supports dtypes "
                    f"{', '.join(config_lib.SUPPORTED_DTYPES)}; got {query.dtype}")
  if query.shape[-1] not in config_lib.SUPPORTED_HEAD_DIMS:
    raise ValueError(f"flash_attn_hopper's kernel supports head dims "
                     f"{config_lib.SUPPORTED_HEAD_DIMS}; got {query.shape[-1]}")


#: TMA tiles global memory in rows of 8 when a head row is wider than the 128-byte swizzle,
#: so sequence lengths go to the kernel as multiples of 8.
SEQ_MULTIPLE = 8


def _pad_seq(x, minimum: int):
  """Zero-pads the sequence axis (1) to a multiple of SEQ_MULTIPLE and at least `minimum`.

  Only awkward lengths (T or S not a multiple of 8, or shorter than one tile) pay this copy;
  the kernel masks the padded keys and the padded query rows are sliced off.
  """
  n = x.shape[1]
  target = max(minimum, -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE)
  if target == n:
    return x
  return jnp.pad(x, ((0, 0), (0, target - n), (0, 0), (0, 0)))


CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def _window(local_window_size) -> tuple[int | None, int | None]:
  """`jax.nn`'s local_window_size as (left, right): an int w means (w, w)."""
  if local_window_size is None:
    return None, None
  if isinstance(local_window_size, (int, np.integer)):
    local_window_size = (local_window_size, local_window_size)
  try:
    left, right = (int(x) for x in local_window_size)
  except (TypeError, ValueError):
    raise ValueError(f"local_window_size must be an int or a (left, right) pair of ints; got "
                     f"{local_window_size!r}") from None
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative; got {local_window_size!r}")
  return left, right


def mask_spec(t: int, s: int, *, is_causal, local_window_size,
              causal_alignment="top_left") -> masking.MaskSpec:
  """The kernels' `MaskSpec` for the op's arguments (T queries, S keys)."""
  if causal_alignment not in CAUSAL_ALIGNMENTS:
    raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}; got "
                     f"{causal_alignment!r}")
  left, right = _window(local_window_size)
  spec = masking.MaskSpec(is_causal=bool(is_causal), left=left, right=right,
                          offset=s - t if causal_alignment == "bottom_right" else 0)
  return spec.without_idle_edges(t, s)


def _as_bias(bias, mask, shape, dtype):
  """`bias` and `mask` as one (B|1, N|1, T, S) input of the kernels, or None: an additive
  bias of the scaled logits in the kernel's dtype (−inf where the mask is False), or a
  `mask` alone as uint8 (1: visible), whose tiles are half the size. `shape` is
  (B, N, T, S)."""
  def four(name, x):
    x = jnp.asarray(x)
    if x.ndim > 4:
      raise ValueError(f"{name} must be broadcastable to (B, N, T, S) = {shape}; got shape "
                       f"{x.shape}")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if any(n not in (1, full) for n, full in zip(x.shape, shape)):
      raise ValueError(f"{name} must be broadcastable to (B, N, T, S) = {shape}; got shape "
                       f"{x.shape}")
    return x
  if bias is None and mask is not None:
    mask = four("mask", mask).astype(bool).astype(jnp.uint8)
    return jnp.broadcast_to(mask, mask.shape[:2] + shape[2:])
  parts = []
  if bias is not None:
    parts.append(four("bias", bias).astype(dtype))
  if mask is not None:
    parts.append(jnp.where(four("mask", mask).astype(bool), 0.0, -jnp.inf).astype(dtype))
  if not parts:
    return None
  total = parts[0] if len(parts) == 1 else parts[0] + parts[1]
  return jnp.broadcast_to(total, total.shape[:2] + shape[2:])


def _kernel_attention(q, k, v, *, scale, spec, config, interpret, kv_lens=None,
                      segment_ids=None, soft_cap=None, backward_config=None, bias=None,
                      bias_grad=False, deterministic=True):
  """Our kernel on 4D inputs; returns out (B, T, N, H) and the LSE (B, T, N) in float32.

  Queries that see no key get output 0 and LSE −inf here (`dot_product_attention` then
  gives them jax.nn's answer)."""
  t, s = q.shape[1], k.shape[1]
  segments = segment_ids is not None
  is_mask = bias is not None and bias.dtype == jnp.uint8  # A mask alone (`_as_bias`).
  bias_bytes = 0 if bias is None else bias.dtype.itemsize
  cfg = config_lib.resolve_forward_config(q.shape[-1], q.dtype, spec.is_causal, config,
                                          segments=segments, bias_bytes=bias_bytes, seq_len=t)
  opts = forward_kernel.ForwardOptions(scale=float(scale), mask=spec, config=cfg,
                                       interpret=bool(interpret), seq_kv=s,
                                       max_ctas=INTERPRET_CTAS if interpret else None,
                                       kv_lens=kv_lens is not None, segments=segments,
                                       soft_cap=soft_cap,
                                       bias=None if bias is None else (bias.shape[0] > 1,
                                                                       bias.shape[1] > 1),
                                       bias_grad=bias_grad, bias_is_mask=is_mask)
  if backward_config is not None:  # Checked now, not when a gradient is first taken.
    config_lib.resolve_backward_config(q.shape[-1], q.dtype, spec.is_causal, backward_config,
                                       segments, bias_bytes)
  q, k, v = _pad_seq(q, cfg.rows_per_cta), _pad_seq(k, cfg.block_kv), _pad_seq(v, cfg.block_kv)
  if segments:
    segment_ids = masking.pad_segment_ids(segment_ids, q.shape[1], k.shape[1])
  if bias is not None:  # Padded keys and rows are masked (and then dropped).
    bias = jnp.pad(bias, ((0, 0), (0, 0), (0, q.shape[1] - t), (0, k.shape[1] - s)),
                   constant_values=0 if is_mask else -jnp.inf)
  out, lse = autodiff.attention(q, k, v, kv_lens, segment_ids, bias, opts, backward_config,
                                bool(deterministic))
  return out[:, :t], jnp.transpose(lse[:, :, :t], (0, 2, 1))


def _over_shards(run, q, k, v, kv_lens, segment_ids, bias):
  """`run(q, k, v, kv_lens=, segment_ids=, bias=)` on each device's shard when q is sharded
  over batch and/or heads on explicit mesh axes (the kernel is a custom call that XLA's
  partitioner cannot split: without this it would gather Q, K and V on every device)."""
  sharding = getattr(jax.typeof(q), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * 4
  b_ax, t_ax, n_ax, d_ax = spec[:4]
  call = lambda q, k, v, kv_lens, ids, bias: run(q, k, v, kv_lens=kv_lens, segment_ids=ids,
                                                 bias=bias)
  if b_ax is None and n_ax is None and t_ax is None and d_ax is None:
    return call(q, k, v, kv_lens, segment_ids, bias)
  if t_ax is not None or d_ax is not None:
    raise ValueError(f"query is sharded along the sequence or the head dim ({sharding.spec}); "
                     "dot_product_attention shards batch and heads. For the sequence, use "
                     "flash_attn_hopper.ring_attention (context parallelism)")
  P = jax.sharding.PartitionSpec
  if n_ax is not None:
    size = int(np.prod([sharding.mesh.shape[a] for a in np.atleast_1d(n_ax)]))
    if k.shape[2] % size:
      raise ValueError(f"query's heads are sharded {size} ways, which does not divide the "
                       f"{k.shape[2]} key/value heads; shard fewer ways or replicate heads")
  heads = P(b_ax, None, n_ax, None)
  place = lambda x: jax.reshard(x, jax.sharding.NamedSharding(sharding.mesh, heads))
  bias_spec = None if bias is None else P(b_ax if bias.shape[0] > 1 else None,
                                          n_ax if bias.shape[1] > 1 else None)
  in_specs = (heads, heads, heads, None if kv_lens is None else P(b_ax),
              None if segment_ids is None else P(b_ax), bias_spec)
  return jax.shard_map(call, mesh=sharding.mesh, in_specs=in_specs,
                       out_specs=(heads, P(b_ax, None, n_ax)))(
      q, place(k), place(v), kv_lens, segment_ids, bias)


def _as_jax_nn_for_empty_rows(out, v, empty):
  """jax.nn masks logits with a large finite negative, so a query that sees no key gets the
  mean of V over all keys. The kernel returns 0 there; this puts jax.nn's rows in.

  `empty`: (T,) numpy (static masks), (B, T) jax (with key lengths) or (B, T, N) jax (with
  segment ids: where the kernel's LSE is −inf) bool."""
  if isinstance(empty, np.ndarray) and not empty.any():
    return out
  n = out.shape[2]
  mean_v = jnp.mean(v.astype(jnp.float32), axis=1)                  # (B, K, H)
  mean_v = jnp.repeat(mean_v, n // v.shape[2], axis=1).astype(out.dtype)  # (B, N, H)
  empty = jnp.asarray(empty)
  empty = empty[None] if empty.ndim == 1 else empty
  empty = empty[:, :, None] if empty.ndim == 2 else empty
  return jnp.where(empty[..., None], mean_v[:, None], out)


def _lengths(name: str, lengths, batch: int):
  """A `jax.nn` sequence-lengths argument as (B,) int32, checked, or None."""
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array; got dtype {lengths.dtype}")
  if lengths.shape not in ((batch,), ()) and not (batch == 1 and lengths.shape == (1,)):
    raise ValueError(f"{name} must have shape ({batch},) (one length per batch element); "
                     f"got {lengths.shape}")
  return jnp.broadcast_to(lengths.astype(jnp.int32), (batch,))


def _band_as_mask(spec: masking.MaskSpec, t: int, s: int, mask):
  """jax.nn has no bottom-right alignment: its paths get the band as an explicit mask."""
  band = jnp.asarray(spec.visible(np.arange(t)[:, None], np.arange(s)[None, :]))
  return band if mask is None else jnp.logical_and(mask, band)


def _soft_cap(cap) -> float | None:
  """`logits_soft_cap` as a float > 0, or None."""
  if cap is None:
    return None
  try:
    cap = float(cap)
  except (TypeError, ValueError):
    raise TypeError(f"logits_soft_cap must be a positive number or None; got {cap!r}") from None
  if not cap > 0 or not np.isfinite(cap):
    raise ValueError(f"logits_soft_cap must be a positive finite number; got {cap!r}")
  return cap


def _soft_capped_without_kernel(query, key, value, *, implementation, return_residual,
                                **kwargs):
  """jax.nn has no soft-cap: its 'xla' stand-in is the reference's XLA ops (float32
  softmax, T×S logits, as jax.nn's XLA path), cast back to the input dtype."""
  if implementation == "cudnn":
    raise NotImplementedError(
        "logits_soft_cap is not supported by implementation='cudnn' (jax.nn has no soft-cap); "
        "use implementation='xla' or our kernel (implementation=None on Hopper)")
  out = reference.attention_reference(query, key, value, return_residual=return_residual,
                                      **kwargs)
  if return_residual:
    return out[0].astype(query.dtype), out[1]
  return out.astype(query.dtype)


def _segments_as_mask(ids: masking.SegmentIds, mask, squeeze: bool):
  """jax.nn has no segment ids: its paths get them as an explicit (B, 1, T, S) mask."""
  same = ids.q[:, None, :, None] == ids.kv[:, None, None, :]
  same = same[0] if squeeze else same
  return same if mask is None else jnp.logical_and(mask, same)


def _without_kernel(query, key, value, *, bias, mask, spec, segments, soft_cap, is_causal,
                    local_window_size, causal_alignment, implementation, **kwargs):
  """The op through `jax.nn.dot_product_attention` ('xla', 'cudnn', or the fallback off
  Hopper), with what jax.nn lacks (bottom-right bands, segment ids) given to it as a mask.
  `kwargs`: scale, the sequence lengths and return_residual, passed on as they are."""
  if soft_cap is not None:
    return _soft_capped_without_kernel(
        query, key, value, bias=bias, mask=mask, is_causal=is_causal,
        local_window_size=local_window_size, causal_alignment=causal_alignment,
        segment_ids=segments, logits_soft_cap=soft_cap, implementation=implementation,
        **kwargs)
  t, s = query.shape[-3], key.shape[-3]
  if spec.offset and spec.banded:
    mask = _band_as_mask(spec, t, s, mask)
    is_causal, local_window_size = False, None
  if segments is not None:
    mask = _segments_as_mask(segments, mask, query.ndim == 3)
  return jax.nn.dot_product_attention(
      query, key, value, bias=bias, mask=mask, is_causal=is_causal,
      local_window_size=local_window_size, implementation=implementation or "xla", **kwargs)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False,
                          causal_alignment="top_left", segment_ids=None, logits_soft_cap=None,
                          interpret=False, config=None, backward_config=None,
                          deterministic=True):
  """Scaled dot-product attention with `jax.nn.dot_product_attention`'s semantics.

  Args:
    query: (B, T, N, H) or (T, N, H).
    key, value: (B, S, K, H) or (S, K, H); N must be a multiple of K (GQA; K = 1 is MQA).
      K/V are never repeated in memory.
    bias, mask: as in `jax.nn`, broadcastable to (B, N, T, S). The kernel adds them to the
      scaled logits as one bias tile per block (the mask as −inf), materialized to
      (B|1, N|1, T, S): a bias in the inputs' dtype, a mask alone as uint8. Blocks a mask
      hides entirely are skipped; blocks it leaves fully visible stream no tile. Both work
      at every head dim (a bias at D 256 with a one-slot ring of its tiles). The backward
      kernels stream the same tiles, and a differentiated bias's gradient is the dQ kernel's
      dS, (B, N, T, S) in the inputs' dtype, summed over the dimensions the bias broadcasts
      (a bias that is not differentiated writes none). A bias is rounded to the inputs'
      dtype.
    query_seq_lengths, key_value_seq_lengths: (B,) int32, as in `jax.nn` (padding). Keys
      past a batch element's length are masked and their blocks skipped; output rows past a
      query's length are zero.
    local_window_size: as in `jax.nn`: an int w or a pair (left, right); query i sees keys
      [i − left, i + right] (shifted by S − T with bottom-right alignment). KV blocks outside
      the band are skipped, so the cost follows the window, not S.
    scale: logit scale; default 1/sqrt(H).
    is_causal: causal mask (query i sees keys j <= i), top-left aligned as in `jax.nn`. KV
      blocks above the diagonal are skipped.
    causal_alignment: 'top_left' (default, jax.nn's) or 'bottom_right' (FlashAttention's for
      T != S, as in decoding and chunked prefill: query i sees keys j <= i + S − T). It
      shifts the window the same way.
    segment_ids: packed sequences. One int array (B, T) for self-attention (T == S), or a
      `SegmentIds(q=(B, T), kv=(B, S))` / (q_ids, kv_ids) pair, as splash attention and
      maxtext take them; (L,) arrays apply to every batch element. Query i sees key j only
      when their ids are equal, on top of the other masks. KV blocks that share no segment
      with a Q tile are skipped, so packing documents costs what the documents cost. Ids
      need not be sorted (unsorted ids skip fewer blocks). jax.nn has no such argument: its
      paths get the ids as an explicit mask.
    logits_soft_cap: Gemma 2's soft-cap: the scaled logits x become cap·tanh(x / cap)
      before the masks and the softmax, forward and backward. jax.nn has no such argument:
      implementation='xla' computes it with `attention_reference`'s XLA ops in float32, and
      'cudnn' refuses it.
    implementation: None (our kernel on a Hopper GPU; elsewhere XLA, with one warning),
      'flash_attn_hopper' (our kernel; an error off Hopper unless `interpret`), 'xla' or
      'cudnn' (`jax.nn.dot_product_attention`'s own).
    return_residual: also return the log-sum-exp of the scaled logits, shape (B, T, N) or
      (T, N), in float32 from the kernel (jax.nn's paths return it in the input dtype).
    interpret: run our kernel through the Mosaic GPU interpreter (on a CPU; slow, for tests).
    config: a `ForwardConfig` overriding the tuned block sizes.
    backward_config: a `BackwardConfig` overriding the backward kernels' block sizes (D 64
      and 128; checked when the gradient is taken).
    deterministic: whether gradients must come out bitwise the same in every run (the
      default). With False, the backward may take FA3's five matmuls where they measured
      faster (`config.TUNED_BACKWARD_FUSED`: D 128 non-causal and D 64 causal, from 16k
      queries): dQ is added up inside the dK/dV kernel in float32, in whatever order the
      tiles finish, so its last bits may vary from run to run, as with cuDNN's and
      FlashAttention's default backward. `backward_config=BackwardConfig(fused_dq=True)`
      takes it at any length (D 64 and 128). A differentiated bias keeps the deterministic
      backward (its gradient is the dQ kernel's dS).

  Kernel dtypes are float16 and bfloat16; head dims 64, 128 and 256; any T ≥ 1 and S ≥ 1.

  A query that sees no key (a window, a bottom-right alignment or a segment without keys
  can leave one with none) gets what `jax.nn` gives it: the mean of V over all keys; its
  gradient flows to V alone.
  Its LSE from the kernel is −inf.

  Returns:
    The output, shaped like `query` and in its dtype; with `return_residual`, (output, lse).

  Example:
    >>> out = dot_product_attention(q, k, v, is_causal=True)  # q: (2, 4096, 16, 128) bf16
  """
  query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
  _check_shapes(query, key, value)
  t, s = query.shape[-3], key.shape[-3]
  spec = mask_spec(t, s, is_causal=is_causal, local_window_size=local_window_size,
                   causal_alignment=causal_alignment)
  masks = dict(bias=bias, mask=mask)
  lengths = dict(query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths)

  segments = masking.as_segment_ids(segment_ids, query.shape[0] if query.ndim == 4 else 1, t, s)
  soft_cap = _soft_cap(logits_soft_cap)

  use_kernel = interpret or implementation == KERNEL or (implementation is None and on_hopper())
  if not use_kernel:
    if implementation is None:
      _warn_fallback_once()
    return _without_kernel(
        query, key, value, **masks, **lengths, scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, causal_alignment=causal_alignment, spec=spec,
        segments=segments, soft_cap=soft_cap, implementation=implementation,
        return_residual=return_residual)
  if not interpret and not on_hopper():
    raise RuntimeError(
        f"implementation='{KERNEL}' needs an sm90 (Hopper) GPU; the default device is "
        f"{jax.devices()[0].device_kind}. Use implementation=None to fall back to XLA, or "
        f"interpret=True to run the kernel through the Mosaic GPU interpreter.")
  _check_kernel_support(query)

  squeeze = query.ndim == 3
  if squeeze:
    query, key, value = query[None], key[None], value[None]
  scale = 1.0 / np.sqrt(query.shape[-1]) if scale is None else scale
  batch = query.shape[0]
  q_lens = _lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lens = _lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  combined = _as_bias(bias, mask, (batch, query.shape[2], t, s), query.dtype)
  run = functools.partial(_kernel_attention, scale=scale, spec=spec, config=config,
                          interpret=interpret, soft_cap=soft_cap,
                          backward_config=backward_config, bias_grad=bias is not None,
                          deterministic=deterministic)
  out, lse = _over_shards(run, query, key, value, kv_lens, segments, combined)
  # Which queries saw no key: known statically for a band, from the LSE for data masks.
  empty = (jnp.isneginf(lse) if segments is not None or combined is not None else
           masking.empty_rows(spec, t, s, kv_lens))
  out = _as_jax_nn_for_empty_rows(out, value, empty)
  if q_lens is not None:  # As jax.nn: rows past a query's length are zero and see no key.
    valid = (jnp.arange(t)[None, :] < q_lens[:, None])[:, :, None]
    out = jnp.where(valid[..., None], out, 0)
    lse = jnp.where(valid, lse, -jnp.inf)
  if squeeze:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
