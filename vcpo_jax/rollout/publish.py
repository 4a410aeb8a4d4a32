"""Publishers: how the async source's parameters reach its sampler (`async_.publish_path`), one part of AsyncSource.

    AsyncSource (rollout/async_.py: queue, liveness, replacement, checkpoints)
      composes a Publisher, picked by async_.publish_path:
        "shm"       ShmPublisher (this file): a spawned sampler reads a ParamSlot in /dev/shm
        "device"    DevicePublisher (device_publish.py): a sampler thread on its own devices, jax.device_put
        "transfer"  TransferPublisher (transfer_publish.py): a spawned sampler pulls device arrays
      and a Topology (rollout/topology.py): OneHost, or ManyHosts (rollout/multihost.py: per-host prompt blocks,
      agreement, a publish snapshot gathered to host-complete arrays). The publisher sees the topology only
      through the `snap` and `host_arrays` functions it is given.

The interface, in the order AsyncSource.publish calls it:
  prepare(leaves, version) -> payload   device-side work dispatched at every publish (snapshot, cast, checksum)
  first(payload, names) -> arrays       the first version, for open()
  open(arrays, version) -> slot         a fresh channel holding `version`, for a new sampler (the first or a
                                        replacement); the worker reads it (version(), latest(), checksum_of)
  started()                             the sampler holds the channel (transfer: the server thread starts)
  write(payload, names, version, poll)  every later version, into the current channel
  published(payload, version)           the version is out (the checksum recorded with `record`)
  newest() -> (version, arrays)         what a replacement sampler starts from
  quiesce(raise_error), flush(...)      before a replacement; flush: tests and benchmarks
  raise_error(dead, died)               a failure of the publisher's own thread
  stop(), close()                       threads first (before the sampler stops), then the channels
`record(version, checksum)` keeps the checksums next() checks each batch's echo against, and drops those below
version - 2k - 2: a batch consumed after version v's publish is for a step >= v, so it carries versions >= v - k
(the rule keeps a margin of k + 2 more).
"""

from __future__ import annotations

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax.rollout.process.param_slot import ParamSlot
from vcpo_jax.rollout.process.shm_queue import PeerDiedError


class _Closing(Exception):
  """close() ended the background publisher's wait."""


def snapshot_leaf(x, dtype):
  """Inside jit: a fresh copy of `x` (floating leaves cast to `dtype`), never an alias of the (donated) input."""
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
    return x.astype(dtype)
  return jnp.copy(x)


def background_for(setting, backend: str) -> bool:
  """async_.background_publish ("auto" | "true" | "false"; Python bools too) -> whether publish() hands the
  copy to a thread. "auto": not on the "cpu" backend (the synchronous copy is cheaper there: the snapshot is a
  full memory copy on the caller's thread), yes on accelerators."""
  text = str(setting).lower()
  if text == "auto":
    return backend != "cpu"
  if text not in ("true", "false"):
    raise ValueError(f"async_.background_publish={setting!r}: use 'auto', 'true' or 'false'.")
  return text == "true"


