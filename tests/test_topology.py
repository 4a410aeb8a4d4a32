"""The async source's topology as a part (rollout/topology.py, rollout/multihost.py), without jax.distributed.

Two ManyHosts of one process, one thread each, stand for two hosts: the real distributed.Agreement over an
in-memory key-value store (the coordination service's calls it uses), and an allgather that concatenates what
both threads hand it (process_allgather's result). Each host's batch is made by hand, so the global batch,
the agreed stops and the queued batches of a checkpoint are checked against numbers written here.
"""

import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import batch as batch_lib
from vcpo_jax import distributed
from vcpo_jax.rollout import async_, multihost, topology

P, G, T, K = 4, 2, 3, 2  # prompts per step (2 per host), group size, columns, staleness budget


class _Store:
  """The coordination client's key-value calls (distributed.Agreement's), in memory."""

  def __init__(self):
    self.kv, self.lock = {}, threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.lock:
      self.kv[key] = value

  def key_value_dir_get(self, prefix):
    with self.lock:
      return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

  def key_value_delete(self, key):
    with self.lock:
      self.kv.pop(key, None)


class _Gather:
  """process_allgather across the host threads: tiled concatenates, untiled stacks, in host order."""

  def __init__(self, hosts: int):
    self.barrier, self.slots = threading.Barrier(hosts), [None] * hosts

  def of(self, host: int):
    def allgather(x, tiled):
      self.slots[host] = x
      self.barrier.wait(timeout=30)
      xs = list(self.slots)
      self.barrier.wait(timeout=30)  # every host has read the slots before any writes the next
      return jax.tree.map(lambda *ls: np.concatenate(ls) if tiled else np.stack(ls), *xs)

    return allgather


def _hosts(outer=(None, None)):
  store, gather = _Store(), _Gather(2)
  cfg = types.SimpleNamespace(
    sampler_devices="", timeout_s=5.0, startup_timeout_s=5.0, heartbeat_timeout_s=0.0, max_sampler_restarts=0
  )
  rollout = types.SimpleNamespace(prompts_per_step=P, group_size=G)
  out = []
  for h in range(2):
    agreement = distributed.Agreement("t", lost_after_s=30.0, client=store, host=h, hosts=2)
    t = multihost.ManyHosts(
      cfg, rollout, K, jnp.float32, "t", host=h, hosts=2, agreement=agreement, allgather=gather.of(h)
    )
    t.interrupt(outer[h])
    out.append(t)
  return out


