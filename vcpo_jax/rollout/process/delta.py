"""Delta records of a parameter buffer: what changed between two versions, XORed, byte-shuffled and compressed.

A ParamSlot buffer (param_slot._layout: the arrays in order, each at the next multiple of 64 bytes, zero padding)
of version v is sent as a record against a base version u that the receiver holds:

    x = buf_v XOR buf_u                                   (bytes; 0 wherever a value did not change)
    per block (each array's padded extent cut into BLOCK_BYTES pieces):
      all-zero block   -> code 0, nothing stored
      else             -> byte planes of the block (plane j = byte j of every element of the array's dtype:
                          the sign / exponent bytes of a float change rarely, so their planes are mostly zero),
                          zlib level 1: code = +compressed length, or -raw length when zlib does not shrink it
    record = int64 codes [nblocks] ++ the stored blocks, in order.

The receiver rebuilds buf_v = buf_u XOR x bit for bit (XOR is its own inverse), so the slot's checksum of the
rebuilt buffer is the checksum of a full copy. Why XOR of bytes and not sparse indices: an AdamW step moves nearly
every float32 parameter, but a bfloat16 copy of it changes only where the step crosses a rounding boundary, and the
bits that change are low mantissa bits; the XOR keeps both cases cheap (zero blocks skipped, zero high planes
compressed), with no per-element index. zlib (stdlib) because no faster codec (lz4, zstd) is installed here.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK_BYTES = 1 << 18  # 256 KiB: large enough for zlib, small enough to skip unchanged regions
_LEVEL = 1  # zlib's fastest level: the XOR planes are mostly zeros, which every level compresses well
_THREADS = max(1, min(8, os.cpu_count() or 1))  # zlib and numpy release the GIL: blocks are coded in parallel
_POOL_MIN = 32  # fewer blocks than this are coded on the caller's thread (thread hand-offs cost more)
_pool: ThreadPoolExecutor | None = None


def _map(fn, items):
  global _pool
  if len(items) < _POOL_MIN or _THREADS == 1:
    return [fn(x) for x in items]
  if _pool is None:
    _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="vcpo-delta")
  return list(_pool.map(fn, items))


def blocks(spec: Mapping[str, tuple[tuple[int, ...], np.dtype]], offsets: Mapping[str, int], nbytes: int):
  """[(lo, hi, itemsize)] of the buffer: each array's extent up to the next array (its zero padding included),
  cut into BLOCK_BYTES pieces; every piece is a multiple of the itemsize (extents are multiples of 64 bytes)."""
  names = list(spec)
  out = []
  for i, n in enumerate(names):
    lo, end = offsets[n], offsets[names[i + 1]] if i + 1 < len(names) else nbytes
    size = spec[n][1].itemsize
    out += [(a, min(a + BLOCK_BYTES, end), size) for a in range(lo, end, BLOCK_BYTES)]
  return out


def _planes(x: np.ndarray, size: int) -> bytes:
  """uint8 bytes [n * size] -> the byte planes (byte 0 of every element, then byte 1, ...)."""
  return x.reshape(-1, size).T.tobytes() if size > 1 else x.tobytes()


def _unplanes(data: bytes, size: int) -> np.ndarray:
  """_planes' inverse, as uint8 [n * size]."""
  p = np.frombuffer(data, np.uint8)
  return p.reshape(size, -1).T.reshape(-1) if size > 1 else p


