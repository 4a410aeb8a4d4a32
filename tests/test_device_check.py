"""benchmarks/device_check.py: the accelerator check runs end to end on CPU at a tiny shape."""

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import device_check
from tests import xla_flags
from vcpo_jax.model.config import tiny_qwen2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("dc") / "sub" / "check.json")  # --out's folder is created
  env = dict(os.environ, XLA_FLAGS=xla_flags.FAST_COMPILE)  # one CPU device, as on a 1-GPU host
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, "-m", "benchmarks.device_check", f"--out={out}", "--repeats=1", "--batches=4"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out) as f:
    rep = json.load(f)
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == rep  # the file is also the last stdout line
  return rep


@pytest.mark.slow
def test_report_fields(report):
  assert report["errors"] == {}, report.get("tracebacks")
  assert report["tiny"] and report["platform"] == "cpu"  # automatic on CPU
  assert report["nominal_hbm_bytes_per_s"] is None  # no HBM figure for a CPU
  lrn = report["learner"]
  for k in ("vcpo_s", "plain_step_s", "plain_grad_s"):
    assert lrn[k] > 0 and len(lrn[k[:-2] + "_times_s"]) == 1
    assert lrn[k[:-2] + "_lower_s"] > 0 and lrn[k[:-2] + "_compile_s"] > 0  # timed apart from the steps
  assert lrn["random_params_s"] > 0 and lrn["random_params_compile"]["programs_compiled"] >= 1
  init = report["init"]  # the trainer's initializer, timed on its own
  assert init["first_call_s"] > 0 and init["compile"]["programs_compiled"] >= 1 and init["num_layers"] == 1
  for part in ("learner", "sampler", "init"):
    assert report["compile_seconds"][part]["backend_compile_s"] > 0 and report["part_seconds"][part] > 0
  assert lrn["ratio_vcpo_over_plain_step"] == pytest.approx(lrn["vcpo_s"] / lrn["plain_step_s"])
  assert lrn["rows"] == 16 and lrn["seq_len"] == 32 and lrn["oom_retries"] == []
  assert math.isfinite(lrn["vcpo_metrics"]["pg_loss"]) and lrn["vcpo_metrics"]["nonfinite"] == 0.0
  assert report["xla_flags"] == xla_flags.FAST_COMPILE  # recorded: a flag variant's report says which
  smp = report["sampler"]
  assert smp["decode_layers"] == "scan"  # gsm8k's sampler: scanned layers ("auto" over a scanned model)
  # As an async run holds them: on CPU the publish dtype is float32 and sampler.param_dtype "auto" keeps it.
  assert (smp["publish_dtype"], smp["sampler_param_dtype"], smp["params_dtype_as_passed"]) == (
    "float32",
    "auto",
    "float32",
  )
  (row,) = smp["batches"]
  assert row["batch"] == 4 and row["tokens_per_s"] > 0
  assert row["first_call_s"] > 0 and row["compile"]["programs_compiled"] >= 1
  assert row["weight_bytes"] == lrn["num_params"] * 4  # float32 weights read per decode step
  if row["decode_step_s"] is None:  # a tiny call's decode steps can be inside the timing noise: said, not made up
    assert "noise" in row["note"] and "achieved_bytes_per_s" not in row
  else:
    assert row["achieved_bytes_per_s"] == pytest.approx(row["total_bytes"] / row["decode_step_s"])
  assert "roofline_fraction" not in row  # unknown bandwidth: no fraction is made up
  assert set(report["memory"][0]) >= {"peak_bytes_in_use", "bytes_limit"}


