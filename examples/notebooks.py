"""Builds and runs the example notebooks (examples/*.ipynb) from the cells below.

    python examples/notebooks.py            # write the notebooks and execute them in place
    python examples/notebooks.py --check    # execute them without writing (what CI does)

The notebooks run on a CPU at small sizes: our kernels through the Mosaic GPU interpreter. On
a Hopper GPU the same cells run the kernels for real. Keeping the cells here keeps their text
reviewable in a diff; the committed .ipynb files carry the outputs.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

SETUP = """\
import os, sys
sys.path.insert(0, os.path.abspath(".."))  # the repository, when run from examples/
import numpy as np
import jax, jax.numpy as jnp
import flash_attn_hopper as fah
from flash_attn_hopper import api
ON_HOPPER = api.on_hopper()
INTERPRET = not ON_HOPPER  # on a CPU, the real kernels run in the Mosaic GPU interpreter
print("jax", jax.__version__, "| device:", jax.devices()[0].device_kind, "| interpret:", INTERPRET)"""

NOTEBOOKS = {
    "quickstart": [
        ("md", "# Quick start\n\n`flash_attn_hopper.dot_product_attention` takes "
               "`jax.nn.dot_product_attention`'s arguments. Inputs are (B, T, N, H); K/V may "
               "have fewer heads (GQA)."),
        ("code", SETUP),
        ("code", """\
rng = np.random.default_rng(0)
B, T, S, N, K, H = 1, 200, 256, 4, 2, 64
q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
out = fah.dot_product_attention(q, k, v, is_causal=True, interpret=INTERPRET)
ref = fah.attention_reference(q, k, v, is_causal=True)
naive = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
print("out", out.shape, out.dtype)
print("max |ours - float32 reference| :", float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))))
print("max |jax.nn bf16 - reference|  :", float(jnp.max(jnp.abs(naive.astype(jnp.float32) - ref))))"""),
        ("md", "Gradients come from our backward kernels (dQ, then dK/dV) at every head dim."),
        ("code", """\
loss = lambda q, k, v: jnp.sum(fah.dot_product_attention(q, k, v, is_causal=True,
                                                        interpret=INTERPRET).astype(jnp.float32) ** 2)
ref_loss = lambda q, k, v: jnp.sum(fah.attention_reference(q, k, v, is_causal=True) ** 2)
dq = jax.grad(loss)(q, k, v)
dq_ref = jax.grad(ref_loss)(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
print("dq relative error:", float(jnp.linalg.norm(dq.astype(jnp.float32) - dq_ref) / jnp.linalg.norm(dq_ref)))"""),
    ],
    "masks": [
        ("md", "# Masks as pictures\n\nWhat each query (row) sees of the keys (columns), and "
               "which KV blocks the kernel visits for each Q tile: the rest are never loaded."),
        ("code", SETUP),
        ("code", """\
%matplotlib inline
import matplotlib.pyplot as plt
from flash_attn_hopper import masking, reference
T, S, BLOCK = 256, 320, 64
cases = {
    "causal": dict(is_causal=True),
    "window (64, 0), causal": dict(is_causal=True, local_window_size=(64, 0)),
    "bottom-right causal": dict(is_causal=True, causal_alignment="bottom_right"),
    "window (32, 32)": dict(local_window_size=(32, 32)),
}
fig, axes = plt.subplots(1, len(cases) + 1, figsize=(4 * (len(cases) + 1), 4))
for ax, (name, kw) in zip(axes, cases.items()):
    ax.imshow(np.asarray(reference.band_mask(T, S, **kw)), cmap="Blues", aspect="auto")
    spec = api.mask_spec(T, S, is_causal=kw.get("is_causal", False),
                         local_window_size=kw.get("local_window_size"),
                         causal_alignment=kw.get("causal_alignment", "top_left"))
    for q0 in range(0, T, BLOCK):  # the blocks the kernel visits: full (green), edge (orange)
        r = masking.kv_block_range(spec, q0, BLOCK, S, BLOCK)
        for j in range(int(r.first), int(r.end)):
            full = int(r.full_lo) <= j < int(r.full_hi)
            ax.add_patch(plt.Rectangle((j * BLOCK, q0), BLOCK, BLOCK, fill=False, lw=1.5,
                                       ec="green" if full else "orange"))
    ax.set_title(name); ax.set_xlabel("key"); ax.set_ylabel("query")
lens = np.array([160, 320])  # padding: key_value_seq_lengths per batch element
axes[-1].imshow(np.arange(S)[None, :].repeat(2, 0) < lens[:, None], cmap="Blues", aspect="auto",
               interpolation="nearest")
axes[-1].set_title("key_value_seq_lengths [160, 320]"); axes[-1].set_xlabel("key"); axes[-1].set_ylabel("batch")
plt.tight_layout(); plt.show()"""),
        ("md", "Packed sequences: three documents in one row of 320 tokens, causal within each "
               "(`segment_ids`). The blocks outside the documents' diagonal squares are never "
               "loaded; blocks fully inside one document skip the element mask (green)."),
        ("code", """\
ids = jnp.asarray(np.repeat([0, 1, 2], [100, 156, 64]), jnp.int32)[None]
visible = np.asarray((ids[0][:, None] == ids[0][None, :]) & np.tri(S, dtype=bool))
spans = np.asarray(masking.segment_spans(ids, ids, BLOCK, BLOCK))[0]
spec = api.mask_spec(S, S, is_causal=True, local_window_size=None)
fig, ax = plt.subplots(figsize=(4, 4))
ax.imshow(visible, cmap="Blues")
for i, span in enumerate(spans):
    r = masking.kv_block_range(spec, i * BLOCK, BLOCK, S, BLOCK).intersect(masking.BlockRange(*span))
    for j in range(int(r.first), int(r.end)):
        full = int(r.full_lo) <= j < int(r.full_hi)
        ax.add_patch(plt.Rectangle((j * BLOCK, i * BLOCK), BLOCK, BLOCK, fill=False, lw=1.5,
                                   ec="green" if full else "orange"))
ax.set_title("segment_ids [0]*100 + [1]*156 + [2]*64, causal"); ax.set_xlabel("key"); ax.set_ylabel("query")
plt.show()"""),
        ("code", """\
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((1, T, 2, 64)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((1, S, 1, 64)), jnp.bfloat16)
for name, kw in cases.items():
    out = fah.dot_product_attention(q, k, k, interpret=INTERPRET, **kw)
    ref = fah.attention_reference(q, k, k, **kw)
    print(f"{name:24s} max error {float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))):.4f}")
q = jnp.asarray(rng.standard_normal((1, S, 2, 64)), jnp.bfloat16)
out = fah.dot_product_attention(q, k, k, is_causal=True, segment_ids=ids, interpret=INTERPRET)
ref = fah.attention_reference(q, k, k, is_causal=True, segment_ids=ids)
print(f"{'packed, causal':24s} max error {float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))):.4f}")"""),
    ],
    "benchmark": [
        ("md", "# Benchmark plots\n\nThe committed H200 results (`bench/results/*.json`), "
               "ours against cuDNN, measured in the same run. `python -m bench` makes new ones."),
        ("code", SETUP),
        ("code", """\
import json
%matplotlib inline
import matplotlib.pyplot as plt

def ratio_plot(results, pass_name, dtype, title):
    \"\"\"Bars of ours / cuDNN per workload of one pass and dtype in bench/results/<results>.\"\"\"
    cells = {}
    for c in json.load(open(os.path.join("..", "bench", "results", results)))["cells"]:
        name = c["workload"]["name"]
        if c["status"] == "ok" and c["pass_name"] == pass_name and name.endswith("_" + dtype):
            cells.setdefault(name, {})[c["peer"]] = c["tflops"]
    names = sorted((n for n in cells if {"ours", "cudnn"} <= set(cells[n])), key=lambda n: (
        ("causal" in n), int(n.split("_d")[1].split("_")[0]), int(n.split("_t")[1].split("_")[0])))
    ratios = [cells[n]["ours"] / cells[n]["cudnn"] for n in names]
    fig, ax = plt.subplots(figsize=(12, 4))
    ax.bar(range(len(names)), ratios, color=["tab:orange" if "causal" in n else "tab:blue" for n in names])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), [n.replace("h2048_", "").replace("_" + dtype, "") for n in names], rotation=60, ha="right")
    ax.set_ylabel(f"ours / cuDNN ({title})"); ax.set_title("H200, B·T = 16k, hidden 2048")
    plt.tight_layout(); plt.show()
    print(f"geomean ours/cuDNN {title}:", float(np.exp(np.mean(np.log(ratios)))))

