"""Async mode on two "hosts": 2 local processes x 2 fake CPU devices, one global (2, 2, 1) learner mesh
(jax.distributed + gloo), and one spawned sampler per process (rollout/multihost.py).

Four 2-process jobs (this file run as a script, twice each, through main.train as main.py runs it) and
two single-process runs in this process share one work directory; the test checks, in order:

1. a fresh job trains a few steps (a checkpoint every 2 steps): both processes consume the same global
   batch (rows 0..N/2 from host 0's sampler, N/2..N from host 1's, group ids 0..P-1), whose problems are a
   single-host run's for that step, in its order; every batch sampled with the initial parameters (step 0
   always; later ones while the samplers ran ahead) is token for token the batch a single-host async
   sampler makes for that step; lags within k; equal parameter checksums on both hosts for every published
   version, echoed by each host's sampler. Then host 1's sampler is SIGKILLed: host 1 replaces it while
   host 0 waits in the agreement, and both go on (each step once on each host, no batch twice, lags within
   k, host 1's replacement's batches after its first sampler's, async/sampler_restarts 1 from host 1, 0
   from host 0). Its replacement is SIGKILLed too, past host 1's async_.max_sampler_restarts = 1: both
   learner processes end within 30 s, agreeing to stop at one step, with the joint checkpoint of that step,
   holding every batch a host had received and not consumed, per host, and no /dev/shm object left;
2. the job resumes on 2 processes: the first step consumed is the checkpoint's, each host first consumes
   exactly its own checkpointed rows (same tokens, made by the first job's samplers), then its new
   sampler's, so no trajectory is lost or used twice; SIGTERM to host 0's learner alone stops both with a
   joint checkpoint and exit code 130 within 30 s, /dev/shm clean;
3. that checkpoint resumes in this single process (a (2, 4, 1) mesh, one sampler): the batches complete
   on both hosts come first, then one more step, the final checkpoint (2 processes -> 1);
4. that single-process checkpoint resumes on 2 processes (1 -> 2); after 2 steps host 1's learner is
   SIGKILLed: host 0's learner (and both samplers) end within 60 s, with exit code 1 (waiting in the
   agreement, its peer is lost after async_.peer_lost_s = 20 s; in a collective that gloo fails, at once;
   both through main.train, which skips jax's shutdown barrier; in a collective that never returns, the
   heartbeat thread's watchdog ends it after 30 s), /dev/shm clean on both hosts;
5. it resumes on 2 processes once more; after a step host 0's learner (it runs jax's coordination service)
   is SIGKILLed: host 1's learner ends within 30 s (jax's coordination agent aborts it: no joint checkpoint
   can be written without host 0), both samplers gone, /dev/shm clean.

What cannot match a single-host run: the schedule. Which parameter version a batch is sampled with is up
to timing in any async run, so after the first update the two runs' batches are compared only where both
used the initial parameters; the learner step on the 2-process mesh equals the single-process step
(tests/test_multihost.py).
"""

import json
import logging
import os
import signal
import sys
import time

import pytest

from tests import multiproc

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
      "checkpoint.every": 2,  # periodic saves keep queued batches too (the run goes on)
      "log.norm_overhead_every": 0,
      "async_.timeout_s": 300.0,
      "async_.peer_lost_s": 20.0,
      "async_.max_sampler_restarts": 1,  # job 1: the first sampler failure is replaced, the second stops the job
      "distributed.enabled": True,
      "distributed.coordinator_address": f"127.0.0.1:{port}",
      "distributed.num_processes": 2,
      "distributed.process_id": process_id,
    }
  )


