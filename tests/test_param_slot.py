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
