"""async_.publish_path='transfer' (rollout/transfer_publish.py): a spawned sampler pulls parameters with
jax.experimental.transfer. XLA:CPU, one learner process (this one) and spawned sampler processes."""

import os
import signal
import time

import jax
import numpy as np
import pytest

from tests import fixtures
from tests.test_async import _source, _subprocesses_share_a_compilation_cache, _tiny, versions_and_batches  # noqa: F401
from vcpo_jax import metrics as metrics_lib
from vcpo_jax import run_config, trainer
from vcpo_jax.rollout import async_
from vcpo_jax.rollout.device_publish import device_checksum
from vcpo_jax.rollout.process import worker as worker_lib
from vcpo_jax.rollout.process.shm_queue import SPAWN
from vcpo_jax.rollout.transfer_publish import TransferAsyncSource


def _shm_mappings(pid: int) -> dict[str, int]:
  """/dev/shm files process `pid` maps -> bytes mapped (a removed file's name ends in ' (deleted)')."""
  out = {}
  with open(f"/proc/{pid}/maps") as f:
    for line in f:
      if "/dev/shm/" in line:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        name = line[line.index("/dev/shm/") :].strip()
        out[name] = out.get(name, 0) + hi - lo
  return out


# max_sampler_restarts=0: a failed sampler ends the source (tests/test_recovery.py covers its replacement)
_OVER = {"lag.k": 1, "async_.publish_path": "transfer", "async_.queue_slots": 1, "async_.max_sampler_restarts": 0}


def _pull_child(slot, versions, out):
  """A stand-in sampler process: pulls each of `versions` (min_version) through the slot, sends host copies."""
  for v in versions:
    got, arrays = slot.latest(min_version=v, timeout=120.0)
    out.send(
      (
        got,
        {n: np.asarray(a) for n, a in arrays.items()},
        sorted({str(d) for a in arrays.values() for d in a.devices()}),
        slot.checksum_of(arrays, slot.names),
        os.getpid(),
      )
    )
  slot.close()
  out.close()


def test_the_sampler_process_pulls_the_learners_parameters_after_a_step_even_once_they_are_donated():
  """The channel alone (the worker replaced by _pull_child): the pulled copy equals the published parameters
  bit for bit, lives on the other process's device, and carries its version and the learner's checksum;
  publish() returns before the pull (nothing waits for the sampler) and no shared-memory segment exists."""
  src, params = _source(_tiny(steps=3, **_OVER), TransferAsyncSource)
  names = worker_lib.param_names(params)
  params1 = jax.tree.map(lambda x: x * 2.0 + 1.0, params)  # "after a step"
  want = {0: {n: np.array(a) for n, a in zip(names, jax.tree.leaves(params))}}
  want[1] = {n: np.array(a) for n, a in zip(names, jax.tree.leaves(params1))}
  recv, send = SPAWN.Pipe(duplex=False)

  def start(arrays, version):  # the channel of TransferAsyncSource._start, with the stand-in sampler
    src._open_slot(arrays, version)
    src.proc = SPAWN.Process(target=_pull_child, args=(src.slot, [0, 1], send))
    src.proc.start()
    send.close()
    src._serve_requests()

  src._start = start
  src.replaceable = False  # the stand-in sampler has no batch queue, so no heartbeat to watch
  try:
    src.publish(params, 0)
    got = [recv.recv() if recv.poll(120.0) else pytest.fail("no pull of version 0")]
    src.publish(params1, 1)
    jax.jit(lambda p: jax.tree.map(lambda x: x * 0.0, p), donate_argnums=0)(params1)  # what train_step does
    got.append(recv.recv() if recv.poll(120.0) else pytest.fail("no pull of version 1"))
    for v, (version, arrays, devices, csum, pid) in enumerate(got):
      assert version == v and pid == src.proc.pid != os.getpid()
      assert set(arrays) == set(names)
      for n in names:
        np.testing.assert_array_equal(arrays[n], want[v][n], err_msg=n)
        assert arrays[n].dtype == want[v][n].dtype == np.float32  # the CPU publish dtype
      assert devices == ["cpu:0"]  # the sampler process's own first device (its id 0, not the learner's)
      assert csum == int(src._checksums[v]) == int(device_checksum([want[v][n] for n in names]))
    assert src.offers == 2 and len(src.publish_blocking_s) == 2
    assert src.resource_paths() == []  # no named /dev/shm segment (the stand-in sampler has no batch queue)
    src.proc.join(30.0)
    assert src.proc.exitcode == 0
  finally:
    src.close()


