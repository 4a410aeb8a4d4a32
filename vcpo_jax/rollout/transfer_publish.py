"""Cross-process device-to-device publishing (`async_.publish_path="transfer"`): `jax.experimental.transfer`.

    learner (this process, devices L)                       sampler (spawned, process/worker.py, devices S)
    publish(params, v): snapshot on L[0] = the newest offer   version(): reads the counter
                        counter := v
    server thread: request u <-------------pipe-------------- latest(): sends a fresh uuid u, then
                   await_pull(u, newest offer) ==transfer==>  conn.pull(u): device arrays on S[0]
    next(b) <-------------------ShmQueue (batch b)----------- the async worker's loop, unchanged

The sampler is the shm path's spawned process (own devices and XLA client), but the weights never go through
the host or /dev/shm: each process runs a transfer server on 127.0.0.1 and the sampler pulls each version it
takes straight into device arrays. Only small things cross otherwise: the newest published version (a shared
int64 counter), the pull requests (one uuid per pull on a pipe), the batches (ShmQueue) and the control pipe.

Contract:
- publish(params, v) dispatches a snapshot onto the learner's first device (fresh buffers in the publish dtype:
  the next step donates `params`) and its device checksum, makes it the newest offer and sets the counter; it
  never waits for the sampler. The server thread answers each request with `await_pull(uuid, newest offer)`,
  so exactly one pull answers each offer and the learner holds at most two snapshots. The offer carries its
  version (int32), so the sampler learns which version it got atomically with the weights.
- Delta publishing (`async_.publish_delta="auto"`): the request carries the version the sampler holds; the
  answer is the compressed XOR record against it (process/delta.py) when the server's last answered version is
  that one, else the full snapshot; the sampler rebuilds the version bit for bit. `publish_records` lists
  (version, kind, bytes) per answered request.
- Checksum: rollout/device_publish.py's `device_checksum` on the learner's snapshot and on the sampler's pulled
  arrays; every batch echoes the sampler's and AsyncSource.next compares it with the published one's.
- Failures and shutdown as the shm path: a dead sampler raises SamplerDiedError from next() and publish();
  close() stops the server thread, then the worker, then drops the server and the offers.
- Unsupported (one-line config errors, run_spec): several processes (distributed.enabled), in-flight updates.

Costs: benchmarks/README.md "Parameter publishing". What blocks the learner, how deltas are kept, and what
tests/test_transfer_publish.py covers (and does not): docs/design_notes.md "rollout/transfer_publish.py".
"""

from __future__ import annotations

import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax.rollout import publish as publish_lib
from vcpo_jax.rollout.device_publish import device_checksum
from vcpo_jax.rollout.process import delta as delta_lib
from vcpo_jax.rollout.process.shm_queue import SPAWN

_ADDRESS = "127.0.0.1:0"  # learner and sampler share the host; port 0: the OS picks a free one
_SERVE_POLL_S = 0.1  # the server thread's wait slice on the request pipe (it checks close() between slices)
_DELTA_MAX_FRAC = 0.75  # a delta record longer than this fraction of a full copy is sent as the full copy (ParamSlot's)


def _start_server(device):
  from jax.experimental import transfer

  return transfer.start_transfer_server(device.client, _ADDRESS, [_ADDRESS])