@pytest.mark.slow
def test_mfu_fields_and_flops_agree(report):
  """The two FLOP counts of a step: 6 x N_params x tokens and XLA's (which adds attention, the log-softmax and
  the optimizer; a factor 0.5-3 apart at the tiny shape, where those weigh more than at 1.5B)."""
  lrn = report["learner"]
  mfu = lrn["mfu"]
  assert mfu["tokens"] == lrn["rows"] * lrn["seq_len"] == 512 and mfu["devices"] == 1
  assert mfu["model_flops_6nd"] == 6 * lrn["num_params"] * 512
  assert mfu["peak_bf16_flops_per_device"] is None and report["peak_bf16_flops_per_device"] is None  # CPU
  for name in ("vcpo", "plain_step", "plain_grad"):
    row = mfu[name]
    assert row["xla_flops"] == lrn[f"{name}_xla_flops"] > 0
    assert 0.5 < row["xla_over_6nd"] < 3.0, row
    assert row["model_flops_per_s"] == pytest.approx(mfu["model_flops_6nd"] / lrn[f"{name}_s"])
    assert row["mfu"] is None and row["xla_utilization"] is None  # no peak: no MFU made up
  assert mfu["vcpo"]["xla_flops"] >= mfu["plain_grad"]["xla_flops"]  # VCPO does the plain work and more
  assert mfu["vcpo_step_over_plain_step"] == pytest.approx(lrn["ratio_vcpo_over_plain_step"])


def test_mfu_against_a_known_peak():
  out = {"num_params": 10, "vcpo_s": 2.0, "vcpo_xla_flops": 800.0, "plain_step_s": 1.0, "plain_step_xla_flops": None}
  rep = device_check.mfu_report(out, tokens=10, device_kind="NVIDIA H200", devices=2)
  assert rep["model_flops_6nd"] == 600.0 and rep["peak_bf16_flops_per_device"] == 989e12
  assert rep["vcpo"]["mfu"] == pytest.approx(600.0 / 2.0 / (2 * 989e12))
  assert rep["vcpo"]["xla_flops"] == 1600.0  # per device x devices
  assert rep["vcpo"]["xla_utilization"] == pytest.approx(1600.0 / 2.0 / (2 * 989e12))
  assert rep["plain_step"]["xla_flops"] is None and rep["plain_step"]["xla_utilization"] is None
  assert "plain_grad" not in rep and rep["vcpo_step_over_plain_step"] == 2.0


def test_peak_bf16_flops_by_device_kind():
  assert device_check.peak_bf16_flops("NVIDIA H200") == 989e12
  assert device_check.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert device_check.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
  assert device_check.peak_bf16_flops("TPU v5p") == 459e12
  assert device_check.peak_bf16_flops("TPU v5 lite") == 197e12  # v5e
  assert device_check.peak_bf16_flops("cpu") is None


def test_nominal_bandwidth_by_device_kind():
  assert device_check.nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
  assert device_check.nominal_bandwidth("NVIDIA H100 PCIe") == 2.0e12
  assert device_check.nominal_bandwidth("NVIDIA H200") == 4.8e12
  assert device_check.nominal_bandwidth("TPU v5 lite") == 0.819e12  # v5e
  assert device_check.nominal_bandwidth("TPU v5") == 2.765e12  # v5p
  assert device_check.nominal_bandwidth("TPU v6 lite") == 1.64e12
  assert device_check.nominal_bandwidth("cpu") is None


def test_decode_bytes_by_hand():
  """tiny_qwen2 (V 256, D 64, F 128, 2 layers, K 2, H 16) in bf16, batch 3, 10 filled positions."""
  cfg = tiny_qwen2(dtype="bfloat16")
  got = device_check.decode_bytes(cfg, batch=3, filled=10)
  assert got["weight_bytes"] == cfg.num_params * 2
  assert got["kv_bytes"] == 3 * 10 * 2 * 2 * 2 * 16 * 2  # B x S x layers x (k, v) x K x H x 2 bytes
  assert got["total_bytes"] == got["weight_bytes"] + got["kv_bytes"]


