"""Bytes and time of one async publish, full model vs LoRA adapters (what travels per version).

    python -m benchmarks.lora_publish --rounds=5

For the CPU default policy (countdown: hidden 128, 3 layers, SwiGLU 256) and a 50M-parameter model (hidden 768,
7 layers, SwiGLU 3072; benchmarks/publish.py's sizes), full fine-tuning (every parameter published) against
LoRA at --ranks (default 8 and 64, all seven projections: only the adapters are published, the frozen base
went once at the sampler's start). Time: the learner-side synchronous publish of the shm path
(AsyncSource.publish with background_publish=false): the device_get of the published leaves and
ParamSlot.publish (the copy into /dev/shm with its fused checksum), median and range over rounds, float32
(the CPU publish dtype). Bytes are exact (the published tree). Prints a table and one JSON line.

    python -m benchmarks.lora_publish --apply --rounds=20

`--apply` instead times how the sampler applies a version, for LoRA rank 64 at each size: one decode step
(B = 8 rows, one token, a 256-slot KV cache; `transformer.forward` jitted as the sampler's decode step calls it)
with the adapters unmerged (x W + s (x A) B per projection) against the merged plain model (W + s A B), and the
merge itself (`lora.merge_into_base`, jitted: paid once per version). Median and range over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

SIZES = {"cpu_default": (128, 3, 256), "50M": (768, 7, 3072)}


def _tree(size: str, rank: int):
  import jax
  from flax import nnx

  from vcpo_jax.model import config, lora, transformer

  hidden, layers, ffn = SIZES[size]
  cfg = config.tiny_qwen2(vocab_size=512, hidden_size=hidden, num_layers=layers, intermediate_size=ffn, lora_rank=rank)
  cfg = cfg.replace(num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 128), head_dim=64)
  _, abstract = transformer.split(nnx.eval_shape(lambda: transformer.init(cfg)))
  travelling = lora.split(abstract)[0]  # what a publish moves
  keys = iter(jax.random.split(jax.random.key(0), 10_000))
  arrays = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), travelling)
  return cfg, arrays, lora.num_bytes(abstract)


def time_publish(arrays, rounds: int) -> list[float]:
  """Seconds of device_get + ParamSlot.publish (copy + checksum) per round, after one warm-up."""
  import jax

  from vcpo_jax.rollout.process import worker as worker_lib
  from vcpo_jax.rollout.process.param_slot import ParamSlot

  names = worker_lib.param_names(arrays)
  leaves = jax.tree.leaves(arrays)
  slot = ParamSlot({n: (x.shape, np.dtype(x.dtype)) for n, x in zip(names, leaves)}, nbuf=2)
  out = []
  try:
    for r in range(rounds + 1):
      t0 = time.perf_counter()
      host = {n: np.asarray(a) for n, a in zip(names, jax.device_get(leaves))}
      slot.publish(host, r)
      if r:
        out.append(time.perf_counter() - t0)
  finally:
    slot.close()
  return out


def time_apply(size: str, rank: int, rounds: int) -> dict:
  """ms (median, min, max) of an unmerged and a merged decode step, and of the merge (see the module docstring)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from vcpo_jax.model import lora, transformer

  cfg, _, _ = _tree(size, rank)
  graphdef, params = transformer.split(transformer.init(cfg, 0))
  params = lora.combine(jax.tree.map(lambda x: x + 0.01, lora.split(params)[0]), lora.split(params)[1])
  merge = jax.jit(lambda p: lora.merge_into_base(p, cfg)[1])
  merged = merge(params)
  g_plain = transformer.split(nnx.eval_shape(lambda: transformer.init(cfg.replace(lora_rank=0))))[0]
  b, s = 8, 256
  tok, pos = jnp.zeros((b, 1), jnp.int32), jnp.full((b, 1), s - 1, jnp.int32)
  mask = transformer.attn.AttentionMask(jnp.ones((b, s), bool))

  def step(g):
    return jax.jit(lambda p, c: transformer.forward(g, p, tok, pos, mask, c, jnp.int32(s - 1))[0])

  cache = transformer.init_cache(cfg, b, s)
  fns = {"unmerged": (step(graphdef), params), "merged": (step(g_plain), merged)}
  out = {}
  for name, (fn, p) in fns.items():
    jax.block_until_ready(fn(p, cache))
    ts = []
    for _ in range(rounds):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(p, cache))
      ts.append(time.perf_counter() - t0)
    out[name] = ts
  jax.block_until_ready(merge(params))
  ts = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(merge(params))
    ts.append(time.perf_counter() - t0)
  out["merge"] = ts
  return {k: [float(np.median(v)) * 1e3, float(min(v)) * 1e3, float(max(v)) * 1e3] for k, v in out.items()}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--sizes", default="cpu_default,50M")
  p.add_argument("--ranks", default="8,64", help="LoRA ranks (0, full fine-tuning, is always measured)")
  p.add_argument("--apply", action="store_true", help="time unmerged vs merged decode and the merge (see above)")
  a = p.parse_args(argv)
  if a.apply:
    res = {size: time_apply(size, 64, a.rounds) for size in a.sizes.split(",")}
    print("| model | decode step, unmerged (ms) | decode step, merged (ms) | merge, once per version (ms) |")
    print("|---|---|---|---|")
    f = lambda m: f"{m[0]:.2f} ({m[1]:.2f}-{m[2]:.2f})"
    for size, r in res.items():
      print(f"| {size} | {f(r['unmerged'])} | {f(r['merged'])} | {f(r['merge'])} |")
    print(json.dumps(dict(benchmark="lora_apply", args=vars(a), results=res, load=os.getloadavg()[0])))
    return
  rows = []
  for size in a.sizes.split(","):
    for rank in [0] + [int(r) for r in a.ranks.split(",")]:
      cfg, arrays, model_bytes = _tree(size, rank)
      from vcpo_jax.model import lora

      secs = time_publish(arrays, a.rounds)
      rows.append(
        dict(
          size=size,
          params=cfg.num_params,
          rank=rank,
          published_bytes=lora.num_bytes(arrays),
          model_bytes=model_bytes,
          publish_ms=[float(np.median(secs)) * 1e3, float(min(secs)) * 1e3, float(max(secs)) * 1e3],
          load=os.getloadavg()[0],
        )
      )
      print(f"[lora_publish] {json.dumps(rows[-1])}", flush=True)
  print("| model | parameters | LoRA rank | published MiB | of the model | publish ms, median (range) |")
  print("|---|---:|---:|---:|---:|---|")
  for x in rows:
    m = x["publish_ms"]
    print(
      f"| {x['size']} | {x['params'] / 1e6:.2f}M | {x['rank'] or 'full'} | {x['published_bytes'] / 2**20:.3f} | "
      f"{x['published_bytes'] / x['model_bytes']:.4f} | {m[0]:.2f} ({m[1]:.2f}-{m[2]:.2f}) |"
    )
  print(json.dumps(dict(benchmark="lora_publish", args=vars(a), results=rows)))


if __name__ == "__main__":
  main()