class Publisher:
  """The interface (module docstring) with the shared parts: the checksum record and the host copy times.

  Args:
    cfg: AsyncConfig. k: the staleness budget. publish_dtype: of floating leaves in the channel.
    run_id: names of shared-memory objects. snap: leaves -> fresh on-device copies in the publish dtype (the
    topology's: one host a jitted copy, many hosts a gather to host-complete arrays). host_arrays: (leaves,
    names) -> {name: numpy array in the publish dtype} (the topology's host copy).
  """

  in_process = False  # True: the sampler is a thread of this process (device path), not a spawned process
  background = False  # True: publish() hands the host copy to a thread
  eval_ok = False  # True: eval.background (a spawned sampler with a ParamSlot evaluates)

  def __init__(self, cfg, k: int, publish_dtype, run_id: str, snap, host_arrays):
    self.cfg, self.k, self.publish_dtype, self.run_id = cfg, int(k), publish_dtype, run_id
    self.snap, self.host_arrays = snap, host_arrays
    self.slot = None  # the current sampler's channel
    self.checksums: dict[int, int] = {}  # version -> checksum of what was published (recent ones)
    self.publish_records: collections.deque = collections.deque(maxlen=4096)  # (version, "full" | "delta", bytes)
    self.copy_s: collections.deque = collections.deque()  # host copy seconds of versions written, not logged yet
    self._thread = None  # the publisher's own thread, if any
    self._thread_error: BaseException | None = None
    self._closing = False

  def record(self, version: int, checksum):
    """Keeps `version`'s checksum (None: not checked) and drops those no batch can echo any more."""
    self.checksums[version] = checksum
    for v in [v for v in self.checksums if v < version - 2 * self.k - 2]:
      del self.checksums[v]

  def prepare(self, leaves: list, version: int):
    return leaves

  def first(self, payload, names) -> dict:
    raise NotImplementedError

  def open(self, arrays: dict, version: int):
    raise NotImplementedError

  def started(self):
    pass

  def write(self, payload, names, version: int, poll):
    raise NotImplementedError

  def published(self, payload, version: int):
    pass

  def newest(self) -> tuple[int, dict]:
    return self.slot.latest(timeout=60.0)

  def flush(self, timeout: float, raise_error):
    """Waits until the publisher's thread has written the newest version; then `raise_error()`."""
    raise_error()

  def quiesce(self, raise_error):
    """Before a replacement: lets the thread finish its copy into the old channel (a failed thread is forgotten,
    and started() starts a new one for a snapshot it had not taken)."""
    if self._thread is None:
      return
    try:
      self.flush(60.0, raise_error)
    finally:
      if not self._thread.is_alive():
        self._thread = None

  def raise_error(self, dead: bool, died):
    """Re-raises a failure of the publisher's thread; `died(context)` builds the sampler's SamplerDiedError."""
    if self._thread_error is not None:
      e, self._thread_error = self._thread_error, None
      if isinstance(e, PeerDiedError):
        raise died(f"while publishing in the background: {e}")
      raise RuntimeError(f"async source: the background publisher failed: {e!r}") from e

  def take_copy_s(self) -> float | None:
    last = None
    while self.copy_s:
      last = self.copy_s.popleft()
    return last

  def close_slot(self):
    if self.slot is not None:
      self.slot.close()
    self.slot = None

  def stop(self):
    """Ends the publisher's thread (a copy in progress finishes; a lock wait ends at once)."""
    self._closing = True
    if self._thread is not None:
      self._thread.join(30.0)
      self._thread = None

  def close(self):
    self.close_slot()

  def resource_paths(self) -> list[str]:
    return [] if self.slot is None else self.slot.resource_paths()


