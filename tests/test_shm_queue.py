"""Tests for the shared-memory batch queue and parameter slot (vcpo_jax.rollout).

Workers run under the spawn context, as the async sampler does. Every wait has a
timeout, so a bug shows up as a failure, never as a hung test run.
"""

import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vcpo_jax.rollout.process.param_slot import ParamSlot, checksum
from vcpo_jax.rollout.process.shm_queue import SPAWN, BatchSchema, Field, PeerDiedError, QueueFinished, ShmQueue

N = 4
SCHEMA = BatchSchema(
  {
    "tokens": Field(np.int32, (N, "T"), fill=-1),
    "loss_mask": Field(np.bool_, (N, "T")),
    "behavior_logp": Field(np.float32, (N, "T")),
    "rewards": Field(np.float32, (N,)),
  },
  {"T": (8, 16, 32)},
)
WAIT_S = 20.0  # generous: only a bug or a wedged machine reaches it


def make_batch(i: int, t: int) -> dict:
  """Batch number i with t tokens; every value identifies (i, position)."""
  return {
    "tokens": (np.arange(N * t, dtype=np.int32).reshape(N, t) + 1000 * i),
    "loss_mask": (np.arange(N * t).reshape(N, t) + i) % 3 == 0,
    "behavior_logp": np.full((N, t), -0.5 * i, np.float32),
    "rewards": np.full((N,), i, np.float32),
  }


def check_item(item, i: int, t: int):
  """The item is batch i, padded to its bucket with each field's fill."""
  want = make_batch(i, t)
  assert item.meta == {"i": i, "t": t}
  assert item.sizes == {"T": t}
  bucket = item.buckets["T"]
  assert bucket == min(b for b in SCHEMA.buckets["T"] if b >= t)
  for name, a in item.arrays.items():
    f = SCHEMA.fields[name]
    assert a.dtype == f.dtype
    if name == "rewards":
      np.testing.assert_array_equal(a, want[name])
      continue
    assert a.shape == (N, bucket)
    np.testing.assert_array_equal(a[:, :t], want[name])
    assert (a[:, t:] == f.dtype.type(f.fill)).all()


def lengths(n: int, seed: int) -> list[int]:
  return [random.Random(seed + i).randint(1, 32) for i in range(n)]


# ---------------------------------------------------------------- spawn workers


def _produce(q: ShmQueue, n: int, seed: int, max_sleep: float):
  rng = random.Random(seed)
  for i, t in enumerate(lengths(n, seed)):
    time.sleep(rng.uniform(0, max_sleep))
    q.put(make_batch(i, t), {"i": i, "t": t}, timeout=WAIT_S)
  q.finish()


def _produce_forever(q: ShmQueue):
  i = 0
  while True:
    q.put(make_batch(i, 8), {"i": i, "t": 8}, timeout=WAIT_S)
    i += 1


def _crash_at_start(q: ShmQueue):
  raise RuntimeError("sampler failed before its first batch (expected in this test)")


def _consume_one_then_die(q: ShmQueue):
  q.get(timeout=WAIT_S)
  os.kill(os.getpid(), signal.SIGKILL)


def _publish_versions(slot: ParamSlot, n: int):
  for v in range(n):
    slot.publish(
      {
        "flat": np.full(slot.spec["flat"][0], v, np.float32),
        "emb": np.full(slot.spec["emb"][0], v % 256, ml_dtypes.bfloat16),
      }
    )


def _start(target, *args):
  p = SPAWN.Process(target=target, args=args, daemon=True)
  p.start()
  return p


def _stop(p):
  if p.is_alive():
    p.kill()
  p.join(WAIT_S)


# ---------------------------------------------------------------- single process


def test_fifo_padding_and_meta_in_one_process():
  with ShmQueue(SCHEMA, nslots=3) as q:
    ts = [5, 8, 9, 32]
    for i, t in enumerate(ts[:3]):
      q.put(make_batch(i, t), {"i": i, "t": t})
    assert q.qsize() == 3
    check_item(q.get(timeout=1), 0, 5)
    q.put(make_batch(3, 32), {"i": 3, "t": 32})  # wraps around the ring
    for i, t in enumerate(ts[1:], start=1):
      item = q.get(timeout=1)
      assert item.seq == i
      check_item(item, i, t)
    with pytest.raises(queue.Empty):
      q.get(timeout=0.05)


