"""Learner-side publish time per step in async mode: background publish against the copy on the learner's path.

    python -m benchmarks.publish --rounds=3 --steps=8

Issue 14 item 3: `AsyncSource.publish` used to `device_get` every parameter and copy it into the shared-memory
slot on the learner's critical path each step; `async_.background_publish=True` (the default) dispatches an
on-device snapshot and hands it to a thread. This runs the real trainer (`vcpo_jax.trainer.run`,
configs/countdown.py, mode='async', lag.k = 2, no warm start, evaluation on 4 problems at start and end only)
at two model sizes: the CPU default (hidden 128, 3 layers, 0.4M parameters, N = 64) and a 50M-parameter model
(hidden 768, 7 layers, SwiGLU 3072; N = 8 so that a step stays affordable on 2 cores), each with
`background_publish` False ("before": the copy in publish()) and True ("after"). Both settings of a size run
in this process, in rounds, order rotated each round, with the same config, shapes, dtype (float32 on CPU) and
compile treatment (each run compiles its own step). Per run: the median over steps of `time/publish_s` (the
trainer's learner-side time inside `source.publish` after each update; the first publish, which starts the
sampler, is not a step and is not counted). Reported per size: the medians of both settings over rounds and
the median and range of the per-round ratios before / after. Prints a table and one JSON line.
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


def _config(size: str, steps: int, background: bool):
  from configs import countdown

  hidden, layers, ffn, prompts, group = SIZES[size]
  c = countdown.get_config()
  c.mode, c.lag.k, c.steps = "async", 2, steps
  c.model.hidden_size, c.model.num_layers, c.model.intermediate_size = hidden, layers, ffn
  c.task.prompts_per_step, c.task.group_size = prompts, group
  c.sft.steps = 0
  c.eval.every, c.eval.num_problems, c.eval.n = 0, 4, 1
  c.checkpoint.every = steps
  c.log.progress = c.log.plots = False
  c.async_.background_publish = background
  return c


def num_params(size: str) -> int:
  from vcpo_jax import run_config

  return run_config.parse_config(_config(size, 2, True)).model_cfg.num_params


def run_one(size: str, steps: int, background: bool) -> float:
  """One trainer run; returns the median learner-side publish time per step (seconds)."""
  from vcpo_jax import metrics as metrics_lib
  from vcpo_jax import trainer

  with tempfile.TemporaryDirectory(prefix="bench_publish_") as wd:
    trainer.run(_config(size, steps, background), wd)
    rows = metrics_lib.read_jsonl(os.path.join(wd, "metrics.jsonl"))
    pub = [r["time/publish_s"] for r in rows if "time/publish_s" in r]
  if len(pub) != steps:
    raise RuntimeError(f"expected {steps} publish timings, got {len(pub)}")
  return float(np.median(pub))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--sizes", default="cpu_default,50M")
  a = p.parse_args(argv)
  results = []
  for size in a.sizes.split(","):
    per = {False: [], True: []}
    load0 = os.getloadavg()
    for r in range(a.rounds):
      for background in (False, True) if r % 2 == 0 else (True, False):
        t0 = time.time()
        per[background].append(run_one(size, a.steps, background))
        print(
          f"[publish] {size} round {r} background={background}: {per[background][-1] * 1e3:.2f} ms "
          f"({time.time() - t0:.0f} s run)",
          flush=True,
        )
    ratios = np.asarray(per[False]) / np.asarray(per[True])
    results.append(
      dict(
        size=size,
        params=num_params(size),
        before_ms=float(np.median(per[False]) * 1e3),
        after_ms=float(np.median(per[True]) * 1e3),
        ratio_median=float(np.median(ratios)),
        ratio_min=float(ratios.min()),
        ratio_max=float(ratios.max()),
        per_round_before_ms=[x * 1e3 for x in per[False]],
        per_round_after_ms=[x * 1e3 for x in per[True]],
        load_before=list(load0),
        load_after=list(os.getloadavg()),
      )
    )
  print(
    "| model | parameters | before: copy in publish() (ms) | after: background (ms) | before / after, median (range) | load avg |"
  )
  print("|---|---:|---:|---:|---|---|")
  for x in results:
    print(
      f"| {x['size']} | {x['params'] / 1e6:.1f}M | {x['before_ms']:.2f} | {x['after_ms']:.2f} | "
      f"{x['ratio_median']:.1f}x ({x['ratio_min']:.1f}-{x['ratio_max']:.1f}) | "
      f"{x['load_before'][0]:.1f} -> {x['load_after'][0]:.1f} |"
    )
  print(json.dumps(dict(benchmark="publish", args=vars(a), results=results)))


if __name__ == "__main__":
  main()