class ShmPublisher(Publisher):
  """async_.publish_path="shm": one parameter copy (or two) in a ParamSlot in /dev/shm, version and checksum.

  Synchronous (async_.background_publish false, the CPU default): write() does the device_get and the copy
  into the slot. Background: prepare() dispatches the on-device snapshot and write() hands it to a thread
  that does the host copy and the slot write; a snapshot the thread has not taken yet is replaced by a newer
  one. async_.publish_buffers, publish_checksum and publish_delta configure the slot (open()). `eager`: the
  snapshot is dispatched at every publish, also on the synchronous path (many hosts: it is a collective).
  """

  eval_ok = True

  def __init__(self, *a, background: bool, eager: bool = False, **kw):
    super().__init__(*a, **kw)
    self.background, self.eager = bool(background), bool(eager)
    self._cv = threading.Condition()
    self._todo = None  # (snapshot leaves, version, names) not yet taken by the thread; a newer one replaces it
    self._busy = False

  def prepare(self, leaves, version):
    return self.snap(leaves) if (self.background or self.eager) else leaves

  def first(self, payload, names):
    return self.host_arrays(payload if (self.background or self.eager) else self.snap(payload), names)

  def open(self, arrays, version):
    # async_.publish_buffers: 1 = one parameter copy in /dev/shm (a write waits for a sampler read in progress),
    # 2 = double buffer (a write never waits); 0 = 1 with background publishing (the thread waits, never the
    # learner), else 2.
    nbuf = int(self.cfg.publish_buffers) or (1 if self.background else 2)
    # async_.publish_checksum: computed during the slot's copies; "background": on the background path only.
    csum = {"true": True, "false": False, "background": self.background}[self.cfg.publish_checksum]
    # async_.publish_delta: "auto" = delta records on a one-copy slot (ParamSlot's "Delta publishing").
    delta = self.cfg.publish_delta == "auto" and nbuf == 1
    self.slot = ParamSlot(arrays, run=self.run_id, nbuf=nbuf, checksum=csum, delta=delta)
    self._write(arrays, version, None)  # before the start: the worker's first wait succeeds at once
    return self.slot

  def started(self):
    if self._thread is None and self._todo is not None:  # a snapshot a failed thread had not taken
      self._hand_over(*self._todo)

  def write(self, payload, names, version, poll):
    if self.background:
      self._hand_over(payload, version, names)  # dispatched, not waited for
      return
    t1 = time.perf_counter()
    arrays = self.host_arrays(payload, names)  # device_get (a view on CPU), one copy with its checksum
    if not self.eager:  # one host: a signal or a dead sampler ends the publish before the copy (many hosts: only
      poll()  # in the lock wait, as before; a host's stop is agreed on in next())
    self._write(arrays, version, poll)
    self.copy_s.append(time.perf_counter() - t1)

  def _write(self, arrays: dict, version: int, poll):
    """Writes version `version` into the slot and records its checksum (computed during the copy)."""
    self.slot.publish(arrays, version, poll=poll)
    if self.slot.last_publish is not None:  # (version, "full" | "delta", bytes written into the slot)
      self.publish_records.append((version, self.slot.last_publish["kind"], self.slot.last_publish["bytes"]))
    self.record(version, self.slot.last_checksum)  # None: async_.publish_checksum off, not checked

  def _hand_over(self, snap: list, version: int, names):
    """Gives the background publisher the newest snapshot (replacing one it has not taken yet)."""
    with self._cv:
      self._todo = (snap, version, names)
      self._cv.notify_all()
    if self._thread is None:
      self._thread = threading.Thread(target=self._publisher, name="vcpo-async-publish", daemon=True)
      self._thread.start()

  def _publisher(self):
    """Background thread: the newest pending snapshot -> host -> slot, until close()."""
    while True:
      with self._cv:
        while self._todo is None and not self._closing:
          self._cv.wait()
        if self._closing:
          return
        (snap, version, names), self._todo = self._todo, None
        self._busy = True
      try:
        t0 = time.perf_counter()
        self._write(self.host_arrays(snap, names), version, self._thread_poll)
        self.copy_s.append(time.perf_counter() - t0)  # deque.append: safe against the learner's popleft
      except _Closing:
        return
      except Exception as e:  # noqa: BLE001 -- any failure is re-raised by the next publish() / next()
        self._thread_error = e
        return
      finally:
        with self._cv:
          self._busy = False
          self._cv.notify_all()

  def _thread_poll(self):
    if self._closing:
      raise _Closing()

  def flush(self, timeout: float, raise_error):
    """Waits until the background publisher has written the newest version."""
    deadline = time.monotonic() + timeout
    with self._cv:
      while (self._todo is not None or self._busy) and self._thread_error is None:
        if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
          raise TimeoutError(f"async source: the background publisher did not finish within {timeout} s")
    raise_error()

  def stop(self):
    with self._cv:
      self._closing = True
      self._cv.notify_all()
    super().stop()


def host_arrays(leaves: list, names, dtype) -> dict:
  """{name: numpy array} of device `leaves` (device_get), floating ones cast to `dtype` (a snapshot is cast
  already; the synchronous path casts here)."""
  out = {n: np.asarray(a) for n, a in zip(names, jax.device_get(leaves))}
  for n, a in out.items():
    if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype:  # jnp: knows bfloat16
      out[n] = a.astype(dtype)
  return out
