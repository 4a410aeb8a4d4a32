"""benchmarks/sampler.py: every timed call of ours is bracketed by its own roofline measurements."""

import numpy as np

from benchmarks import sampler as bench


def test_interleaved_brackets_each_of_our_calls():
  log, stamps = [], iter(range(100))

  def stick():
    log.append("stick")
    return next(stamps)

  t_ours, t_theirs, sticks = bench.interleaved(
    lambda: log.append("ours"), lambda: log.append("theirs"), rounds=3, yardstick=stick
  )
  assert log == ["stick", "ours", "stick", "theirs"] * 3
  assert sticks == [(0, 1), (2, 3), (4, 5)]  # round r: the measurement just before and just after ours
  assert len(t_ours) == len(t_theirs) == 3


def test_interleaved_without_a_yardstick_keeps_its_two_lists():
  log = []
  out = bench.interleaved(lambda: log.append("ours"), lambda: log.append("theirs"), rounds=2)
  assert len(out) == 2 and log == ["ours", "theirs"] * 2


def test_matmul_floor_rounds_each_bracketed_by_the_roofline(monkeypatch):
  """--matmul_floor runs the model's dots and reports per round the roofline of the whole generate call (the mean
  of the measurements just before and after that round) over the round's time."""
  sticks = iter([dict(peak_flops=1e9, bandwidth=1e9), dict(peak_flops=3e9, bandwidth=3e9)] * 2)
  monkeypatch.setattr(bench, "measure_roofline", lambda: next(sticks))
  cfg = bench.MODELS["tiny"]()
  out = bench.matmul_floor(cfg, batch=2, prompt=4, new=3, rounds=2)
  roof = (bench.roofline_seconds(cfg, 2, 4, 3, 1e9, 1e9) + bench.roofline_seconds(cfg, 2, 4, 3, 3e9, 3e9)) / 2
  np.testing.assert_allclose(out["roofline_round_s"], [roof, roof])
  fracs = [roof / t for t in out["round_s"]]
  assert out["fraction"] == np.median(fracs) and out["fraction_min"] == min(fracs)
