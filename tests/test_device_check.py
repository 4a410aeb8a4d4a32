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
  assert lrn["ratio_vcpo_over_plain_step"] == pytest.approx(lrn["vcpo_s"] / lrn["plain_step_s"])
  assert lrn["rows"] == 16 and lrn["seq_len"] == 32 and lrn["oom_retries"] == []
  assert math.isfinite(lrn["vcpo_metrics"]["pg_loss"]) and lrn["vcpo_metrics"]["nonfinite"] == 0.0
  (row,) = report["sampler"]["batches"]
  assert row["batch"] == 4 and row["tokens_per_s"] > 0 and row["decode_step_s"] > 0
  assert row["achieved_bytes_per_s"] == pytest.approx(row["total_bytes"] / row["decode_step_s"])
  assert "roofline_fraction" not in row  # unknown bandwidth: no fraction is made up
  assert set(report["memory"][0]) >= {"peak_bytes_in_use", "bytes_limit"}


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

  def boom():
    raise RuntimeError("RESOURCE_EXHAUSTED: 99 GiB")

  far = float("inf")
  assert device_check.run_part("learner", boom, report, far) is None
  assert device_check.run_part("sampler", lambda: {"ok": 1}, report, far) == {"ok": 1}
  assert report["errors"] == {"learner": "RuntimeError: RESOURCE_EXHAUSTED: 99 GiB"} and report["sampler"] == {"ok": 1}
  device_check.run_part("late", dict, report, deadline=0.0)
  assert "deadline" in report["errors"]["late"] and "late" not in report
