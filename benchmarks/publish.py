"""Learner-side publish time per step in async mode: background publish against the copy on the learner's path.

    python -m benchmarks.publish --rounds=3 --steps=8

Issue 14 item 3: `AsyncSource.publish` used to `device_get` every parameter and copy it into the shared-memory
slot on the learner's critical path each step; `async_.background_publish="true"` dispatches an on-device
snapshot and hands it to a thread; "false" copies in publish(); the default "auto" is "false" on the CPU
backend and "true" on accelerators (async_.background_for). This runs the real trainer (`vcpo_jax.trainer.run`,
configs/countdown.py, mode='async', lag.k = 2, no warm start, evaluation on 4 problems at start and end only)
at two model sizes: the CPU default (hidden 128, 3 layers, 0.4M parameters, N = 64) and a 50M-parameter model
(hidden 768, 7 layers, SwiGLU 3072; N = 8 so that a step stays affordable on 2 cores), each with
`background_publish` "false" (the copy in publish()) and "true" (the background thread). Both settings of a size
run in this process, in rounds, order rotated each round, with the same config, shapes, dtype (float32 on CPU)
and compile treatment (each run compiles its own step). Per run, medians over steps of: `time/publish_s` (the
trainer's learner-side blocking time inside `source.publish` after each update; the first publish, which
starts the sampler, is not a step and is not counted), `time/publish_copy_s` (the host copy's own time: the
thread's on the background path) and `time/learn_s + time/publish_s` (the learner's update plus publish: the
background thread's copy competes with the next update for the cores, which publish_s alone does not see).
Reported per size: the medians of both settings over rounds and the median and range of the per-round ratios
false / true of publish_s. Prints a table and one JSON line.

A setting "false:1" / "false:2" (or "true:2", ...) also sets async_.publish_buffers (parameter copies in the
slot: the synchronous path's one-copy slot against its double buffer), and "false:2:false" also sets
async_.publish_checksum (default "true"): e.g. --settings=false:2:false,false:2,false:1 compares the synchronous
path without the checksum (as before it had one), with it, and with it and one parameter copy.

    python -m benchmarks.publish --checksum --rounds=7

`--checksum` instead times, per size, on host arrays of the model's own parameter shapes (float32, random):
the slot's copy alone (np.copyto into a mapped slot buffer, as ParamSlot.publish did before the checksum), the
slot's copy with its fused checksum (ParamSlot's block copy + row sums: what publish() does now; "read": the
same walk out of the slot into given arrays, what latest() does),
the checksum as a separate pass (`param_slot.checksum`) and zlib.adler32 over the same bytes (the previous
checksum), in rounds with the order rotated; median and range over rounds, and the ratios to the copy.

A setting's 4th and 5th fields set async_.publish_delta and async_.publish_dtype: e.g.
--settings=false:1,false:1:true:auto,false:1:true:off:bfloat16,false:1:true:auto:bfloat16 compares full and delta
publishing (the table's "MB per publish": bytes written into the slot per publish after the first).

    python -m benchmarks.publish --delta --layers=4 --rounds=5 --lr=1e-6

`--delta` instead times full against delta publishing through ParamSlot at Qwen2.5-1.5B's widths (`--layers` of
its 28 decoder layers, no embedding, bfloat16, random host arrays moved by lr * N(0, 1) per element per round,
the size of an AdamW step): write and read seconds, bytes per publish, the fraction of elements and bytes changed
(`delta_costs`). `--path=transfer` times the transfer path's full against delta pulls instead, both ends in this
process over loopback transfer servers (`transfer_delta_costs`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

SIZES = {
  # name: (hidden, layers, intermediate, prompts per step, group size)
  "cpu_default": (128, 3, 256, 8, 8),
  "50M": (768, 7, 3072, 2, 4),
}


def _config(size: str, steps: int, background: str):
  from configs import countdown

  background, buffers, csum, delta, dtype = (background.split(":") + ["", "", "", ""])[:5]

  hidden, layers, ffn, prompts, group = SIZES[size]
  c = countdown.get_config()
  c.mode, c.lag.k, c.steps = "async", 2, steps
  c.model.hidden_size, c.model.num_layers, c.model.intermediate_size = hidden, layers, ffn
  c.task.prompts_per_step, c.task.group_size = prompts, group
  c.sft.steps = 0
  c.eval.every, c.eval.num_problems, c.eval.n = 0, 4, 1
  c.checkpoint.every = steps
  c.log.progress = c.log.plots = False
  if background == "device":  # async_.publish_path='device': a sampler thread on fake CPU device 1
    c.async_.publish_path, c.async_.sampler_devices = "device", "1"
    c.async_.max_sampler_restarts = 0  # replacement needs the shm path
  elif background == "transfer":  # async_.publish_path='transfer': a sampler process pulling from this one
    c.async_.publish_path = "transfer"
    c.async_.max_sampler_restarts = 0  # replacement needs the shm path
    c.async_.publish_delta = delta or "off"  # "transfer:0:true:auto": delta pulls
    if os.environ.get("BENCH_PUBLISH_DEVICES"):
      c.async_.sampler_devices = "1"
  else:
    c.async_.background_publish = background
    c.async_.publish_buffers = int(buffers or 0)
    c.async_.publish_checksum = csum or "true"
    c.async_.publish_delta = delta or "off"
    c.async_.publish_dtype = dtype or "auto"
    if os.environ.get("BENCH_PUBLISH_DEVICES"):  # --settings with "device": the same learner device for all
      c.async_.sampler_devices = "1"
  return c


def num_params(size: str) -> int:
  from vcpo_jax import run_config

  return run_config.parse_config(_config(size, 2, "true")).model_cfg.num_params


def run_one(size: str, steps: int, background: str) -> dict:
  """One trainer run; returns medians over its steps (seconds) of publish_s, publish_copy_s, learn_s + publish_s."""
  from vcpo_jax import metrics as metrics_lib
  from vcpo_jax import rollout, trainer

  built, build = [], rollout.build_source
  rollout.build_source = lambda *a, **kw: built.append(build(*a, **kw)) or built[-1]
  try:
    with tempfile.TemporaryDirectory(prefix="bench_publish_") as wd:
      trainer.run(_config(size, steps, background), wd)
      rows = [r for r in metrics_lib.read_jsonl(os.path.join(wd, "metrics.jsonl")) if "time/publish_s" in r]
  finally:
    rollout.build_source = build
  if len(rows) != steps:
    raise RuntimeError(f"expected {steps} publish timings, got {len(rows)}")
  med = lambda xs: float(np.median(xs)) if xs else float("nan")
  return dict(
    publish=med([r["time/publish_s"] for r in rows]),
    copy=med([r["time/publish_copy_s"] for r in rows if "time/publish_copy_s" in r]),
    step=med([r["time/learn_s"] + r["time/publish_s"] for r in rows]),
    # transfer: the server thread's await_pull registration per pull request (off the learner's thread)
    offer=med(getattr(built[0].publisher, "offer_s", [])),
    # delta publishing: bytes written into the slot per publish after the first (a full copy: the slot's size)
    bytes=med([b for _, _, b in list(built[0].publisher.publish_records)[1:]])
    if built[0].publisher.publish_records
    else float("nan"),
    full_bytes=float(built[0].publisher.publish_records[0][2]) if built[0].publisher.publish_records else float("nan"),
    delta_frac=float(np.mean([k == "delta" for _, k, _ in list(built[0].publisher.publish_records)[1:]] or [0.0])),
  )


def checksum_costs(size: str, rounds: int) -> dict:
  """Seconds (median, min, max over rounds) of: the slot copy, the copy with its fused checksum, the checksum as
  its own pass, zlib.adler32; at `size`'s parameter shapes (float32)."""
  import zlib

  from vcpo_jax import run_config
  from vcpo_jax.rollout.process import param_slot
  from vcpo_jax.rollout.process import worker as worker_lib

  model_cfg = run_config.parse_config(_config(size, 2, "false")).model_cfg
  _, abstract = worker_lib.abstract_params(model_cfg)
  import jax

  rng = np.random.default_rng(0)
  arrays = {
    n: rng.standard_normal(x.shape, dtype=np.float32)
    for n, x in zip(worker_lib.param_names(abstract), jax.tree.leaves(abstract))
  }
  slot = param_slot.ParamSlot(arrays, nbuf=1)
  dst = slot._views[0]
  for n, a in arrays.items():  # fault the slot's pages in once, as a running slot has
    np.copyto(dst[n], a)

  def copy():
    for n, a in arrays.items():
      np.copyto(dst[n], a)

  def copy_checksum():  # what ParamSlot.publish does now (its header updates aside)
    return param_slot._copy_sum(slot._bufs[0], slot._offsets, arrays, into_buf=True)

  out = {n: np.empty_like(a) for n, a in arrays.items()}
  for n, a in out.items():
    np.copyto(a, arrays[n])

  def read_checksum():  # what ParamSlot.latest does now, into arrays given as `out`
    return param_slot._copy_sum(slot._bufs[0], slot._offsets, out, into_buf=False)

  def adler():
    c = 1
    for a in arrays.values():
      c = zlib.adler32(a.reshape(-1).view(np.uint8), c)

  fns = {
    "copy": copy,
    "copy_checksum": copy_checksum,
    "read_checksum": read_checksum,
    "checksum": lambda: param_slot.checksum(arrays),
    "adler32": adler,
  }
  assert copy_checksum() == param_slot.checksum(arrays)
  per = {k: [] for k in fns}
  try:
    for r in range(rounds):
      for k in list(fns) if r % 2 == 0 else list(fns)[::-1]:
        t0 = time.perf_counter()
        fns[k]()
        per[k].append(time.perf_counter() - t0)
  finally:
    slot.close()
  ratio = lambda k: np.asarray(per[k]) / np.asarray(per["copy"])
  return dict(
    size=size,
    params=int(sum(a.size for a in arrays.values())),
    ms={k: [float(np.median(v)) * 1e3, float(min(v)) * 1e3, float(max(v)) * 1e3] for k, v in per.items()},
    over_copy={k: [float(np.median(ratio(k))), float(ratio(k).min()), float(ratio(k).max())] for k in fns},
  )


