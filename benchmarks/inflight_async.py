"""In-flight weight updates in async mode: countdown with and without them, per staleness budget k.

    python -m benchmarks.inflight_async --runs=/tmp/inflight_runs --steps=60 --ks=2,8 --seeds=0,1

Runs the real trainer (`vcpo_jax.trainer.run`) on configs/countdown.py (the speedup study's setup:
`vcpo_jax.experiments.speedup._config`, warm start included) in mode='async' with lag.k = k, once with
`async_.inflight_updates=False` (today's sampler: one version per batch, the static one-loop decode) and
once with it True (`async_.chunk_tokens` = `async_.update_every_tokens` = --chunk: the sampler looks at
the parameter slot after every chunk of decode steps; the KV cache is kept). Reports per run: final and
start evaluation accuracy, per-token lag (mean of train/token_lag_mean, max of train/token_lag_max), the
fraction of trajectories spanning several versions, ESS / N, the sampler's idle fraction, learner steps/s
(the learner's timeline, evaluation excluded) and the device-seconds (generation + update). Finished runs
(summary.json) are reused. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from vcpo_jax import metrics as metrics_lib
from vcpo_jax.experiments import speedup


def run_one(workdir: str, k: int, inflight: bool, steps: int, seed: int, chunk: int) -> None:
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return
  from vcpo_jax import trainer

  c = speedup._config("async", k, steps, seed, eval_every=0)
  c.async_.inflight_updates = inflight
  if inflight:
    c.async_.chunk_tokens = c.async_.update_every_tokens = chunk
  t0 = time.time()
  trainer.run(c, workdir)
  print(f"[inflight] k={k} inflight={inflight} seed={seed}: {time.time() - t0:.0f} s", flush=True)


def summarize(workdir: str) -> dict:
  base = speedup.summarize(workdir, None)
  train = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/pg_loss" in r]
  col = lambda name: np.asarray([r[name] for r in train if name in r], np.float64)
  return dict(
    final_acc=base["final_acc"],
    start_acc=base["start_acc"],
    token_lag_mean=float(col("train/token_lag_mean").mean()),
    token_lag_max=float(col("train/token_lag_max").max()),
    multi_version_frac=float(col("train/multi_version_frac").mean()),
    ess_ratio=float(col("train/ess_ratio").mean()),
    sampler_idle_frac=float(col("time/sampler_idle_frac").mean()),
    steps_per_s=base["steps_per_s"],
    device_s=base["device_s"],
    gen_s=base["gen_s"],
    learn_s=base["learn_s"],
  )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--runs", default="/tmp/inflight_runs")
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--ks", default="2,8")
  p.add_argument("--seeds", default="0,1")
  p.add_argument("--chunk", type=int, default=4)
  a = p.parse_args(argv)
  ks = [int(x) for x in a.ks.split(",")]
  seeds = [int(x) for x in a.seeds.split(",")]
  rows = []
  for seed in seeds:  # seed-major: a cut-short study still has every setting for the first seeds
    for k in ks:
      for inflight in (False, True):
        wd = os.path.join(a.runs, f"k{k}-{'inflight' if inflight else 'off'}-seed{seed}")
        run_one(wd, k, inflight, a.steps, seed, a.chunk)
        rows.append(dict(k=k, inflight=inflight, seed=seed, **summarize(wd)))
  cols = [
    ("final_acc", "{:.3f}"),
    ("start_acc", "{:.3f}"),
    ("token_lag_mean", "{:.2f}"),
    ("token_lag_max", "{:.0f}"),
    ("multi_version_frac", "{:.2f}"),
    ("ess_ratio", "{:.3f}"),
    ("sampler_idle_frac", "{:.2f}"),
    ("steps_per_s", "{:.2f}"),
    ("device_s", "{:.0f}"),
  ]
  print("| k | in-flight | seed | " + " | ".join(c for c, _ in cols) + " |")
  print("|---|---|---|" + "---|" * len(cols))
  for r in sorted(rows, key=lambda r: (r["k"], r["inflight"], r["seed"])):
    vals = " | ".join(f.format(r[c]) for c, f in cols)
    print(f"| {r['k']} | {'on' if r['inflight'] else 'off'} | {r['seed']} | {vals} |")
  print(json.dumps(dict(args=vars(a), rows=rows)))


if __name__ == "__main__":
  main()
