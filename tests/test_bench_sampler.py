"""benchmarks/sampler.py: every timed call of ours is bracketed by its own roofline measurements."""

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