def main_checksum(a):
  results = []
  for size in a.sizes.split(","):
    load0 = os.getloadavg()
    x = checksum_costs(size, a.rounds)
    x["load_before"], x["load_after"] = list(load0), list(os.getloadavg())
    results.append(x)
  print(
    "| model | parameters | copy (ms) | write: copy + checksum (ms) | read: checksum + copy (ms) | checksum pass (ms) "
    "| zlib.adler32 (ms) | load avg |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---|")
  fmt = lambda v: "{:.2f} ({:.2f}-{:.2f})".format(*v)
  keys = ("copy_checksum", "read_checksum", "checksum", "adler32")
  for x in results:
    m, r = x["ms"], x["over_copy"]
    print(
      f"| {x['size']} | {x['params'] / 1e6:.1f}M | {fmt(m['copy'])} | "
      + " | ".join(fmt(m[k]) for k in keys)
      + f" | {x['load_before'][0]:.1f} -> {x['load_after'][0]:.1f} |"
    )
    print("|  | / copy, per round |  | " + " | ".join("{:.2f}x ({:.2f}-{:.2f})".format(*r[k]) for k in keys) + " |  |")
  print(json.dumps(dict(benchmark="publish_checksum", args=vars(a), results=results)))


QWEN25_1P5B = {"hidden": 1536, "ffn": 8960, "heads": 12, "kv_heads": 2, "head_dim": 128, "vocab": 151936, "layers": 28}