def _recording_build_source(emit):
  """rollout.build_source, wrapped: emit(tag, record) per consumed batch (STEP), per checkpoint's queued
  batches (QUEUED) and at close (PUBLISHED, SHM)."""
  from vcpo_jax import rollout

  build = rollout.build_source

  def recording(*a, **kw):
    src = build(*a, **kw)
    nxt, close, queued = src.next, src.close, src.queued_state

    def next_(step):
      batch, info = nxt(step)
      tokens, n = batch["tokens"], len(batch["tokens"])
      hosts = info.get("hosts") or [  # one process: its own sampler's batch
        {
          "version": int(batch["policy_version"].min()),
          "checksum": info["params_checksum"],
          "pid": info["producer"][0],
          "seq": info["producer"][1],
          "restarts": src.sampler_restarts,
        }
      ]
      rec = {
        "step": step,
        "sampler_pid": src.pid,
        "problem_ids": info["problem_ids"],
        "versions": batch["policy_version"].tolist(),
        "group_id": batch["group_id"].tolist(),
        "half_sums": [int(tokens[: n // 2].sum()), int(tokens[n // 2 :].sum())],  # host 0's rows, host 1's
        "hosts": [{k: h[k] for k in ("version", "checksum", "pid", "seq", "restarts")} for h in hosts],
        "restarts": info["metrics"]["async/sampler_restarts"],  # the row's: every host's replacements
        "shm": src.resource_paths(),
      }
      if not batch["policy_version"].any():  # the initial parameters: compared with a single-host sampler
        rec["tokens"] = tokens.tolist()
      emit("STEP", rec)
      return batch, info

    def queued_():
      arrays, metas = queued()
      recs = []
      for arr, m in zip(arrays, metas):
        n, tok = len(arr["tokens"]), arr["tokens"]
        per = m.get("hosts") or [m]
        recs.append(
          {
            "step": m["step"],
            "present": [h is not None for h in per],
            "half_sums": [int(tok[: n // 2].sum()), int(tok[n // 2 :].sum())],
            "pids": [h["sampler_pid"] if h else None for h in per],
          }
        )
      emit("QUEUED", recs)
      return arrays, metas

    def close_():
      emit("PUBLISHED", {str(v): c for v, c in src.publisher.checksums.items()})
      emit("SHM", src.resource_paths())
      close()

    src.next, src.close, src.queued_state = next_, close_, queued_
    return src

  return recording


def _print(tag, rec):
  print(tag + " " + json.dumps(rec), flush=True)


def _worker(process_id: int, port: int, workdir: str, steps: int) -> None:
  """One process of the job: main.train (as main.py runs it), printing the records of _recording_build_source."""
  import faulthandler

  import jax

  faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack (debugging)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # The test's persistent compilation cache is for the samplers (they inherit the environment): a learner
  # of process 1 never finds process 0's entries (only process 0 writes them, under its own keys), so a
  # loading process 0 would wait in a collective for a compiling process 1, past gloo's 30 s deadline.
  jax.config.update("jax_compilation_cache_dir", None)
  import main
  from vcpo_jax import rollout

  rollout.build_source = _recording_build_source(_print)
  summary = main.train(_config(process_id, port, steps), workdir)
  print("SUMMARY " + json.dumps(summary, default=str), flush=True)


def _start(workdir: str, logdir, tag: str, steps: int = 10_000) -> tuple[list, list]:
  """Starts the 2 processes of a job (tests/multiproc.py); returns ([(Popen, log file)], [log paths])."""
  paths = [logdir / f"p{i}_{tag}.log" for i in range(2)]
  logs = [open(path, "w") for path in paths]  # noqa: SIM115 -- closed in _kill_all
  return list(zip(multiproc.launch(__file__, workdir, str(steps), logs=logs), logs)), paths


def _wait_all(procs, timeout: float) -> float:
  """Waits until every process of `procs` has exited (at most `timeout` s in all); returns the time taken."""
  t0 = time.monotonic()
  for p, _ in procs:
    p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
  return time.monotonic() - t0


def _gone(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  return False


def _records(path, tag: str) -> list:
  with open(path) as f:
    return [json.loads(line[len(tag) + 1 :]) for line in f if line.startswith(tag + " ")]


def _kill_all(procs):
  multiproc.kill([p for p, _ in procs])
  for _, log in procs:
    log.close()


def _assert_stopped_together(procs, logs, code: int, host: int, reason: str) -> list[str]:
  """Every process exited with `code` and host `host`'s log says why all stopped (`reason`); returns the logs."""
  out = [f.read_text() for f in logs]
  for i, (p, _) in enumerate(procs):
    assert p.returncode == code, f"process {i} exited {p.returncode}:\n{out[i][-3000:]}"
  assert "every process stops at step" in out[host] and reason in out[host], out[host][-3000:]
  return out


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
  a = [
    distributed.Agreement("r", client=kv, host=h, hosts=3, beat_s=0.05, lost_after_s=1.0, watchdog_s=0)
    for h in range(3)
  ]
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
  a0 = distributed.Agreement("r", client=kv, host=0, hosts=2, beat_s=0.05, lost_after_s=0.5, watchdog_s=1.0)
  fired = []
  a0._watchdog_exit = fired.append  # the heartbeat thread's os._exit(1), recorded instead
  a1 = distributed.Agreement("r", client=kv, host=1, hosts=2, beat_s=0.05, lost_after_s=0.5, watchdog_s=0)
  try:
    time.sleep(0.7)
    assert a0.lost_peers() == []  # host 1 beats: alive although it has not posted
    a1.close()  # host 1 stops beating (killed, SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(distributed.PeerLostError, match=r"process\(es\) \[1\] posted nothing for step 3"):
      a0.exchange(3, {"ok": True}, timeout_s=30)
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 10  # a main thread stuck in a collective: the watchdog ends the process
    while not fired and time.monotonic() < deadline:
      time.sleep(0.05)
    assert fired[0] == [1]
  finally:
    a0.close()
    a1.close()


def test_the_agreement_waits_for_every_replacement_a_peers_budget_allows():
  import types

  from vcpo_jax.rollout import multihost

  cfg = types.SimpleNamespace(
    startup_timeout_s=600.0, timeout_s=120.0, heartbeat_timeout_s=300.0, max_sampler_restarts=3
  )
  # per attempt: the failure noticed (the longer of timeout_s, heartbeat_timeout_s), the new sampler's first batch
  assert multihost.agreement_timeout_s(cfg) == 4 * (600.0 + 300.0) + 60.0
  cfg.max_sampler_restarts = 0  # no replacement: one attempt
  assert multihost.agreement_timeout_s(cfg) == 600.0 + 300.0 + 60.0
  cfg.heartbeat_timeout_s = 0.0  # 0 = async_.timeout_s
  assert multihost.agreement_timeout_s(cfg) == 600.0 + 120.0 + 60.0


def test_host_local_sampler_devices_and_platform_env(monkeypatch):
  import jax

  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax.rollout import multihost

  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  monkeypatch.delenv("TPU_VISIBLE_CHIPS", raising=False)
  devices = jax.devices()
  learn = mesh_lib.learner_devices("1,3", devices)
  assert [d.id for d in learn] == [d.id for i, d in enumerate(devices) if i not in (1, 3)]
  with pytest.raises(ValueError, match="host-local ids"):
    mesh_lib.learner_devices(str(len(devices)), devices)
  # the launcher already restricted this process: chips "4,5,6,7" are visible, the sampler has 5 and 9
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
  assert [d.id for d in mesh_lib.learner_devices("5,9", devices[:4])] == [devices[i].id for i in (0, 2, 3)]
  assert mesh_lib.learner_devices("9", devices[:4]) == devices[:4]  # not visible here: excluded already
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
    # per-token records over the R = 2 response columns (the top-k ids, the support threshold, -inf = no cut)
    "topk_ids": (10 * step + host + np.arange(n * 2 * 3)).reshape(n, 2, 3).astype(np.int32),
    "support_thr": np.where(np.arange(n * 2).reshape(n, 2) % 3 == 0, -np.inf, -0.5 * host - step).astype(np.float32),
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

  from vcpo_jax.rollout import async_, multihost, topology

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
  # AsyncSource (one process, its OneHost topology) restoring the 2-host checkpoint keeps the whole batch 5 only
  src = types.SimpleNamespace(proc=None, _pending=__import__("collections").deque(), topology=topology.OneHost(None))
  async_.AsyncSource.load_queued(src, arrays, metas)
  assert [m["step"] for _, m, _ in src._pending] == [5]


# ----------------------------------------------------------------------------- the 2-process jobs


def _check_single_host_samples(records):
  """Batches the job sampled with the initial parameters equal, token for token, the batch a single-host async
  sampler makes for that step (maker.make(params_0, b, fold_in(key, b), 0), as worker.py calls it)."""
  import jax
  import numpy as np

  from tests import fixtures
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import run_config
  from vcpo_jax.model import policy
  from vcpo_jax.rollout.common import RolloutMaker
  from vcpo_jax.sampler import Sampler

  spec = run_config.parse_config(_config(0, 1, 10_000))
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 1, 1)), devices=jax.devices()[:1])  # born-sharded == host init
  model_cfg, tokenizer, graphdef, params = policy.build_policy(spec.model_cfg, mesh, seed=spec.seed)
  cfg = fixtures.sampler_config(spec, tokenizer)
  maker = RolloutMaker(spec.rollout, tokenizer, Sampler(graphdef, model_cfg, cfg), spec.make_train_problems())
  initial = [r for r in records if "tokens" in r]
  assert initial and initial[0]["step"] == 0, [r["step"] for r in initial]
  for r in initial:
    batch, _ = maker.make(params, r["step"], jax.random.fold_in(jax.random.key(spec.seed), r["step"]), 0)
    np.testing.assert_array_equal(np.asarray(r["tokens"]), np.asarray(batch["tokens"]), err_msg=f"step {r['step']}")
  print(f"steps {[r['step'] for r in initial]} (initial parameters) equal the single-host sampler's batches")


def _check_consumed_queued_first(queued, resumed, new_pids):
  """The resumed job's first steps are the checkpoint's queued batches (each host's rows where it had them, made
  by the old samplers), then the new samplers' batches; steps consecutive from the checkpoint's."""
  assert [r["step"] for r in resumed] == list(range(resumed[0]["step"], resumed[0]["step"] + len(resumed)))
  for i, r in enumerate(resumed):
    q = queued[i] if i < len(queued) else None
    for h, host in enumerate(r["hosts"]):
      if q is not None and q["present"][h]:
        assert r["step"] == q["step"] and r["half_sums"][h] == q["half_sums"][h], (i, h, r, q)
        assert host["pid"] == q["pids"][h], (i, h, host, q)
      else:
        assert host["pid"] == new_pids[h], (i, h, host)


@pytest.mark.slow
def test_two_hosts_train_agree_stop_together_and_resume(tmp_path, caplog, monkeypatch):
  from vcpo_jax import run_config
  from vcpo_jax.checkpoint import Checkpointer
  from vcpo_jax.rollout.common import RolloutMaker

  # Every job's samplers (spawned by the learners, they inherit the environment) compile the same programs:
  # all but the first load them from jax's persistent compilation cache in this test's directory. The
  # learners do not use it (_worker), nor does this process, whose jax is configured already and does not
  # read these variables.
  for var, value in (
    ("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache")),
    ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
    ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0"),
  ):
    monkeypatch.setenv(var, value)
  workdir = str(tmp_path / "run")
  latest = lambda: Checkpointer(os.path.join(workdir, "checkpoints")).latest_step()

  # 1. a fresh job: a few steps on both hosts, then host 1's sampler dies: host 1 replaces it and both go on;
  # its replacement dies too (past host 1's budget of 1): both processes stop within 30 s
  procs, logs = _start(workdir, tmp_path, "fresh")
  replaced = lambda: [r for r in _records(logs[1], "STEP") if r["hosts"][1]["pid"] != first_pids[1]]
  try:
    _wait_for(lambda: all(len(_records(f, "STEP")) >= 3 for f in logs), 600, "3 steps on both hosts", procs)
    first_pids = [_records(f, "STEP")[0]["sampler_pid"] for f in logs]
    t0 = time.monotonic()
    os.kill(first_pids[1], signal.SIGKILL)
    _wait_for(lambda: len(replaced()) >= 1, 600, "a batch of host 1's replacement sampler", procs)
    print(
      f"host 1's sampler SIGKILLed: the first batch of its replacement consumed {time.monotonic() - t0:.1f} s later"
    )
    _wait_for(lambda: len(replaced()) >= 2, 600, "2 batches of host 1's replacement sampler", procs)
    os.kill(replaced()[0]["hosts"][1]["pid"], signal.SIGKILL)
    elapsed = _wait_all(procs, 30.0)
    print(f"both learner processes ended {elapsed:.1f} s after the SIGKILL of host 1's replacement sampler")
  finally:
    _kill_all(procs)
  out = _assert_stopped_together(procs, logs, 1, 0, "host 1: SamplerDiedError")

  steps = [_records(f, "STEP") for f in logs]
  n = min(len(s) for s in steps)
  assert n >= 3
  spec = run_config.parse_config(_config(0, 1, 10_000))
  single_host = RolloutMaker(spec.rollout, None, None, spec.make_train_problems())  # a one-host run's prompts
  second_pid = replaced()[0]["hosts"][1]["pid"]
  for s in steps:  # each step once on each host, in order; no host batch (sampler pid, its n-th) twice
    assert [r["step"] for r in s] == list(range(len(s)))
    for h in range(2):
      made = [(r["hosts"][h]["pid"], r["hosts"][h]["seq"]) for r in s]
      assert len(set(made)) == len(made), made
  pids1 = [r["hosts"][1]["pid"] for r in steps[1]]  # the first sampler's batches, then only the replacement's
  cut = pids1.index(second_pid)
  assert set(pids1[:cut]) == {first_pids[1]} and set(pids1[cut:]) == {second_pid}, pids1
  restarts = [r["hosts"][1]["restarts"] for r in steps[1]]  # its first sampler's queued batches may come after it
  assert restarts == sorted(restarts) and restarts[0] == 0 and set(restarts[cut:]) == {1}, restarts
  assert all(r["hosts"][0]["restarts"] == 0 and r["restarts"] == r["hosts"][1]["restarts"] for r in steps[1])
  for a, b in zip(steps[0][:n], steps[1][:n]):
    drop = ("sampler_pid", "shm")
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    step = a["step"]
    assert a["problem_ids"] == [q.id for q in single_host.problems_for_step(step)]
    assert a["group_id"] == [g for g in range(P) for _ in range(G)]  # host 0's group, then host 1's
    assert a["hosts"][0]["pid"] == first_pids[0] and a["hosts"][1]["pid"] in (first_pids[1], second_pid)
    for h, host in enumerate(a["hosts"]):  # rows [h N/2, (h+1) N/2) came from host h's sampler
      assert a["versions"][h * P * G // 2 : (h + 1) * P * G // 2] == [host["version"]] * (P * G // 2)
    assert all(0 <= step - v <= K for v in a["versions"])
  published = [_records(f, "PUBLISHED")[0] for f in logs]
  common = set(published[0]) & set(published[1])
  assert common and all(published[0][v] == published[1][v] for v in common)
  for rec in steps[0][:n]:  # each host's sampler read exactly what its learner published
    for h, host in enumerate(rec["hosts"]):
      if str(host["version"]) in published[h]:
        assert host["checksum"] == published[h][str(host["version"])]
  assert not [p for f in logs for p in _records(f, "SHM")[0] if os.path.exists(p)]
  assert not [p for f in logs for r in _records(f, "STEP") for p in r["shm"] if os.path.exists(p)]  # every sampler's
  stopped = latest()
  assert stopped is not None and stopped >= n - 1  # the joint checkpoint of the step both stopped at
  queued = [_records(f, "QUEUED")[-1] for f in logs]
  assert queued[0] == queued[1] and queued[0], queued  # host 0's sampler was ahead: it had batches queued
  queued = queued[0]
  assert [q["step"] for q in queued] == list(range(stopped, stopped + len(queued)))
  assert all(q["pids"][h] in (None, first_pids[h], second_pid) for q in queued for h in range(2))
  _check_single_host_samples(steps[0][:n])

  # 2. resume on 2 processes: each host's queued rows first; SIGTERM to host 0 only stops both, with a checkpoint
  procs, logs = _start(workdir, tmp_path, "resumed")
  try:  # past the restored batches and the first new step (its compilation: a signal acts between steps)
    want = len(queued) + 2
    _wait_for(lambda: all(len(_records(f, "STEP")) >= want for f in logs), 600, f"{want} resumed steps", procs)
    os.kill(procs[0][0].pid, signal.SIGTERM)
    print(f"both learner processes ended {_wait_all(procs, 30.0):.1f} s after SIGTERM to host 0")
  finally:
    _kill_all(procs)
  out = _assert_stopped_together(procs, logs, 130, 1, "host 0: interrupted")
  resumed = [_records(f, "STEP") for f in logs]
  assert resumed[0][0]["step"] == stopped == resumed[1][0]["step"]  # the first step not in the checkpoint
  new_pids = [resumed[0][-1]["sampler_pid"], resumed[1][-1]["sampler_pid"]]
  _check_consumed_queued_first(queued, resumed[0], new_pids)
  assert not [p for f in logs for p in _records(f, "SHM")[0] if os.path.exists(p)]
  signalled = latest()
  assert signalled > stopped
  queued = _records(logs[0], "QUEUED")[-1]
  assert [q["step"] for q in queued] == list(range(signalled, signalled + len(queued)))

  # 3. resume that 2-process checkpoint in this one process (a (2, 4, 1) mesh on its 8 devices, one sampler):
  # the batches both hosts had queued first, then one more step
  import jax

  from vcpo_jax import rollout, trainer

  if len(jax.devices()) % 4:
    return
  whole = next((i for i, q in enumerate(queued) if not all(q["present"])), len(queued))
  config = _config(0, 1, signalled + whole + 1)
  config.distributed.enabled = False
  config.mesh.shape = (2, -1, 1)
  caplog.set_level(logging.INFO, logger="vcpo_jax")
  one = []
  build = rollout.build_source
  rollout.build_source = _recording_build_source(lambda tag, rec: one.append((tag, rec)))
  try:
    summary = trainer.run(config, workdir)
  finally:
    rollout.build_source = build
  assert f"resumed from step {signalled} " in caplog.text
  assert summary["step"] == signalled + whole + 1
  consumed = [r for tag, r in one if tag == "STEP"]
  assert [r["step"] for r in consumed] == list(range(signalled, signalled + whole + 1))
  for r, q in zip(consumed, queued[:whole]):  # both hosts' rows of each whole batch, made by the job's samplers
    assert r["half_sums"] == q["half_sums"] and r["hosts"][0]["pid"] == q["pids"], (r, q)
  assert consumed[-1]["hosts"][0]["pid"] == consumed[-1]["sampler_pid"]  # this process's own sampler
  final = latest()
  assert final == signalled + whole + 1

  # 4. resume that single-process checkpoint on 2 processes; SIGKILL host 1's learner after 2 steps
  procs, logs = _start(workdir, tmp_path, "onto2")
  try:
    _wait_for(lambda: all(len(_records(f, "STEP")) >= 2 for f in logs), 600, "2 steps on 2 processes", procs)
    procs[1][0].kill()
    elapsed = _wait_all(procs[:1], 60.0)
    print(f"host 0's learner ended {elapsed:.1f} s after the SIGKILL of host 1's learner")
  finally:
    _kill_all(procs)
  out = logs[0].read_text()
  assert procs[0][0].returncode == 1, f"host 0 exited {procs[0][0].returncode}:\n{out[-3000:]}"
  # in the agreement: PeerLostError after peer_lost_s; in a failing collective: its error; both -> main.train;
  # in a collective that never returns (gloo, seen in the train step): the watchdog, 1.5 x peer_lost_s
  assert "this process of the 2-process job fails" in out or "silent for 30 s" in out, out[-3000:]
  onto2 = [_records(f, "STEP") for f in logs]
  assert onto2[0][0]["step"] == final == onto2[1][0]["step"]
  _assert_reclaimed(onto2)

  # 5. resume on 2 processes again; SIGKILL host 0's learner (it runs jax's coordination service) after a step:
  # host 1 ends within 30 s (jax's coordination agent sees the service gone and aborts it; no checkpoint can
  # be written without host 0), both samplers gone and /dev/shm clean
  procs, logs = _start(workdir, tmp_path, "kill0")
  try:
    _wait_for(lambda: all(len(_records(f, "STEP")) >= 1 for f in logs), 600, "a step on 2 processes", procs)
    procs[0][0].kill()
    elapsed = _wait_all(procs[1:], 30.0)
    print(f"host 1's learner ended {elapsed:.1f} s after the SIGKILL of host 0's learner")
  finally:
    _kill_all(procs)
  assert procs[1][0].returncode != 0, logs[1].read_text()[-3000:]
  _assert_reclaimed([_records(f, "STEP") for f in logs])


def _assert_reclaimed(records, timeout: float = 20.0):
  """Every sampler of a job's STEP records has exited and none of their /dev/shm objects is left (a dead
  host's sampler: PR_SET_PDEATHSIG; its segments: the resource tracker), within `timeout` s."""
  samplers = [r[0]["sampler_pid"] for r in records]
  shm = sorted({p for r in records for rec in r for p in rec["shm"]})
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and not (all(map(_gone, samplers)) and not any(map(os.path.exists, shm))):
    time.sleep(0.2)
  assert all(map(_gone, samplers)) and shm and not [p for p in shm if os.path.exists(p)], shm


if __name__ == "__mp_main__":  # a sampler spawned by a learner process of this file
  _dense_reward()
if __name__ == "__main__":
  _dense_reward()
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
