"""The endpoints of moe_replay_protocol.md from its six run directories: a markdown table and a JSON record.

  python docs/results/moe_replay_table.py /tmp/h41v --out=docs/results/moe_replay_runs.json

Reads <root>/moe_r{1,0}_s{0,1,2}/{eval,metrics}.jsonl (r1: routing replay on, r0: off); every number is the
protocol's: final eval accuracy (mean_at_n at the last step), last-50-step means of the learner's metrics,
paired differences on - off over seeds with SE = sd / sqrt(n) and the 95% t-interval.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from scipy import stats

SEEDS = (0, 1, 2)
LAST = 50  # the protocol's window: steps (S - 50, S]


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def endpoints(run_dir: str) -> dict:
  evals = sorted(_jsonl(os.path.join(run_dir, "eval.jsonl")), key=lambda e: e["step"])
  rows = [m for m in _jsonl(os.path.join(run_dir, "metrics.jsonl")) if "train/ess_ratio" in m]
  last_step = max(m["step"] for m in rows)
  window = [m for m in rows if m["step"] > last_step - LAST]

  def mean(key):
    vals = [m[key] for m in window if key in m]
    return float(np.mean(vals)) if vals else None

  out = {
    "acc_by_step": {int(e["step"]): e["mean_at_n"] for e in evals},
    "final_step": int(evals[-1]["step"]),
    "final_acc": evals[-1]["mean_at_n"],
    "steps_logged": last_step,
    "ess_ratio": mean("train/ess_ratio"),
    "log_ratio_range": float(np.mean([m["train/log_ratio_max"] - m["train/log_ratio_min"] for m in window])),
    "lag_mean": mean("train/lag_mean"),
  }
  for k in ("route_mismatch", "log_ratio_std", "log_ratio_std_replay", "ess", "ess_replay"):
    out[f"moe/{k}"] = mean(f"train/moe/{k}")
  return out


def paired(on: list[float], off: list[float]) -> dict:
  d = np.asarray(on) - np.asarray(off)
  se = float(np.std(d, ddof=1) / np.sqrt(len(d)))
  half = float(stats.t.ppf(0.975, len(d) - 1) * se)
  return {"mean": float(d.mean()), "se": se, "ci95": (float(d.mean() - half), float(d.mean() + half))}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("root")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  runs = {(r, s): endpoints(os.path.join(args.root, f"moe_r{r}_s{s}")) for r in (1, 0) for s in SEEDS}
  pct = lambda x: f"{100 * x:.1f}%"
  print("| seed | acc step 0 | final acc, replay on | off | on - off | ESS/N on | off | log-ratio range on | off |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for s in SEEDS:
    on, off = runs[1, s], runs[0, s]
    print(
      f"| {s} | {pct(on['acc_by_step'][0])} / {pct(off['acc_by_step'][0])} | {pct(on['final_acc'])} | "
      f"{pct(off['final_acc'])} | {100 * (on['final_acc'] - off['final_acc']):+.1f} | {on['ess_ratio']:.4f} | "
      f"{off['ess_ratio']:.4f} | {on['log_ratio_range']:.3f} | {off['log_ratio_range']:.3f} |"
    )
  summary = {}
  for key in ("final_acc", "ess_ratio", "log_ratio_range"):
    on, off = [runs[1, s][key] for s in SEEDS], [runs[0, s][key] for s in SEEDS]
    summary[key] = {"on_mean": float(np.mean(on)), "off_mean": float(np.mean(off)), "diff": paired(on, off)}
    p = summary[key]["diff"]
    print(
      f"{key}: on {np.mean(on):.4f}, off {np.mean(off):.4f}, on - off {p['mean']:+.4f} +- {p['se']:.4f} (SE), "
      f"95% t-interval [{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}]"
    )
  print("| seed | route mismatch | token log-ratio std own | replayed | ESS/N own | replayed |")
  print("| --- | --- | --- | --- | --- | --- |")
  for s in SEEDS:
    m = runs[1, s]
    print(
      f"| {s} | {m['moe/route_mismatch']:.4f} | {m['moe/log_ratio_std']:.4f} | {m['moe/log_ratio_std_replay']:.4f} "
      f"| {m['moe/ess']:.4f} | {m['moe/ess_replay']:.4f} |"
    )
  if args.out:
    record = {"runs": {f"replay{r}_seed{s}": v for (r, s), v in runs.items()}, "summary": summary}
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)


if __name__ == "__main__":
  main()