def qwen_1p5b_shapes(layers: int, embed: bool = False) -> dict:
  """{name: shape} of `layers` decoder layers at Qwen2.5-1.5B's widths (q/k/v biases, two norms), and its tied
  embedding if `embed`: the parameters a publish moves (46.8M per layer, 233M embedding, 1.54B at 28 layers)."""
  q = QWEN25_1P5B
  d, f, kv = q["hidden"], q["ffn"], q["kv_heads"] * q["head_dim"]
  one = {"q": (d, d), "q_b": (d,), "k": (d, kv), "k_b": (kv,), "v": (d, kv), "v_b": (kv,), "o": (d, d)}
  one.update({"gate": (d, f), "up": (d, f), "down": (f, d), "ln1": (d,), "ln2": (d,)})
  out = {"embed": (q["vocab"], d)} if embed else {}
  for i in range(layers):
    out.update({f"layers.{i}.{n}": s for n, s in one.items()})
  return out


def testbed_shapes(size: str) -> dict:
  """{name: shape} of a SIZES model's parameters (configs/countdown.py at that size)."""
  import jax

  from vcpo_jax import run_config
  from vcpo_jax.rollout.process import worker as worker_lib

  _, abstract = worker_lib.abstract_params(run_config.parse_config(_config(size, 2, "false")).model_cfg)
  return {n: tuple(x.shape) for n, x in zip(worker_lib.param_names(abstract), jax.tree.leaves(abstract))}


