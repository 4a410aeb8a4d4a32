"""param_slot.checksum: hand-checked values, a brute-force reference, what it detects, and that the slot's fused
copies compute the same value as the standalone function. (The slot's protocol: tests/test_shm_queue.py.)"""

import ml_dtypes
import numpy as np
import pytest

from vcpo_jax.rollout.process import param_slot
from vcpo_jax.rollout.process.param_slot import ParamSlot, checksum


def _reference(arrays: dict) -> int:
  """The definition, word by word: the arrays at 64-byte offsets, zero padding, uint64 words w_p,
  sum_p (2 * (p // 512) + 1) * w_p mod 2^64."""
  buf, off = bytearray(), 0
  for a in arrays.values():
    raw = np.ascontiguousarray(a).tobytes()
    buf += bytes(off - len(buf)) + raw
    off = -(-(off + len(raw)) // 64) * 64
  buf += bytes(off - len(buf))
  words = np.frombuffer(bytes(buf), np.uint64)
  return sum((2 * (p // 512) + 1) * int(w) for p, w in enumerate(words)) % 2**64


def _same(x, y) -> bool:
  """Equal bytes (bfloat16 and NaN-proof)."""
  return np.array_equal(
    np.ascontiguousarray(x).reshape(-1).view(np.uint8), np.ascontiguousarray(y).reshape(-1).view(np.uint8)
  )


def _arrays(seed=0, n=70_000):
  rng = np.random.default_rng(seed)
  return {
    "w": rng.standard_normal(n).astype(np.float32),
    "b": np.arange(5, dtype=np.int8),  # a tail shorter than a word
    "e": rng.standard_normal((33, 7)).astype(ml_dtypes.bfloat16),
    "s": np.array(3, np.int32),  # 0-d
  }


def test_hand_checked_values():
  assert checksum({"a": np.ones(1, np.float32)}) == 0x3F800000  # word 0 = 1.0f's bits, weight 1
  # b starts at byte 64 = word 8, still row 0 (weight 1): its word is 1 + 2 * 2^32.
  assert checksum({"a": np.ones(1, np.float32), "b": np.array([1, 2], np.int32)}) == 0x3F800000 + 1 + 2 * 2**32
  # 513 words of 1: 512 in row 0 (weight 1), one in row 1 (weight 3).
  assert checksum({"a": np.ones(513, np.uint64)}) == 512 + 3
  assert checksum({"a": np.array([5], np.int8)}) == 5  # zero-padded to one word
  assert checksum({"a": np.full(2, 2**63, np.uint64)}) == 0  # wraps mod 2^64
  assert checksum({"a": np.zeros(0, np.float32)}) == 0


@pytest.mark.parametrize("block_bytes", [param_slot._BLOCK_BYTES, 8192, 4096])
def test_equals_the_word_by_word_reference_whatever_the_block_walk(monkeypatch, block_bytes):
  """Blocks of one or two 4 KiB rows cut every array into many pieces: the value does not depend on the walk."""
  monkeypatch.setattr(param_slot, "_BLOCK_BYTES", block_bytes)
  a = _arrays()
  want = _reference(a)
  assert checksum(a) == want
  with ParamSlot(a, nbuf=2) as slot:
    slot.publish(a)
    assert slot.last_checksum == want  # the learner's, computed while writing
    _, got = slot.latest()
    assert slot.checksum_of(got, list(a)) == want  # the sampler's, computed while reading
    out = {n: np.empty_like(x) for n, x in a.items()}
    out["e"] = np.empty((7, 33), ml_dtypes.bfloat16).T  # a non-contiguous destination
    slot.latest(out=out)
    assert all(_same(out[n], a[n]) for n in a)
    assert slot.checksum_of({n: out[n] for n in a}, list(a)) == want  # recomputed: these are not latest()'s


def test_detects_a_flipped_byte_anywhere_a_torn_write_and_another_version():
  a = {"w": np.random.default_rng(1).standard_normal(3000).astype(np.float32)}
  base = checksum(a)
  raw = a["w"].view(np.uint8)
  for i in range(raw.size):  # every byte, every bit position over the bytes (odd weights: a one-word change)
    flipped = raw.copy()
    flipped[i] ^= 1 << (i % 8)
    assert checksum({"w": flipped.view(np.float32)}) != base, i
  newer = {"w": a["w"] - np.float32(1e-3) * a["w"]}  # the next version: one small update
  assert checksum(newer) != base
  for cut in (1, 1024, 1500, 2999):  # a torn write: the new version's first `cut` values, then the old one's
    torn = np.concatenate([newer["w"][:cut], a["w"][cut:]])
    assert checksum({"w": torn}) not in (base, checksum(newer)), cut
  rows = a["w"][: 2 * 1024].reshape(2, 1024)  # two 4 KiB rows trade places
  assert checksum({"w": np.concatenate([rows[::-1].reshape(-1), a["w"][2048:]])}) != base
  assert checksum({"x": a["w"][:1024], "y": a["w"][1024:2048]}) != checksum(
    {"x": a["w"][1024:2048], "y": a["w"][:1024]}
  )


@pytest.mark.parametrize("nbuf", [1, 2])
def test_a_corrupted_slot_buffer_gives_the_reader_another_checksum(nbuf):
  """What next() compares: the writer's checksum of what it wrote against the reader's of what it read."""
  a = _arrays(2)
  with ParamSlot(a, nbuf=nbuf) as slot:
    slot.publish(a)
    wrote = slot.last_checksum
    b = int(slot._hdr[param_slot._H_LATEST])
    slot._bufs[b][slot._offsets["w"] + 4097] ^= 0x10  # one byte of the published buffer
    _, got = slot.latest()
    assert slot.checksum_of(got, list(a)) != wrote
    assert slot.checksum_of(got, list(a)) == checksum(got)


def test_checksum_false_makes_plain_copies():
  a = _arrays(3)
  with ParamSlot(a, checksum=False) as slot:
    slot.publish(a)
    _, got = slot.latest()
    assert slot.last_checksum is None and slot.checksum_of(got, list(a)) is None
    assert all(_same(got[n], a[n]) for n in a)


# ---------------------------------------------------------------- delta publishing (process/delta.py)


def _reader(slot: ParamSlot) -> ParamSlot:
  """The sampler's end of `slot` in this process (what unpickling in a spawned process builds)."""
  r = ParamSlot.__new__(ParamSlot)
  r.__setstate__(slot.__getstate__())
  return r


def _step(a: dict, rng, frac: float) -> dict:
  """An update of a fraction `frac` of the float32 values (a small relative change) and of every bfloat16 value."""
  w = a["w"] * np.where(rng.random(a["w"].size) < frac, np.float32(1 + 1e-3), np.float32(1)).astype(np.float32)
  e = (a["e"].astype(np.float32) + 0.05 * rng.standard_normal(a["e"].shape)).astype(ml_dtypes.bfloat16)
  return {**a, "w": w, "e": e}


def test_delta_codec_rebuilds_the_buffer_bit_for_bit_and_skips_unchanged_blocks():
  from vcpo_jax.rollout.process import delta

  rng = np.random.default_rng(5)
  spec = {"w": ((600_000,), np.dtype(np.float32)), "e": ((70, 3), np.dtype(ml_dtypes.bfloat16))}
  offsets, nbytes = param_slot._layout(spec)
  layout = delta.blocks(spec, offsets, nbytes)
  assert [hi - lo for lo, hi, _ in layout[:2]] == [delta.BLOCK_BYTES] * 2 and layout[-1][2] == 2
  base = np.zeros(nbytes, np.uint8)
  base[:2_400_000] = rng.integers(0, 256, 2_400_000, dtype=np.uint8)
  new = base.copy()
  new[12] ^= 0x80  # block 0
  new[offsets["e"] + 5] ^= 0x01  # the last block (e)
  rec = delta.encode(new, base, layout, limit=nbytes)
  codes = np.frombuffer(rec[: 8 * len(layout)], np.int64)
  assert (codes != 0).tolist() == [True] + [False] * (len(layout) - 2) + [True]
  assert len(rec) < 8 * len(layout) + 2000  # two one-byte changes: two tiny compressed blocks
  assert np.array_equal(delta.decode(rec, base, np.empty_like(base), layout), new)
  noise = rng.integers(0, 256, nbytes, dtype=np.uint8)  # every byte changes, incompressibly
  assert delta.encode(noise, base, layout, limit=nbytes // 2) is None  # past the limit: send the full copy
  raw = delta.encode(noise, base, layout, limit=2 * nbytes)
  assert (np.frombuffer(raw[: 8 * len(layout)], np.int64) < 0).all()  # stored raw: zlib did not shrink it
  assert np.array_equal(delta.decode(raw, base, base.copy(), layout), noise)


def test_delta_publishing_reconstructs_every_version_bit_for_bit_with_the_full_publishs_checksum():
  """Several versions, the reader taking some and skipping others: each publish is a delta record against the
  version the reader holds (a skipped version costs nothing: the writer keeps the reader's version), the reader
  rebuilds every version it takes bit for bit, and both checksums equal those of a full publish."""
  rng = np.random.default_rng(7)
  a = _arrays(4, n=300_000)
  with ParamSlot(a, nbuf=1, delta=True) as slot, ParamSlot(a, nbuf=1) as full:
    reader = _reader(slot)
    kinds, bases = [], []
    for v in range(7):
      if v:
        a = _step(a, rng, frac=0.02)
      slot.publish(a, v)
      full.publish(a, v)
      kinds.append(slot.last_publish["kind"])
      bases.append(slot.last_publish["base"])
      assert slot.last_checksum == full.last_checksum == checksum(a), v
      if v in (0, 1, 2, 5, 6):  # versions 3 and 4 are skipped
        got_v, got = reader.latest(timeout=5.0)
        assert got_v == v and all(_same(got[n], a[n]) for n in a), v
        assert reader.checksum_of(got, list(a)) == slot.last_checksum, v
    assert kinds == ["full"] + ["delta"] * 6
    assert bases == [-1, 0, 1, 2, 2, 2, 5]  # against the version the reader held at each publish
    assert slot.last_publish["bytes"] < slot.nbytes / 4
    v, mine = slot.latest()  # the writer's own copy of the newest version (a replacement's start)
    assert v == 6 and all(_same(mine[n], a[n]) for n in a)
    reader.close()


def test_delta_publishing_sends_full_copies_to_a_fresh_reader_and_when_the_delta_is_too_long():
  rng = np.random.default_rng(8)
  a = _arrays(5, n=200_000)
  with ParamSlot(a, nbuf=1, delta=True) as slot:
    for v in range(3):  # no reader has taken a version: nothing to diff against
      slot.publish(_step(a, rng, 0.01) if v else a, v)
      assert slot.last_publish == {"kind": "full", "bytes": slot.nbytes, "base": -1}, v
    reader = _reader(slot)
    reader.latest(timeout=5.0)
    b = {**a, "w": rng.standard_normal(a["w"].size).astype(np.float32)}  # every float32 value replaced
    slot.publish(b, 3)
    assert slot.last_publish["kind"] == "full"  # its record would exceed _DELTA_MAX_FRAC of the copy
    got_v, got = reader.latest(timeout=5.0)
    assert got_v == 3 and all(_same(got[n], b[n]) for n in b)
    c = _step(b, rng, 0.01)
    slot.publish(c, 4)
    assert slot.last_publish["kind"] == "delta" and slot.last_publish["base"] == 3
    assert reader.latest(timeout=5.0)[0] == 4 and reader.checksum_of(reader._last_read[1], list(c)) == checksum(c)
    reader.close()
    fresh = _reader(slot)  # header: a reader holds version 4; a new reader end holds nothing
    with pytest.raises(RuntimeError, match="the slot's protocol broke"):
      slot.publish(_step(c, rng, 0.01), 5)  # a delta against 4, which this fresh end does not hold
      fresh.latest(timeout=5.0)
    fresh.close()
  with pytest.raises(ValueError, match="needs nbuf=1"):
    ParamSlot(a, nbuf=2, delta=True)


def _read_in_child(slot, n, conn):
  """A spawned reader: takes versions 0 .. n - 1 as they come, sends (version, checksum) of each."""
  got = []
  while len(got) < n:
    v, arrays = slot.latest(min_version=len(got), timeout=30.0)
    got.append((v, slot.checksum_of(arrays, list(slot.spec))))
    conn.send(v)
  conn.send(got)
  slot.close()


def test_delta_publishing_to_a_spawned_reader():
  """The real pairing: a writer and a reader in another (spawned) process; each delta record is decoded there."""
  from vcpo_jax.rollout.process.shm_queue import SPAWN

  rng = np.random.default_rng(9)
  a, sums, n = _arrays(6, n=200_000), [], 5
  with ParamSlot(a, nbuf=1, delta=True) as slot:
    here, there = SPAWN.Pipe()
    proc = SPAWN.Process(target=_read_in_child, args=(slot, n, there))
    proc.start()
    kinds = []
    for v in range(n):
      if v:
        a = _step(a, rng, 0.02)
      slot.publish(a, v)
      sums.append((v, checksum(a)))
      kinds.append(slot.last_publish["kind"])
      assert here.poll(60.0) and here.recv() == v  # it read version v before the next publish
    assert here.poll(60.0) and here.recv() == sums
    proc.join(30.0)
    assert proc.exitcode == 0 and kinds == ["full"] + ["delta"] * (n - 1)
