"""Device-to-device publishing (`async_.publish_path="device"`): the sampler is a thread of the learner's process.

    learner (main thread, devices L)                   sampler thread (devices S = async_.sampler_devices)
    publish(params, v): jax.device_put(params, S) --DeviceSlot (v, device arrays, checksum)--> newest params
    next(b) <-----------------in-process queue (batch b)---------------- the async worker's loop, unchanged

Where learner and sampler share a host with several devices, the parameters go from the learner's devices to
the sampler's with one `jax.device_put` onto a replicated sharding of the sampler's mesh (a device-to-device
copy: NVLink / ICI on accelerators, a memcpy between fake CPU devices), with no host copy and no shared
memory. (A spawned sampler process that pulls device arrays from this one with `jax.experimental.transfer`
is `publish_path="transfer"`, rollout/transfer_publish.py.) Here the sampler runs the same worker loop (process/worker.py's _Worker: staleness bound k, in-flight updates, per-batch metadata)
in a thread, on its own mesh over the devices S; the learner's mesh is every other device (trainer.
_build_mesh). The sampler thread and the learner share the Python interpreter (dispatch only: XLA runs
the programs outside the GIL) and, on CPU, the cores.

Checksum: `device_checksum`, computed where the arrays live (the learner's copy before the transfer, the
sampler's after it) and compared per batch as in the shared-memory path: a position-weighted uint32 sum
(wrapping, so exact and independent of sharding), not param_slot's 64-bit host one. The learner's is fetched only
when a batch is checked, so publish() does not wait for it.

Failures. A sampler thread that crashes (an exception: its traceback comes through the control pipe, the
thread ends and drops its arrays) is replaced as a sampler process is (AsyncSource._replace, within
async_.max_sampler_restarts per async_.restart_window_s): a fresh thread on the same devices, with a fresh
slot holding the newest published version and a fresh queue; the batches the old one completed are served
first, the one it was making is made again. A hung thread (no heartbeat for async_.heartbeat_timeout_s, or
no batch within async_.timeout_s although the staleness bound allows one) is not replaced: a Python thread
cannot be killed, so it would keep its device memory (its parameter copy, its decode state) on the very
devices a replacement needs, and a hang inside a device call would also hold those devices' queue, so a
replacement's programs would wait behind it. It ends the run as before (TimeoutError: the trainer
checkpoints and exits 1); a start-up line says so. Every batch carries its thread's number (1 for the first
thread, meta "sampler_thread"), so `info["producer"]` is (pid, seq, thread): the pid is this process's.

Tested (tests/test_async.py, fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=4, learner on
2, sampler on 2): published parameters equal to the learner's after a step, versions and checksums echoed;
tests/test_recovery.py: a sampler thread that raises is replaced and the run finishes.
Not tested: accelerators (no GPU / TPU run), in-flight updates and multi-turn makers over this path, resume.
Unsupported (one-line config errors): several processes (jax.process_count() > 1), no sampler devices,
background evaluation, sampler_cpus / sampler_env (process settings).
"""

from __future__ import annotations

import collections
import logging
import os
import queue as queue_lib
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax import mesh as mesh_lib
from vcpo_jax.rollout import publish as publish_lib
from vcpo_jax.rollout.process import worker as worker_lib
from vcpo_jax.rollout.process.shm_queue import QueueFinished

log = logging.getLogger("vcpo_jax")


@jax.jit
def _device_checksum(leaves):
  total = jnp.uint32(1)
  for x in leaves:
    if x.dtype.itemsize == 4:
      bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype.itemsize == 2:
      bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    else:
      bits = x.astype(jnp.uint32)
    flat = bits.reshape(-1)
    weights = jnp.arange(1, flat.shape[0] + 1, dtype=jnp.uint32)
    total = total * jnp.uint32(1000003) + jnp.sum(flat * weights, dtype=jnp.uint32)
  return total


def device_checksum(leaves):
  """sum_i bits(x)_i * (i + 1) mod 2^32 per leaf (bits: the leaf's 32- or 16-bit pattern), chained over the
  leaves as c = c * 1000003 + s (mod 2^32), from c = 1. A uint32 device scalar (not fetched)."""
  return _device_checksum(list(leaves))


class DeviceSlot:
  """In-process latest-value channel of device arrays with a monotone version (the ParamSlot interface the
  worker loop uses: version(), latest(), plus checksum_of for its echo)."""

  def __init__(self):
    self._cv = threading.Condition()
    self._version, self._arrays = -1, None

  def publish(self, arrays: dict, version: int):
    with self._cv:
      if version <= self._version:
        raise ValueError(f"DeviceSlot.publish: version {version} must exceed the last published {self._version}")
      self._version, self._arrays = int(version), dict(arrays)
      self._cv.notify_all()

  def version(self) -> int:
    with self._cv:
      return self._version

  def latest(self, min_version=None, timeout=None, out=None, poll=None):
    need = 0 if min_version is None else int(min_version)
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cv:
      while self._version < need:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise TimeoutError(f"DeviceSlot.latest: version {need} not published within {timeout} s")
        self._cv.wait(timeout=0.1 if left is None else min(left, 0.1))
        if poll is not None:
          poll()
      return self._version, dict(self._arrays)

  def checksum_of(self, arrays: dict, names) -> int:
    return int(device_checksum([arrays[n] for n in names]))

  def close(self):
    with self._cv:
      self._arrays = None

  def resource_paths(self) -> list[str]:
    return []


_Item = collections.namedtuple("_Item", "arrays meta")


