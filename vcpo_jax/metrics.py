"""Run logging: tensorboardX events, metrics.jsonl, a console progress bar, end-of-run plots.

Every record is one flat dict of scalars keyed like "train/reward_mean" or
"eval/accuracy", plus "step" and "wall_time" (seconds since the run started,
continued across resumes). The jsonl file is the source of truth: plots and the
experiment scripts read it back with `read_jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Iterable

import numpy as np

# Plots written at the end of a run: (file stem, title, metric keys to overlay).
PLOTS = (
  ("reward", "reward and accuracy", ("train/reward_mean", "train/accuracy", "eval/accuracy")),
  ("ess", "ESS ratio", ("train/ess_ratio", "train/ess_ratio_applied")),
  ("lr_scale", "learning-rate scale", ("train/lr_scale",)),
  ("grad_norm", "gradient norm (before clipping)", ("train/grad_norm",)),
  ("lag", "policy lag (learner steps)", ("train/lag_min", "train/lag_mean", "train/lag_max")),
)


def _scalar(v):
  try:
    f = float(v)
  except (TypeError, ValueError):
    return None
  return f


class MetricsWriter:
  """Writes scalars to tensorboard + jsonl and drives a tqdm progress bar."""

  def __init__(
    self,
    workdir: str,
    total_steps: int,
    initial_step: int = 0,
    wall_offset: float = 0.0,
    progress: bool = True,
    tensorboard: bool = True,
  ):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
    self._t0 = time.time() - wall_offset
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(os.path.join(workdir, "tb"))
    self._bar = None
    if progress:
      from tqdm.auto import tqdm

      self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True)
    if initial_step:  # a resumed run drops records logged after the checkpoint it resumed from
      truncate_jsonl(self.jsonl_path, initial_step + 1)

  @property
  def wall_time(self) -> float:
    return time.time() - self._t0

  def write(self, step: int, metrics: dict, advance: bool = False):
    record = {"step": int(step), "wall_time": round(self.wall_time, 3)}
    for k, v in metrics.items():
      f = _scalar(v)
      if f is not None:
        record[k] = f if math.isfinite(f) else str(f)
    with open(self.jsonl_path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, float):
          self._tb.add_scalar(k, v, step)
    if self._bar is not None:
      if advance:
        self._bar.update(1)
      shown = {
        "R": metrics.get("train/reward_mean"),
        "ess": metrics.get("train/ess_ratio"),
        "lr×": metrics.get("train/lr_scale"),
        "acc": metrics.get("eval/accuracy"),
      }
      self._bar.set_postfix({k: f"{float(v):.3f}" for k, v in shown.items() if _scalar(v) is not None}, refresh=False)

  def close(self):
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()


def read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_jsonl(path: str, first_dropped_step: int):
  """Keeps records with step < first_dropped_step (used on resume, so no step is logged twice)."""
  records = [r for r in read_jsonl(path) if r.get("step", 0) < first_dropped_step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  os.replace(tmp, path)


def series(records: Iterable[dict], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
  pts = [(r[x], r[key]) for r in records if key in r and isinstance(r[key], (int, float))]
  if not pts:
    return np.zeros(0), np.zeros(0)
  a = np.asarray(pts, dtype=np.float64)
  return a[:, 0], a[:, 1]


def plot_run(workdir: str) -> list[str]:
  """Writes one PNG per PLOTS entry (against step and wall-clock) into workdir/plots."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  out_dir = os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for stem, title, keys in PLOTS:
    present = [k for k in keys if series(records, k)[0].size]
    if not present:
      continue
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, x in zip(axes, ("step", "wall_time")):
      for k in present:
        xs, ys = series(records, k, x)
        ax.plot(xs, ys, marker="." if xs.size < 50 else None, label=k)
      ax.set_xlabel("learner step" if x == "step" else "wall-clock (s)")
      ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
  return written