def test_get_views_and_out_buffers():
  with ShmQueue(SCHEMA, nslots=1) as q:
    q.put(make_batch(1, 16), {"i": 1, "t": 16})
    item = q.get(copy=False)
    check_item(item, 1, 16)
    assert not item.arrays["tokens"].flags.writeable
    with pytest.raises(queue.Full):  # the view still holds the only slot
      q.put(make_batch(2, 16), {"i": 2, "t": 16}, timeout=0.05)
    q.release()
    q.put(make_batch(2, 16), {"i": 2, "t": 16}, timeout=1)
    out = {n: np.zeros(SCHEMA.shape(n, {"T": 16}), f.dtype) for n, f in SCHEMA.fields.items()}
    item = q.get(out=out)
    assert item.arrays["tokens"] is out["tokens"]
    check_item(item, 2, 16)


def test_bad_batches_raise_clear_errors():
  with ShmQueue(SCHEMA, nslots=1, meta_bytes=64) as q:
    good = make_batch(0, 8)
    with pytest.raises(ValueError, match=r"'T' has length 33.*largest bucket 32"):
      q.put(make_batch(0, 33))
    with pytest.raises(ValueError, match=r"'behavior_logp' has dtype float64.*astype"):
      q.put({**good, "behavior_logp": good["behavior_logp"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"missing \['rewards'\]"):
      q.put({k: v for k, v in good.items() if k != "rewards"})
    with pytest.raises(ValueError, match=r"fixes axis 0 to 4"):
      q.put({**good, "rewards": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match=r"every field must agree on T"):
      q.put({**good, "loss_mask": np.ones((N, 9), bool)})
    with pytest.raises(ValueError, match=r"meta_bytes=64"):
      q.put(good, {"text": "x" * 100})
    with pytest.raises(ValueError, match=r"JSON"):
      q.put(good, {"arr": np.zeros(2)})
    assert q.qsize() == 0  # rejected batches do not consume a slot
    q.put(good, {"i": 0, "t": 8})
    check_item(q.get(timeout=1), 0, 8)
  with pytest.raises(ValueError, match=r"no entry in BatchSchema.buckets"):
    BatchSchema({"x": Field(np.int32, ("L",))}, {"T": (4,)})
  with pytest.raises(ValueError, match="closed"):
    q.get(timeout=0)


def test_close_unlinks_semaphores_while_references_remain():
  """close() removes the segment and both semaphores at once, even if something (a traceback frame)
  still references the queue's semaphores; a later collection and a second close() are harmless."""
  import gc
  from multiprocessing import util

  q = ShmQueue(SCHEMA, nslots=2)
  paths = q.resource_paths()
  assert len(paths) == 3 and all(os.path.exists(p) for p in paths)
  held = (q._free, q._items)  # what a frame in a traceback would keep alive
  q.close()
  assert not [p for p in paths if os.path.exists(p)]
  assert not [
    f for f in util._finalizer_registry.values() if getattr(f, "_weakref", None) is not None and f._weakref() in held
  ]  # nothing left to unlink twice at gc / exit
  del held
  gc.collect()
  q.close()


def test_an_unlinked_or_closed_queue_or_slot_cannot_be_sent_to_another_process():
  """Pickling (what spawning a child does) refuses a queue or slot whose names are unlinked (a child could not
  attach them) or that is closed, naming the class."""
  import pickle

  a = {"w": np.arange(8, dtype=np.float32)}
  for make, kind in ((lambda: ShmQueue(SCHEMA, nslots=1), "ShmQueue"), (lambda: ParamSlot(a), "ParamSlot")):
    owner = make()
    owner.unlink()
    with pytest.raises(ValueError, match=f"cannot send an unlinked {kind} to another process"):
      pickle.dumps(owner)
    owner.close()
    with pytest.raises(ValueError, match=f"cannot send a closed {kind} to another process"):
      pickle.dumps(owner)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 32), min_size=1, max_size=6), st.integers(1, 3))
def test_roundtrip_property(ts, nslots):
  """Any sequence of lengths comes back in order, unpadded part exact, padding = fill."""
  with ShmQueue(SCHEMA, nslots=nslots) as q:
    got = 0
    for i, t in enumerate(ts):
      if q.qsize() == nslots:
        check_item(q.get(timeout=1), got, ts[got])
        got += 1
      q.put(make_batch(i, t), {"i": i, "t": t}, timeout=1)
    while got < len(ts):
      check_item(q.get(timeout=1), got, ts[got])
      got += 1


# ---------------------------------------------------------------- across processes