@pytest.mark.slow
def test_a_failing_part_is_recorded_and_the_next_still_runs():
  report = {"errors": {}}
  saves = []

  def boom(out):
    out["rows"] = 32  # measured before it failed: kept
    raise RuntimeError("RESOURCE_EXHAUSTED: 99 GiB")

  far = float("inf")
  assert device_check.run_part("learner", boom, report, far, lambda: saves.append("learner")) is None
  assert device_check.run_part("sampler", lambda out: {"ok": 1}, report, far, lambda: saves.append("sampler")) == {
    "ok": 1
  }
  assert report["errors"] == {"learner": "RuntimeError: RESOURCE_EXHAUSTED: 99 GiB"} and report["sampler"] == {"ok": 1}
  assert report["learner"] == {"rows": 32} and "RESOURCE_EXHAUSTED" in report["tracebacks"]["learner"]
  assert saves == ["learner", "sampler"]  # the JSON is written after each part, failed or not
  device_check.run_part("late", lambda out: None, report, deadline=0.0)
  assert "budget" in report["errors"]["late"] and "late" not in report


def test_the_json_is_written_after_each_part_even_when_one_raises(tmp_path, monkeypatch):
  """In process, with stand-in parts: the first raises, the second sees the first's record on disk already; a
  budget of 0 s skips every part with its reason and still writes the file."""
  out = tmp_path / "check.json"
  seen = {}

  def fails(ctx, part_out):
    part_out["phase"] = "compiled"
    raise ValueError("no such kernel")

  def reads(ctx, part_out):
    seen.update(json.loads(out.read_text()))
    return {"ok": True}

  monkeypatch.setattr(device_check, "PARTS", {"learner": fails, "sampler": reads})
  device_check.main([f"--out={out}", "--repeats=1"])
  rep = json.loads(out.read_text())
  assert rep["errors"] == {"learner": "ValueError: no such kernel"} and "no such kernel" in rep["tracebacks"]["learner"]
  assert rep["learner"] == {"phase": "compiled"} and rep["sampler"] == {"ok": True}
  assert seen["errors"] == rep["errors"] and seen["learner"] == {"phase": "compiled"}  # on disk before the sampler
  assert rep["command"] == f"python -m benchmarks.device_check --out={out} --repeats=1"
  assert rep["elapsed_s"] > 0 and set(rep["compile_seconds"]) == {"learner", "sampler"}
  device_check.main([f"--out={out}", "--budget_s=0"])
  rep = json.loads(out.read_text())
  assert set(rep["errors"]) == {"learner", "sampler"} and all("budget" in e for e in rep["errors"].values())
  assert not (tmp_path / "check.json.tmp").exists()


@pytest.mark.slow
def test_the_hard_limit_ends_a_part_that_runs_on_and_still_writes_the_json(tmp_path):
  """A part stuck past --limit_s (a compile cannot be interrupted) is recorded as cut off; the process ends at
  the limit with the JSON written, the parts before it kept and the ones after it never started."""
  out = tmp_path / "check.json"
  script = (
    "import time; from benchmarks import device_check as dc\n"
    "dc.PARTS = {'learner': lambda ctx, out: {'ok': 1}, 'sampler': lambda ctx, out: time.sleep(120),"
    " 'init': lambda ctx, out: {'never': 1}}\n"
    f"dc.main(['--out={out}', '--limit_s=12'])\n"  # 12 s: the setup before the first part fits on a loaded machine
  )
  env = dict(os.environ, XLA_FLAGS=xla_flags.FAST_COMPILE, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-c", script]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rep = json.loads(out.read_text())
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == rep
  assert rep["learner"] == {"ok": 1} and "cut off" in rep["errors"]["sampler"] and "init" not in rep
  assert 11.5 < rep["elapsed_s"] < 90 and rep["part_seconds"]["sampler"] > 0


def test_sampler_config_keeps_the_runs_decode_layers_unless_told():
  """--decode_layers sets the sampler part's SamplerConfig.decode_layers (a variant of the prepared session);
  without it the run's own value stays; either way one bucket per batch and no stop token."""
  from benchmarks import memory

  setting = memory.load_setting("gsm8k", dict(device_check.TINY_MODEL))
  runs = device_check._sampler_config(setting, 8, 4, (2, 4))
  assert runs.decode_layers == setting.sampler_cfg.decode_layers
  assert (runs.batch_buckets, runs.eos_id, runs.stop_ids, runs.max_new_tokens) == ((2, 4), None, (), 4)
  assert device_check._sampler_config(setting, 8, 4, (2,), "unrolled").decode_layers == "unrolled"
