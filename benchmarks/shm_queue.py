"""Rollout-batch transport between two processes: ShmQueue vs multiprocessing.Queue.

    python -m benchmarks.shm_queue                   # 1, 16 and 64 MiB batches (~1-2 min)
    python -m benchmarks.shm_queue --sizes=large --trials=5

A spawned producer process puts the same realistic rollout batch over and over;
the parent (the learner's role) takes them. Batch fields, all [N, T] except the
per-row ones: tokens int32, behavior_logp float32, ref_logp float32,
prompt_mask / response_mask / loss_mask / attention_mask bool (16 bytes per
token), rewards float32 [N], group_id int32 [N], policy_version int32 [N].

  small   N =  64, T = 1024     1 MiB
  medium  N = 256, T = 4096    16 MiB
  large   N = 512, T = 8192    64 MiB

Transports (both with room for `--nslots` batches, so both apply back-pressure):
  mp.Queue    multiprocessing.Queue from the spawn context: pickle, pipe, unpickle.
  shm copy    ShmQueue.get(): fresh arrays per batch (what mp.Queue returns too).
  shm out     ShmQueue.get(out=...): copied into the learner's reused host buffers.
  shm views   ShmQueue.get(copy=False): read-only views into the slot, zero-copy
              (e.g. jax.device_put straight from shared memory); the slot is
              handed back at the next get.
The producer side is the same for the three shm modes: one memcpy into the slot.

The consumer READS every byte it receives (an xor checksum, `read_all`), in every
transport, so a zero-copy view is charged for the data it hands over. All transports
run at once (each with its own producer) and are timed interleaved, round by round
(`--trials` rounds, one window of batches per transport each); the table gives the
median throughput and the median and range of the per-round ratios to mp.Queue. "of memcpy" divides it by the bandwidth of a
plain in-process numpy copy of the same batch into preallocated arrays (best of
several), the ceiling for any transport that copies the data once. The last
line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from vcpo_jax.rollout.process.shm_queue import SPAWN, BatchSchema, Field, ShmQueue

SIZES = {"small": (64, 1024), "medium": (256, 4096), "large": (512, 8192)}
TRANSPORTS = ("mp.Queue", "shm copy", "shm out", "shm views")


def schema(n: int, t: int) -> BatchSchema:
  nt = (n, "T")
  return BatchSchema(
    {
      "tokens": Field(np.int32, nt),
      "behavior_logp": Field(np.float32, nt),
      "ref_logp": Field(np.float32, nt),
      "prompt_mask": Field(np.bool_, nt),
      "response_mask": Field(np.bool_, nt),
      "loss_mask": Field(np.bool_, nt),
      "attention_mask": Field(np.bool_, nt),
      "rewards": Field(np.float32, (n,)),
      "group_id": Field(np.int32, (n,)),
      "policy_version": Field(np.int32, (n,)),
    },
    {"T": (t // 4, t // 2, t)},
  )


def make_batch(n: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  resp = np.arange(t)[None, :] >= t // 4
  return {
    "tokens": rng.integers(0, 150_000, (n, t), dtype=np.int32),
    "behavior_logp": -rng.exponential(1.0, (n, t)).astype(np.float32),
    "ref_logp": -rng.exponential(1.0, (n, t)).astype(np.float32),
    "prompt_mask": np.broadcast_to(~resp, (n, t)).copy(),
    "response_mask": np.broadcast_to(resp, (n, t)).copy(),
    "loss_mask": rng.random((n, t)) < 0.7,
    "attention_mask": np.ones((n, t), bool),
    "rewards": rng.random(n).astype(np.float32),
    "group_id": np.arange(n, dtype=np.int32) // 8,
    "policy_version": np.full(n, 3, np.int32),
  }


def nbytes(batch) -> int:
  return sum(a.nbytes for a in batch.values())


def _producer(q, transport: str, n: int, t: int, count: int):
  batch = make_batch(n, t)
  for i in range(count):
    if transport == "mp.Queue":
      q.put((batch, {"i": i}))
    else:
      q.put(batch, {"i": i}, timeout=120)


def read_all(arrays: dict[str, np.ndarray]) -> int:
  """Reads every byte of the batch (an xor checksum), as a learner's host-to-device copy would.

  Every transport's consumer calls it, so a zero-copy view is charged for the bytes it hands over.
  """
  acc = 0
  for a in arrays.values():
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    word = flat[: flat.size // 8 * 8].view(np.uint64)
    acc ^= int(np.bitwise_xor.reduce(word)) if word.size else 0
    acc ^= int(np.bitwise_xor.reduce(flat[word.size * 8 :])) if flat.size % 8 else 0
  return acc


class Channel:
  """One transport between a spawned producer and this process; `take()` returns one read batch."""

  def __init__(self, transport: str, size: str, nslots: int, total: int):
    n, t = SIZES[size]
    self.transport, self.i = transport, 0
    self.q = SPAWN.Queue(maxsize=nslots) if transport == "mp.Queue" else ShmQueue(schema(n, t), nslots=nslots)
    self.out = {k: np.empty_like(v) for k, v in make_batch(n, t).items()} if transport == "shm out" else None
    self.p = SPAWN.Process(target=_producer, args=(self.q, transport, n, t, total), daemon=True)
    self.p.start()
    if transport != "mp.Queue":
      self.q.watch(self.p)

  def take(self) -> int:
    if self.transport == "mp.Queue":
      arrays, meta = self.q.get(timeout=120)
    else:
      item = self.q.get(timeout=120, copy=self.transport != "shm views", out=self.out)
      arrays, meta = item.arrays, item.meta
    assert meta["i"] == self.i, (meta, self.i)
    self.i += 1
    return read_all(arrays)

  def close(self):
    self.p.join(60)
    if self.p.is_alive():
      self.p.kill()
      self.p.join()
    if self.transport == "mp.Queue":
      self.q.close()
      self.q.join_thread()
    else:
      self.q.close()


def measure(transports, size: str, nslots: int, reps: int, rounds: int, warmup: int) -> dict[str, list[float]]:
  """Batches/s per round for every transport, the transports timed INTERLEAVED round by round.

  All producers start first; an idle producer blocks on its full queue (back-pressure), so only the
  transport being timed moves data. Each round times one window of `reps` batches per transport.
  """
  chans = {tr: Channel(tr, size, nslots, warmup + reps * rounds) for tr in transports}
  try:
    for ch in chans.values():
      for _ in range(warmup):
        ch.take()
    rates = {tr: [] for tr in transports}
    for _ in range(rounds):
      for tr, ch in chans.items():
        t0 = time.perf_counter()
        for _ in range(reps):
          ch.take()
        rates[tr].append(reps / (time.perf_counter() - t0))
  finally:
    for ch in chans.values():
      ch.close()
  return rates


def memcpy_bandwidth(size: str, repeats: int = 10) -> float:
  """Bytes/s of np.copyto of the whole batch into preallocated arrays (best of `repeats`)."""
  batch = make_batch(*SIZES[size])
  dst = {k: np.empty_like(v) for k, v in batch.items()}
  for k in batch:  # touch the destination once so page faults are not timed
    np.copyto(dst[k], batch[k])
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    for k in batch:
      np.copyto(dst[k], batch[k])
    best = min(best, time.perf_counter() - t0)
  return nbytes(batch) / best


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="small,medium,large")
  ap.add_argument("--transports", default=",".join(TRANSPORTS))
  ap.add_argument("--nslots", type=int, default=4)
  ap.add_argument("--trials", type=int, default=3, help="interleaved rounds (one window per transport each)")
  ap.add_argument("--scale", type=float, default=1.0, help="multiplies the batch counts")
  args = ap.parse_args(argv)
  sizes = args.sizes.split(",")
  transports = args.transports.split(",")
  reps_for = {"small": 200, "medium": 30, "large": 10}

  rows = []
  hdr = f"{'batch':<8}{'MiB':>7}  {'transport':<10}{'batches/s':>11}{'GB/s':>8}{'of memcpy':>11}  vs mp.Queue (range)"
  print(f"cpus={os.cpu_count()} loadavg={os.getloadavg()[0]:.1f} nslots={args.nslots} trials={args.trials}")
  print(hdr)
  print("-" * len(hdr))
  for size in sizes:
    b = nbytes(make_batch(*SIZES[size]))
    bw = memcpy_bandwidth(size)
    reps = max(2, int(reps_for[size] * args.scale))
    rates = measure(transports, size, args.nslots, reps, args.trials, warmup=max(2, args.nslots + 1))
    base = rates.get("mp.Queue")
    for tr in transports:
      med = statistics.median(rates[tr])
      gbps = med * b / 1e9
      ratios = [x / y for x, y in zip(rates[tr], base)] if base else [float("nan")]
      row = {
        "batch": size,
        "N": SIZES[size][0],
        "T": SIZES[size][1],
        "mib": b / 2**20,
        "transport": tr,
        "batches_per_s": med,
        "gb_per_s": gbps,
        "memcpy_gb_per_s": bw / 1e9,
        "frac_of_memcpy": gbps * 1e9 / bw,
        "ratio_vs_mp_queue": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "rounds_batches_per_s": rates[tr],
      }
      rows.append(row)
      print(
        f"{size:<8}{b / 2**20:>7.1f}  {tr:<10}{med:>11.1f}{gbps:>8.2f}"
        f"{row['frac_of_memcpy']:>11.2f}{row['ratio_vs_mp_queue']:>9.1f} ({min(ratios):.1f}-{max(ratios):.1f})",
        flush=True,
      )
    print(f"{'':<8}{'':>7}  {'memcpy':<10}{bw / b:>11.1f}{bw / 1e9:>8.2f}{1.0:>11.2f}")
  large = {r["transport"]: r["ratio_vs_mp_queue"] for r in rows if r["batch"] == "large"}
  summary = {
    "benchmark": "shm_queue",
    "cpus": os.cpu_count(),
    "nslots": args.nslots,
    "loadavg_end": os.getloadavg()[0],
    "large_ratio_vs_mp_queue": large,
    "goal_8x_large": {k: v >= 8 for k, v in large.items() if k != "mp.Queue"},
    "rows": rows,
  }
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