def _rng3(xs) -> list[float]:
  return [float(np.median(xs)), float(np.min(xs)), float(np.max(xs))]


def _delta_summary(setting: dict, shapes: dict, per: dict, **changed) -> dict:
  """A delta study's result: the setting, the parameter count, [median, min, max] over rounds of each way's
  ("full", "delta") fields, the full / delta ratio of write_s, read_s and bytes, and the changed fractions."""
  ratio = lambda f: np.asarray(per["full"][f]) / np.asarray(per["delta"][f])
  return dict(
    **setting,
    params=int(sum(int(np.prod(s)) for s in shapes.values())),
    **{f"{k}_{f}": _rng3(per[k][f]) for k in per for f in per[k]},
    full_over_delta={f: _rng3(ratio(f)) for f in ("write_s", "read_s", "bytes")},
    **changed,
  )


def delta_costs(layers: int, lr: float, rounds: int, seed: int = 0, shape: str = "1.5B", dtype: str = "bfloat16"):
  """Full against delta publishing through ParamSlot (bfloat16, one copy, checksum on), writer and reader in this
  process (the reader takes every version before the next publish, as the sampler does at one batch per step).
  Each round: a float32 master moves by lr * N(0, 1) per element (an AdamW step's size), is cast to bfloat16,
  and both slots publish it, then their readers read it, the order of the two slots alternating by round.
  Per round: write (publish) and read (latest) seconds, bytes written into the slot, the fraction of bfloat16
  elements and of bytes that changed; the readers' checksums must equal the writers' (and each other's)."""
  import ml_dtypes

  from vcpo_jax.rollout.process.param_slot import ParamSlot

  bf16 = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
  rng = np.random.default_rng(seed)
  shapes = qwen_1p5b_shapes(layers) if shape == "1.5B" else testbed_shapes(shape)
  master = {  # vectors (norms, biases) at 1, matrices ~ N(0, 0.02^2)
    n: (np.ones(s, np.float32) if len(s) < 2 else 0.02 * rng.standard_normal(s, np.float32)) for n, s in shapes.items()
  }
  cast = lambda: {n: m.astype(bf16) for n, m in master.items()}
  arrays = cast()
  slots = {"full": ParamSlot(arrays, nbuf=1), "delta": ParamSlot(arrays, nbuf=1, delta=True)}
  readers = {}
  for k, slot in slots.items():
    readers[k] = ParamSlot.__new__(ParamSlot)
    readers[k].__setstate__(slot.__getstate__())  # the sampler's end (what unpickling in its process builds)
    slot.publish(arrays, 0)
    readers[k].latest(timeout=60.0)
  per = {k: {"write_s": [], "read_s": [], "bytes": []} for k in slots}
  changed_el, changed_b = [], []
  try:
    for r in range(rounds):
      for m in master.values():
        m -= np.float32(lr) * rng.standard_normal(m.shape, np.float32)
      prev, arrays = arrays, cast()
      el = sum(int((a != prev[n]).sum()) for n, a in arrays.items())
      by = sum(int((a.view(np.uint8) != prev[n].view(np.uint8)).sum()) for n, a in arrays.items())
      size = sum(a.size for a in arrays.values())
      changed_el.append(el / size)
      changed_b.append(by / (bf16.itemsize * size))
      sums = set()
      for k in list(slots) if r % 2 == 0 else list(slots)[::-1]:
        t0 = time.perf_counter()
        slots[k].publish(arrays, r + 1)
        t1 = time.perf_counter()
        v, got = readers[k].latest(timeout=60.0)
        t2 = time.perf_counter()
        assert v == r + 1 and readers[k].checksum_of(got, list(slots[k].spec)) == slots[k].last_checksum
        sums.add(slots[k].last_checksum)
        per[k]["write_s"].append(t1 - t0)
        per[k]["read_s"].append(t2 - t1)
        per[k]["bytes"].append(slots[k].last_publish["bytes"])
        del got
      assert len(sums) == 1  # both slots published the same bytes
      print(
        f"[publish --delta] round {r}: "
        + ", ".join(
          f"{k} write {per[k]['write_s'][-1]:.2f} s read {per[k]['read_s'][-1]:.2f} s {per[k]['bytes'][-1] / 1e6:.1f} MB"
          for k in slots
        )
        + f", {100 * changed_el[-1]:.2f}% elements changed (load {os.getloadavg()[0]:.1f})",
        flush=True,
      )
  finally:
    for x in (*readers.values(), *slots.values()):
      x.close()
  setting = dict(shape=shape, dtype=dtype, layers=layers, lr=lr)
  return _delta_summary(setting, shapes, per, changed_elements=_rng3(changed_el), changed_bytes=_rng3(changed_b))


