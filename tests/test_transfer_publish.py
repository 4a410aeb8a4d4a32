"""async_.publish_path='transfer' (rollout/transfer_publish.py): a spawned sampler pulls parameters with
jax.experimental.transfer. XLA:CPU, one learner process (this one) and spawned sampler processes."""

import os
import signal
import time

import jax
import numpy as np
import pytest

from tests import fixtures
from tests.test_async import (  # noqa: F401
  _source,
  _subprocesses_share_a_compilation_cache,
  _tiny,
  echoed_checksums,
  versions_and_batches,
)
from vcpo_jax import metrics as metrics_lib
from vcpo_jax import run_config, trainer
from vcpo_jax.rollout import async_
from vcpo_jax.rollout.device_publish import device_checksum
from vcpo_jax.rollout.process import worker as worker_lib
from vcpo_jax.rollout.process.shm_queue import SPAWN
from vcpo_jax.rollout.transfer_publish import TransferPublisher


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


@pytest.mark.slow
def test_the_sampler_process_pulls_the_learners_parameters_after_a_step_even_once_they_are_donated():
  """The channel alone (the worker replaced by _pull_child): the pulled copy equals the published parameters
  bit for bit, lives on the other process's device, and carries its version and the learner's checksum;
  publish() returns before the pull (nothing waits for the sampler) and no shared-memory segment exists."""
  src, params = _source(_tiny(steps=3, **_OVER), async_.AsyncSource)
  names = worker_lib.param_names(params)
  params1 = jax.tree.map(lambda x: x * 2.0 + 1.0, params)  # "after a step"
  want = {0: {n: np.array(a) for n, a in zip(names, jax.tree.leaves(params))}}
  want[1] = {n: np.array(a) for n, a in zip(names, jax.tree.leaves(params1))}
  recv, send = SPAWN.Pipe(duplex=False)

  def start(arrays, version):  # the channel of AsyncSource._start, with the stand-in sampler
    src._open_slot(arrays, version)
    src.proc = SPAWN.Process(target=_pull_child, args=(src.slot, [0, 1], send))
    src.proc.start()
    send.close()
    src.publisher.started()

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
      assert csum == int(src.publisher.checksums[v]) == int(device_checksum([want[v][n] for n in names]))
    assert src.publisher.offers == 2 and len(src.publish_blocking_s) == 2
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
  got, src = versions_and_batches(async_.AsyncSource, _OVER)
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
  src, params = _source(_tiny(steps=6, **_OVER), async_.AsyncSource)
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
    src.publisher._thread.join(5.0)
    assert not src.publisher._thread.is_alive()  # the request pipe closed with the sampler
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
  assert isinstance(src.publisher, TransferPublisher)
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
    ({}, r"async_\.publish_path='transfer'"),
    ({"async_.publish_path": "device", "async_.sampler_devices": "1"}, r"async_\.publish_path='device'"),
  ],
)
def test_device_and_transfer_publishers_on_several_hosts_fail_in_config_parsing(over, match):
  """They serve one learner process (the many-hosts topology gathers to host-complete arrays, which the
  device_put / offer of a process-local device cannot take): one line naming the field, its value and the fix."""
  several = {"distributed.enabled": True, "distributed.coordinator_address": "h:1", "distributed.num_processes": 2}
  with pytest.raises(ValueError, match=match + r".*serve one learner process; set 'shm'") as e:
    run_config.parse_config(_tiny(**{**_OVER, **several, **over}), check_prompts=False)
  assert "\n" not in str(e.value)


def test_inflight_updates_over_the_transfer_path_fail_in_config_parsing():
  with pytest.raises(ValueError, match=r"async_\.inflight_updates=True: in-flight updates do not run over") as e:
    run_config.parse_config(_tiny(**{**_OVER, "async_.inflight_updates": True}), check_prompts=False)
  assert "\n" not in str(e.value)


def test_background_eval_needs_a_sampler_process_so_the_device_path_refuses_it():
  device = {"async_.publish_path": "device", "async_.sampler_devices": "1", "eval.background": True}
  with pytest.raises(ValueError, match=r"eval\.background.*'shm' or 'transfer' \(have 'device'\)"):
    run_config.parse_config(_tiny(**{**_OVER, **device}), check_prompts=False)
  run_config.parse_config(_tiny(**{**_OVER, "eval.background": True}), check_prompts=False)  # transfer: fine


@pytest.mark.slow
def test_background_eval_over_the_transfer_path(tmp_path, monkeypatch):
  """eval.background with publish_path='transfer' (the publisher is a part: the spawned sampler evaluates from its
  own eval ParamSlot while its weights come by pulls): records of steps 0 and 2 tagged with their versions and
  the checksum of what the sampler read; the learner exits cleanly and nothing is left in /dev/shm."""
  from tests.test_async import _assert_removed

  built, _, paths = fixtures.record_sources(monkeypatch)
  cfg = _tiny(steps=4, **{**_OVER, "eval.every": 2, "eval.background": True})
  workdir = str(tmp_path / "run")
  assert trainer.run(cfg, workdir)["step"] == 4
  (src,) = built
  assert isinstance(src.publisher, TransferPublisher) and src.proc.exitcode == 0
  bg = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "eval.jsonl")) if r.get("background")]
  assert [r["step"] for r in bg] == [0, 2] and [r["policy_version"] for r in bg] == [0, 2]
  assert all(r["sampler_pid"] == src.pid and isinstance(r["params_checksum"], int) for r in bg)
  _assert_removed(paths)