class TransferSlot:
  """The sampler's end of the transfer path, with the ParamSlot interface the worker loop uses (version(),
  latest(), checksum_of, close). Built by the learner, pickled to the spawned sampler; it starts the sampler's
  transfer server and connects to the learner's at its first pull.

  address: the learner's transfer server; names / shapes / dtypes: the published leaves, in flatten order;
  published: the shared counter of the newest published version; requests: the sampler's end of the request
  pipe (duplex: with delta, the learner answers each request with what the pull carries).
  delta: pull delta records against the version this end holds ("Delta publishing" in the module docstring).
  """

  def __init__(self, address: str, names, shapes, dtypes, published, requests, delta: bool = False):
    self.address, self.names = address, tuple(names)
    self.shapes, self.dtypes = tuple(tuple(s) for s in shapes), tuple(jnp.dtype(d).name for d in dtypes)
    self._published, self._requests, self.delta = published, requests, bool(delta)
    self._server = self._conn = None  # the sampler's, built in its process
    self._uuids = itertools.count(1)
    self._held = None  # delta: (version, its packed host buffer) of the newest version pulled
    self.last_pull = None  # {"kind": "full" | "delta", "bytes": bytes pulled} of the last latest()

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_server"] = state["_conn"] = state["_uuids"] = state["_held"] = None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._uuids = itertools.count(1)

  def version(self) -> int:
    return int(self._published.value)

  def latest(self, min_version=None, timeout=None, out=None, poll=None):
    """(version, {name: device array on this process's first device}) with version >= min_version (default 0):
    waits for the counter (TimeoutError after `timeout` s; `poll()` between slices), then pulls the newest offer."""
    need = 0 if min_version is None else int(min_version)
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.version() < need:
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"TransferSlot.latest: version {need} not published within {timeout} s")
      time.sleep(0.005)
      if poll is not None:
        poll()
    device = jax.local_devices()[0]
    if self._conn is None:
      self._server = _start_server(device)
      self._conn = self._server.connect(self.address)
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=sharding) for s, d in zip(self.shapes, self.dtypes)]
    specs.append(jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding))  # the offer's version
    uuid = next(self._uuids)
    if self.delta:
      return self._pull_delta(uuid, specs, sharding, poll)
    self._requests.send(uuid)
    pulled = jax.block_until_ready(self._conn.pull(uuid, specs))
    version = int(pulled[-1])
    self.last_pull = {"kind": "full", "bytes": sum(x.nbytes for x in pulled[:-1])}
    return version, dict(zip(self.names, pulled[:-1]))

  def layout(self) -> delta_lib.Layout:
    return delta_lib.Layout({n: (s, jnp.dtype(d)) for n, s, d in zip(self.names, self.shapes, self.dtypes)})

  def _pull_delta(self, uuid: int, specs: list, sharding, poll):
    """Delta publishing's pull: sends (uuid, the version held or -1), reads the learner's answer (kind, version,
    base, bytes) and pulls the full arrays or the record, which it applies to the held buffer (bit for bit)."""
    held = -1 if self._held is None else self._held[0]
    self._requests.send((uuid, held))
    while not self._requests.poll(_SERVE_POLL_S):
      if poll is not None:
        poll()
    kind, version, base, nbytes = self._requests.recv()
    if kind == "full":
      pulled = jax.block_until_ready(self._conn.pull(uuid, specs))
      arrays = dict(zip(self.names, pulled[:-1]))
      self._held = (version, self.layout().pack({n: np.asarray(a) for n, a in arrays.items()}))
    else:
      if base != held:
        raise RuntimeError(f"TransferSlot: a delta record against version {base}, but this end holds {held}")
      rec_spec = [jax.ShapeDtypeStruct((nbytes,), jnp.uint8, sharding=sharding), specs[-1]]
      record = np.asarray(jax.block_until_ready(self._conn.pull(uuid, rec_spec))[0])
      layout = self.layout()
      new = delta_lib.decode(record, self._held[1], np.empty(layout.nbytes, np.uint8), layout.blocks)
      self._held = (version, new)
      arrays = {n: jax.device_put(a, sharding) for n, a in layout.views(new).items()}
    self.last_pull = {"kind": kind, "bytes": int(nbytes)}
    return int(version), arrays

  def checksum_of(self, arrays: dict, names) -> int:
    return int(device_checksum([arrays[n] for n in names]))

  def unlink(self):
    """Nothing named to remove (the counter's page is unlinked at creation)."""

  def close(self):
    """Closes this end of the request pipe (the learner's server thread then ends) and drops the connection."""
    self._conn = self._server = None
    if self._requests is not None:
      self._requests.close()

  def resource_paths(self) -> list[str]:
    return []  # no named segment: the counter is a page of multiprocessing's heap, unlinked at creation


