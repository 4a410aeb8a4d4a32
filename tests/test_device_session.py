"""benchmarks/device_session.sh: the prepared accelerator session's steps, their flags and its time rule."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(tmp_path, total_s: int) -> dict:
  env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), TOTAL_S=str(total_s), XLA_FLAGS="--xla_x=1")
  out = subprocess.run(["bash", "benchmarks/device_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  return dict(line.split(": ", 1) for line in out.stdout.splitlines() if not line.startswith("done"))


def test_the_session_runs_the_check_then_the_sampler_variants(tmp_path):
  plan = _plan(tmp_path, 10_000)
  assert list(plan) == ["device_check", "first_command", "sampler_cmdbuf", "sampler_dsfusion", "sampler_unrolled"]
  assert "benchmarks.device_check" in plan["device_check"] and "--parts" not in plan["device_check"]
  assert "--limit_s=285" in plan["device_check"]  # inside the 6 minutes the issue allows
  for name in ("sampler_cmdbuf", "sampler_dsfusion", "sampler_unrolled"):
    assert "--parts=sampler" in plan[name] and f"--out={tmp_path}/{name}.json" in plan[name]
  assert "WHILE" in plan["sampler_cmdbuf"] and "dynamic_slice_fusion=true" in plan["sampler_dsfusion"]
  assert "--decode_layers=unrolled" in plan["sampler_unrolled"]
  for name in ("device_check", "sampler_cmdbuf", "sampler_dsfusion", "sampler_unrolled"):
    # the caller's XLA_FLAGS kept, the variant's appended; no leading blank (XLA would read a file name)
    assert plan[name].split("XLA_FLAGS=", 1)[1].startswith("--xla_x=1")
  assert "main.py --config=configs/countdown.py" in plan["first_command"]


def test_a_step_whose_limit_would_pass_the_total_is_skipped(tmp_path):
  plan = _plan(tmp_path, 200)  # the check's 300 s would pass 200 s; the 100 s and 80 s steps fit
  assert plan["device_check"].startswith("skipped")
  assert not plan["first_command"].startswith("skipped") and not plan["sampler_unrolled"].startswith("skipped")