ratio_plot("h200_forward.json", "fwd", "float16", "forward, fp16")"""),
        ("md", "Forward + backward (`h200_fwdbwd_bf16.json`, `h200_fwdbwd_fp16.json`): our "
               "backward kernels at every head dim."),
        ("code", 'ratio_plot("h200_fwdbwd_bf16.json", "fwdbwd", "bfloat16", "fwd+bwd, bf16")\n'
                 'ratio_plot("h200_fwdbwd_fp16.json", "fwdbwd", "float16", "fwd+bwd, fp16")'),
    ],
    "flax": [
        ("md", "# In a flax model\n\n`fah.flax_attention_fn()` is an `attention_fn` for "
               "`nnx.MultiHeadAttention`; outputs and gradients match flax's own attention."),
        ("code", SETUP),
        ("code", """\
from flax import nnx
make = lambda fn: nnx.MultiHeadAttention(num_heads=2, in_features=128, dtype=jnp.bfloat16,
                                         decode=False, rngs=nnx.Rngs(0),
                                         **({} if fn is None else {"attention_fn": fn}))
ours, theirs = make(fah.flax_attention_fn(interpret=INTERPRET)), make(None)
x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 128)), jnp.bfloat16)
a, b = ours(x), theirs(x)
print("max |ours - flax| :", float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))))
g = lambda m: nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(m)
ga, gb = g(ours), g(theirs)
print("query kernel grad, relative diff:",
      float(jnp.linalg.norm((ga.query.kernel[...] - gb.query.kernel[...]).astype(jnp.float32))
            / jnp.linalg.norm(gb.query.kernel[...].astype(jnp.float32))))"""),
    ],
}


def build(name: str, cells) -> nbformat.NotebookNode:
  nb = nbformat.v4.new_notebook()
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                               "language": "python"}
  nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else
              nbformat.v4.new_code_cell(src) for kind, src in cells]
  return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 900) -> nbformat.NotebookNode:
  NotebookClient(nb, timeout=timeout, kernel_name="python3",
                 resources={"metadata": {"path": str(HERE)}}).execute()
  return nb


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="execute without writing")
  parser.add_argument("names", nargs="*", default=list(NOTEBOOKS))
  args = parser.parse_args()
  for name in args.names:
    nb = execute(build(name, NOTEBOOKS[name]))
    if not args.check:
      nbformat.write(nb, HERE / f"{name}.ipynb")
    print(f"{name}: ok", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
