"""Async mode on two "hosts": 2 local processes x 2 fake CPU devices, one global (2, 2, 1) learner mesh
(jax.distributed + gloo), and one spawned sampler per process (rollout/multihost.py).

One job is started (this file run as a script, twice); the test then

1. lets it train a few steps and checks, from what each process printed per step: both processes consumed
   the same global batch (rows 0..N/2 from host 0's sampler, N/2..N from host 1's, group ids 0..P-1),
   whose problems are exactly a single-host run's for that step, in its order (no prompt twice); every
   row's lag is within k; both processes published the same parameters for every version (checksums of
   the host copies agree), and each host's sampler echoed the checksum of the version it used;
2. SIGKILLs host 1's sampler: both learner processes must end within 30 s, after agreeing to stop at the
   same step, having written the joint checkpoint of that step, with no /dev/shm object of either left;
3. resumes the job from that checkpoint on 2 processes (the first step consumed is the checkpoint's), then
   sends SIGTERM to host 0's learner only: both processes agree to stop at one step, write the joint
   checkpoint and exit 130 within 30 s, /dev/shm clean;
4. resumes that checkpoint in this single process (another mesh over its own devices, a one-host
   sampler) and trains 1 more step: a checkpoint written by 2 processes restores on 1.

What cannot match a single-host run: the samples. Each host samples its P/2 prompts as one batch with
fold_in(fold_in(key, host), step), and the sampler's draws depend on the batch shape, so the problem
order is the single-host one (checked) but the responses, rewards and parameters are not.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, G, K = 2, 4, 2  # the smoke config's prompts per step and group size; staleness bound


def _dense_reward():
  """A reward with signal for a random policy (fraction of digits in the response), so every step updates the
  parameters; set in the learner processes and, as this file is their __main__, in the spawned samplers."""
  from vcpo_jax.rollout import common

  common.tasks.score_problems = lambda problems, outputs, extraction=None: (
    [sum(ch.isdigit() for ch in o) / max(len(o), 1) for o in outputs],
    0,
  )


def _config(process_id: int, port: int, steps: int):
  from tests import fixtures

  return fixtures.tiny_countdown_config(
    **{
      "mode": "async",
      "lag.k": K,
      "steps": steps,
      "mesh.shape": (2, 2, 1),
      "optim.lr": 1e-2,
      "checkpoint.every": 1000,
      "log.norm_overhead_every": 0,
      "async_.timeout_s": 300.0,
      "async_.peer_lost_s": 20.0,
      "distributed.enabled": True,
      "distributed.coordinator_address": f"127.0.0.1:{port}",
      "distributed.num_processes": 2,
      "distributed.process_id": process_id,
    }
  )


def _worker(process_id: int, port: int, workdir: str, steps: int) -> None:
  """One process of the job: trainer.run, printing one JSON line per consumed step and at close."""
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from vcpo_jax import trainer

  build = trainer.build_source

  def recording_build_source(*a, **kw):
    src = build(*a, **kw)
    nxt, close = src.next, src.close

    def next_(step):
      batch, info = nxt(step)
      rec = {
        "step": step,
        "sampler_pid": src.pid,
        "problem_ids": info["problem_ids"],
        "versions": batch["policy_version"].tolist(),
        "group_id": batch["group_id"].tolist(),
        "tokens_sum": int(batch["tokens"].sum()),
        "hosts": [{k: h[k] for k in ("version", "checksum", "pid")} for h in info["hosts"]],
      }
      print("STEP " + json.dumps(rec), flush=True)
      return batch, info

    def close_():
      print("PUBLISHED " + json.dumps({str(v): c for v, c in src._checksums.items()}), flush=True)
      print("SHM " + json.dumps(src.resource_paths()), flush=True)
      close()

    src.next, src.close = next_, close_
    return src

  trainer.build_source = recording_build_source
  summary = trainer.run(_config(process_id, port, steps), workdir)
  print("SUMMARY " + json.dumps(summary, default=str), flush=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(workdir: str, steps: int, logdir, tag=None) -> list:
  port = _free_port()
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=2",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
  )
  procs = []
  for i in range(2):
    log = open(logdir / f"p{i}_{tag or steps}.log", "w")  # noqa: SIM115 -- closed in _kill_all
    procs.append(
      (
        subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), str(i), str(port), workdir, str(steps)],
          env=env,
          cwd=REPO,
          stdout=log,
          stderr=subprocess.STDOUT,
        ),
        log,
      )
    )
  return procs


def _records(path, tag: str) -> list:
  with open(path) as f:
    return [json.loads(line[len(tag) + 1 :]) for line in f if line.startswith(tag + " ")]


def _kill_all(procs):
  for p, log in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
    log.close()


def _wait_for(pred, timeout: float, what: str, procs):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if pred():
      return
    dead = [p.returncode for p, _ in procs if p.poll() is not None]
    if dead:
      raise AssertionError(f"a process exited ({dead}) before {what}")
    time.sleep(0.2)
  raise AssertionError(f"timed out waiting for {what}")


# ----------------------------------------------------------------------------- pieces, in this process


class _FakeKV:
  """The coordination client's key-value calls over one dict (shared by the fake 'hosts' of a test)."""

  def __init__(self):
    self.store = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.store and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.store[key] = value

  def key_value_try_get(self, key):
    if key not in self.store:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.store[key]

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]

  def key_value_delete(self, key):
    self.store.pop(key, None)