def _in_threads(fns):
  """fns[h]() in one thread per host; [result or the exception raised]."""
  out = [None] * len(fns)

  def run(h):
    try:
      out[h] = fns[h]()
    except BaseException as e:  # noqa: BLE001 -- handed to the test
      out[h] = e

  threads = [threading.Thread(target=run, args=(h,)) for h in range(len(fns))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  return out


def _arrays(step: int, host: int, version: int) -> dict:
  """Host `host`'s rows of batch `step` (2 groups of 2 rows, host-local group ids), tokens naming both."""
  n = P // 2 * G
  tokens = (1000 * step + 100 * host + np.arange(n * T)).reshape(n, T).astype(np.int32)
  return {
    "tokens": tokens,
    "valid_mask": np.ones((n, T), bool),
    "loss_mask": np.arange(n * T).reshape(n, T) % T > 0,
    "behavior_logp": np.full((n, T), -0.5 * (host + 1), np.float32),
    "rewards": np.arange(n, dtype=np.float32) + 10 * host,
    "correct": np.zeros(n, np.float32),
    "group_id": np.repeat(np.arange(P // 2, dtype=np.int32), G),
    "policy_version": np.full((n,), version, np.int32),
    "token_version": np.where(np.arange(n * T).reshape(n, T) % T > 0, version, -1).astype(np.int32),
  }


def _local(step, host, version, checksum, restarts=0):
  """What AsyncSource's own next() hands the topology: this host's Batch and its info."""
  info = {
    "texts": ["x"] * 4,
    "problem_ids": [f"p{step}_{host}_{i}" for i in range(P // 2)],
    "response_len_mean": 2.0 + 2 * host,
    "finished_frac": 0.25 + 0.5 * host,
    "sampler_gen_s": 1.0 + host,
    "sampler_idle_frac": 0.5 * host,
    "params_checksum": checksum,
    "producer": (100 + host, step),
    "metrics": {"async/sampler_restarts": restarts},
  }
  return batch_lib.Batch.from_arrays(_arrays(step, host, version)), info


def test_many_hosts_gather_the_global_batch_in_prompt_order():
  """Host 0 sampled step 3 with version 2, host 1 with version 1 (restarted once): every host holds rows 0-3 from
  host 0 and 4-7 from host 1, group ids 0..3, the hosts' problems in order, lags and means over both."""
  hosts = _hosts()
  assert [t.rows(P * G) for t in hosts] == [4, 4] and [t.worker_fields() for t in hosts] == [
    {"prompt_block": (0, 2), "host": 0},
    {"prompt_block": (2, 4), "host": 1},
  ]
  locals_ = [_local(3, 0, 2, 7), _local(3, 1, 1, 9, restarts=1)]
  got = _in_threads([lambda h=h: hosts[h].next(3, lambda s, h=h: locals_[h], None) for h in range(2)])
  for t in hosts:
    t.close()
  for batch, info in got:
    np.testing.assert_array_equal(batch["tokens"][:4], _arrays(3, 0, 2)["tokens"])
    np.testing.assert_array_equal(batch["tokens"][4:], _arrays(3, 1, 1)["tokens"])
    assert batch["group_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch["policy_version"].tolist() == [2] * 4 + [1] * 4
    assert info["problem_ids"] == ["p3_0_0", "p3_0_1", "p3_1_0", "p3_1_1"]
    assert (info["lag_min"], info["lag_mean"], info["lag_max"]) == (1, 1.5, 2)
    m = info["metrics"]
    assert (m["train/token_lag_min"], m["train/token_lag_mean"], m["train/token_lag_max"]) == (1.0, 1.5, 2.0)
    assert m["async/sampler_restarts"] == 1  # the sum over hosts
    assert info["response_len_mean"] == 3.0 and info["finished_frac"] == 0.5 and info["sampler_gen_s"] == 2.0
    assert info["sampler_idle_frac"] == 0.25 and info["texts"] is None
    assert [(p["version"], p["checksum"], p["pid"], p["restarts"]) for p in info["hosts"]] == [
      (2, 7, 100, 0),
      (1, 9, 101, 1),
    ]


def test_hosts_that_sampled_one_version_from_different_parameters_stop():
  hosts = _hosts()
  locals_ = [_local(3, 0, 2, 7), _local(3, 1, 2, 8)]
  got = _in_threads([lambda h=h: hosts[h].next(3, lambda s, h=h: locals_[h], None) for h in range(2)])
  for t in hosts:
    t.close()
  for e in got:
    assert isinstance(e, RuntimeError) and "different parameters of one version: {2: {" in str(e)


def test_a_failure_or_a_signal_on_one_host_stops_every_host_at_that_step():
  """Host 1's sampler failed (past its budget): both hosts raise JobStopped at step 5 with exit code 1, and host 0
  puts the batch it had received back for the joint checkpoint. A signal on host 0: exit code 130."""

  def failed(step):
    raise async_.SamplerDiedError("the async sampler process (pid 7) was killed by SIGKILL\ntraceback")

  hosts, requeued = _hosts(), []
  local = [lambda s: _local(5, 0, 4, 1), failed]
  got = _in_threads([lambda h=h: hosts[h].next(5, local[h], lambda h=h: requeued.append(h)) for h in range(2)])
  for e in got:
    assert isinstance(e, distributed.JobStopped) and e.exit_code == 1, e
    assert "step 5 (host 1: SamplerDiedError: the async sampler process (pid 7) was killed by SIGKILL)" in str(e)
  assert requeued == [0]
  for t in hosts:
    t.close()

  class Interrupted(Exception):
    pass

  def signalled():
    raise Interrupted("SIGTERM")

  hosts, requeued = _hosts(outer=(signalled, None)), []
  got = _in_threads(
    [lambda h=h: hosts[h].next(6, lambda s, h=h: _local(6, h, 5, 1), lambda h=h: requeued.append(h)) for h in range(2)]
  )
  for e in got:
    assert isinstance(e, distributed.JobStopped) and e.exit_code == 130, e
    assert "host 0: interrupted (SIGTERM)" in str(e)
  assert 0 not in requeued  # host 0 stopped before taking its batch (host 1 took its own, or followed first)
  for t in hosts:
    t.close()
  with pytest.raises(Interrupted):  # outside next() (a publish): the trainer's own Interrupted, not agreed on
    hosts[0]._interrupt_or_peer()


def test_a_publish_failure_is_kept_for_the_next_agreement():
  """ManyHosts.publish keeps a failed write (no host raises alone, between collectives) and skips later writes
  until next() has posted it as this host's stop; OneHost raises at once."""
  hosts, writes = _hosts(), []

  def write_fails():
    writes.append("failed")
    raise async_.SamplerDiedError("died at publish()")

  hosts[1].publish(write_fails)
  hosts[1].publish(lambda: writes.append("skipped"))
  hosts[0].publish(lambda: writes.append("host 0"))
  assert writes == ["failed", "host 0"]
  got = _in_threads([lambda h=h: hosts[h].next(2, lambda s, h=h: _local(2, h, 1, 1), lambda: None) for h in range(2)])
  for e in got:
    assert isinstance(e, distributed.JobStopped) and "host 1: SamplerDiedError: died at publish()" in str(e)
  hosts[1].publish(lambda: writes.append("after"))  # reported: the next write runs
  assert writes[-1] == "after"
  for t in hosts:
    t.close()
  with pytest.raises(async_.SamplerDiedError):
    topology.OneHost(jnp.float32).publish(write_fails)


def test_queued_batches_pack_across_hosts_and_unpack_per_host():
  """At a save host 0 holds batches 7, 8 and host 1 batch 7: both write the same two global batches (host 1's rows
  of batch 8 zeros), and each host gets exactly its own back."""
  hosts = _hosts()
  schema = async_.batch_schema(P // 2 * G, T)

  def meta(s, h):
    return {
      "step": s,
      "version": s - 1,
      "problem_ids": [f"p{s}_{h}"],
      "response_len_mean": 1.0 + h,
      "finished_frac": 1.0,
      "gen_s": 0.5 * (h + 1),
      "sampler_pid": 100 + h,
      "seq": s,
    }

  held = [[(_arrays(s, 0, s - 1), meta(s, 0)) for s in (7, 8)], [(_arrays(7, 1, 6), meta(7, 1))]]
  packed = _in_threads([lambda h=h: hosts[h].pack(held[h], schema) for h in range(2)])
  for t in hosts:
    t.close()
  assert isinstance(packed[0], tuple), packed[0]
  for arrays, metas in packed:
    assert [m["step"] for m in metas] == [7, 8] and [m["hosts"][1] is None for m in metas] == [False, True]
    assert metas[0]["problem_ids"] == ["p7_0", "p7_1"] and metas[0]["gen_s"] == 1.0
    np.testing.assert_array_equal(arrays[0]["tokens"][4:], _arrays(7, 1, 6)["tokens"])
    assert arrays[0]["group_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and not arrays[1]["tokens"][4:].any()
  arrays, metas = packed[0]
  for h in range(2):
    back = hosts[h].unpack(arrays, metas)
    assert [m["step"] for _, m in back] == [7, 8][: len(held[h])]
    for (a, _), (a0, _) in zip(back, held[h]):
      for f in a0:
        np.testing.assert_array_equal(a[f], a0[f])
  # one host: batch 7 only (batch 8 was not complete on every host), whole
  ((a, m),) = topology.OneHost(jnp.float32).unpack(arrays, metas)
  assert m["step"] == 7 and a["group_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
  # and its own batches come back as they were
  one = topology.OneHost(jnp.float32)
  assert one.unpack(*one.pack(held[0], schema)) == [(a0, m0) for a0, m0 in held[0]]


def test_one_host_snapshot_is_a_fresh_cast_copy_and_many_hosts_gather_every_publish():
  one = topology.OneHost(jnp.bfloat16)
  x, i = jnp.arange(4, dtype=jnp.float32) / 3, jnp.arange(3, dtype=jnp.int32)
  sx, si = one.snapshot([x, i])
  assert sx.dtype == jnp.bfloat16 and si.dtype == jnp.int32 and si.unsafe_buffer_pointer() != i.unsafe_buffer_pointer()
  np.testing.assert_array_equal(np.asarray(sx, np.float32), np.asarray(x.astype(jnp.bfloat16), np.float32))
  host = one.host_arrays([x, i], ["w", "n"])
  assert host["w"].dtype == jnp.bfloat16 and host["n"].tolist() == [0, 1, 2]
  assert [a.dtype for a in one.host_copy([x, i])] == [np.float32, np.int32]  # the LoRA base keeps its dtype
  assert not one.gathers and multihost.ManyHosts.gathers  # many hosts: the shm publisher snapshots eagerly
  assert one.interrupt(None) is None and one.rows(8) == 8 and one.sampler_env({"A": "1"}) == {"A": "1"}
