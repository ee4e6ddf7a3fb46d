"""Context parallelism: attention over a sequence sharded along T, K/V passed around a ring.

Each device of a mesh axis holds a shard of the queries and of the keys and values. For n
devices, n steps: at each step a device attends its queries to the K/V shard it holds, then
passes that shard to the next device (`lax.ppermute`, which XLA overlaps with the next step's
compute). Partial results merge through their float32 LSEs:

    lse = logaddexp(lse₁, lse₂),   out = out₁·e^(lse₁ − lse) + out₂·e^(lse₂ − lse)

The backward runs the same ring: each step adds the local queries' dQ, and the dK/dV of the
shard it holds, which travel with that shard and are home after the n-th pass. Each block's
gradients come from the global output and LSE (FlashAttention's backward needs no more).

Causal attention over contiguous shards leaves the last device with most of the work. The
zig-zag layout balances it: the sequence is cut into 2n chunks and device d holds chunks d and
2n − 1 − d (`zigzag` / `unzigzag` reorder a sequence into and out of that layout). Per pair of
chunks a block is either fully visible, causal on its diagonal, or skipped.

    out = ring_attention(q, k, v, axis_name="sp", num_devices=n, is_causal=True)  # in shard_map
    out = sharded_attention(mesh, "sp", q, k, v, is_causal=True)                   # from outside

Blocks run through `dot_product_attention` (our kernel on Hopper; `implementation="xla"`
elsewhere) and their backward through the backward kernels where the op's would run
(Hopper), else `blockwise` (XLA).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flash_attn_hopper import api
from flash_attn_hopper import autodiff
from flash_attn_hopper import blockwise
from flash_attn_hopper import config as config_lib
from flash_attn_hopper import masking
from flash_attn_hopper.kernels import backward as backward_kernel
from flash_attn_hopper.kernels import common

LAYOUTS = ("zigzag", "contiguous")
# What one (query chunk, key chunk) pair does: nothing, everything, or causal on its diagonal.
SKIP, FULL, DIAGONAL = 0, 1, 2


class RingOptions(NamedTuple):
  """Static options of one ring call (hashable)."""
  axis_name: str
  num_devices: int
  is_causal: bool
  layout: str
  scale: float | None
  implementation: str | None
  interpret: bool


def zigzag(x, num_devices: int, axis: int = 1):
  """Reorders a sequence axis into the zig-zag layout: chunk order 0, 2n−1, 1, 2n−2, …, so
  that sharding the result evenly gives device d the chunks d and 2n − 1 − d."""
  order = np.stack([np.arange(num_devices), 2 * num_devices - 1 - np.arange(num_devices)], 1)
  return _reorder(x, order.reshape(-1), axis)


def unzigzag(x, num_devices: int, axis: int = 1):
  """The inverse of `zigzag`."""
  order = np.stack([np.arange(num_devices), 2 * num_devices - 1 - np.arange(num_devices)], 1)
  return _reorder(x, np.argsort(order.reshape(-1)), axis)


def _reorder(x, chunk_order, axis: int):
  chunks = jnp.split(x, len(chunk_order), axis=axis)
  return jnp.concatenate([chunks[i] for i in chunk_order], axis=axis)


def _chunk_ids(device, opts: RingOptions) -> list:
  """The global chunk index of each local chunk of `device` (traced)."""
  if opts.layout == "zigzag":
    return [device, 2 * opts.num_devices - 1 - device]
  return [device]


def _mode(q_chunk, k_chunk, is_causal: bool):
  """SKIP, FULL or DIAGONAL for a pair of global chunk indices (traced)."""
  if not is_causal:
    return jnp.int32(FULL)
  return jnp.where(k_chunk < q_chunk, FULL, jnp.where(k_chunk == q_chunk, DIAGONAL, SKIP))


def _split(x, parts: int):
  return jnp.split(x, parts, axis=1) if x is not None else [None] * parts


def _block_forward(q, k, v, q_ids, kv_ids, mode, opts: RingOptions):
  """(out float32, lse (B, T, N) float32) of one chunk pair; SKIP gives (0, −inf)."""
  def attend(is_causal):
    def run():
      segments = None if q_ids is None else masking.SegmentIds(q_ids, kv_ids)
      out, lse = api.dot_product_attention(
          q, k, v, scale=opts.scale, is_causal=is_causal, segment_ids=segments,
          implementation=opts.implementation, interpret=opts.interpret, return_residual=True)
      return out.astype(jnp.float32), lse.astype(jnp.float32)
    return run
  skip = lambda: (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:-1], -jnp.inf))
  return lax.switch(mode, [skip, attend(False), attend(True)])


def _merge(acc, part):
  """Two partial softmax results, by their LSEs (a −inf LSE weighs nothing)."""
  (out1, lse1), (out2, lse2) = acc, part
  lse = jnp.logaddexp(lse1, lse2)
  safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
  w1, w2 = jnp.exp(lse1 - safe)[..., None], jnp.exp(lse2 - safe)[..., None]
  return out1 * w1 + out2 * w2, lse


def _rotate(xs, opts: RingOptions):
  """Passes each array to the next device of the ring."""
  n = opts.num_devices
  perm = [(d, (d + 1) % n) for d in range(n)]
  return jax.tree.map(lambda x: lax.ppermute(x, opts.axis_name, perm), xs)


def _forward(q, k, v, q_ids, kv_ids, opts: RingOptions):
  """The ring's forward: (out in q's dtype, lse (B, T_local, N) float32)."""
  device = lax.axis_index(opts.axis_name)
  parts = len(_chunk_ids(0, opts))
  qs, q_id_chunks = _split(q, parts), _split(q_ids, parts)
  acc = [(jnp.zeros(x.shape, jnp.float32), jnp.full(x.shape[:-1], -jnp.inf)) for x in qs]
  for step in range(opts.num_devices):
    source = (device - step) % opts.num_devices  # whose K/V this device holds now
    ks, vs, kv_id_chunks = _split(k, parts), _split(v, parts), _split(kv_ids, parts)
    for a, q_chunk in enumerate(_chunk_ids(device, opts)):
      for c, k_chunk in enumerate(_chunk_ids(source, opts)):
        part = _block_forward(qs[a], ks[c], vs[c], q_id_chunks[a], kv_id_chunks[c],
                              _mode(q_chunk, k_chunk, opts.is_causal), opts)
        acc[a] = _merge(acc[a], part)
    if step + 1 < opts.num_devices:
      k, v, kv_ids = _rotate((k, v, kv_ids), opts)
  out = jnp.concatenate([o for o, _ in acc], axis=1)
  lse = jnp.concatenate([l for _, l in acc], axis=1)
  return out.astype(q.dtype), lse


def _uses_kernels(q, opts: RingOptions) -> bool:
  """Whether a block's backward runs the backward kernels (where the op's forward would run
  ours, at the head dims they cover)."""
  kernel = opts.interpret or opts.implementation == api.KERNEL or (
      opts.implementation is None and api.on_hopper())
  return kernel and q.shape[-1] in autodiff.KERNEL_BACKWARD_HEAD_DIMS


def _kernel_block_backward(q, k, v, out, lse, dout, segments, is_causal, scale, opts):
  """The backward kernels on one chunk pair: inputs padded as the op pads them, the LSE
  (B, T, N) as the kernels read it, (B, N, whole tiles), padded rows contributing nothing."""
  t, s = q.shape[1], k.shape[1]
  cfg = config_lib.resolve_backward_config(q.shape[-1], q.dtype, is_causal, None,
                                           segments is not None, seq_len=t)
  rows = 2 * cfg.block_q
  pad_q = lambda x: api._pad_seq(x, rows)
  qp, outp, doutp = pad_q(q), pad_q(out), pad_q(dout)
  kp, vp = api._pad_seq(k, 2 * cfg.block_kv), api._pad_seq(v, 2 * cfg.block_kv)
  tiles = -(-qp.shape[1] // rows) * rows
  lse_p = jnp.pad(jnp.transpose(lse, (0, 2, 1)), ((0, 0), (0, 0), (0, tiles - t)))
  if segments is not None:
    segments = masking.pad_segment_ids(segments, qp.shape[1], kp.shape[1])
  bwd_opts = common.BackwardOptions(scale=scale, mask=masking.MaskSpec(is_causal=is_causal),
                                    config=cfg, interpret=opts.interpret, seq_kv=s,
                                    segments=segments is not None,
                                    max_ctas=api.INTERPRET_CTAS if opts.interpret else None)
  dq, dk, dv, _ = backward_kernel.attention_backward(qp, kp, vp, outp, lse_p, doutp, bwd_opts,
                                                     None, segments)  # (no bias: no dbias)
  return (dq[:, :t].astype(jnp.float32), dk[:, :s].astype(jnp.float32),
          dv[:, :s].astype(jnp.float32))


def _block_backward(q, k, v, out, lse, dout, q_ids, kv_ids, mode, opts: RingOptions):
  """(dq, dk, dv) in float32 of one chunk pair, from the global out and LSE."""
  scale = 1.0 / float(np.sqrt(q.shape[-1])) if opts.scale is None else opts.scale
  segments = None if q_ids is None else masking.SegmentIds(q_ids, kv_ids)

  def grads(is_causal):
    if _uses_kernels(q, opts):
      return lambda: _kernel_block_backward(q, k, v, out.astype(q.dtype), lse, dout,
                                            segments, is_causal, scale, opts)
    return lambda: blockwise.attention_backward(
        q, k, v, out, jnp.transpose(lse, (0, 2, 1)), dout, scale=scale,
        mask=masking.MaskSpec(is_causal=is_causal), segment_ids=segments,
        grad_dtype=jnp.float32)
  zeros = lambda: tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
  return lax.switch(mode, [zeros, grads(False), grads(True)])


def _backward(q, k, v, q_ids, kv_ids, out, lse, dout, opts: RingOptions):
  """The ring's backward: dQ stays, dK/dV travel with their shard and come home."""
  device = lax.axis_index(opts.axis_name)
  parts = len(_chunk_ids(0, opts))
  qs, outs, dous = _split(q, parts), _split(out, parts), _split(dout, parts)
  lses, q_id_chunks = _split(lse, parts), _split(q_ids, parts)
  dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
  dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  for step in range(opts.num_devices):
    source = (device - step) % opts.num_devices
    ks, vs, kv_id_chunks = _split(k, parts), _split(v, parts), _split(kv_ids, parts)
    dks, dvs = _split(dk, parts), _split(dv, parts)
    for a, q_chunk in enumerate(_chunk_ids(device, opts)):
      for c, k_chunk in enumerate(_chunk_ids(source, opts)):
        g = _block_backward(qs[a], ks[c], vs[c], outs[a], lses[a], dous[a], q_id_chunks[a],
                            kv_id_chunks[c], _mode(q_chunk, k_chunk, opts.is_causal), opts)
        dq[a], dks[c], dvs[c] = dq[a] + g[0], dks[c] + g[1], dvs[c] + g[2]
    dk, dv = jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)
    # n passes in all: the shard, and the gradients that travel with it, are home at the end.
    k, v, kv_ids, dk, dv = _rotate((k, v, kv_ids, dk, dv), opts)
  return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype),
          dv.astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, q_ids, kv_ids, opts: RingOptions):
  return _forward(q, k, v, q_ids, kv_ids, opts)