@pytest.mark.parametrize(
  "producer_sleep,consumer_sleep", [(0.0, 0.003), (0.003, 0.0)], ids=["producer_faster", "producer_slower"]
)
@pytest.mark.slow
def test_no_loss_no_duplication_across_processes(producer_sleep, consumer_sleep):
  n, seed = 60, 7
  rng = random.Random(1)
  with ShmQueue(SCHEMA, nslots=3) as q:
    p = _start(_produce, q, n, seed, producer_sleep)
    q.watch(p)
    seen = []
    try:
      while True:
        time.sleep(rng.uniform(0, consumer_sleep))
        try:
          item = q.get(timeout=WAIT_S)
        except QueueFinished:
          break
        seen.append(item.meta["i"])
        check_item(item, item.meta["i"], lengths(n, seed)[item.meta["i"]])
      p.join(WAIT_S)  # finish() precedes the producer's exit
    finally:
      _stop(p)
    assert seen == list(range(n))
    assert p.exitcode == 0


def test_back_pressure_blocks_then_proceeds():
  with ShmQueue(SCHEMA, nslots=2) as q:
    p = _start(_produce, q, 6, 3, 0.0)
    try:
      deadline = time.monotonic() + WAIT_S
      while q.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
      time.sleep(0.2)  # the producer is now blocked in put(): nothing beyond capacity
      assert q.qsize() == 2 and p.is_alive()
      seen = [q.get(timeout=WAIT_S).meta["i"] for _ in range(6)]
      assert seen == list(range(6))
      with pytest.raises(QueueFinished):
        q.get(timeout=WAIT_S)
    finally:
      _stop(p)


def test_producer_sigkill_is_detected_and_segments_removed():
  q = ShmQueue(SCHEMA, nslots=3)
  paths = q.resource_paths()
  assert all(os.path.exists(x) for x in paths)
  p = _start(_produce_forever, q)  # no watch(): liveness comes from the registered pid
  try:
    deadline = time.monotonic() + WAIT_S
    while q.qsize() < 3 and time.monotonic() < deadline:
      time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    # Completed batches are delivered first, then the death is reported (not a timeout).
    assert [q.get(timeout=WAIT_S).meta["i"] for _ in range(3)] == [0, 1, 2]
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError, match="no longer running"):
      q.get(timeout=WAIT_S)
    print(f"producer death detected in {time.monotonic() - t0:.3f} s")
  finally:
    _stop(p)
    q.close()
  assert not [x for x in paths if os.path.exists(x)]


@pytest.mark.slow
def test_producer_dying_before_first_put_is_detected_with_watch():
  with ShmQueue(SCHEMA, nslots=2) as q:
    p = _start(_crash_at_start, q)
    q.watch(p)
    try:
      with pytest.raises(PeerDiedError, match="exited with code 1"):
        q.get(timeout=WAIT_S)
    finally:
      _stop(p)


def test_consumer_death_is_detected_by_producer():
  with ShmQueue(SCHEMA, nslots=2) as q:
    p = _start(_consume_one_then_die, q)
    try:
      with pytest.raises(PeerDiedError, match="ShmQueue.put"):
        for i in range(10):  # 1 taken by the child + 2 slots, then put must fail
          q.put(make_batch(i, 8), {"i": i, "t": 8}, timeout=WAIT_S)
    finally:
      _stop(p)


_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from test_shm_queue import SCHEMA, _produce_forever, _start
    from vcpo_jax.rollout.process.shm_queue import ShmQueue
    from vcpo_jax.rollout.process.param_slot import ParamSlot
    if __name__ == "__main__":
      q = ShmQueue(SCHEMA, nslots=2)
      slot = ParamSlot({{"w": ((1000,), "float32")}})
      print(" ".join(q.resource_paths() + slot.resource_paths()), flush=True)
      p = _start(_produce_forever, q)
      while q.qsize() < 2:
        time.sleep(0.01)
      if {creator_dies}:
        os.kill(os.getpid(), signal.SIGKILL)
      os.kill(p.pid, signal.SIGKILL)
      p.join()
      q.close(); slot.close()
