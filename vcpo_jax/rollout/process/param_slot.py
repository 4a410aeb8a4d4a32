"""Shared-memory parameter slot: the learner publishes weights + a version, samplers read the latest.

Layout: one segment holding a header and `nbuf` buffers (2 by default, 1 for one parameter copy in shared
memory), each with every array of a fixed schema (e.g. one flat float32 / bfloat16 vector, or a dict of arrays).

Consistency (double buffer + per-buffer seqlock, header under a lock):
  writer: b = the buffer not published last
          seq[b] += 1                       (odd: being written)
          copy the arrays into buffer b
          seq[b] += 1; version[b] = v; latest = b      (even: complete)
  reader: (v, b, s1) = (version[latest], latest, seq[b]); copy buffer b;
          s2 = seq[b]; accept iff s1 == s2, else retry.
A reader is only disturbed when the writer laps it (two publishes during one copy), so it never sees torn data.

One buffer (nbuf=1) adds reader exclusion to the seqlock:
  reader: under the lock, wait while seq is odd (a write in progress), then record reading = its pid; copy;
          under the lock clear reading and accept iff seq did not change.
  writer: under the lock, wait while reading names a live process (a dead reader's mark is cleared), then
          seq += 1 (odd), write, seq += 1.
So a write waits for at most one reader's copy and readers wait for the write in progress; one reader at a
time. The header words are read and written under a spawn-context Lock, never held during a copy; its
acquire/release are full memory barriers, so the seqlock is correct on weakly ordered CPUs too.

Ownership and cleanup are those of `shm_queue.Segment` (the creating process unlinks the segment and the lock;
names carry the run id and owner pid). Pass the slot to spawned samplers as a `Process` argument; `unlink()`
removes both names once they have attached. Waits take the lock in short slices, calling an optional `poll()`
between them (which may raise to abandon the wait).

Checksum (`checksum`, 64 bits, position-weighted sums of uint64 words): publish() computes it over what it
wrote (`last_checksum`), latest() over what it copied out (`checksum_of`), each fused into its copy block by
block while the block is in cache (not a second pass over memory).

Single writer; any number of readers (one with delta publishing: the header holds one reader's version).
Why one buffer is AsyncSource's default: docs/design_notes.md "rollout/process/param_slot.py".
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from vcpo_jax import cleanup
from vcpo_jax.rollout.process import delta as delta_lib
from vcpo_jax.rollout.process.shm_queue import (
  SPAWN,
  NamedLock,
  PeerDiedError,
  Segment,
  _align,
  _unlink_semaphore,
  check_sendable,
  pid_alive,
)

_MAGIC = 0x5643504F50415241  # "VCPOPARA"
_HDR_WORDS = 16
# Header word indices: latest version, latest buffer, writer pid, creator pid, seq[2], version[2], reader
# pid copying now (nbuf=1), nbuf.
_H_MAGIC, _H_VERSION, _H_LATEST, _H_WRITER, _H_CREATOR = range(5)
_H_SEQ, _H_BUFVER, _H_READING, _H_NBUF = 5, 7, 9, 10
# Delta publishing (nbuf=1): what the buffer holds (0 full, 1 a delta record), the record's base version and
# length, and the version the reader holds (-1: none; written by the reader when it accepts a copy).
_H_KIND, _H_BASE, _H_LEN, _H_HELD = 11, 12, 13, 14
_POLL_S = 0.002  # versions change once per learner step; a short sleep poll is cheap
_LOCK_TIMEOUT_S = 10.0
_LOCK_SLICE_S = 0.1  # lock-wait slice: `poll` runs between slices


# The checksum, of one buffer of the slot's layout (`_layout`: the arrays in order, each at the next multiple of
# 64 bytes, zero padding): its bytes as little-endian uint64 words w_p, p = 0, 1, ...,
#     checksum = sum_p (2 * (p // _ROW_WORDS) + 1) * w_p  mod 2^64.
# Integer arithmetic with wraparound: exact, whatever the order of the additions (numpy's SIMD lanes, the block
# loop). Every weight is odd, hence invertible mod 2^64: ANY change confined to one word (a flipped bit or byte)
# changes it; a torn write or another version's buffer changes the sums of the rows it covers. The weight steps
# every 4 KiB row, so it is position-dependent at row granularity (rows, or arrays, that trade places are caught;
# words that trade places inside one row are not): a per-word weight would cost a multiply pass, about twice the
# copy at 50M parameters, where row sums ride on the copy. ParamSlot walks its buffer in 2 MiB blocks: publish()
# copies the arrays' pieces of a block into the slot and sums the block while it is in cache, latest() sums a
# block of the slot and then copies its pieces out (benchmarks/README.md "Parameter publishing" has the costs).
_ROW_WORDS = 512  # 4 KiB rows
_BLOCK_BYTES = 1 << 21  # one copy + sum block: in cache between the two
_DELTA_MAX_FRAC = 0.75  # a delta record longer than this fraction of a full copy is sent as the full copy


def _layout(spec: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[dict[str, int], int]:
  """({name: byte offset in one buffer}, bytes of one buffer): each array at the next multiple of _ALIGN."""
  offsets, off = {}, 0
  for name, (shape, dtype) in spec.items():
    offsets[name] = off
    off = _align(off + int(np.prod(shape)) * dtype.itemsize)
  return offsets, off


def _sum_rows(words: np.ndarray, rows: np.ndarray, w0: int):
  """rows[r] += the sum of the words at buffer word positions w0, w0 + 1, ... that lie in row r (w0: a row start)."""
  r0, full = w0 // _ROW_WORDS, words.size // _ROW_WORDS
  if full:
    rows[r0 : r0 + full] += np.add.reduce(words[: full * _ROW_WORDS].reshape(full, _ROW_WORDS), axis=1)
  if words.size > full * _ROW_WORDS:
    rows[r0 + full] += np.add.reduce(words[full * _ROW_WORDS :])


def _copy_sum(buf: np.ndarray, offsets: Mapping[str, int], arrays: Mapping[str, np.ndarray], into_buf: bool) -> int:
  """The checksum of `buf` (one buffer's bytes, uint8, a multiple of 8 long) while copying the arrays' bytes into it
  (into_buf: each block is summed after its pieces are copied in) or out of it (each block is summed, then its
  pieces are copied out). arrays: {name: C-contiguous array of the spec's shape and dtype}, in layout order."""
  rows = np.zeros(-(-buf.size // (8 * _ROW_WORDS)), np.uint64)
  pieces = [(offsets[n], a.reshape(-1).view(np.uint8)) for n, a in arrays.items()]
  i = 0  # the next piece
  for lo in range(0, buf.size, _BLOCK_BYTES):
    hi = min(lo + _BLOCK_BYTES, buf.size)
    if not into_buf:
      _sum_rows(buf[lo:hi].view(np.uint64), rows, lo // 8)
    while i < len(pieces) and pieces[i][0] < hi:  # the pieces of [lo, hi)
      off, b = pieces[i]
      a0, a1 = max(lo, off) - off, min(hi, off + b.size) - off
      if a1 > a0:
        if into_buf:
          np.copyto(buf[off + a0 : off + a1], b[a0:a1])
        else:
          np.copyto(b[a0:a1], buf[off + a0 : off + a1])
      if off + b.size > hi:
        break  # it continues in the next block
      i += 1
    if into_buf:
      _sum_rows(buf[lo:hi].view(np.uint64), rows, lo // 8)
  return int(np.add.reduce(rows * (2 * np.arange(rows.size, dtype=np.uint64) + 1))) if rows.size else 0


def checksum(arrays: Mapping[str, Any], names=None) -> int:
  """The 64-bit checksum above of the arrays laid out as in a ParamSlot, in `names` order (default: the
  mapping's). The slot computes the same during its copies (`ParamSlot.publish`: `last_checksum`; `latest`:
  `checksum_of`), so the learner records it per published version and the sampler echoes it of what it read."""
  names = list(names if names is not None else arrays)
  arrs = {n: np.ascontiguousarray(arrays[n]) for n in names}
  offsets, nbytes = _layout({n: (a.shape, a.dtype) for n, a in arrs.items()})
  return _copy_sum(np.zeros(nbytes, np.uint8), offsets, arrs, into_buf=True)


def _normalize_spec(spec: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{name: array | ShapeDtypeStruct | (shape, dtype)} -> {name: (shape, dtype)}."""
  if not spec:
    raise ValueError("ParamSlot spec is empty; give {name: (shape, dtype)} for every array")
  out = {}
  for name, s in spec.items():
    shape, dtype = (s.shape, s.dtype) if hasattr(s, "shape") else s
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
      raise ValueError(f"ParamSlot spec[{name!r}] has a negative dimension: {shape}")
    out[name] = (shape, np.dtype(dtype))
  return out


class ParamSlot:
  """Latest-value channel for parameter arrays with a monotone version counter.

  Args:
    spec: {name: (shape, dtype)} or {name: array-like with .shape/.dtype}; fixed.
    ctx: multiprocessing context for the lock (spawn by default).
    run: the run id stamped into the segment's and the lock's names (default: a random id).
    nbuf: 2 (double buffer: writes never wait) or 1 (one copy: a write waits for the reader's copy).
    checksum: compute `checksum` during every copy (publish: `last_checksum`; latest: `checksum_of`); False:
      plain copies, and both are None.
    delta: publish a delta record (process/delta.py) against the version the reader holds when the writer
      keeps that version's host copy, else the full copy (see "Delta publishing" below); needs nbuf=1.

  Delta publishing (delta=True). The writer keeps host copies of two versions in the slot's layout: the last
  one it published and the one the reader held at that publish (2 buffers of `nbytes`); the reader keeps the
  one it holds (1 buffer). A publish reads the reader's version from the header (under the lock, while no copy
  is in progress: with one buffer no read can start or end during the write), and writes a record against it
  when it holds that version's copy and the record is at most _DELTA_MAX_FRAC of a full copy, else the full
  copy: a fresh reader (a replacement sampler, a resumed run: new slots) gets a full one, and a reader that
  skipped versions gets a delta against the one it holds. The checksum is the same as a full publish's: the
  writer's of the version's own buffer, the reader's of the buffer it rebuilt. `last_publish` says what the
  last publish wrote ({"kind": "full" | "delta", "bytes", "base"}; without delta, always "full"); latest() in
  the writer's process returns its own copy of the last version (what a replacement sampler starts from).
  """

  def __init__(
    self,
    spec: Mapping[str, Any],
    *,
    ctx=None,
    run: str | None = None,
    nbuf: int = 2,
    checksum: bool = True,
    delta: bool = False,
  ):
    if nbuf not in (1, 2):
      raise ValueError(f"ParamSlot(nbuf={nbuf}): use 2 (double buffer) or 1 (one parameter copy).")
    if delta and nbuf != 1:
      raise ValueError("ParamSlot(delta=True) needs nbuf=1 (the writer must know the version the reader holds).")
    self._init_layout(_normalize_spec(spec), nbuf, checksum, delta)
    run = run or cleanup.run_id()
    self._seg = Segment(_HDR_WORDS * 8 + nbuf * self._buf_nbytes, cleanup.new_name(run, "p"), create=True)
    self._lock = NamedLock(run=run, kind="pl", ctx=ctx or SPAWN)
    self._map()
    self._hdr[:] = 0
    self._hdr[[_H_MAGIC, _H_VERSION, _H_LATEST, _H_CREATOR, _H_NBUF]] = [_MAGIC, -1, -1, os.getpid(), nbuf]
    self._hdr[[_H_BASE, _H_HELD]] = -1

  def _init_layout(self, spec, nbuf, checksum, delta=False):
    self.spec, self.nbuf, self.checksums, self.delta = spec, nbuf, bool(checksum), bool(delta)
    # Delta publishing: the writer's (version, layout buffer) of its last publish and of the reader's version
    # then; the reader's of the version it holds; the last publish's kind and bytes.
    self._last = self._acked = self._held = None
    self.last_publish: dict | None = None
    self.last_checksum: int | None = None  # `checksum` of what this process's last publish() wrote
    self._last_read = None  # (checksum, arrays) of this process's last latest()
    self._unlinked = False
    self._offsets, self._buf_nbytes = _layout(spec)
    self._blocks = delta_lib.blocks(spec, self._offsets, self._buf_nbytes) if delta else None

  def _map(self):
    self._hdr = np.ndarray((_HDR_WORDS,), np.int64, buffer=self._seg.buf)
    self._views = [
      {
        name: np.ndarray(
          shape, dtype, buffer=self._seg.buf, offset=_HDR_WORDS * 8 + b * self._buf_nbytes + self._offsets[name]
        )
        for name, (shape, dtype) in self.spec.items()
      }
      for b in range(self.nbuf)
    ]
    base = _HDR_WORDS * 8
    self._bufs = [  # each buffer's bytes, for the checksum's block walk
      np.ndarray((self._buf_nbytes,), np.uint8, buffer=self._seg.buf, offset=base + b * self._buf_nbytes)
      for b in range(self.nbuf)
    ]

  def __getstate__(self):
    check_sendable(self)
    return {
      "spec": self.spec,
      "nbuf": self.nbuf,
      "checksum": self.checksums,
      "delta": self.delta,
      "name": self._seg.name,
      "lock": self._lock,
    }

  def __setstate__(self, s):
    self._init_layout(s["spec"], s["nbuf"], s["checksum"], s["delta"])
    self._lock = s["lock"]
    self._seg = Segment(name=s["name"])
    self._map()
    if self._hdr[_H_MAGIC] != _MAGIC:
      raise RuntimeError(f"shared-memory segment {s['name']} is not a ParamSlot")

  @property
  def name(self) -> str:
    return self._seg.name

  @property
  def nbytes(self) -> int:
    """Bytes of one parameter copy (the segment holds `nbuf`)."""
    return self._buf_nbytes

  def unlink(self):
    """Removes the segment's and the lock's names from /dev/shm now (the creating process; a no-op in a copy).
    Both sides keep using what they hold open; call it once every reader has attached."""
    if self._seg is None:
      return
    self._unlinked = True
    self._seg.unlink()
    _unlink_semaphore(self._lock)

  def resource_paths(self) -> list[str]:
    """/dev/shm paths of the segment and the lock's semaphore (Linux), for leak checks."""
    n = getattr(self._lock._semlock, "name", None)
    return [self._seg.path] + ([os.path.join("/dev/shm", "sem." + n.lstrip("/"))] if n else [])

  @contextlib.contextmanager
  def _locked(self, poll=None):
    """Hold the header lock; a timeout means its holder died (or stopped) inside the critical section."""
    self._check_open()
    deadline = time.monotonic() + _LOCK_TIMEOUT_S
    while not self._lock.acquire(timeout=_LOCK_SLICE_S):
      if poll is not None:
        poll()
      if time.monotonic() >= deadline:
        raise PeerDiedError(
          f"ParamSlot header lock not released within {_LOCK_TIMEOUT_S} s: a process died (or was stopped) "
          "while holding it"
        )
    try:
      yield
    finally:
      self._lock.release()

  def _check_open(self):
    if self._seg is None:
      raise ValueError("ParamSlot is closed")

  def version(self) -> int:
    """Latest published version, -1 before the first publish."""
    with self._locked():
      return int(self._hdr[_H_VERSION])

  def publish(self, arrays: Mapping[str, Any], version: int | None = None, poll=None) -> int:
    """Write a new parameter version (default: previous + 1) and return it.

    `poll()` runs while the lock is busy (see the module docstring); whatever it raises propagates.
    Raises ValueError if the arrays do not match the spec or `version` is not
    larger than the last published one (versions are monotone).
    """
    self._check_open()
    if set(arrays) != set(self.spec):
      raise ValueError(f"ParamSlot.publish: got arrays {sorted(arrays)}, the spec has {sorted(self.spec)}")
    checked = {}
    for name, (shape, dtype) in self.spec.items():
      a = np.asarray(arrays[name])
      if a.shape != shape or a.dtype != dtype:
        raise ValueError(
          f"ParamSlot.publish: {name!r} is {a.dtype}{a.shape}, the spec says "
          f"{dtype}{shape}; cast/reshape it before publishing"
        )
      checked[name] = a
    while True:
      with self._locked(poll):
        me, writer = os.getpid(), int(self._hdr[_H_WRITER])
        if writer not in (0, me) and pid_alive(writer):
          raise ValueError(f"ParamSlot has a single writer and process {writer} is it")
        reader = int(self._hdr[_H_READING])
        if self.nbuf == 1 and reader and pid_alive(reader):
          busy = True  # one buffer: wait until the reader's copy is done
        else:
          busy = False
          self._hdr[_H_READING] = 0  # a dead reader's mark
          self._hdr[_H_WRITER] = me
          last = int(self._hdr[_H_VERSION])
          version = last + 1 if version is None else int(version)
          if version <= last:
            raise ValueError(f"ParamSlot.publish: version {version} must exceed the last published version {last}")
          b = 0 if self.nbuf == 1 or self._hdr[_H_LATEST] != 0 else 1
          held = int(self._hdr[_H_HELD])  # delta: the reader's version; no read starts or ends until this write does
          self._hdr[_H_SEQ + b] += 1  # odd: readers of buffer b will retry (nbuf=1: wait)
      if not busy:
        break
      if poll is not None:
        poll()
      time.sleep(_POLL_S)
    csum = None
    if self.delta:
      csum, record = self._write_delta(checked, version, held)
    elif self.checksums:  # copied and summed block by block
      src = {n: np.ascontiguousarray(checked[n]) for n in self.spec}  # layout order
      csum = _copy_sum(self._bufs[b], self._offsets, src, into_buf=True)
    else:
      for name, a in checked.items():
        np.copyto(self._views[b][name], a)
    with self._locked(poll):
      self._hdr[_H_SEQ + b] += 1
      self._hdr[_H_BUFVER + b] = version
      self._hdr[_H_LATEST] = b
      self._hdr[_H_VERSION] = version
      if self.delta:  # what buffer 0 holds now
        self._hdr[[_H_KIND, _H_BASE, _H_LEN]] = record
    self.last_checksum = csum
    if not self.delta:
      self.last_publish = {"kind": "full", "bytes": self._buf_nbytes, "base": -1}
    return version

  def _write_delta(self, checked: Mapping[str, np.ndarray], version: int, held: int) -> tuple[int | None, list]:
    """Delta publishing: the version's own layout buffer (checksummed during that copy, as a full publish's),
    then a delta record against the reader's version `held` into buffer 0 when this writer holds it and the
    record is short enough, else the full buffer. Returns (checksum, [kind, base, length] for the header)."""
    new = np.zeros(self._buf_nbytes, np.uint8)  # zero padding, as the slot's buffers
    csum = _copy_sum(new, self._offsets, {n: np.ascontiguousarray(checked[n]) for n in self.spec}, into_buf=True)
    base = dict(x for x in (self._acked, self._last) if x is not None).get(held)
    limit = int(_DELTA_MAX_FRAC * self._buf_nbytes)
    record = None if base is None else delta_lib.encode(new, base, self._blocks, limit)
    buf = self._bufs[0]
    if record is None:
      np.copyto(buf, new)
      head = [0, -1, self._buf_nbytes]
    else:
      buf[: len(record)] = np.frombuffer(record, np.uint8)
      head = [1, held, len(record)]
    self._acked = (held, base) if base is not None else None  # the reader still holds `held`
    self._last = (version, new)
    self.last_publish = {"kind": ("full", "delta")[head[0]], "bytes": head[2], "base": head[1]}
    return (csum if self.checksums else None), head

  def _read_delta(self, kind: int, base: int, length: int, flat: Mapping[str, np.ndarray]) -> tuple:
    """Delta publishing, the reader: buffer 0 (a full copy, or a record against the version this reader holds)
    -> a fresh layout buffer of the version -> `flat` (checksummed during that copy). Returns (buffer, checksum)."""
    src = self._bufs[0]
    if kind == 0:
      new = src.copy()
    else:
      if self._held is None or self._held[0] != base:
        raise RuntimeError(
          f"ParamSlot: a delta record against version {base}, but this reader holds "
          f"{None if self._held is None else self._held[0]} (the slot's protocol broke)"
        )
      new = delta_lib.decode(src[:length], self._held[1], np.empty(self._buf_nbytes, np.uint8), self._blocks)
    return new, _copy_sum(new, self._offsets, flat, into_buf=False)

  def newest(self) -> tuple[int, dict[str, np.ndarray]]:
    """Delta publishing, the writer: (version, {name: array copy}) of its last publish, from its own copy."""
    version, buf = self._last
    out = {n: np.empty(s, d) for n, (s, d) in self.spec.items()}
    _copy_sum(buf, self._offsets, out, into_buf=False)
    return version, out

  def latest(
    self,
    min_version: int | None = None,
    timeout: float | None = None,
    out: Mapping[str, np.ndarray] | None = None,
    poll=None,
  ) -> tuple[int, dict[str, np.ndarray]]:
    """Copy of the newest parameters once their version is >= `min_version`.

    Args:
      min_version: wait until at least this version is published (None: any, i.e. >= 0).
      timeout: seconds to wait (None: forever, still checking that the writer lives).
      out: arrays to copy into instead of allocating.
      poll: called while the lock is busy (bound the version wait with `timeout`); what it raises propagates.

    Returns:
      (version, {name: array}); the arrays are untorn copies of that version.

    Raises:
      TimeoutError: the version did not arrive in time.
      PeerDiedError: the writer (or, before any publish, the creator) exited.
    """
    need = 0 if min_version is None else int(min_version)
    if self.delta and self._last is not None:  # the writer: its own copy (the buffer may hold a delta record)
      return self.newest()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      writing = False
      with self._locked(poll):
        v = int(self._hdr[_H_VERSION])
        b = int(self._hdr[_H_LATEST])
        s1 = int(self._hdr[_H_SEQ + b]) if b >= 0 else -1
        record = [int(x) for x in self._hdr[[_H_KIND, _H_BASE, _H_LEN]]]
        writer = int(self._hdr[_H_WRITER]) or int(self._hdr[_H_CREATOR])
        if self.nbuf == 1 and v >= need:
          writing = s1 % 2 == 1  # a write in progress: wait for it (there is no other buffer)
          if not writing:
            self._hdr[_H_READING] = os.getpid()  # the writer waits until this copy is done
      if writing:
        if deadline is not None and time.monotonic() >= deadline:
          raise TimeoutError(f"ParamSlot.latest: version {v} still being written after {timeout} s")
        time.sleep(_POLL_S)
        continue
      if v >= need:
        dst = out if out is not None else {n: np.empty(s, d) for n, (s, d) in self.spec.items()}
        csum = new = None
        try:
          if self.delta or self.checksums:  # summed and copied block by block
            flat = {n: dst[n] if dst[n].flags.c_contiguous else np.empty(s, d) for n, (s, d) in self.spec.items()}
            if self.delta:  # rebuilt from a delta record (or copied whole), then summed and copied
              new, csum = self._read_delta(*record, flat)
              csum = csum if self.checksums else None
            else:
              csum = _copy_sum(self._bufs[b], self._offsets, flat, into_buf=False)
            for n, x in flat.items():
              if x is not dst[n]:  # a non-contiguous `out` array
                np.copyto(dst[n], x)
          else:
            for name, view in self._views[b].items():
              np.copyto(dst[name], view)
        finally:
          with self._locked(poll):
            s2 = int(self._hdr[_H_SEQ + b])
            if self.nbuf == 1:
              self._hdr[_H_READING] = 0
            if new is not None and s1 == s2:  # delta: the writer's next record is against this version
              self._held = (v, new)
              self._hdr[_H_HELD] = v
        if s1 == s2:
          self._last_read = (csum, dict(dst))
          return v, dict(dst)
        continue  # the writer lapped this copy: read the newer buffer
      if writer != os.getpid() and not pid_alive(writer):
        raise PeerDiedError(f"ParamSlot writer process {writer} exited; last version {v}, waiting for {need}")
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"ParamSlot.latest: version {need} not published within {timeout} s (latest {v})")
      time.sleep(_POLL_S)

  def checksum_of(self, arrays: Mapping[str, Any], names) -> int | None:
    """`checksum(arrays, names)`; for the arrays the last latest() returned, as it returned them (in spec order),
    the value it computed during its copy (no second pass). None for a slot made with checksum=False."""
    if not self.checksums:
      return None
    csum, read = self._last_read if self._last_read is not None else (None, {})
    names = list(names)
    if csum is not None and names == list(self.spec) and all(arrays.get(n) is read.get(n) for n in names):
      return csum
    return checksum(arrays, names)

  def close(self):
    """Unmap; the creating process also unlinks the segment. Idempotent."""
    if getattr(self, "_seg", None) is None:
      return
    self._hdr = self._views = self._bufs = None
    seg, self._seg = self._seg, None
    seg.close()
    # Unlink the lock's semaphore now: a stray reference (a traceback frame) would keep it in /dev/shm.
    lock, self._lock = self._lock, None
    _unlink_semaphore(lock)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