def test_prompt_blocks_cover_each_step_once_in_order():
  from vcpo_jax import distributed

  assert [distributed.prompt_block(8, h, 4) for h in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
  assert distributed.prompt_block(3, 0, 1) == (0, 3)
  with pytest.raises(ValueError, match="prompts_per_step=6 must be divisible by the number of processes"):
    distributed.prompt_block(6, 0, 4)


def test_peer_lost_s_is_checked_in_config_parsing():
  from tests import fixtures
  from vcpo_jax import run_config

  with pytest.raises(run_config.ConfigError, match=r"async_\.peer_lost_s=1\.0: must be a finite number of seconds > 2"):
    run_config.parse_config(fixtures.tiny_countdown_config(**{"async_.peer_lost_s": 1.0}))


def test_agreement_orders_payloads_and_stops_every_host_alike():
  from vcpo_jax import distributed

  kv = _FakeKV()
  a = [distributed.Agreement("r", client=kv, host=h, hosts=3, beat_s=0.05, lost_after_s=1.0) for h in range(3)]
  try:
    for h in (2, 0):  # hosts 2 and 0 have posted; host 1's wait returns all three, in host order
      kv.key_value_set(f"vcpo_jax/r/step/5/{h}", json.dumps({"ok": True, "h": h}))
    assert [p["h"] for p in a[1].exchange(5, {"ok": True, "h": 1})] == [0, 1, 2]
    distributed.decide([{"ok": True}] * 3, 5)  # all ok: no stop
    # host 2's sampler failed, host 0 stopped waiting because of it: exit code 1, the cause named
    a[2].client.key_value_set("vcpo_jax/r/step/6/2", json.dumps({"ok": False, "reason": "SamplerDiedError: x"}))
    with pytest.raises(distributed._PeerStopping, match="host 2 posted a stop at step 6"):
      a[0].check(6)
    payloads = [{"ok": False, "follow": True, "signal": True, "reason": "peer"}, {"ok": True}]
    payloads.append({"ok": False, "reason": "SamplerDiedError: x"})
    with pytest.raises(distributed.JobStopped, match=r"step 6 \(host 2: SamplerDiedError: x\)") as e:
      distributed.decide(payloads, 6)
    assert e.value.exit_code == 1
    with pytest.raises(distributed.JobStopped) as e:  # a signal anywhere: 130 everywhere
      distributed.decide([{"ok": True}, {"ok": False, "signal": True, "reason": "interrupted"}], 7)
    assert e.value.exit_code == 130
  finally:
    for x in a:
      x.close()


def test_a_silent_peer_is_lost_after_its_heartbeat_stops():
  from vcpo_jax import distributed

  kv = _FakeKV()
  a0 = distributed.Agreement("r", client=kv, host=0, hosts=2, beat_s=0.05, lost_after_s=0.5)
  a1 = distributed.Agreement("r", client=kv, host=1, hosts=2, beat_s=0.05, lost_after_s=0.5)
  try:
    time.sleep(0.7)
    assert a0.lost_peers() == []  # host 1 beats: alive although it has not posted
    a1.close()  # host 1 stops beating (killed, SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(distributed.PeerLostError, match=r"process\(es\) \[1\] posted nothing for step 3"):
      a0.exchange(3, {"ok": True}, timeout_s=30)
    assert time.monotonic() - t0 < 5
  finally:
    a0.close()
    a1.close()


def test_host_local_sampler_devices_and_platform_env(monkeypatch):
  import jax

  from vcpo_jax import distributed
  from vcpo_jax.rollout import multihost

  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  monkeypatch.delenv("TPU_VISIBLE_CHIPS", raising=False)
  devices = jax.devices()
  learn = distributed.learner_devices("1,3", devices)
  assert [d.id for d in learn] == [d.id for i, d in enumerate(devices) if i not in (1, 3)]
  with pytest.raises(ValueError, match="host-local ids"):
    distributed.learner_devices(str(len(devices)), devices)
  # the launcher already restricted this process: chips "4,5,6,7" are visible, the sampler has 5 and 9
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
  assert [d.id for d in distributed.learner_devices("5,9", devices[:4])] == [devices[i].id for i in (0, 2, 3)]
  assert distributed.learner_devices("9", devices[:4]) == devices[:4]  # not visible here: excluded already
  assert multihost.sampler_platform_env("2,3", "gpu") == {"CUDA_VISIBLE_DEVICES": "2,3"}
  tpu = multihost.sampler_platform_env("3", "tpu")
  assert tpu["TPU_VISIBLE_CHIPS"] == "3" and tpu["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
  assert multihost.sampler_platform_env("", "tpu") == {}
  with pytest.raises(ValueError, match="3 TPU chips"):
    multihost.sampler_platform_env("0,1,2", "tpu")


def test_host_complete_copy_of_a_sharded_leaf():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from vcpo_jax.rollout import multihost

  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))
  x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, PartitionSpec("fsdp", "data")))
  sh = multihost.host_complete_sharding(x)
  assert sh.mesh.axis_names == ("hosts", "local") and sh.mesh.devices.shape == (1, 4)
  assert sh.spec == PartitionSpec("local", None)  # dim 0 (8) splits over the 4 devices of the host
  y = jax.device_put(x, sh)
  np.testing.assert_array_equal(multihost.local_copy(y), np.arange(32.0).reshape(8, 4))
  odd = jax.device_put(jnp.ones((3, 5)), NamedSharding(mesh, PartitionSpec()))
  assert multihost.host_complete_sharding(odd).spec == PartitionSpec(None, None)  # nothing divisible: replicated