class TransferPublisher(publish_lib.Publisher):
  """async_.publish_path="transfer": the spawned sampler pulls each version it takes from this process's devices
  with `jax.experimental.transfer` (see the module docstring). A failed sampler is replaced (AsyncSource._replace):
  the new one pulls the newest offer from the same transfer server over a fresh request pipe, answered by a
  fresh server thread (this publisher's thread)."""

  eval_ok = True  # a spawned sampler: background evaluation reads its own ParamSlot, as on the shm path

  def __init__(self, cfg, *a, **kw):
    check_transfer_path(cfg, jax.process_count())
    super().__init__(cfg, *a, **kw)
    self._server = None
    self._offer_lock = threading.Lock()
    self._offer = None  # (snapshot leaves, version scalar, version) of the newest version: what the next pull gets
    self.delta = cfg.publish_delta == "auto"  # async_.publish_delta: records against the sampler's version
    self._delta_lock = threading.Lock()  # the server threads' (a replaced sampler's may still be ending) host copies
    self._bufs: dict[int, np.ndarray] = {}  # delta: packed host copy of the version answered last (the base)
    self._layout = None
    self._offered = None  # the one registered last (kept alive until the next request: its pull is done then)
    self._requests = None  # the receive end of the request pipe
    self._published_v = SPAWN.Value("q", -1, lock=False)  # 8-byte aligned: one store / load on x86 and arm64
    self._snap1 = None
    self.offers = 0  # requests answered
    self.offer_s: list[float] = []  # the server thread's await_pull registration time, per request

  def prepare(self, leaves, version):
    """Dispatches a snapshot of `leaves` on the learner's first device (publish dtype), its checksum and the
    version scalar: the offer. No host copy; nothing waits for the sampler (the server thread answers pulls)."""
    if self._snap1 is None:
      self._snap1 = self._snapshot_fn(leaves)
    snap = self._snap1(leaves)
    return (snap, jax.device_put(np.int32(version), self._device), version), device_checksum(snap)

  def first(self, payload, names):
    self._offer = payload[0]
    return dict(zip(names, payload[0][0]))

  def write(self, payload, names, version, poll):
    with self._offer_lock:
      self._offer = payload[0]

  def published(self, payload, version):
    self._published_v.value = version  # after the offer: a request that sees v gets v or newer
    self.record(version, payload[1])  # fetched (int) when a batch of this version is checked

  def _snapshot_fn(self, leaves):
    """leaves -> fresh copies (floating ones in the publish dtype) on the learner's first device: one jitted copy
    when every leaf lives there already, else the copy on the leaves' own devices, then a gather onto it (a
    copy to a different sharding: fresh buffers, never an alias of a donated one)."""
    devices = {d for x in leaves for d in x.devices()}
    self._device = min(devices, key=lambda d: d.id)
    one = jax.sharding.SingleDeviceSharding(self._device)
    if devices == {self._device}:
      dtype = self.publish_dtype
      return jax.jit(lambda xs: [publish_lib.snapshot_leaf(x, dtype) for x in xs], out_shardings=one)
    return lambda xs: jax.device_put(self.snap(xs), one)

  def newest(self) -> tuple[int, dict]:
    """The newest offer (device snapshots in the publish dtype) and its version: a replacement's start."""
    with self._offer_lock:
      snap, _, ver = self._offer
    return ver, dict(zip(self.slot.names, snap))

  def raise_error(self, dead, died):
    """A pull that failed because its sampler died is the sampler's death (replaceable), not the server's."""
    if self._thread_error is not None and dead:
      self._thread_error = None
      raise died("during a parameter pull")
    super().raise_error(dead, died)

  def open(self, arrays, version):
    if self._server is None:  # one server for the run: a replacement sampler connects to the same one
      self._server = _start_server(self._device)
    self._requests, send = SPAWN.Pipe(duplex=self.delta)  # delta: the learner answers each request
    leaves = list(arrays.values())
    self.slot = TransferSlot(
      self._server.address(),
      list(arrays),
      [x.shape for x in leaves],
      [x.dtype for x in leaves],
      self._published_v,
      send,
      delta=self.delta,
    )
    self._layout = self.slot.layout() if self.delta else None
    self._published_v.value = int(version)
    return self.slot

  def started(self):
    """Once the sampler holds the slot: closes this process's send end of the request pipe (the sampler's is
    then the only one, so its exit ends the server thread's wait) and starts the server thread on that pipe
    (a replaced sampler's thread keeps its own pipe and ends at its EOF)."""
    self.slot.close()
    self._thread = threading.Thread(target=self._serve, args=(self._requests,), name="vcpo-transfer-serve", daemon=True)
    self._thread.start()

  def _serve(self, requests):
    """Server thread: answers each pull request on `requests` with the newest offer, until close() or its
    sampler is gone."""
    while not self._closing:
      try:
        if not requests.poll(_SERVE_POLL_S):
          continue
        request = requests.recv()
      except (EOFError, OSError):
        return  # the sampler closed its end (exited): next() / publish() report a dead one
      t0 = time.perf_counter()
      with self._offer_lock:
        offer = self._offer
      snap, ver, _ = offer
      payload, answer = ([*snap, ver], None) if not self.delta else self._delta_answer(offer, request[1])
      uuid = request[0] if self.delta else request
      try:
        self._server.await_pull(uuid, payload)
        if answer is not None:
          requests.send(answer)
      except (EOFError, OSError, BrokenPipeError):
        return  # the sampler exited between its request and the answer
      except Exception as e:  # noqa: BLE001 -- re-raised by the next publish() / next()
        self._thread_error = e
        return
      self._offered = payload
      self.offers += 1
      self.offer_s.append(time.perf_counter() - t0)

  def _delta_answer(self, offer, held: int) -> tuple[list, tuple]:
    """(what the pull carries, the answer (kind, version, base, bytes)) for a sampler holding version `held`
    (-1: none): a delta record against it when this side kept that version's host copy (the one answered last)
    and the record is under 3/4 of a full copy, else the full snapshot. The answered version becomes the base."""
    snap, ver, version = offer
    with self._delta_lock:
      new = self._bufs.get(version)
      if new is None:
        new = self._layout.pack({n: np.asarray(x) for n, x in zip(self._layout.spec, jax.device_get(snap))})
      base = self._bufs.get(held) if held >= 0 else None
      limit = int(_DELTA_MAX_FRAC * self._layout.nbytes)
      record = None if base is None else delta_lib.encode(new, base, self._layout.blocks, limit)
      self._bufs = {version: new}
    if record is None:
      self.publish_records.append((version, "full", self._layout.nbytes))
      return [*snap, ver], ("full", version, -1, self._layout.nbytes)
    self.publish_records.append((version, "delta", len(record)))
    payload = jax.device_put(np.frombuffer(record, np.uint8), self._device)
    return [payload, ver], ("delta", version, held, len(record))

  def close(self):
    """After stop() (the server thread) and the sampler's end: the request pipe, the server, the offers."""
    super().close()
    if self._requests is not None:
      self._requests.close()
    self._requests = None
    self._server = self._offer = self._offered = None


def check_transfer_path(cfg, process_count: int):
  """One-line error for async_.publish_path='transfer' on several processes (run_spec checks the config earlier:
  distributed.enabled, in-flight updates)."""
  if process_count > 1:
    raise ValueError(
      f"async_.publish_path='transfer' runs on one learner process (have {process_count}); "
      "set async_.publish_path='shm'."
    )