@pytest.mark.slow
def test_transfer_batches_equal_the_shm_paths_and_echo_version_and_checksum():
  """The real worker over both paths, versions fixed by the protocol: every batch equals the shm path's field
  for field (same parameters, keys and sampler programs); each echoes its version's device checksum; the
  sampler process maps only the batch queue's segments; close() stops it (exit 0)."""
  shm, _ = versions_and_batches(async_.AsyncSource, {"lag.k": 1, "async_.queue_slots": 1})
  got, src = versions_and_batches(TransferAsyncSource, _OVER)
  assert src.proc.exitcode == 0 and src.slot is None
  for step, ((b_shm, i_shm), (b_tr, i_tr)) in enumerate(zip(shm, got)):
    assert (b_tr["policy_version"] == max(0, step - 1)).all(), step
    assert set(b_tr) == set(b_shm)
    for name in b_shm:
      np.testing.assert_array_equal(np.asarray(b_tr[name]), np.asarray(b_shm[name]), err_msg=f"{step} {name}")
    assert i_tr["texts"] == i_shm["texts"] and i_tr["problem_ids"] == i_shm["problem_ids"]
    assert isinstance(i_tr["params_checksum"], int)  # next() checked it against the published one


@pytest.mark.slow
def test_killed_sampler_is_reported_and_close_stops_the_transfer_path():
  """SIGKILL of the sampler process: next() and publish() raise SamplerDiedError, as on the shm path; the
  server thread ends; close() is idempotent."""
  src, params = _source(_tiny(steps=6, **_OVER), TransferAsyncSource)
  try:
    src.publish(params, 0)
    src.next(0)
    # The weights never come through /dev/shm: the sampler maps the batch queue's segments and the counter's
    # page (multiprocessing's heap, unlinked at creation), nothing else.
    queue = src.queue.resource_paths()  # their names are removed once the sampler has attached: "<path> (deleted)"
    other = {p: size for p, size in _shm_mappings(src.pid).items() if p.removesuffix(" (deleted)") not in queue}
    assert len(other) == 1 and list(other.values()) == [4096] and next(iter(other)).endswith("(deleted)"), other
    os.kill(src.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(async_.SamplerDiedError, match="SIGKILL"):
      for step in range(1, 6):
        src.next(step)
    assert time.monotonic() - t0 < 30.0
    with pytest.raises(async_.SamplerDiedError):
      src.publish(params, 1)
    src._thread.join(5.0)
    assert not src._thread.is_alive()  # the request pipe closed with the sampler
  finally:
    src.close()
  src.close()


@pytest.mark.slow
def test_async_run_over_the_transfer_path_matches_the_shm_runs_first_steps(tmp_path, monkeypatch):
  """trainer.run with publish_path='transfer': lags bounded, checksums checked every step, clean exit; the
  steps whose batches came from the same versions as the shm run's (at least step 1: batch 0 from version 0)
  log the same values."""
  steps = 4
  runs = {}
  for path in ("shm", "transfer"):
    built, seen, _ = fixtures.record_sources(monkeypatch)
    wd = str(tmp_path / path)
    extra = {"async_.max_sampler_restarts": 0} if path == "transfer" else {}  # as the test ran before replacement
    trainer.run(_tiny(steps=steps, **{"lag.k": 1, "async_.publish_path": path, **extra}), wd)
    (src,) = built
    assert src.proc.exitcode == 0
    rows = [r for r in metrics_lib.read_jsonl(os.path.join(wd, "metrics.jsonl")) if "train/lag_max" in r]
    runs[path] = ([tuple(v.tolist()) for _, v, _ in seen], rows)
    monkeypatch.undo()
  assert isinstance(src, TransferAsyncSource)
  (v_shm, r_shm), (v_tr, r_tr) = runs["shm"], runs["transfer"]
  assert all(0 <= r["train/lag_min"] <= r["train/lag_max"] <= 1 for r in r_tr)
  same = next((i for i, (a, b) in enumerate(zip(v_shm, v_tr)) if a != b), steps)
  assert same >= 1
  print(f"[transfer] steps with the same batch versions as the shm run: {same} of {steps}")
  # Rows 0 .. same - 1 (steps 1 .. same) were learned from the same batches and parameters: every logged value
  # but the timings is equal (loss, reward, gradient norms, lag statistics, ...).
  for a, b in zip(r_shm[:same], r_tr[:same]):
    keys = {k for k in set(a) | set(b) if not k.startswith("time/") and k != "wall_time"}
    assert "train/reward_mean" in keys and len(keys) > 10
    assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}, a["step"]


@pytest.mark.parametrize(
  "over, match",
  [
    ({"async_.inflight_updates": True}, "async_.inflight_updates"),
    ({"eval.background": True}, "eval.background"),
    (
      {"distributed.enabled": True, "distributed.coordinator_address": "h:1", "distributed.num_processes": 2},
      "async_.publish_path",
    ),
  ],
)
def test_unsupported_transfer_combinations_fail_in_config_parsing(over, match):
  with pytest.raises(ValueError, match=match):
    run_config.parse_config(_tiny(**{**_OVER, **over}), check_prompts=False)