def _host_batch(step: int, host: int, prompts: int = 2, g: int = 2):
  """A fake host batch of `prompts` groups of g rows (tokens name step, host and row) and its sampler metadata."""
  import numpy as np

  n = prompts * g
  arrays = {
    "tokens": (1000 * step + 100 * host + np.arange(n * 3)).reshape(n, 3).astype(np.int32),
    "group_id": np.repeat(np.arange(prompts, dtype=np.int32), g),
    "policy_version": np.full((n,), step - 1, np.int32),
    "loss_mask": np.arange(n * 3).reshape(n, 3) % 2 == 0,
  }
  meta = {
    "step": step,
    "version": step - 1,
    "problem_ids": [f"p{step}_{host}_{i}" for i in range(prompts)],
    "response_len_mean": 1.0 + host,
    "finished_frac": 0.5,
    "gen_s": 0.1,
    "sampler_pid": 10 + host,
    "seq": step,
    "texts": ["t"] * n,
  }
  return arrays, meta


def test_queued_batches_come_back_per_host_or_whole_on_another_host_count():
  """pack_queued / unpack_queued: host 0 had received batches 5, 6, 7 at the save, host 1 only batch 5."""
  import types

  import numpy as np

  from vcpo_jax.rollout import async_, multihost

  blocks2 = [(0, 2), (2, 4)]
  per_host = [[_host_batch(s, 0) for s in (5, 6, 7)], [_host_batch(5, 1)]]
  arrays, metas = multihost.pack_queued(per_host, blocks2, 2)
  assert [m["step"] for m in metas] == [5, 6, 7] and [m["hosts"][1] is None for m in metas] == [False, True, True]
  np.testing.assert_array_equal(arrays[0]["group_id"], [0, 0, 1, 1, 2, 2, 3, 3])  # host 1's groups are 2, 3
  np.testing.assert_array_equal(arrays[0]["tokens"][4:], per_host[1][0][0]["tokens"])
  assert not arrays[1]["tokens"][4:].any() and not arrays[1]["loss_mask"][4:].any()  # host 1 had no batch 6
  assert metas[0]["problem_ids"] == ["p5_0_0", "p5_0_1", "p5_1_0", "p5_1_1"] and metas[0]["sampler_pid"] == [10, 11]

  # the same 2 hosts: each gets exactly its own batches back (host 0 three, host 1 one), local group ids
  for h in range(2):
    back = multihost.unpack_queued(arrays, metas, h, 2, 2, blocks2)
    assert len(back) == len(per_host[h])
    for (a, m), (a0, m0) in zip(back, per_host[h]):
      assert m == dict(m0, texts=None)
      for f in a0:
        np.testing.assert_array_equal(a[f], a0[f])
  # one host: only batch 5 is whole (6 and 7 are made again by its sampler)
  ((a, m),) = multihost.unpack_queued(arrays, metas, 0, 1, 2, [(0, 4)])
  np.testing.assert_array_equal(a["tokens"], arrays[0]["tokens"])
  assert m["problem_ids"] == metas[0]["problem_ids"] and m["version"] == 4 and "hosts" not in m
  # four hosts of one prompt each: host 3 gets rows 6, 7 of batch 5 (group id 0)
  ((a, m),) = multihost.unpack_queued(arrays, metas, 3, 4, 2, [(i, i + 1) for i in range(4)])
  np.testing.assert_array_equal(a["tokens"], per_host[1][0][0]["tokens"][2:])
  assert a["group_id"].tolist() == [0, 0] and m["problem_ids"] == ["p5_1_1"]
  # a single-host checkpoint (whole batches of P = 4, the sampler's own metadata) onto 2 hosts
  whole, whole_meta = _host_batch(9, 0, prompts=4)
  ((a, m),) = multihost.unpack_queued([whole], [whole_meta], 1, 2, 2, blocks2)
  np.testing.assert_array_equal(a["tokens"], whole["tokens"][4:])
  assert a["group_id"].tolist() == [0, 0, 1, 1] and m["problem_ids"] == whole_meta["problem_ids"][2:]
  assert m["texts"] == ["t"] * 4 and m["step"] == 9
  # AsyncSource (one process) restoring the 2-host checkpoint keeps the whole batch 5 only
  src = types.SimpleNamespace(proc=None, _pending=__import__("collections").deque())
  async_.AsyncSource.load_queued(src, arrays, metas)
  assert [m["step"] for _, m, _ in src._pending] == [5]