def encode(new: np.ndarray, base: np.ndarray, layout: list, limit: int) -> bytes | None:
  """The record of `new` against `base` (uint8 buffers of one layout, `blocks(...)`), or None once it would exceed
  `limit` bytes (a full send is then cheaper). Blocks are coded by a pool of _THREADS threads."""
  wn, wb = new.view(np.uint64), base.view(np.uint64)

  def one(block):
    lo, hi, size = block
    x = np.bitwise_xor(wn[lo // 8 : hi // 8], wb[lo // 8 : hi // 8])
    if not x.any():
      return 0, b""
    raw = _planes(x.view(np.uint8), size)
    packed = zlib.compress(raw, _LEVEL)
    return (len(packed), packed) if len(packed) < len(raw) else (-len(raw), raw)

  coded = _map(one, layout)
  codes = np.asarray([c for c, _ in coded], np.int64).reshape(len(layout))
  if codes.nbytes + sum(len(d) for _, d in coded) > limit:
    return None
  return codes.tobytes() + b"".join(d for _, d in coded)


def decode(record, base: np.ndarray, out: np.ndarray, layout: list) -> np.ndarray:
  """Rebuilds the new buffer into `out` (uint8, the layout's size; may be `base` itself) from `base` and the
  record (bytes-like); returns `out`."""
  rec = memoryview(record).cast("B")
  codes = np.frombuffer(rec[: 8 * len(layout)], np.int64)
  if out is not base:
    np.copyto(out, base)
  starts = 8 * len(layout) + np.concatenate([[0], np.cumsum(np.abs(codes))])
  if starts[-1] != len(rec):
    raise ValueError(f"delta record: {len(rec)} bytes, its blocks account for {int(starts[-1])}")

  def one(i):  # blocks are disjoint: the threads patch different bytes of `out`
    (lo, hi, size), code, pos = layout[i], int(codes[i]), int(starts[i])
    chunk = rec[pos : pos + abs(code)]
    x = _unplanes(zlib.decompress(chunk) if code > 0 else bytes(chunk), size)
    if x.size != hi - lo:
      raise ValueError(f"delta record: block [{lo}, {hi}) decodes to {x.size} bytes")
    np.bitwise_xor(out[lo:hi], x, out=out[lo:hi])

  _map(one, [i for i in range(len(layout)) if codes[i] != 0])
  return out


def changed_fraction(new: np.ndarray, base: np.ndarray, itemsize: int = 1) -> tuple[float, float]:
  """(fraction of bytes, fraction of `itemsize`-byte elements) that differ between two uint8 buffers."""
  d = new != base
  return float(d.mean()), float(d.reshape(-1, itemsize).any(axis=1).mean())


class Layout:
  """ParamSlot's buffer layout of a spec {name: (shape, dtype)} (each array at the next multiple of 64 bytes, zero
  padding) for channels that keep their versions as such buffers themselves (the transfer path, the multi-host
  gather): pack arrays into one, view one as arrays, and the delta blocks of it."""

  def __init__(self, spec: Mapping[str, tuple[tuple[int, ...], np.dtype]]):
    self.spec = {n: (tuple(int(d) for d in shape), np.dtype(dtype)) for n, (shape, dtype) in spec.items()}
    self.offsets, off = {}, 0
    for name, (shape, dtype) in self.spec.items():
      self.offsets[name] = off
      off += -(-int(np.prod(shape)) * dtype.itemsize // 64) * 64
    self.nbytes = off
    self.blocks = blocks(self.spec, self.offsets, self.nbytes)

  def pack(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """A fresh uint8 buffer [nbytes] holding `arrays` (the spec's names, shapes and dtypes)."""
    buf = np.zeros(self.nbytes, np.uint8)
    for name, (shape, dtype) in self.spec.items():
      a = np.ascontiguousarray(arrays[name])
      if a.shape != shape or a.dtype != dtype:
        raise ValueError(f"delta layout: {name!r} is {a.dtype}{list(a.shape)}, the layout holds {dtype}{list(shape)}")
      lo = self.offsets[name]
      buf[lo : lo + a.nbytes] = a.reshape(-1).view(np.uint8)
    return buf

  def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
    """{name: array} views of a packed buffer (no copy)."""
    out = {}
    for name, (shape, dtype) in self.spec.items():
      lo = self.offsets[name]
      out[name] = buf[lo : lo + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
    return out