def _delta_child(slot, versions, out):
  """A stand-in sampler with delta pulls: for each version, (version, host arrays, checksum, last_pull)."""
  for v in versions:
    got, arrays = slot.latest(min_version=v, timeout=120.0)
    out.send((got, {n: np.asarray(a) for n, a in arrays.items()}, slot.checksum_of(arrays, slot.names), slot.last_pull))
  slot.close()
  out.close()


@pytest.mark.slow
def test_delta_pulls_rebuild_every_version_bit_for_bit_across_a_replacement_and_a_resume():
  """async_.publish_delta='auto' on the transfer path, the channel alone: the first pull of a sampler (the start, a
  replacement: a fresh slot holding nothing, a resumed run: a new source) carries the full snapshot, every later
  one the XOR record against the version that sampler holds; the rebuilt arrays equal the published ones bit for
  bit and their device checksum is the learner's; a record is a fraction of a full copy."""
  over = {**_OVER, "async_.publish_delta": "auto"}
  src, params = _source(_tiny(steps=8, **over), async_.AsyncSource)
  names = worker_lib.param_names(params)
  leaves = jax.tree.leaves(params)
  # version v: one tensor's first 100 entries moved (an "AdamW step" of a few weights), every other bit kept
  version = lambda v: jax.tree.unflatten(
    jax.tree.structure(params),
    [x.reshape(-1).at[:100].add(1e-3 * v).reshape(x.shape) if i == 0 else x for i, x in enumerate(leaves)],
  )
  want = lambda v: {n: np.array(a) for n, a in zip(names, jax.tree.leaves(version(v)))}

  def sampler(source, versions, first):
    """A stand-in sampler (a fresh slot: what a replacement gets) pulling `versions`; publishes them in turn."""
    recv, send = SPAWN.Pipe(duplex=False)

    def start(arrays, v):
      source._open_slot(arrays, v)
      source.proc = SPAWN.Process(target=_delta_child, args=(source.slot, versions, send))
      source.proc.start()
      send.close()
      source.publisher.started()

    source._start, source.replaceable = start, False
    got = []
    for v in versions:
      if v == first and source.proc is not None:  # a replacement: a fresh slot and sampler on the same server
        start(dict(zip(names, source.publisher._snap1(jax.tree.leaves(version(v))))), v)
      source.publish(version(v), v)
      got.append(recv.recv() if recv.poll(120.0) else pytest.fail(f"no pull of version {v}"))
    source.proc.join(30.0)
    return got

  try:
    got = sampler(src, [0, 1, 2], 0) + sampler(src, [3, 4], 3)
    resumed, _ = _source(_tiny(steps=8, **over), async_.AsyncSource)
    try:
      got += sampler(resumed, [5, 6], 5)
      records = list(src.publisher.publish_records) + list(resumed.publisher.publish_records)
    finally:
      resumed.close()
  finally:
    src.close()
  kinds = [p["kind"] for _, _, _, p in got]
  assert kinds == ["full", "delta", "delta", "full", "delta", "full", "delta"], kinds
  assert [(v, k) for v, k, _ in records] == list(zip(range(7), kinds))
  full = sum(np.asarray(x).nbytes for x in leaves)
  for v, (version_got, arrays, csum, pull) in enumerate(got):
    assert version_got == v
    for n in names:
      np.testing.assert_array_equal(arrays[n], want(v)[n], err_msg=f"{v} {n}")
    assert csum == int(device_checksum([want(v)[n] for n in names]))  # = the learner's (src.publisher.checksums)
    assert pull["bytes"] < full / 20 if pull["kind"] == "delta" else pull["bytes"] >= full


@pytest.mark.slow
def test_delta_pulls_with_the_real_sampler_across_a_killed_sampler_and_a_resume():
  """The real worker over the transfer path with delta pulls: every batch echoes the device checksum of its version
  computed by the sampler over the arrays it rebuilt (next() checks it), equal to the published one's; the first
  pull of the start, of the replacement of a SIGKILLed sampler and of a resumed run's new source is full, the
  others are deltas."""
  over = {"lag.k": 1, "async_.queue_slots": 1, "async_.publish_path": "transfer", "async_.publish_delta": "auto"}
  src, params = _source(_tiny(steps=8, **over), async_.AsyncSource)
  names = worker_lib.param_names(params)
  version = lambda v: jax.tree.map(lambda x: x * (1.0 + 1e-6 * v), params)  # every value moves a few ulps
  want = lambda v: int(device_checksum([np.asarray(a) for a in jax.tree.leaves(version(v))]))

  try:
    echoed = echoed_checksums(src, version, 0, 6, kill_at=4)
    assert src.sampler_restarts == 1
    kinds = [kind for _, kind, _ in src.publisher.publish_records]
  finally:
    src.close()
  assert echoed == {v: want(v) for v in range(5)}, echoed  # version 4: made by the replacement
  assert kinds[0] == "full" and kinds.count("full") == 2 and "delta" in kinds[1 : kinds.index("full", 1)], kinds
  assert kinds[-1] == "delta", kinds  # the replacement's second pull
  assert len(names) == len(jax.tree.leaves(params))
  resumed, _ = _source(_tiny(steps=8, **over), async_.AsyncSource)  # a resumed run: a new source from version 5
  try:
    assert echoed_checksums(resumed, version, 5, 8) == {v: want(v) for v in (5, 6)}
    assert [kind for _, kind, _ in resumed.publisher.publish_records] == ["full", "delta"]
  finally:
    resumed.close()
