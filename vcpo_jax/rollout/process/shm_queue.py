"""Shared-memory queue that carries rollout batches from the sampler process to the learner.

A batch is a dict of numpy arrays whose shapes follow a declared `BatchSchema` (e.g. tokens [N, T] int32 with
T taken from a bucket list) plus a small JSON-able metadata dict. The queue is a ring of `nslots` fixed-size
slots in one `multiprocessing.shared_memory` segment; `put` writes the arrays in place into a free slot (one
memcpy, no pickling of arrays), `get` copies them out (or returns read-only views with `copy=False`). A length L
on a bucketed dimension is padded with the field's `fill` up to the smallest bucket >= L, so the learner only
ever sees a few fixed shapes (one jit compile per bucket).

Contract:
- Synchronization: two counting semaphores from the spawn context, `free` (starts at nslots) and `items`
  (starts at 0), a classic bounded buffer; their post/wait are full memory barriers, so the slot bytes written
  before `items.release()` are visible after `items.acquire()` on any architecture. They can only be handed
  to a child at spawn time (pass the queue as a `Process` argument).
- Liveness: every wait is a loop of short `acquire(timeout=poll)` calls that check the peer between them: the
  producer's pid (registered at its first `put`) and, if given, a `Process` handle (`watch(proc)`); zombies
  count as dead. Completed batches are drained before the error is raised. The producer symmetrically
  detects a dead consumer.
- Ownership: the constructing process (the learner) creates the segment and the named POSIX semaphores and
  unlinks them on `close()`, garbage collection and interpreter exit; children attach without registering
  with the resource tracker. Names carry the run id and the owner's pid and start time (`vcpo_jax.cleanup`
  removes those of owners that are gone). `unlink()` removes every name once the peer has attached, after
  which the queue can no longer be sent to another process (`check_sendable`).
- Heartbeat: `beat()` bumps a counter in the header (the producer's loop); the consumer reads `beats()`.
- Single producer, single consumer, one thread each. Not thread-safe.

Why semaphores rather than a seqlock, the resource tracker's races, and pid reuse: docs/design_notes.md
"rollout/process/shm_queue.py".
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import multiprocessing as mp
import os
import queue as queue_lib
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing import shared_memory, synchronize
from typing import Any

import numpy as np

from vcpo_jax import cleanup
from vcpo_jax.cleanup import pid_alive

SPAWN = mp.get_context("spawn")

_MAGIC = 0x5643504F51554555  # "VCPOQUEU"
_ALIGN = 64  # cache line; also keeps every field aligned for its dtype
_POLL_S = 0.05  # liveness check period while blocked
_HDR_WORDS = 16  # int64 words of the queue header
# Queue header word indices.
_H_MAGIC, _H_NSLOTS, _H_STRIDE, _H_CREATOR, _H_PRODUCER, _H_CONSUMER, _H_FINISHED = range(7)
_H_PUT, _H_GET = 7, 8
_H_BEAT = 9  # the producer's heartbeat counter (beat())


class PeerDiedError(RuntimeError):
  """The process on the other side of a shared-memory channel exited."""


class QueueFinished(EOFError):
  """The producer called `finish()` and every batch it put has been received."""


def _align(n: int) -> int:
  return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# ----------------------------------------------------------------------------
# Segments
# ----------------------------------------------------------------------------


def _destroy_segment(shm: shared_memory.SharedMemory) -> None:
  """Close and unlink a created segment; tolerant of live views and repeats."""
  try:
    shm.close()
  except BufferError:
    pass  # a caller still holds a view; the mapping goes when that view dies
  try:
    shm.unlink()  # also unregisters it from the resource tracker
  except FileNotFoundError:
    pass


class Segment:
  """A POSIX shared-memory segment, either created (and owned) or attached.

  Segment(size, name, create=True) creates `name`; Segment(name=name) attaches. The owner unlinks the segment on `close()`, on garbage collection and at exit.
  An attached segment is never registered with the resource tracker (see the
  module docstring) and only unmaps on `close()`.
  """

  def __init__(self, size: int = 0, name: str | None = None, *, create: bool | None = None):
    self.owner = name is None if create is None else create
    if self.owner:  # name None: multiprocessing picks one (psm_*); owners in this package pass cleanup names
      self._shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
      self.name = self._shm.name
      self.buf = self._shm.buf
      self._finalizer = weakref.finalize(self, _destroy_segment, self._shm)
    elif sys.version_info >= (3, 13):
      self._shm = shared_memory.SharedMemory(name=name, track=False)
      self.name, self.buf = name, self._shm.buf
      self._finalizer = weakref.finalize(self, self._shm.close)
    else:
      import _posixshmem  # CPython's shm_open binding, the one SharedMemory uses

      fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
      try:
        self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
      finally:
        os.close(fd)
      self.name, self.buf = name, memoryview(self._mmap)
      self._finalizer = weakref.finalize(self, _close_mapping, self.buf, self._mmap)

  @property
  def path(self) -> str:
    return os.path.join("/dev/shm", self.name)

  def unlink(self) -> None:
    """The owner removes the name now; every process that has it mapped keeps its mapping (POSIX). No-op
    in an attached copy and when repeated; close() then only unmaps."""
    if self.owner:
      try:
        self._shm.unlink()
      except FileNotFoundError:
        pass

  def close(self) -> None:
    """Unmap; the owner also unlinks. Views into `buf` must be dropped first."""
    self.buf = None
    self._finalizer()


def _close_mapping(buf: memoryview, mm: mmap.mmap) -> None:
  try:
    buf.release()
    mm.close()
  except BufferError:
    pass


class _Named:
  """Mixin: a multiprocessing semaphore / lock created under a name we choose (`cleanup.new_name`).

  multiprocessing names its semaphores '/mp-<random>', which say nothing about their owner; SemLock asks
  `self._make_name()` for the name, so overriding it is enough. Ownership is unchanged: the creator
  registers the name with the resource tracker and unlinks it at garbage collection / exit (or earlier
  with `_unlink_semaphore`); copies sent to spawned children reopen it by name.
  """

  def __init__(self, *args, run: str, kind: str, ctx):
    self._run_kind = (run, kind)
    super().__init__(*args, ctx=ctx)

  def _make_name(self):
    return "/" + cleanup.new_name(*self._run_kind)  # fresh random part on each (rare) retry


class NamedSemaphore(_Named, synchronize.Semaphore):
  pass


class NamedLock(_Named, synchronize.Lock):
  pass


# ----------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Field:
  """One array of a batch.

  shape: ints are fixed sizes; strings name bucketed dimensions ("T").
  fill: padding value written beyond the actual length on bucketed dims.
  """

  dtype: Any
  shape: tuple[int | str, ...]
  fill: float = 0

  def __post_init__(self):
    object.__setattr__(self, "dtype", np.dtype(self.dtype))
    object.__setattr__(self, "shape", tuple(self.shape))
    for d in self.shape:
      if not (isinstance(d, str) or (isinstance(d, (int, np.integer)) and d >= 0)):
        raise ValueError(f"Field.shape entries must be ints >= 0 or dim names, got {d!r}")


@dataclasses.dataclass(frozen=True)
class BatchSchema:
  """Fields of a batch and the bucket sizes of each named (variable) dimension.

  Example: BatchSchema({"tokens": Field("int32", (64, "T"))}, {"T": (256, 512, 1024)}).
  """

  fields: Mapping[str, Field]
  buckets: Mapping[str, Sequence[int]]

  def __post_init__(self):
    if not self.fields:
      raise ValueError("BatchSchema.fields is empty; declare at least one Field")
    fields = {k: v if isinstance(v, Field) else Field(*v) for k, v in self.fields.items()}
    buckets = {}
    for dim, sizes in self.buckets.items():
      sizes = tuple(sorted(int(s) for s in sizes))
      if not sizes or sizes[0] < 1:
        raise ValueError(f"BatchSchema.buckets[{dim!r}] must be a non-empty list of sizes >= 1")
      buckets[dim] = sizes
    for name, f in fields.items():
      for d in f.shape:
        if isinstance(d, str) and d not in buckets:
          raise ValueError(
            f"field {name!r} uses dimension {d!r} which has no entry in BatchSchema.buckets; "
            f"add buckets[{d!r}] = (sizes, ...)"
          )
    object.__setattr__(self, "fields", fields)
    object.__setattr__(self, "buckets", buckets)

  @property
  def dims(self) -> tuple[str, ...]:
    return tuple(self.buckets)

  def shape(self, name: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Concrete shape of field `name` with bucketed dims set from `sizes`."""
    return tuple(sizes[d] if isinstance(d, str) else int(d) for d in self.fields[name].shape)

  def max_nbytes(self, name: str) -> int:
    f = self.fields[name]
    return int(np.prod(self.shape(name, {d: b[-1] for d, b in self.buckets.items()}))) * f.dtype.itemsize

  def bucket_for(self, dim: str, length: int, field: str) -> int:
    for b in self.buckets[dim]:
      if length <= b:
        return b
    raise ValueError(
      f"field {field!r}: dimension {dim!r} has length {length}, larger than the largest "
      f"bucket {self.buckets[dim][-1]}; add a bucket to BatchSchema.buckets[{dim!r}] "
      f"or truncate the batch"
    )

  def validate(self, arrays: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Check names, dtypes and fixed dims; return (numpy arrays, actual size per bucketed dim)."""
    missing = set(self.fields) - set(arrays)
    extra = set(arrays) - set(self.fields)
    if missing or extra:
      raise ValueError(
        f"batch fields do not match the schema: missing {sorted(missing)}, unexpected "
        f"{sorted(extra)}; declare them in BatchSchema.fields or fix the batch"
      )
    out, sizes = {}, {}
    for name, f in self.fields.items():
      a = np.asarray(arrays[name])
      if a.dtype != f.dtype:
        raise ValueError(
          f"field {name!r} has dtype {a.dtype}, the schema says {f.dtype}; cast it with .astype(np.{f.dtype.name})"
        )
      if a.ndim != len(f.shape):
        raise ValueError(f"field {name!r} has shape {a.shape}, the schema says {f.shape}")
      for axis, (n, d) in enumerate(zip(a.shape, f.shape)):
        if isinstance(d, str):
          if sizes.setdefault(d, n) != n:
            raise ValueError(
              f"field {name!r} axis {axis} ({d}) has length {n} but another field "
              f"has {d} = {sizes[d]}; every field must agree on {d}"
            )
        elif n != d:
          raise ValueError(f"field {name!r} has shape {a.shape}, the schema fixes axis {axis} to {d}")
      out[name] = a
    return out, sizes


@dataclasses.dataclass
class Item:
  """One received batch.

  arrays: padded to the bucket shapes (`buckets`); `sizes` are the actual lengths.
  """

  arrays: dict[str, np.ndarray]
  meta: dict
  sizes: dict[str, int]
  buckets: dict[str, int]
  seq: int


# ----------------------------------------------------------------------------
# The queue
# ----------------------------------------------------------------------------


def _unlink_semaphore(sem) -> None:
  """Runs, now and once, multiprocessing's unlink finalizer of a semaphore this process created.

  `SemLock` registers `util.Finalize(sem, SemLock._cleanup, (name,))` in its creator: sem_unlink plus
  resource-tracker unregistration. Calling that Finalize removes it from the registry, so neither garbage
  collection nor interpreter exit unlinks the name a second time. Copies in other processes have no
  finalizer (nothing happens); open handles, e.g. a worker's, stay valid after the unlink (POSIX).
  """
  from multiprocessing import util

  if sem is None:
    return
  for fin in list(util._finalizer_registry.values()):
    ref = getattr(fin, "_weakref", None)
    if ref is not None and ref() is sem:
      fin()
      return


def check_sendable(owner) -> None:
  """Raises ValueError if a segment owner (ShmQueue, ParamSlot) cannot be pickled to another process: it is
  closed (no segment) or its names are unlinked (a spawned child could not attach them)."""
  kind = type(owner).__name__
  if owner._seg is None:
    raise ValueError(f"cannot send a closed {kind} to another process")
  if owner._unlinked:
    raise ValueError(f"cannot send an unlinked {kind} to another process: its names are gone")


class ShmQueue:
  """Bounded SPSC FIFO of schema-shaped batches in shared memory.

  Create it in the owning process (the learner) and pass it to a spawned worker
  as a `Process` argument; the worker's copy attaches to the same segment.

  Args:
    schema: field dtypes/shapes and bucket sizes; slots are sized for the largest buckets.
    nslots: capacity in batches; `put` blocks (back-pressure) when all are full.
    meta_bytes: room for the JSON-encoded metadata of one batch.
    ctx: multiprocessing context whose semaphores are used (must be spawn or forkserver
      for jax processes).
    run: the run id stamped into the names of the segment and semaphores with this process's pid
      (`cleanup.new_name`; default: a random id), so `vcpo_jax.cleanup` can tell whose they are.
  """

  def __init__(
    self, schema: BatchSchema, nslots: int = 4, meta_bytes: int = 1 << 16, *, ctx=None, run: str | None = None
  ):
    if nslots < 1:
      raise ValueError(f"nslots must be >= 1, got {nslots}")
    if meta_bytes < 2:
      raise ValueError(f"meta_bytes must be >= 2 (room for '{{}}'), got {meta_bytes}")
    ctx = ctx or SPAWN
    self._init_layout(schema, nslots, meta_bytes)
    run = run or cleanup.run_id()
    self._seg = Segment(_HDR_WORDS * 8 + nslots * self._stride, cleanup.new_name(run, "q"), create=True)
    self._free = NamedSemaphore(nslots, run=run, kind="qf", ctx=ctx)
    self._items = NamedSemaphore(0, run=run, kind="qi", ctx=ctx)
    self._map()
    self._hdr[:] = 0
    self._hdr[[_H_MAGIC, _H_NSLOTS, _H_STRIDE, _H_CREATOR]] = [_MAGIC, nslots, self._stride, os.getpid()]

  def _init_layout(self, schema, nslots, meta_bytes):
    self.schema, self.nslots, self.meta_bytes = schema, nslots, meta_bytes
    # Slot: [seq, meta_len, (bucket, size) per dim] words, meta bytes, then fields.
    self._slot_words = 2 + 2 * len(schema.dims)
    off = _align(self._slot_words * 8)
    self._meta_off = off
    off = _align(off + meta_bytes)
    self._field_off = {}
    for name in schema.fields:
      self._field_off[name] = off
      off = _align(off + schema.max_nbytes(name))
    self._stride = off
    self._watch: list = []
    self._held: int | None = None
    self._unlinked = False
    self._role_pid_set = {"producer": False, "consumer": False}

  def _map(self):
    self._hdr = np.ndarray((_HDR_WORDS,), np.int64, buffer=self._seg.buf)
    base = _HDR_WORDS * 8
    self._slot_hdr = [
      np.ndarray((self._slot_words,), np.int64, buffer=self._seg.buf, offset=base + i * self._stride)
      for i in range(self.nslots)
    ]
    self._base = base

  # Spawned children receive the semaphores by inheritance and attach the segment.
  def __getstate__(self):
    check_sendable(self)
    return {
      "schema": self.schema,
      "nslots": self.nslots,
      "meta_bytes": self.meta_bytes,
      "name": self._seg.name,
      "free": self._free,
      "items": self._items,
    }

  def __setstate__(self, s):
    self._init_layout(s["schema"], s["nslots"], s["meta_bytes"])
    self._free, self._items = s["free"], s["items"]
    self._seg = Segment(name=s["name"])
    self._map()
    if self._hdr[_H_MAGIC] != _MAGIC or self._hdr[_H_STRIDE] != self._stride:
      raise RuntimeError(f"shared-memory segment {s['name']} is not a matching ShmQueue")

  # ------------------------------------------------------------------ helpers

  @property
  def name(self) -> str:
    return self._seg.name

  def resource_paths(self) -> list[str]:
    """/dev/shm paths of the segment and semaphores (Linux), for leak checks."""
    sems = [getattr(s._semlock, "name", None) for s in (self._free, self._items)]
    return [self._seg.path] + [os.path.join("/dev/shm", "sem." + n.lstrip("/")) for n in sems if n]

  def unlink(self):
    """Removes the segment's and both semaphores' names from /dev/shm now (the creating process; a no-op in a
    copy). Both sides keep using what they hold open; call it once the peer has attached."""
    if self._seg is None:
      return
    self._unlinked = True
    self._seg.unlink()
    for sem in (self._free, self._items):
      _unlink_semaphore(sem)

  def beat(self):
    """Producer: one heartbeat (a counter in the shared header; a single aligned int64 store)."""
    self._hdr[_H_BEAT] += 1

  def beats(self) -> int:
    """The producer's heartbeat count so far."""
    self._check_open()
    return int(self._hdr[_H_BEAT])

  def watch(self, *processes) -> ShmQueue:
    """Treat the exit of any of these `multiprocessing.Process` handles as peer death."""
    self._watch.extend(processes)
    return self

  def qsize(self) -> int:
    """Batches put and not yet taken (approximate while the peer runs)."""
    self._check_open()
    return int(self._hdr[_H_PUT] - self._hdr[_H_GET])

  def _check_open(self):
    if self._seg is None:
      raise ValueError("ShmQueue is closed")

  def _claim(self, role: str, word: int):
    """Register this process as the single producer / consumer."""
    if self._role_pid_set[role]:
      return
    me, other = os.getpid(), int(self._hdr[word])
    if other not in (0, me) and pid_alive(other):
      raise ValueError(f"ShmQueue is single-{role}: process {other} is already its {role}")
    self._hdr[word] = me
    self._role_pid_set[role] = True

  def _peer_gone(self, peer_word: int) -> str | None:
    """A message if the peer is known to be dead, else None."""
    for p in self._watch:
      if p.exitcode is not None:
        return f"process {p.name} (pid {p.pid}) exited with code {p.exitcode}"
    pid = int(self._hdr[peer_word])
    if pid == 0:
      creator = int(self._hdr[_H_CREATOR])
      pid = creator if creator != os.getpid() else 0
    if pid and not pid_alive(pid):
      return f"process {pid} is no longer running"
    return None

  def _wait(self, sem, timeout, peer_word, what, empty_exc):
    """Acquire `sem`, checking peer liveness (and `finish`) every poll period."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      wait = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
      if sem.acquire(timeout=wait):
        return
      finished = peer_word == _H_PRODUCER and self._hdr[_H_FINISHED]
      gone = None if finished else self._peer_gone(peer_word)
      if finished or gone:
        if sem.acquire(block=False):  # a batch completed just before: deliver it
          return
        if finished:
          raise QueueFinished(f"the producer finished; all {int(self._hdr[_H_GET])} batches received")
        raise PeerDiedError(
          f"{what}: the peer {gone}. Its traceback (if any) is in its own log; "
          f"{int(self._hdr[_H_GET])} batches had been received."
        )
      if deadline is not None and time.monotonic() >= deadline:
        raise empty_exc(f"{what}: timed out after {timeout} s")

  def _field_view(self, slot: int, name: str, shape) -> np.ndarray:
    off = self._base + slot * self._stride + self._field_off[name]
    return np.ndarray(shape, self.schema.fields[name].dtype, buffer=self._seg.buf, offset=off)

  # ------------------------------------------------------------------ producer

  def put(self, arrays: Mapping[str, Any], meta: Mapping | None = None, timeout: float | None = None):
    """Write one batch into the next slot; blocks while the queue is full.

    Raises:
      ValueError: the batch does not fit the schema or `meta` is not small JSON.
      queue.Full: no slot freed within `timeout` seconds.
      PeerDiedError: the consumer exited while we waited.
    """
    self._check_open()
    arrays, sizes = self.schema.validate(arrays)
    buckets = {
      d: self.schema.bucket_for(d, n, next(k for k, f in self.schema.fields.items() if d in f.shape))
      for d, n in sizes.items()
    }
    for d in self.schema.dims:  # dims no field uses are impossible (schema checks), but be safe
      buckets.setdefault(d, self.schema.buckets[d][0])
      sizes.setdefault(d, buckets[d])
    try:
      meta_b = json.dumps(dict(meta or {}), separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
      raise ValueError(f"meta must be a JSON-serializable dict of small values: {e}") from None
    if len(meta_b) > self.meta_bytes:
      raise ValueError(
        f"meta is {len(meta_b)} bytes once JSON-encoded, more than meta_bytes="
        f"{self.meta_bytes}; raise ShmQueue(meta_bytes=...) or send less metadata"
      )
    self._claim("producer", _H_PRODUCER)
    self._wait(self._free, timeout, _H_CONSUMER, "ShmQueue.put", queue_lib.Full)

    seq = int(self._hdr[_H_PUT])
    slot = seq % self.nslots
    for name, a in arrays.items():
      shape = self.schema.shape(name, buckets)
      dst = self._field_view(slot, name, shape)
      if a.shape == shape:
        np.copyto(dst, a)
      else:
        dst[tuple(slice(0, n) for n in a.shape)] = a
        fill = self.schema.fields[name].fill
        for axis, (n, b) in enumerate(zip(a.shape, shape)):
          if n < b:  # pad only the tail region of each bucketed axis
            dst[(slice(None),) * axis + (slice(n, None),)] = fill
    off = self._base + slot * self._stride + self._meta_off
    self._seg.buf[off : off + len(meta_b)] = meta_b
    words = [seq, len(meta_b)]
    for d in self.schema.dims:
      words += [buckets[d], sizes[d]]
    self._slot_hdr[slot][:] = words
    self._hdr[_H_PUT] = seq + 1
    self._items.release()  # barrier: everything above is visible to the consumer

  def finish(self):
    """Producer side: no more batches. The consumer's `get` raises QueueFinished once drained."""
    self._check_open()
    self._hdr[_H_FINISHED] = 1

  # ------------------------------------------------------------------ consumer

  def get(self, timeout: float | None = None, copy: bool = True, out: Mapping[str, np.ndarray] | None = None) -> Item:
    """Take the oldest batch.

    Args:
      timeout: seconds to wait for a batch (None: forever, still checking liveness).
      copy: True returns fresh arrays and frees the slot at once. False returns
        read-only views into the slot, valid until the next `get`/`release`/`close`
        (zero-copy). Caution: on the CPU backend `jax.device_put` of such a view
        aliases the shared memory (no copy), so a jax array made from it changes
        when the producer reuses the slot; keep the slot (no `get`/`release`)
        until the step using it has finished (`jax.block_until_ready`), or use
        `out=` / `copy=True`.
      out: arrays to copy into instead of allocating (their shapes must be the
        bucket shapes of this batch); frees the slot at once.

    Raises:
      queue.Empty: nothing arrived within `timeout`.
      PeerDiedError: the producer exited and every completed batch has been taken.
      QueueFinished: the producer called `finish()` and everything has been taken.
    """
    self._check_open()
    self.release()
    self._claim("consumer", _H_CONSUMER)
    self._wait(self._items, timeout, _H_PRODUCER, "ShmQueue.get", queue_lib.Empty)

    seq = int(self._hdr[_H_GET])
    slot = seq % self.nslots
    words = self._slot_hdr[slot].tolist()
    if words[0] != seq:
      raise RuntimeError(
        f"ShmQueue slot {slot} holds batch {words[0]}, expected {seq}: "
        f"more than one producer or consumer is using this queue"
      )
    off = self._base + slot * self._stride + self._meta_off
    meta = json.loads(bytes(self._seg.buf[off : off + words[1]]))
    buckets = {d: words[2 + 2 * i] for i, d in enumerate(self.schema.dims)}
    sizes = {d: words[3 + 2 * i] for i, d in enumerate(self.schema.dims)}
    arrays = {}
    for name in self.schema.fields:
      view = self._field_view(slot, name, self.schema.shape(name, buckets))
      if out is not None:
        dst = out[name]
        if dst.shape != view.shape or dst.dtype != view.dtype:
          raise ValueError(f"out[{name!r}] is {dst.dtype}{dst.shape}, this batch needs {view.dtype}{view.shape}")
        np.copyto(dst, view)
        arrays[name] = dst
      elif copy:
        arrays[name] = view.copy()
      else:
        view.flags.writeable = False
        arrays[name] = view
    self._hdr[_H_GET] = seq + 1
    self._held = slot
    if copy or out is not None:
      self.release()
    return Item(arrays, meta, sizes, buckets, seq)

  def release(self):
    """Return the slot held by a `get(copy=False)` to the producer (its views go stale)."""
    if self._held is not None:
      self._held = None
      self._free.release()

  # ------------------------------------------------------------------ lifetime

  def close(self):
    """Unmap; the creating process also unlinks the segment. Idempotent."""
    if getattr(self, "_seg", None) is None:
      return
    self._hdr = self._slot_hdr = None
    self._held = None
    seg, self._seg = self._seg, None
    seg.close()
    # Unlink the named semaphores now, not when the last reference goes: a
    # traceback frame (or any stray reference) would otherwise keep them in
    # /dev/shm after close(). Only the creating process holds the unlink hook.
    free, items, self._free, self._items = self._free, self._items, None, None
    for sem in (free, items):
      _unlink_semaphore(sem)
    self._watch = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