class ThreadQueue:
  """In-process bounded batch queue with the ShmQueue interface the worker and AsyncSource.next use."""

  def __init__(self, schema, nslots: int, thread: int = 1):
    self.schema = schema
    self._q: queue_lib.Queue = queue_lib.Queue(maxsize=nslots)
    self._finished = False
    self._beats = 0
    self.thread = int(thread)  # which sampler thread of the source feeds it (1, 2, ... with replacements)

  def put(self, arrays: dict, meta: dict, timeout=None):
    item = _Item({n: np.asarray(a) for n, a in arrays.items()}, dict(meta, sampler_thread=self.thread))
    self._q.put(item, timeout=timeout)  # raises Full

  def finish(self):
    self._finished = True

  def get(self, timeout=None):
    try:
      return self._q.get(timeout=timeout)
    except queue_lib.Empty:
      if self._finished and self._q.empty():
        raise QueueFinished() from None
      raise

  def watch(self, proc):
    pass

  def beat(self):
    self._beats += 1

  def beats(self) -> int:
    return self._beats

  def close(self):
    pass

  def resource_paths(self) -> list[str]:
    return []


class _ThreadProc:
  """The sampler thread behind AsyncSource's process interface (pid, exitcode, join; signals are no-ops)."""

  def __init__(self, target):
    self.pid = os.getpid()
    self._code = None

    def run():
      try:
        self._code = target()
      except BaseException:  # noqa: BLE001 -- reported through the control pipe, as the process's
        self._code = 1

    self._thread = threading.Thread(target=run, name="vcpo-device-sampler", daemon=True)

  def start(self):
    self._thread.start()

  @property
  def exitcode(self):
    return None if self._thread.is_alive() else self._code

  def join(self, timeout=None):
    self._thread.join(30.0 if timeout is None else timeout)  # a batch in progress finishes first

  def terminate(self):
    pass

  def kill(self):
    pass


def _thread_main(args, batch_queue, slot, conn) -> int:
  """The worker loop in this process (process/worker.main without the process set-up); 0 on "stop"."""
  try:
    worker_lib._Worker(args, batch_queue, slot, conn, os.getpid()).run()
  except worker_lib._Stop:
    return 0
  except BaseException:
    try:
      conn.send(("error", traceback.format_exc()))
    except (OSError, ValueError):
      pass
    raise
  return 0


class DevicePublisher(publish_lib.Publisher):
  """async_.publish_path="device": the sampler is a thread on async_.sampler_devices of this process (it starts
  it: `start_sampler`) and each version is one device-to-device `jax.device_put` (see the module docstring)."""

  in_process = True

  def __init__(self, cfg, *a, mesh_shape, **kw):
    check_device_path(cfg, jax.process_count(), jax.device_count())
    super().__init__(cfg, *a, **kw)
    self._threads = 0  # sampler threads started so far
    if int(cfg.max_sampler_restarts) > 0:
      log.info(
        "async: publish_path='device': a sampler thread that crashes is replaced (async_.max_sampler_restarts=%d); "
        "one that hangs cannot be stopped, and ends the run (checkpoint, exit 1).",
        int(cfg.max_sampler_restarts),
      )
    self.sampler_devices = mesh_lib.split_devices(cfg.sampler_devices, jax.devices())[0]
    self.sampler_mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(mesh_shape), devices=self.sampler_devices)
    self._replicated = jax.sharding.NamedSharding(self.sampler_mesh, jax.sharding.PartitionSpec())

  def prepare(self, leaves, version):
    """Dispatches the copy of `leaves` (cast to the publish dtype on the learner's devices if it differs) onto
    the sampler's devices, and its device checksum; nothing waits for either (the learner's next step may still
    donate the leaves: the runtime orders the donation after the copy's read)."""
    if any(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != self.publish_dtype for x in leaves):
      leaves = self.snap(leaves)
    return jax.device_put(leaves, self._replicated), device_checksum(leaves)

  def first(self, payload, names):
    return dict(zip(names, payload[0]))

  def open(self, arrays, version):
    self.slot = DeviceSlot()
    self.slot.publish(arrays, version)
    return self.slot

  def write(self, payload, names, version, poll):
    self.slot.publish(dict(zip(names, payload[0])), version)

  def published(self, payload, version):
    self.record(version, payload[1])  # a device scalar, fetched (int) when a batch of this version is checked

  def worker_fields(self) -> dict:
    return {"devices": tuple(self.sampler_devices)}

  def start_sampler(self, args, schema, nslots: int, conn):
    """(queue, proc): a sampler thread with its own queue, reading the current slot, making args' batches."""
    self._threads += 1
    queue, slot = ThreadQueue(schema, nslots, thread=self._threads), self.slot  # a replacement's are new objects
    proc = _ThreadProc(lambda: _thread_main(args, queue, slot, conn))
    proc.start()
    return queue, proc


def check_device_path(cfg, process_count: int, device_count: int):
  """One-line errors for async_.publish_path='device' where it does not apply."""
  fix = "set async_.publish_path='shm'"
  if process_count > 1:
    raise ValueError(f"async_.publish_path='device' runs on one process (have {process_count}); {fix}.")
  ids = [int(x) for x in str(cfg.sampler_devices).replace(" ", "").split(",") if x]
  if not ids:
    raise ValueError(f"async_.publish_path='device' needs async_.sampler_devices (e.g. '2,3'); set them or {fix}.")
  if max(ids) >= device_count or len(ids) >= device_count:
    raise ValueError(
      f"async_.sampler_devices={cfg.sampler_devices!r} with publish_path='device': this process has "
      f"{device_count} devices and the learner needs at least one; choose ids below {device_count} or {fix}."
    )
  if cfg.sampler_cpus or dict(cfg.sampler_env or {}):
    raise ValueError(
      f"async_.sampler_cpus / sampler_env set a sampler process's; publish_path='device' has none; {fix}."
    )
