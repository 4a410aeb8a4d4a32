"""rollout/publish.py: the Publisher interface's shared parts (no sampler, no device work)."""

from __future__ import annotations

import pytest

from vcpo_jax.rollout import async_, device_publish, publish, transfer_publish


@pytest.mark.parametrize("k, kept", [(1, [2, 3, 4, 5, 6]), (2, [0, 1, 2, 3, 4, 5, 6]), (0, [4, 5, 6])])
def test_record_keeps_the_checksums_a_batch_can_still_echo(k, kept):
  """Versions below v - 2k - 2 go when v is recorded (hand-checked: v = 6, k = 1 keeps 2..6)."""
  p = publish.Publisher(async_.AsyncConfig(), k, None, "run", snap=None, host_arrays=None)
  for v in range(7):
    p.record(v, 100 + v)
  assert sorted(p.checksums) == kept and p.checksums[6] == 106


def test_every_publish_path_is_one_publisher_and_only_the_process_ones_serve_background_eval():
  paths = {"shm": publish.ShmPublisher, "device": device_publish.DevicePublisher}
  paths["transfer"] = transfer_publish.TransferPublisher
  assert all(issubclass(cls, publish.Publisher) for cls in paths.values())
  assert [name for name, cls in paths.items() if cls.eval_ok] == ["shm", "transfer"]
  assert [name for name, cls in paths.items() if cls.in_process] == ["device"]


def test_background_for_reads_the_setting_and_the_backend():
  assert publish.background_for("auto", "cpu") is False and publish.background_for("auto", "gpu") is True
  assert publish.background_for(True, "cpu") is True and publish.background_for("false", "tpu") is False
  with pytest.raises(ValueError, match="async_.background_publish"):
    publish.background_for("sometimes", "cpu")
