"""Host peak RSS while loading a multi-file HF checkpoint onto 8 fake CPU devices: whole-host vs shard by shard.

Writes a random Llama-shaped float32 checkpoint of about 2 GB (4 safetensors files + index json; config.json
by hf_io.hf_config), then loads it in a fresh spawned interpreter per mode, on a ("data", "fsdp", "tensor")
mesh with the policy's rules (sharding.TRANSFORMER_RULES, as policy.build_policy loads it):

  baseline  imports jax and vcpo_jax, builds the mesh, reads config.json and the abstract model; no weights.
  before    the old whole-host path: hf_io.read_state_dict (every tensor whole, float32 numpy) ->
            hf_io.params_from_hf (a single-device model) -> jax.device_put into the shardings.
  after     hf_io.load_hf(mesh=...): each device block read as its own file slice, one block at a time.

Each child reports VmHWM (the kernel's peak resident set of that process, /proc/self/status) and
ru_maxrss. On fake CPU devices the devices' buffers ARE host memory, so the bound to check is
  after <= baseline + model bytes (the device buffers) + one tensor,   before ~ baseline + 2 x model.

  python -m benchmarks.load_rss                      # ~2 GB, mesh (1, 4, 2)
  python -m benchmarks.load_rss --layers=2 --mesh=1,8,1 --dir=/tmp/ckpt --keep
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import tempfile

import numpy as np


def _config(layers: int):
  from vcpo_jax.model import config as mconfig

  # Llama-3.2-1B-like widths: a 32000 x 2048 embedding and lm_head (262 MB each in f32) are the largest
  # tensors; 8 layers of 180 MB bring the model to about 2 GB.
  return mconfig.tiny_llama(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_layers=layers,
    num_heads=16,
    num_kv_heads=4,
    head_dim=128,
  )


def write_checkpoint(out_dir: str, layers: int, files: int = 4) -> dict:
  """A random float32 checkpoint split over `files` safetensors files + index; returns its sizes."""
  from safetensors.numpy import save_file

  from vcpo_jax.model import hf_io

  cfg = _config(layers)
  shapes = hf_io.hf_shapes(cfg)
  total = sum(int(np.prod(s)) * 4 for s in shapes.values())
  os.makedirs(out_dir, exist_ok=True)
  rng = np.random.default_rng(0)
  groups, group, size = [], [], 0
  for name, shape in shapes.items():  # consecutive tensors, about total / files bytes per file
    group.append(name)
    size += int(np.prod(shape)) * 4
    if size >= total / files and len(groups) < files - 1:
      groups.append(group)
      group, size = [], 0
  groups.append(group)
  weight_map = {}
  for i, names in enumerate(groups):
    fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    tensors = {n: rng.standard_normal(shapes[n], np.float32) * np.float32(0.02) for n in names}
    save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in names})
    del tensors
  with open(os.path.join(out_dir, hf_io.INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  hf_io.hf_config(cfg).save_pretrained(out_dir)
  largest = max(int(np.prod(s)) * 4 for s in shapes.values())
  return {"model_bytes": total, "largest_tensor_bytes": largest, "files": len(groups), "tensors": len(shapes)}


def _status() -> dict[str, int]:
  """Bytes of VmHWM, VmRSS, RssAnon (heap: numpy, XLA:CPU buffers) and RssFile (mapped files) now."""
  with open("/proc/self/status") as f:
    rows = dict(line.split(":", 1) for line in f if line.startswith(("VmHWM", "VmRSS", "RssAnon", "RssFile")))
  return {k: int(v.split()[0]) * 1024 for k, v in rows.items()}


class _AnonPeak:
  """Polls RssAnon / RssFile every 2 ms on a thread (VmHWM mixes them: safetensors maps the files)."""

  def __init__(self):
    import threading

    self.anon = self.file = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.is_set():
      s = _status()
      self.anon, self.file = max(self.anon, s["RssAnon"]), max(self.file, s["RssFile"])
      self._stop.wait(0.002)

  def stop(self) -> dict:
    import resource

    self._stop.set()
    self._thread.join()
    s = _status()
    return {
      "vm_hwm": s["VmHWM"],
      "vm_rss_end": s["VmRSS"],
      "anon_peak": max(self.anon, s["RssAnon"]),
      "file_peak": max(self.file, s["RssFile"]),
      "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _child(mode: str, ckpt: str, mesh_shape: tuple[int, int, int], queue) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  from flax import nnx

  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding as sh
  from vcpo_jax.model import hf_io
  from vcpo_jax.model import transformer as tf
  from vcpo_jax.model.config import ModelConfig

  poll = _AnonPeak()
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(mesh_shape), jax.devices()[:8])
  cfg = ModelConfig.from_hf(ckpt)
  nnx.eval_shape(lambda: tf.Transformer(cfg, rngs=nnx.Rngs(0)))
  params = None
  if mode == "before":
    tensors, sources = hf_io.read_state_dict(ckpt)
    model = hf_io.params_from_hf(tensors, cfg, sources=sources)
    del tensors  # the old load_hf returned the model only
    _, host = tf.split(model)
    del model
    params = jax.device_put(host, sh.param_shardings(host, sh.TRANSFORMER_RULES, mesh))
    del host
  elif mode == "after":
    _, params = tf.split(hf_io.load_hf(ckpt, mesh=mesh, rules=sh.TRANSFORMER_RULES)[1])
  out = poll.stop()
  import ctypes
  import gc

  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed blocks the allocator kept: not held by the loader
  out["vm_rss_trimmed"] = _status()["VmRSS"]
  if params is not None:
    leaves = jax.tree.leaves(params)
    jax.block_until_ready(leaves)
    out["device_bytes"] = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
  queue.put(out)


def measure(mode: str, ckpt: str, mesh_shape) -> dict:
  ctx = mp.get_context("spawn")
  queue = ctx.Queue()
  proc = ctx.Process(target=_child, args=(mode, ckpt, mesh_shape, queue))
  proc.start()
  out = queue.get(timeout=1800)
  proc.join(60)
  if proc.exitcode != 0:
    raise RuntimeError(f"load_rss child {mode!r} exited with {proc.exitcode}")
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=8, help="decoder layers (8: about 2 GB in float32)")
  p.add_argument("--mesh", default="1,4,2", help="(data, fsdp, tensor) over the 8 fake devices")
  p.add_argument("--dir", default="", help="checkpoint directory (default: a temporary one)")
  p.add_argument("--keep", action="store_true", help="keep the checkpoint")
  p.add_argument("--modes", default="baseline,before,after")
  args = p.parse_args(argv)
  mesh_shape = tuple(int(x) for x in args.mesh.split(","))
  ckpt = args.dir or tempfile.mkdtemp(prefix="load_rss_")
  try:
    sizes = write_checkpoint(ckpt, args.layers)
    rows = {m: measure(m, ckpt, mesh_shape) for m in args.modes.split(",")}
  finally:
    if not args.keep:
      shutil.rmtree(ckpt, ignore_errors=True)
  gib = lambda b: b / 2**30
  model, largest = sizes["model_bytes"], sizes["largest_tensor_bytes"]
  base = rows.get("baseline", {}).get("vm_hwm", 0)
  print(
    f"checkpoint: {sizes['files']} files, {sizes['tensors']} tensors, model {gib(model):.3f} GiB, "
    f"largest tensor {gib(largest):.3f} GiB; mesh {mesh_shape} on 8 fake CPU devices"
  )
  print(
    f"{'mode':<9} {'VmHWM':>7} {'- base':>7} {'/ model':>7} {'anon peak - base':>17} {'file peak':>9} {'RSS end':>8}"
  )
  base_anon = rows.get("baseline", {}).get("anon_peak", 0)
  for m, r in rows.items():
    r["above_baseline"] = r["vm_hwm"] - base
    r["anon_above_baseline"] = r["anon_peak"] - base_anon
    print(
      f"{m:<9} {gib(r['vm_hwm']):>7.3f} {gib(r['above_baseline']):>7.3f} {r['above_baseline'] / model:>7.2f} "
      f"{gib(r['anon_above_baseline']):>17.3f} {gib(r['file_peak']):>9.3f} {gib(r['vm_rss_end']):>8.3f}"
    )
  print("(GiB; ru_maxrss and the RSS after gc + malloc_trim are in the JSON)")
  if "after" in rows:
    bound, a = model + largest, rows["after"]
    for what, key in (("VmHWM", "above_baseline"), ("RssAnon peak", "anon_above_baseline")):
      ok = "met" if a[key] <= bound else "NOT met"
      print(f"bound: after {what} - baseline = {gib(a[key]):.3f} GiB <= model + one tensor = {gib(bound):.3f}: {ok}")
  result = {"sizes": sizes, "mesh": mesh_shape, "rows": rows, "load": os.getloadavg()}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
