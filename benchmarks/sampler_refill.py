"""Continuous batching: the refilling sampler vs static batching with long-tailed response lengths.

    python -m benchmarks.sampler_refill                       # small model, 128 rows on 32 slots, 3 rounds
    python -m benchmarks.sampler_refill --rows 128 --slots 32 --new 128 --chunk 16 --rounds 5 --model tiny

Both sides run the same host-driven chunked engine (`SamplerConfig.decode`: "chunked" = static batching,
the next `--slots` rows start once the whole batch has ended; "refill" = a finished row's slot takes the
next waiting row between chunks), the same weights, prompts and per-row response budgets (no stop ids, so
every row generates exactly its budget and both sides produce the same tokens, checked). Budgets are drawn
long-tailed: exponential, clipped to [1, --new], one row per batch of slots at the full --new (so every
static batch runs to the maximum), scaled so that the mean is --new / 4 (max = 4x mean, the issue's setting).
After one warm-up call per side (compiles), the sides run interleaved, round by round; tokens/s counts
response tokens. Prints a table, then one JSON line with the median and range of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from vcpo_jax import sampler as S
from vcpo_jax.model import config, transformer as tf

MODELS = {
  "tiny": lambda: config.tiny_qwen2(),  # 2 layers, D = 64, V = 256
  "small": lambda: config.tiny_qwen2(  # 4 layers, D = 256, V = 8192 (~4.5M parameters)
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32
  ),
}


def long_tailed_budgets(rows: int, slots: int, new: int, seed: int = 0) -> np.ndarray:
  """Exponential budgets clipped to [1, new], one row per batch of `slots` at `new`, the exponential's scale
  bisected so that the mean is new / 4 (max = 4x mean)."""
  rng = np.random.default_rng(seed)
  u = rng.exponential(1.0, rows)
  at_max = (rng.integers(0, slots, (rows + slots - 1) // slots) + np.arange(0, rows, slots))[:rows]
  at_max = at_max[at_max < rows]

  def draw(scale):
    b = np.clip(np.round(u * scale), 1, new).astype(np.int64)
    b[at_max] = new
    return b

  lo, hi = 0.0, float(new)
  for _ in range(50):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if draw(mid).mean() < new / 4 else (lo, mid)
  return draw(lo)


def bench(model="small", rows=128, slots=32, prompt=16, new=128, chunk=16, rounds=3, seed=0) -> dict:
  cfg = MODELS[model]()
  gd, params = tf.split(tf.init(cfg, seed=seed))
  scfg = S.SamplerConfig(
    temperature=1.0,
    prompt_buckets=(prompt,),
    new_token_buckets=(new,),
    batch_buckets=tuple(sorted({1, 2, 4, 8, 16, slots})),
    max_new_tokens=new,
    chunk_tokens=chunk,
  )
  smp = S.Sampler(gd, cfg, scfg)
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, cfg.vocab_size, prompt).tolist() for _ in range(rows)]
  budgets = long_tailed_budgets(rows, slots, new, seed)
  key = jax.random.key(seed)

  def run(mode):
    t0 = time.perf_counter()
    r = smp.generate(params, prompts, key, max_new_tokens=new, decode=mode, budgets=budgets)
    return time.perf_counter() - t0, r, smp.last_decode_steps

  warm = {m: run(m) for m in ("chunked", "refill")}
  np.testing.assert_array_equal(warm["chunked"][1].tokens, warm["refill"][1].tokens)
  times = {"chunked": [], "refill": []}
  steps = {m: warm[m][2] for m in warm}
  for _ in range(rounds):
    for m in ("chunked", "refill"):
      times[m].append(run(m)[0])
  tok = int(budgets.sum())
  tps = {m: [tok / t for t in ts] for m, ts in times.items()}
  ratios = [r / s for r, s in zip(tps["refill"], tps["chunked"])]
  out = dict(
    model=model,
    rows=rows,
    slots=slots,
    prompt=prompt,
    new=new,
    chunk=chunk,
    rounds=rounds,
    budget_mean=float(budgets.mean()),
    budget_max=int(budgets.max()),
    response_tokens=tok,
    decode_steps=steps,
    static_tokens_per_s=float(np.median(tps["chunked"])),
    refill_tokens_per_s=float(np.median(tps["refill"])),
    ratio_median=float(np.median(ratios)),
    ratio_range=[float(min(ratios)), float(max(ratios))],
    loadavg=os.getloadavg()[0],
    cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
  )
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="small", choices=sorted(MODELS))
  p.add_argument("--rows", type=int, default=128)
  p.add_argument("--slots", type=int, default=32)
  p.add_argument("--prompt", type=int, default=16)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--chunk", type=int, default=16)
  p.add_argument("--rounds", type=int, default=3)
  a = p.parse_args(argv)
  r = bench(a.model, a.rows, a.slots, a.prompt, a.new, a.chunk, a.rounds)
  print(f"{'mode':8s} {'tokens/s':>10s} {'decode steps':>13s}")
  print(f"{'static':8s} {r['static_tokens_per_s']:10.0f} {r['decode_steps']['chunked']:13d}")
  print(f"{'refill':8s} {r['refill_tokens_per_s']:10.0f} {r['decode_steps']['refill']:13d}")
  print(
    f"refill / static: median {r['ratio_median']:.2f}x, range {r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f} "
    f"over {a.rounds} interleaved rounds (budgets mean {r['budget_mean']:.1f}, max {r['budget_max']}; "
    f"load average {r['loadavg']:.1f} on {r['cpus']} cpus)"
  )
  print(json.dumps(r))


if __name__ == "__main__":
  main()