def _ring_fwd(q, k, v, q_ids, kv_ids, opts):
  out, lse = _forward(q, k, v, q_ids, kv_ids, opts)
  return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)


def _ring_bwd(opts, residuals, cotangents):
  q, k, v, q_ids, kv_ids, out, lse = residuals
  dout, _ = cotangents  # the LSE is returned with stop-gradient semantics
  return (*_backward(q, k, v, q_ids, kv_ids, out, lse, dout, opts), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(query, key, value, *, axis_name: str, num_devices: int, is_causal=False,
                   scale=None, segment_ids=None, layout="zigzag", implementation=None,
                   interpret=False, return_residual=False):
  """Attention of this device's query shard over the whole ring's keys; call in `shard_map`.

  Args:
    query: (B, T/n, N, H), this device's shard along T; key, value: (B, S/n, K, H).
    axis_name, num_devices: the mesh axis that shards T and its size n.
    is_causal: causal over the global sequence (T == S). With `layout="zigzag"` the shards
      must be in `zigzag` order (chunks d and 2n − 1 − d on device d); with "contiguous",
      device d holds the d-th n-th of the sequence.
    segment_ids: None, or `masking.SegmentIds` of this device's shards, (B, T/n), (B, S/n).
    scale, implementation, interpret: as in `dot_product_attention`, for each block.
    return_residual: also return the float32 LSE, (B, T/n, N).

  Returns:
    This device's output shard (and LSE), as if attention ran on the whole sequence.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
  if layout == "zigzag" and query.shape[1] % 2:
    raise ValueError(f"the zig-zag layout holds two chunks per device; the query shard's "
                     f"length {query.shape[1]} is odd")
  opts = RingOptions(axis_name, int(num_devices), bool(is_causal), layout, scale,
                     implementation, bool(interpret))
  q_ids = kv_ids = None
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids
  out, lse = _ring(query, key, value, q_ids, kv_ids, opts)
  return (out, lse) if return_residual else out


def sharded_attention(mesh, axis_name: str, query, key, value, *, segment_ids=None,
                      layout="zigzag", **kwargs):
  """`ring_attention` over global arrays, sharded along T over `mesh`'s `axis_name`.

  The inputs are in the global order (not zig-zagged); with the zig-zag layout this reorders
  them in and out (the output comes back replicated). Returns the global output.
  """
  if kwargs.get("return_residual"):
    raise ValueError("sharded_attention returns the output only; call ring_attention inside "
                     "shard_map for the LSE")
  n = mesh.shape[axis_name]
  spec = jax.sharding.PartitionSpec(None, axis_name)
  reorder = (lambda x: zigzag(x, n)) if layout == "zigzag" else (lambda x: x)
  place = lambda x: jax.reshard(reorder(x), jax.sharding.NamedSharding(mesh, spec))
  args = [place(x) for x in (query, key, value)]
  ids = None if segment_ids is None else tuple(place(x) for x in segment_ids)

  def local(q, k, v, ids):
    seg = None if ids is None else masking.SegmentIds(*ids)
    return ring_attention(q, k, v, axis_name=axis_name, num_devices=n, segment_ids=seg,
                          layout=layout, **kwargs)
  out = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec,
                      check_vma=False)(*args, ids)
  if layout == "contiguous":
    return out
  # Back to the global order, which the shards do not split evenly in general: this gathers
  # the output. A model that keeps its activations in zig-zag order calls `ring_attention`
  # inside its own shard_map instead, and moves nothing.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return unzigzag(jax.reshard(out, replicated), n)