def transfer_delta_costs(
  layers: int, lr: float, rounds: int, seed: int = 0, shape: str = "1.5B", dtype: str = "bfloat16"
):
  """Full against delta pulls of the transfer path (rollout/transfer_publish.py) at `shape`, both ends in this
  process: two jax.experimental.transfer servers on its CPU device, one connected to the other over loopback.
  Each round the master moves as in `delta_costs`; "full" is the learner's device snapshot pulled whole (await_pull
  + pull: the path without delta), "delta" is what the delta path does per publish: the learner's answer (the
  snapshot to host, packed, `delta.encode` against the version the sampler holds, the record put on the device),
  the record's pull, and the sampler's rebuild (`delta.decode` into its held copy, the arrays put on the device).
  Order alternating by round; the rebuilt arrays' device checksum must equal the published one's. Seconds of the
  learner's side (write_s: snapshot + answer), the pull (pull_s) and the sampler's side (read_s: pull + rebuild)."""
  import itertools

  import jax
  import ml_dtypes
  from jax.experimental import transfer

  from vcpo_jax.rollout.device_publish import device_checksum
  from vcpo_jax.rollout.process import delta as delta_lib

  np_dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
  rng = np.random.default_rng(seed)
  shapes = qwen_1p5b_shapes(layers) if shape == "1.5B" else testbed_shapes(shape)
  master = {
    n: (np.ones(s, np.float32) if len(s) < 2 else 0.02 * rng.standard_normal(s, np.float32)) for n, s in shapes.items()
  }
  device = jax.devices()[0]
  one = jax.sharding.SingleDeviceSharding(device)
  learner = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
  sampler = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
  conn, uuids = sampler.connect(learner.address()), itertools.count(1)
  layout = delta_lib.Layout({n: (s, np_dt) for n, s in shapes.items()})
  specs = [jax.ShapeDtypeStruct(s, np_dt, sharding=one) for s in shapes.values()]
  snapshot = lambda: [jax.device_put(m.astype(np_dt), one) for m in master.values()]
  snap = jax.block_until_ready(snapshot())
  base = layout.pack(dict(zip(shapes, jax.device_get(snap))))  # the version both ends hold (the learner's copy)
  held = base.copy()  # the sampler's

  def full(snap):
    t0 = time.perf_counter()
    uuid = next(uuids)
    learner.await_pull(uuid, snap)
    t1 = time.perf_counter()
    got = jax.block_until_ready(conn.pull(uuid, specs))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, t2 - t1, layout.nbytes, got

  def delta(snap):
    nonlocal base, held
    t0 = time.perf_counter()
    new = layout.pack(dict(zip(shapes, jax.device_get(snap))))
    record = delta_lib.encode(new, base, layout.blocks, layout.nbytes)
    uuid = next(uuids)
    learner.await_pull(uuid, [jax.device_put(np.frombuffer(record, np.uint8), one)])
    base = new
    t1 = time.perf_counter()
    rec = np.asarray(
      jax.block_until_ready(conn.pull(uuid, [jax.ShapeDtypeStruct((len(record),), np.uint8, sharding=one)]))[0]
    )
    t2 = time.perf_counter()
    held = delta_lib.decode(rec, held, np.empty(layout.nbytes, np.uint8), layout.blocks)
    got = jax.block_until_ready([jax.device_put(a, one) for a in layout.views(held).values()])
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t1, len(record), got

  ways = {"full": full, "delta": delta}
  per = {k: {"write_s": [], "pull_s": [], "read_s": [], "bytes": []} for k in ways}
  changed_b = []
  for r in range(rounds):
    for m in master.values():
      m -= np.float32(lr) * rng.standard_normal(m.shape, np.float32)
    prev_base = base
    snap = jax.block_until_ready(snapshot())
    want = int(device_checksum(snap))
    for k in list(ways) if r % 2 == 0 else list(ways)[::-1]:
      w, p, rd, nb, got = ways[k](snap)
      assert int(device_checksum(got)) == want, k  # bit for bit
      for f, v in zip(("write_s", "pull_s", "read_s", "bytes"), (w, p, rd, nb)):
        per[k][f].append(v)
      del got
    changed_b.append(float((base != prev_base).mean()))
    print(
      f"[publish --delta --path=transfer] round {r}: "
      + ", ".join(
        f"{k} write {per[k]['write_s'][-1]:.2f} s read {per[k]['read_s'][-1]:.2f} s {per[k]['bytes'][-1] / 1e6:.1f} MB"
        for k in ways
      )
      + f", {100 * changed_b[-1]:.2f}% bytes changed (load {os.getloadavg()[0]:.1f})",
      flush=True,
    )
  setting = dict(path="transfer", shape=shape, dtype=dtype, layers=layers, lr=lr)
  return _delta_summary(setting, shapes, per, changed_bytes=_rng3(changed_b))