# ----------------------------------------------------------------------------- the 2-process job


@pytest.mark.slow
def test_two_hosts_train_agree_stop_together_and_resume(tmp_path, caplog):
  from vcpo_jax import run_config
  from vcpo_jax.checkpoint import Checkpointer
  from vcpo_jax.rollout.common import RolloutMaker

  workdir = str(tmp_path / "run")
  logs = [tmp_path / f"p{i}_10000.log" for i in range(2)]
  procs = _start(workdir, 10_000, tmp_path)
  try:
    # 1. a few steps of training on both hosts
    _wait_for(lambda: all(len(_records(f, "STEP")) >= 3 for f in logs), 600, "3 steps on both hosts", procs)
    # 2. host 1's sampler dies: both processes stop within 30 s
    pid1 = _records(logs[1], "STEP")[0]["sampler_pid"]
    os.kill(pid1, signal.SIGKILL)
    t0 = time.monotonic()
    for p, _ in procs:
      p.wait(timeout=max(1.0, 30.0 - (time.monotonic() - t0)))
    elapsed = time.monotonic() - t0
    print(f"both learner processes ended {elapsed:.1f} s after the SIGKILL of host 1's sampler")
  finally:
    _kill_all(procs)
  out = [f.read_text() for f in logs]
  assert elapsed < 30.0, elapsed
  for i, (p, _) in enumerate(procs):
    assert p.returncode == 1, f"process {i} exited {p.returncode}:\n{out[i][-3000:]}"
  assert "every process stops at step" in out[0] and "host 1: SamplerDiedError" in out[0], out[0][-3000:]

  steps = [_records(f, "STEP") for f in logs]
  n = min(len(s) for s in steps)
  assert n >= 3
  spec = run_config.parse_config(_config(0, 1, 10_000))
  problems = spec.make_train_problems()
  single_host = RolloutMaker(spec.rollout, None, None, problems)  # the prompt stream of a one-host run
  for a, b in zip(steps[0][:n], steps[1][:n]):
    assert {k: v for k, v in a.items() if k != "sampler_pid"} == {k: v for k, v in b.items() if k != "sampler_pid"}
    step = a["step"]
    assert a["problem_ids"] == [q.id for q in single_host.problems_for_step(step)]
    assert a["group_id"] == [g for g in range(P) for _ in range(G)]  # host 0's group, then host 1's
    assert [h["pid"] for h in a["hosts"]] == [steps[0][0]["sampler_pid"], steps[1][0]["sampler_pid"]]
    versions = a["versions"]
    for h, host in enumerate(a["hosts"]):  # rows [h N/2, (h+1) N/2) came from host h's sampler
      assert versions[h * P * G // 2 : (h + 1) * P * G // 2] == [host["version"]] * (P * G // 2)
    assert all(0 <= step - v <= K for v in versions)
  published = [_records(f, "PUBLISHED")[0] for f in logs]
  common = set(published[0]) & set(published[1])
  assert common and all(published[0][v] == published[1][v] for v in common)
  for rec in steps[0][:n]:  # each host's sampler read exactly what its learner published
    for h, host in enumerate(rec["hosts"]):
      if str(host["version"]) in published[h]:
        assert host["checksum"] == published[h][str(host["version"])]
  shm = [p for f in logs for p in _records(f, "SHM")[0]]
  assert shm and not [p for p in shm if os.path.exists(p)]
  stopped = Checkpointer(os.path.join(workdir, "checkpoints")).latest_step()
  assert stopped is not None and stopped >= n - 1  # the joint checkpoint of the step both stopped at

  # 3. resume on 2 processes from the joint checkpoint; SIGTERM to host 0 only stops both, with a checkpoint
  procs = _start(workdir, 10_000, tmp_path, tag="resumed")
  logs = [tmp_path / f"p{i}_resumed.log" for i in range(2)]
  try:
    # 2 steps: the first resumed step's compilation is over (a signal is acted on between steps)
    _wait_for(lambda: all(len(_records(f, "STEP")) >= 2 for f in logs), 600, "2 resumed steps on both", procs)
    os.kill(procs[0][0].pid, signal.SIGTERM)
    t0 = time.monotonic()
    for p, _ in procs:
      p.wait(timeout=max(1.0, 30.0 - (time.monotonic() - t0)))
    print(f"both learner processes ended {time.monotonic() - t0:.1f} s after SIGTERM to host 0")
  finally:
    _kill_all(procs)
  out = [f.read_text() for f in logs]
  for i, (p, _) in enumerate(procs):
    assert p.returncode == 130, f"resumed process {i} exited {p.returncode}:\n{out[i][-3000:]}"
  assert "every process stops at step" in out[1] and "host 0: interrupted" in out[1], out[1][-3000:]
  resumed = [_records(f, "STEP") for f in logs]
  assert resumed[0][0]["step"] == stopped == resumed[1][0]["step"]  # the first step not in the checkpoint
  assert all(stopped - v <= K for v in resumed[0][0]["versions"])
  assert not [p for f in logs for p in _records(f, "SHM")[0] if os.path.exists(p)]
  signalled = Checkpointer(os.path.join(workdir, "checkpoints")).latest_step()
  assert signalled > stopped

  # 4. resume that 2-process checkpoint in this one process (a (2, 4, 1) mesh on its 8 devices, one sampler)
  import jax

  from vcpo_jax import trainer

  if len(jax.devices()) % 4:
    return
  config = _config(0, 1, signalled + 1)
  config.distributed.enabled = False
  config.mesh.shape = (2, -1, 1)
  caplog.set_level(logging.INFO, logger="vcpo_jax")
  summary = trainer.run(config, workdir)
  assert f"resumed from step {signalled} " in caplog.text
  assert summary["step"] == signalled + 1


if __name__ == "__mp_main__":  # a sampler spawned by a learner process of this file
  _dense_reward()
if __name__ == "__main__":
  _dense_reward()
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
