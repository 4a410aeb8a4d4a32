"""Topologies: where the async source's learner processes are, one part of AsyncSource (the other: a Publisher).

    AsyncSource (rollout/async_.py: queue, staleness bound, liveness, replacement, checkpoints) composes
      a Topology, picked by jax.process_count():
        1    OneHost (this file): one learner process, one sampler; its batch is the step's batch
        > 1  ManyHosts (multihost.py): one sampler per learner process on that host's prompt block, a per-step
             agreement of every host, the global batch gathered, queued batches packed across hosts
      and a Publisher (rollout/publish.py, by async_.publish_path), which sees the topology only through the
      `snapshot` and `host_arrays` functions it is given.

The interface, in the order AsyncSource uses it:
  rows(batch_size) -> int                  rows of this process's batches (its sampler's queue schema)
  sampler_env(env) -> env                  the spawned sampler's environment (many hosts: platform variables)
  interrupt(outer) -> callable | None      what every wait polls (many hosts: a peer's stop, too)
  worker_fields() -> dict                  more WorkerArgs fields (many hosts: the prompt block, the host)
  snapshot(leaves) -> leaves               fresh on-device copies in the publish dtype
  host_arrays(leaves, names) -> dict       {name: numpy array in the publish dtype}
  host_copy(leaves) -> list                numpy copies, dtype kept (LoRA: the frozen base, once)
  publish(write)                           runs the write of a version after the first
  next(step, local, requeue) -> (batch, info)   the learner's batch from `local(step)`, this process's
  pack(local, schema) -> (arrays, metas)   the queued batches a checkpoint stores
  unpack(arrays, metas) -> [(arrays, meta)]     this process's share of a checkpoint's queued batches
  close()
Class attributes: `agreed_stops` (next() agrees on every stop with the other hosts: the trainer then saves
jointly), `gathers` (the snapshot is a collective: dispatched at every publish, by every host).
"""

from __future__ import annotations

import jax
import numpy as np

from vcpo_jax.rollout import publish as publish_lib


class Topology:
  """The interface (module docstring); the defaults are those of a topology that adds nothing to the source."""

  agreed_stops = False
  gathers = False

  def rows(self, batch_size: int) -> int:
    return int(batch_size)

  def sampler_env(self, env: dict) -> dict:
    return env

  def interrupt(self, outer):
    return outer

  def worker_fields(self) -> dict:
    return {}

  def snapshot(self, leaves: list) -> list:
    raise NotImplementedError

  def host_arrays(self, leaves: list, names) -> dict:
    raise NotImplementedError

  def host_copy(self, leaves: list) -> list:
    raise NotImplementedError

  def publish(self, write):
    write()

  def next(self, step: int, local, requeue):
    raise NotImplementedError

  def pack(self, local: list[tuple[dict, dict]], schema) -> tuple[list[dict], list[dict]]:
    raise NotImplementedError

  def unpack(self, arrays: list[dict], metas: list[dict]) -> list[tuple[dict, dict]]:
    raise NotImplementedError

  def close(self):
    pass


class OneHost(Topology):
  """One learner process and its sampler: the step's batch is the sampler's. `publish_dtype`: of floating leaves."""

  def __init__(self, publish_dtype):
    self.publish_dtype = publish_dtype
    self._snap = None  # jit: the cast copy, built at the first snapshot

  def snapshot(self, leaves):
    if self._snap is None:
      dtype = self.publish_dtype
      self._snap = jax.jit(lambda ls: [publish_lib.snapshot_leaf(x, dtype) for x in ls])
    return self._snap(leaves)

  def host_arrays(self, leaves, names):
    return publish_lib.host_arrays(leaves, names, self.publish_dtype)

  def host_copy(self, leaves):
    return [np.asarray(x) for x in jax.device_get(leaves)]

  def next(self, step, local, requeue):
    return local(step)

  def pack(self, local, schema):
    return [dict(a) for a, _ in local], [dict(m) for _, m in local]

  def unpack(self, arrays, metas):
    """The batches in order up to the first one that only some hosts of a multi-host checkpoint had received
    (multihost.pack_queued: None in its "hosts"); this process's sampler makes that one and the rest again."""
    whole = next((i for i, m in enumerate(metas) if None in (m.get("hosts") or ())), len(metas))
    return list(zip(arrays[:whole], metas[:whole]))
