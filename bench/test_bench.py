"""CPU tests of the benchmark's machinery (not of any kernel): `pytest bench/test_bench.py`.

Fake peers built on the float32 reference exercise the numerics check (pass, FAIL, the
pre-scaled q of a fixed-scale peer, chunked GQA references), the n/a and skip statuses, and
one end-to-end CLI run writes its JSON, markdown and PNG.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest

from bench import cli, grid, numerics, options, peers, report
from bench.inputs import WorkloadInputs
from bench.peers import Peer
from bench.runner import RunConfig, run_cell
from flash_attn_hopper.reference import attention_reference
from flash_attn_hopper.workloads import Workload

GQA = Workload("tiny_gqa", batch=2, seq_q=64, seq_kv=96, num_q_heads=4, num_kv_heads=2,
               head_dim=32, is_causal=True, dtype="float32")
CONFIG = RunConfig(passes=("fwd", "bwd", "fwdbwd"), repeats=2, timer="wall", check=True)


def _exact(q, k, v, w):
  out = attention_reference(q, k, v, scale=peers.workload_scale(w), is_causal=w.is_causal)
  return out.astype(q.dtype)


def _wrong_scale(q, k, v, w):
  return attention_reference(q, k, v, scale=1.0, is_causal=w.is_causal).astype(q.dtype)


def _unscaled(q, k, v, w):  # Like attention_mgpu: applies no scale at all.
  return attention_reference(q, k, v, scale=1.0, is_causal=w.is_causal).astype(q.dtype)


@jax.custom_vjp
def _no_backward(q, k, v):
  return attention_reference(q, k, v)


def _no_backward_fwd(q, k, v):
  return attention_reference(q, k, v), None


def _no_backward_bwd(res, g):
  raise NotImplementedError("no bwd yet")


_no_backward.defvjp(_no_backward_fwd, _no_backward_bwd)


@pytest.mark.parametrize("pass_name", ["fwd", "bwd", "fwdbwd"])
def test_exact_peer_passes_with_chunked_reference(monkeypatch, pass_name):
  monkeypatch.setattr(numerics, "REFERENCE_BUDGET_BYTES", 1)  # One q head per chunk.
  inputs = WorkloadInputs(GQA, seed=0, with_grads=True)
  r = run_cell(Peer("exact", _exact), pass_name, inputs, CONFIG)
  assert r.status == "ok", r.note
  assert r.tflops > 0 and len(r.times_ms) == 2
  assert max(r.errors.values()) < 1e-5
  assert set(r.errors) == ({"out"} if pass_name == "fwd" else
                           {"dq", "dk", "dv"} if pass_name == "bwd" else
                           {"out", "dq", "dk", "dv"})


def test_wrong_peer_fails_and_is_not_timed():
  inputs = WorkloadInputs(GQA, seed=0, with_grads=False)
  r = run_cell(Peer("wrong", _wrong_scale), "fwd", inputs, CONFIG)
  assert r.status == "FAIL" and r.tflops is None and not r.times_ms
  assert "out rel err" in r.note


@pytest.mark.parametrize("pass_name", ["fwd", "fwdbwd"])
def test_fixed_scale_peer_gets_prescaled_q(pass_name):
  inputs = WorkloadInputs(GQA, seed=0, with_grads=True)
  peer = Peer("unscaled", _unscaled, fixed_scale=1.0)
  r = run_cell(peer, pass_name, inputs, CONFIG)
  assert r.status == "ok", r.note
  assert jnp.allclose(inputs.q_for(peer), inputs.q * peers.workload_scale(GQA))
  assert max(r.errors.values()) < 1e-5


def test_not_implemented_is_na_and_limits_skip():
  w = GQA.replace(is_causal=False)
  inputs = WorkloadInputs(w, seed=0, with_grads=True)
  r = run_cell(Peer("nobwd", lambda q, k, v, w: _no_backward(q, k, v)), "bwd", inputs, CONFIG)
  assert r.status == "n/a" and "no bwd yet" in r.note
  mgpu = Peer("mgpu", _exact, limits=peers._mgpu_limits)  # pylint: disable=protected-access
  assert run_cell(mgpu, "fwd", inputs, CONFIG).status == "skip"


def test_check_units_cover_first_and_last_kv_head():
  units = numerics.check_units(GQA)
  assert [(u.batch, u.kv_head, u.q_start, u.q_stop) for u in units] == [(0, 0, 0, 2),
                                                                       (1, 1, 2, 4)]
  mqa = Workload("m", 1, 8, 8, 16, 1, 64)
  assert len(numerics.check_units(mqa)) == 1


def test_grid_resize_and_models():
  ws = grid.grid_workloads((128,), (64,), (True,), ("bfloat16",), tokens=256, hidden=128)
  assert ws[0].batch == 2 and ws[0].num_q_heads == 2 and grid.is_grid(ws[0])
  models = grid.model_workloads((), ("float16",))
  assert models and not any(grid.is_grid(m) for m in models)
  assert all(m.dtype == "float16" for m in models)


def test_quick_preset_and_explicit_override():
  p = options.build_parser("")
  args = options.resolve(p.parse_args(["--quick", "--dtypes", "bfloat16"]))
  assert args.passes == ("fwd",) and args.seq_lens == (1024, 4096)
  assert args.head_dims == (64, 128) and args.causal == (False, True)
  assert args.dtypes == ("bfloat16",) and args.peers == peers.PEER_NAMES


def test_backward_config_reaches_our_peer():
  import flash_attn_hopper as fah
  p = options.build_parser("")
  args = options.resolve(p.parse_args(["--backward-config", "64,64,2,1"]))
  assert args.backward_config == fah.BackwardConfig(64, 64, 2, dq_num_stages=1)
  assert "dq_num_stages=1" in peers.ours_peer(False, args.backward_config).description
  args = options.resolve(p.parse_args(["--backward-config", "128,64,2,2,64,64"]))
  assert args.backward_config.dq_rows == 64 and args.backward_config.block_q == 128
  with pytest.raises(SystemExit):
    options.resolve(p.parse_args(["--backward-config", "64,64"]))


def test_nondeterministic_reaches_our_peer(monkeypatch):
  import flash_attn_hopper as fah
  seen = {}
  monkeypatch.setattr(fah, "dot_product_attention", lambda *a, **kw: seen.update(kw))
  p = options.build_parser("")
  args = options.resolve(p.parse_args(["--nondeterministic"]))
  assert args.nondeterministic
  peer = peers.ours_peer(False, None, deterministic=not args.nondeterministic)
  assert "deterministic=False" in peer.description
  w = grid.grid_workloads((128,), (64,), (False,), ("bfloat16",), 256, 128)[0]
  peer.fn(None, None, None, w)
  assert seen["deterministic"] is False


def test_cli_end_to_end(tmp_path, capsys):
  rc = cli.main(["--peers", "xla", "--seq-lens", "64", "--head-dims", "32", "--dtypes",
                 "float32", "--tokens", "64", "--hidden", "64", "--repeats", "2", "--passes",
                 "fwd,bwd", "--out", str(tmp_path), "--tag", "t", "--no-progress"])
  assert rc == 0
  doc = json.loads((tmp_path / "t.json").read_text())
  assert doc["meta"]["complete"] and doc["meta"]["timer"] == "wall"
  xla = [c for c in doc["cells"] if c["peer"] == "xla"]
  assert len(xla) == 4 and all(c["status"] == "ok" for c in xla)
  assert all(c["status"] in ("error", "ok", "n/a") for c in doc["cells"] if c["peer"] == "ours")
  assert (tmp_path / "t.md").exists()
  assert os.path.exists(tmp_path / "t.png") or "no plot" in capsys.readouterr().out
  assert report.summary([]) == []


def test_resume_keeps_whole_workloads_of_an_earlier_run(tmp_path):
  common = ["--peers", "xla", "--head-dims", "32", "--dtypes", "float32", "--tokens", "128",
            "--hidden", "64", "--repeats", "2", "--passes", "fwd", "--out", str(tmp_path),
            "--no-progress", "--causal", "no"]
  assert cli.main(common + ["--seq-lens", "64", "--tag", "cut"]) == 0
  cut = json.loads((tmp_path / "cut.json").read_text())
  # The earlier run's second workload ran ours only, as if its budget ran out in between.
  assert cli.main(common + ["--seq-lens", "128", "--tag", "half", "--peers", "none"]) == 0
  half = json.loads((tmp_path / "half.json").read_text())
  cut["cells"] += half["cells"]
  for c in cut["cells"]:
    c["note"] = "from the earlier run"
  (tmp_path / "cut.json").write_text(json.dumps(cut))
  assert cli.main(common + ["--seq-lens", "64,128", "--tag", "all",
                            "--resume", str(tmp_path / "cut.json")]) == 0
  doc = json.loads((tmp_path / "all.json").read_text())
  assert doc["meta"]["complete"] and doc["meta"]["resumed_from"]["cells_kept"] == 2
  notes = {(c["workload"]["seq_q"], c["peer"]): c["note"] for c in doc["cells"]}
  assert len(notes) == len(doc["cells"]) == 4
  assert notes[(64, "xla")] == notes[(64, peers.OURS)] == "from the earlier run"  # kept
  assert "from the earlier run" not in (notes[(128, "xla")], notes[(128, peers.OURS)])
  assert "resumed: 2 cells" in (tmp_path / "all.md").read_text()
  with pytest.raises(SystemExit, match="repeats"):
    cli.main(common + ["--repeats", "3", "--seq-lens", "64", "--tag", "other",
                       "--resume", str(tmp_path / "cut.json")])


def test_fail_of_ours_sets_exit_status(capsys):
  inputs = WorkloadInputs(GQA, seed=0, with_grads=False)
  theirs = run_cell(Peer("wrong", _wrong_scale), "fwd", inputs, CONFIG)
  assert cli._fail_banner([theirs]) == 0  # pylint: disable=protected-access
  ours = run_cell(Peer(peers.OURS, _wrong_scale), "fwd", inputs, CONFIG)
  assert cli._fail_banner([theirs, ours]) == 1  # pylint: disable=protected-access
  assert "FAILED" in capsys.readouterr().err
  header, rows = report.table_rows([theirs, ours], [peers.OURS, "wrong"])
  assert rows[0][2:4] == ["FAIL", "FAIL"]