""")


@pytest.mark.parametrize("creator_dies", [False, True], ids=["child_killed", "creator_killed"])
@pytest.mark.slow
def test_no_leaks_or_tracker_warnings_in_a_fresh_interpreter(creator_dies):
  """Child crash: the owner closes cleanly, with no resource-tracker warnings.

  Owner crash: its child notices, exits, and the resource tracker unlinks everything.
  """
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = _SCRIPT.format(tests=os.path.join(root, "tests"), creator_dies=creator_dies)
  r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60, check=False)
  paths = r.stdout.split()
  assert len(paths) == 5, r.stderr
  if not creator_dies:
    assert r.returncode == 0, r.stderr
    assert "resource_tracker" not in r.stderr and "Warning" not in r.stderr, r.stderr
  deadline = time.monotonic() + WAIT_S
  while any(os.path.exists(x) for x in paths) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not [x for x in paths if os.path.exists(x)], r.stderr


# ---------------------------------------------------------------- ParamSlot


SPEC = {"flat": ((1 << 19,), np.float32), "emb": ((64, 8), ml_dtypes.bfloat16)}


def test_param_slot_publish_and_latest():
  with ParamSlot(SPEC) as slot:
    assert slot.version() == -1
    with pytest.raises(TimeoutError, match="version 0 not published"):
      slot.latest(timeout=0.05)
    w = {
      "flat": np.arange(1 << 19, dtype=np.float32),
      "emb": np.linspace(-1, 1, 512).reshape(64, 8).astype(ml_dtypes.bfloat16),
    }
    assert slot.publish(w) == 0
    v, got = slot.latest()
    assert v == 0
    np.testing.assert_array_equal(got["flat"], w["flat"])
    assert got["emb"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["emb"].view(np.uint16), w["emb"].view(np.uint16))
    got["flat"][:] = 0  # a copy: the slot is untouched
    assert slot.latest()[1]["flat"][1] == 1
    assert slot.publish(w, version=5) == 5
    with pytest.raises(ValueError, match="must exceed the last published version 5"):
      slot.publish(w, version=5)
    with pytest.raises(ValueError, match=r"'flat' is float64"):
      slot.publish({**w, "flat": w["flat"].astype(np.float64)})
    assert slot.latest(min_version=5, timeout=1)[0] == 5
    with pytest.raises(TimeoutError):
      slot.latest(min_version=6, timeout=0.05)


@pytest.mark.parametrize("nbuf", [2, 1])
@pytest.mark.slow
def test_param_slot_never_torn_and_monotone_under_concurrent_writes(nbuf):
  """nbuf=2: double-buffered seqlock; nbuf=1: one copy (half the memory), the writer waits for the reader."""
  n = 400
  with ParamSlot(SPEC, nbuf=nbuf) as slot:
    size = os.path.getsize(slot._seg.path)  # the segment: header + nbuf parameter copies
    assert nbuf * slot.nbytes <= size < (nbuf + 1) * slot.nbytes
    p = _start(_publish_versions, slot, n)
    try:
      last, reads, versions = -1, 0, set()
      while last < n - 1:
        v, got = slot.latest(min_version=last, timeout=WAIT_S)
        assert v >= last, "versions went backwards"
        flat = got["flat"]
        # Untorn: every element was written by the same publish, the one reported.
        assert flat[0] == v and (flat == flat[0]).all(), f"torn read at version {v}"
        assert (got["emb"] == ml_dtypes.bfloat16(v % 256)).all()
        # The checksum latest() took during its copy is that of version v as the writer meant it.
        want = {
          "flat": np.full(SPEC["flat"][0], v, np.float32),
          "emb": np.full(SPEC["emb"][0], v % 256, ml_dtypes.bfloat16),
        }
        assert slot.checksum_of(got, list(SPEC)) == checksum(want), v
        last, reads = v, reads + 1
        versions.add(v)
      p.join(WAIT_S)
      assert p.exitcode == 0
      assert len(versions) > 1  # the reader really overlapped the writer
      with pytest.raises(PeerDiedError, match="writer process"):
        slot.latest(min_version=n, timeout=WAIT_S)
    finally:
      _stop(p)


def test_param_slot_lock_waits_call_poll_which_can_end_them():
  """A lock held by a peer that is stopped (SIGSTOP) or died inside the critical section: publish() keeps
  calling poll() between slices and ends with what it raises, instead of blocking for the lock timeout."""

  class Interrupted(Exception):
    pass

  calls = []

  def poll():
    calls.append(time.monotonic())
    if len(calls) == 3:
      raise Interrupted()

  w = {"w": np.arange(4, dtype=np.float32)}
  with ParamSlot({"w": ((4,), np.float32)}) as slot:
    assert slot._lock.acquire(timeout=1)  # what a peer frozen inside the critical section looks like
    with pytest.raises(Interrupted):
      slot.publish(w, poll=poll)
    assert len(calls) == 3
    slot._lock.release()
    assert slot.publish(w, poll=poll) == 0  # a free lock: poll is not needed
    assert len(calls) == 3
    assert slot.latest(timeout=1, poll=poll)[0] == 0