def main_delta(a):
  load0 = os.getloadavg()
  if a.path == "transfer":
    x = transfer_delta_costs(a.layers, a.lr, a.rounds, shape=a.shape, dtype=a.dtype)
    x["load_before"], x["load_after"] = list(load0), list(os.getloadavg())
    fmt = lambda v, m=1.0: "{:.2f} ({:.2f}-{:.2f})".format(*(m * t for t in v))
    print(
      "| setting | learner s | pull s | sampler s (pull + rebuild) | MB per publish | full / delta (learner, sampler, bytes) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for k in ("full", "delta"):
      rat = "" if k == "full" else ", ".join(fmt(x["full_over_delta"][f]) for f in ("write_s", "read_s", "bytes"))
      print(
        f"| {k} | {fmt(x[f'{k}_write_s'])} | {fmt(x[f'{k}_pull_s'])} | {fmt(x[f'{k}_read_s'])} | {fmt(x[f'{k}_bytes'], 1e-6)} | {rat} |"
      )
    print(
      f"changed per step: {fmt(x['changed_bytes'], 100)} % of bytes; load {x['load_before'][0]:.1f} -> {x['load_after'][0]:.1f}"
    )
    print(json.dumps({"benchmark": "publish_delta_transfer", "args": vars(a), "result": x}))
    return
  x = delta_costs(a.layers, a.lr, a.rounds, shape=a.shape, dtype=a.dtype)
  x["load_before"], x["load_after"] = list(load0), list(os.getloadavg())
  scale = QWEN25_1P5B["layers"] / a.layers if a.shape == "1.5B" else 1.0
  print("| setting | write s | read s | MB per publish | MB at 28 layers | full / delta (write, read, bytes) |")
  print("|---|---:|---:|---:|---:|---|")
  fmt = lambda v, m=1.0: "{:.2f} ({:.2f}-{:.2f})".format(*(m * t for t in v))
  for k in ("full", "delta"):
    rat = "" if k == "full" else ", ".join(fmt(x["full_over_delta"][f]) for f in ("write_s", "read_s", "bytes"))
    print(
      f"| {k} | {fmt(x[f'{k}_write_s'])} | {fmt(x[f'{k}_read_s'])} | {fmt(x[f'{k}_bytes'], 1e-6)} | "
      f"{fmt(x[f'{k}_bytes'], 1e-6 * scale)} | {rat} |"
    )
  print(
    f"changed per step: {fmt(x['changed_elements'], 100)} % of elements, {fmt(x['changed_bytes'], 100)} % of "
    f"bytes; load {x['load_before'][0]:.1f} -> {x['load_after'][0]:.1f}"
  )
  print(json.dumps({"benchmark": "publish_delta", "args": vars(a), "result": x}))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--sizes", default="cpu_default,50M")
  p.add_argument(
    "--settings",
    default="false,true",
    help="background_publish values and/or 'device' (publish_path='device' on 2 fake CPU devices: learner on "
    "device 0, sampler thread on device 1; every setting then runs its learner on device 0 alone) and/or "
    "'transfer' (publish_path='transfer': a sampler process pulling with jax.experimental.transfer)",
  )
  p.add_argument("--checksum", action="store_true", help="time the slot copy against its checksum (see above)")
  p.add_argument("--delta", action="store_true", help="full against delta publishing at Qwen2.5-1.5B widths")
  p.add_argument("--layers", type=int, default=4, help="--delta: decoder layers of the 1.5B widths (of 28)")
  p.add_argument("--lr", type=float, default=1e-6, help="--delta: the update's size per element (AdamW lr)")
  p.add_argument("--shape", default="1.5B", help="--delta: 1.5B (Qwen2.5-1.5B widths) or a SIZES model")
  p.add_argument("--dtype", default="bfloat16", help="--delta: the published dtype (bfloat16 | float32)")
  p.add_argument("--path", default="shm", help="--delta: shm (ParamSlot) | transfer (jax.experimental.transfer pulls)")
  a = p.parse_args(argv)
  if a.checksum:
    return main_checksum(a)
  if a.delta:
    return main_delta(a)
  settings = a.settings.split(",")
  if "device" in settings:  # before JAX is imported (vcpo_jax is imported inside the functions)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    os.environ["BENCH_PUBLISH_DEVICES"] = "1"
  results = []
  for size in a.sizes.split(","):
    per = {b: [] for b in settings}
    load0 = os.getloadavg()
    for r in range(a.rounds):
      for background in settings if r % 2 == 0 else settings[::-1]:
        t0 = time.time()
        per[background].append(run_one(size, a.steps, background))
        x = per[background][-1]
        print(
          f"[publish] {size} round {r} background={background}: publish {x['publish'] * 1e3:.2f} ms, copy "
          f"{x['copy'] * 1e3:.2f} ms, learn+publish {x['step'] * 1e3:.1f} ms, offer {x['offer'] * 1e3:.2f} ms, "
          f"{x['bytes'] / 1e6:.3f} of {x['full_bytes'] / 1e6:.3f} MB, delta {x['delta_frac']:.2f} "
          f"({time.time() - t0:.0f} s run, load {os.getloadavg()[0]:.1f})",
          flush=True,
        )
    col = lambda b, f: [x[f] * 1e3 for x in per[b]]
    ratios = {b: np.asarray(col(settings[0], "publish")) / np.asarray(col(b, "publish")) for b in settings[1:]}
    results.append(
      dict(
        size=size,
        params=num_params(size),
        **{f"{b}_{f}_ms": float(np.median(col(b, f))) for b in per for f in ("publish", "copy", "step", "offer")},
        **{f"{b}_mb": float(np.median([x["bytes"] for x in per[b]])) / 1e6 for b in per},
        ratios={b: [float(np.median(r)), float(r.min()), float(r.max())] for b, r in ratios.items()},
        per_round={b: per[b] for b in per},
        load_before=list(load0),
        load_after=list(os.getloadavg()),
      )
    )
  print(
    f"| model | parameters | setting | publish_s (ms) | {settings[0]} / setting, median (range) | "
    "publish_copy_s (ms) | learn + publish (ms) | MB per publish | load avg |"
  )
  print("|---|---:|---|---:|---|---:|---:|---:|---|")
  for x in results:
    for b in settings:
      ratio = "" if b == settings[0] else "{:.1f}x ({:.1f}-{:.1f})".format(*x["ratios"][b])
      print(
        f"| {x['size']} | {x['params'] / 1e6:.1f}M | {b} | {x[f'{b}_publish_ms']:.2f} | {ratio} | "
        f"{x[f'{b}_copy_ms']:.2f} | {x[f'{b}_step_ms']:.0f} | {x[f'{b}_mb']:.3f} | "
        f"{x['load_before'][0]:.1f} -> {x['load_after'][0]:.1f} |"
      )
  print(json.dumps(dict(benchmark="publish", args=vars(a), results=results)))


if __name__ == "__main__":
  main()
