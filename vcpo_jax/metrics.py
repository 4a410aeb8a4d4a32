"""Run logging: tensorboardX events, metrics.jsonl, a console progress bar, end-of-run plots.

Every record is one flat dict of scalars keyed like "train/reward_mean" or
"eval/accuracy", plus "step" and "wall_time" (seconds since the run started,
continued across resumes). The jsonl file is the source of truth: plots and the
experiment scripts read it back with `read_jsonl`. Every path may be a local
path or an fsspec URL: all I/O goes through `vcpo_jax.fs`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
import time
from collections.abc import Iterable

import numpy as np

from vcpo_jax import fs
from vcpo_jax.schema import check_field

# Plots written at the end of a run: (file stem, title, metric keys to overlay, y-axis label with unit).
# Every plot has two panels with the same y-axis: against the learner step and against wall-clock seconds.
PLOTS = (
  (
    "reward",
    "reward and accuracy",
    ("train/reward_mean", "train/accuracy", "eval/accuracy"),
    "reward, accuracy (mean over rollouts)",
  ),
  ("ess", "ESS ratio", ("train/ess_ratio", "train/ess_ratio_applied"), "ESS / N (fraction of the batch)"),
  ("lr_scale", "learning-rate scale", ("train/lr_scale",), "lr scale (x configured lr)"),
  ("grad_norm", "gradient norm (before clipping)", ("train/grad_norm",), "gradient norm (global L2)"),
  ("lag", "policy lag (learner steps)", ("train/lag_min", "train/lag_mean", "train/lag_max"), "lag (learner steps)"),
  # vcpo_jax.telemetry: how concentrated the update is over trajectories (fractions of the batch / of sum m_n^2)
  (
    "grad_concentration",
    "update concentration (per-trajectory |c_n| ||g_n||)",
    ("grad/top1_share", "grad/top5pct_share", "grad/ess_ratio", "grad/ref_cosine"),
    "share, ESS / N, cosine (fraction)",
  ),
  # the batch gradient's size against the trace of its estimated covariance (signal vs noise)
  (
    "grad_noise",
    "gradient signal and noise (||G||^2, tr Cov(G) from the per-example norms)",
    ("grad/sq_norm", "grad/cov_trace"),
    "squared gradient norm (surrogate units^2)",
  ),
  # the applied baseline's b-dependent variance against the minimum-variance baseline's for the applied weights
  (
    "grad_baseline",
    "baseline variance: applied / minimum-variance for the applied weights",
    ("grad/var_ratio",),
    "V(b used) / V(b min) (1 = optimal)",
  ),
)
# Overlaid series are drawn widest first, each narrower and in its own dash pattern on top, so a series equal
# to another (train/reward_mean is train/accuracy for a 0/1 reward) still shows as a wide band around a line.
_STYLES = (
  {"linestyle": "-", "linewidth": 4.0, "alpha": 0.45},
  {"linestyle": "--", "linewidth": 1.8},
  {"linestyle": ":", "linewidth": 1.8, "marker": "o", "markersize": 3},
  {"linestyle": "-.", "linewidth": 1.5, "marker": "s", "markersize": 3},
)
X_LABELS = {"step": "learner step", "wall_time": "wall-clock (s since the run started)"}
TITLE_WIDTH = 100  # characters per title line (a long title wraps instead of running off the figure)
YLABEL_WIDTH = 34  # characters per y-label line: a longer label wraps instead of outgrowing the panel


@dataclasses.dataclass(frozen=True)
class LogConfig:
  """What the trainer logs besides the metrics (config.log)."""

  progress: bool = True  # console progress bar
  plots: bool = True  # PNG plots at the end of the run
  norm_overhead_every: int = 0  # opt-in (0 = off): time a plain gradient step every N steps (time/norm_overhead)
  ref_grad_every: int = 0  # opt-in (0 = off; sync / lag): grad/ref_cosine to a fresh on-policy batch every N steps

  def __post_init__(self):
    check_field(
      self.norm_overhead_every >= 0, "log.norm_overhead_every", self.norm_overhead_every, "must be >= 0 (0 = off)."
    )
    check_field(self.ref_grad_every >= 0, "log.ref_grad_every", self.ref_grad_every, "must be >= 0 (0 = off).")


def _scalar(v):
  try:
    f = float(v)
  except (TypeError, ValueError):
    return None
  return f


LOGS = ("metrics.jsonl", "eval.jsonl")  # the run's jsonl logs, all truncated together on (re)start
RESUMES = "resumes.jsonl"  # one row per resume of the run's timeline: {"step": restored step, "wall_time"}


class MetricsWriter:
  """Writes scalars to tensorboard + metrics.jsonl, eval records to eval.jsonl, and drives a progress bar.

  The logs describe one timeline. `resume_step=None` is a fresh run: earlier
  records in workdir (a crashed attempt that saved no checkpoint) are dropped;
  `resume_step=s` is a run resumed from the checkpoint at step s: records with
  step > s are dropped (they belong to the discarded timeline after s), and
  tensorboard purges events at steps >= s + 1. Rows reach an appendable file
  system at once; on object stores they are buffered until `flush` (the
  trainer flushes before each checkpoint, so every row a checkpoint covers is
  stored with it). Only the primary process (`primary=True`) writes anything;
  the others keep the clock.
  """

  def __init__(
    self,
    workdir: str,
    total_steps: int,
    resume_step: int | None = None,
    wall_offset: float = 0.0,
    progress: bool = True,
    tensorboard: bool = True,
    primary: bool = True,
  ):
    self.workdir, self.primary = workdir, primary
    self.jsonl_path = fs.join(workdir, "metrics.jsonl")
    self.eval_jsonl_path = fs.join(workdir, "eval.jsonl")
    keep_through = -1 if resume_step is None else int(resume_step)
    tensorboard = tensorboard and primary
    progress = progress and primary
    if primary:
      fs.makedirs(workdir)
      for name in LOGS:
        truncate_jsonl(fs.join(workdir, name), keep_through + 1)
    self._buffered = primary and not fs.supports_append(workdir)
    self._pending: dict[str, list[str]] = {self.jsonl_path: [], self.eval_jsonl_path: []}
    self._t0 = time.time() - wall_offset
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter

      # purge_step: tensorboard hides events at steps >= it written before this one (the discarded timeline).
      # The ns suffix keeps a rerun within the same second from reusing (and overwriting) the last event file.
      self._tb = SummaryWriter(
        fs.tensorboard_logdir(fs.join(workdir, "tb")), purge_step=keep_through + 1, filename_suffix=f".{time.time_ns()}"
      )
    if primary:  # resumes.jsonl: the steps this timeline was resumed from (plots break their lines there)
      resumes = fs.join(workdir, RESUMES)
      truncate_jsonl(resumes, keep_through + 1)
      if resume_step is not None and resume_step < total_steps:  # (a finished run rerun resumes nothing)
        fs.append_text(resumes, json.dumps({"step": int(resume_step), "wall_time": round(wall_offset, 3)}) + "\n")
    self._bar = None
    if progress:
      from tqdm.auto import tqdm

      self._bar = tqdm(total=total_steps, initial=max(keep_through, 0), desc="train", dynamic_ncols=True)

  @property
  def wall_time(self) -> float:
    return time.time() - self._t0

  def _append(self, path: str, record: dict):
    if not self.primary:
      return
    line = json.dumps(record) + "\n"
    if self._buffered:
      self._pending[path].append(line)
    else:
      fs.append_text(path, line)

  def write(self, step: int, metrics: dict, advance: bool = False):
    record = {"step": int(step), "wall_time": round(self.wall_time, 3)}
    for k, v in metrics.items():
      f = _scalar(v)
      if f is not None:
        record[k] = f if math.isfinite(f) else str(f)
    self._append(self.jsonl_path, record)
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

  def write_eval(self, record: dict):
    """Appends one evaluation.evaluate record (with its "step") to eval.jsonl."""
    self._append(self.eval_jsonl_path, record)

  def flush(self):
    """Stores buffered rows (object stores) and tensorboard's pending events."""
    for path, lines in self._pending.items():
      if lines:
        fs.append_text(path, "".join(lines))
        lines.clear()
    if self._tb is not None:
      self._tb.flush()

  def close(self):
    self.flush()
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()


def read_jsonl(path: str) -> list[dict]:
  """The records of a jsonl file ([] if absent). A torn last line (a crash mid-write) is ignored."""
  if not fs.exists(path):
    return []
  lines = [line for line in fs.read_text(path).splitlines() if line.strip()]
  out = []
  for i, line in enumerate(lines):
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      if i < len(lines) - 1:
        raise ValueError(f"{path}: line {i + 1} is not valid json: {line[:80]!r}") from None
  return out


def truncate_jsonl(path: str, first_dropped_step: int):
  """Keeps records with step < first_dropped_step (used on (re)start, so no step is logged twice)."""
  if not fs.exists(path):
    return
  records = [r for r in read_jsonl(path) if r.get("step", 0) < first_dropped_step]
  fs.write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def resume_steps(workdir: str) -> list[int]:
  """The steps the run in `workdir` was resumed from (its resumes.jsonl), in order."""
  return sorted({int(r["step"]) for r in read_jsonl(fs.join(workdir, RESUMES))})


def series(records: Iterable[dict], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
  pts = [(r[x], r[key]) for r in records if key in r and isinstance(r[key], (int, float))]
  if not pts:
    return np.zeros(0), np.zeros(0)
  a = np.asarray(pts, dtype=np.float64)
  return a[:, 0], a[:, 1]


def _fraction_limits(values: np.ndarray) -> tuple[float, float] | None:
  """(0, 1.05) when every value is a fraction in [0, 1] (ESS ratio, lr scale, accuracy), else None (autoscale).

  Fixed limits keep a constant series readable: in sync mode the ESS ratio and the lr scale are 1 up to
  float32 rounding, which autoscaling would blow up into noise on a 1e-7 axis.
  """
  finite = values[np.isfinite(values)]
  tol = 1e-5  # float32 rounding: a sync-mode ESS ratio can read 1.0000001
  if finite.size and finite.min() >= -tol and finite.max() <= 1.0 + tol:
    return (0.0, 1.05)
  return None


def _duplicate_keys(records: list[dict], keys: Iterable[str]) -> dict[str, str]:
  """{key: the earlier key it equals at every step} (train/accuracy is train/reward_mean on a 0/1 task)."""
  out, seen = {}, []
  for k in keys:
    xs, ys = series(records, k)
    same = [j for j, a, b in seen if xs.size == a.size and np.array_equal(xs, a) and np.allclose(ys, b)]
    if xs.size and same:
      out[k] = same[0]
    elif xs.size:
      seen.append((k, xs, ys))
  return out


def _with_gaps(xs: np.ndarray, ys: np.ndarray, steps: np.ndarray, resumed: list[int]):
  """xs, ys with a NaN point after each resume step, so a line is broken where the run was down."""
  if not resumed or not xs.size:
    return xs, ys
  cut = np.searchsorted(steps, np.asarray(resumed), side="right")
  cut = cut[(cut > 0) & (cut < xs.size)]
  return np.insert(xs.astype(float), cut, np.nan), np.insert(ys, cut, np.nan)


def figure(
  records: list[dict],
  title: str,
  keys: Iterable[str],
  ylabel: str,
  hlines: dict | None = None,
  run: str = "",
  resumed: list[int] = (),
):
  """The matplotlib Figure of one PLOTS entry (None if no key has data): panels vs learner step and wall-clock.

  Each panel: x labelled by X_LABELS, y by `ylabel`, tick labels in plain numbers (no offset / scientific
  notation), y limits [0, 1.05] for fractions (`_fraction_limits`), a legend naming each drawn series' key
  (a key without a finite value is left out). Constrained layout keeps every label inside the figure and
  clear of the others (tests/readability.py checks it). A key whose series equals an earlier one's is drawn once (`_duplicate_keys`: train/reward_mean is
  train/accuracy on a 0/1 task); `hlines` {label: y} adds dashed reference lines (the clip norm); `run` (the
  run's identity) goes into the title; at each step in `resumed` the lines break and a dotted line marks it.
  """
  import matplotlib.pyplot as plt

  keys = list(keys)
  dups = _duplicate_keys(records, keys)
  present = [k for k in keys if np.isfinite(series(records, k)[1]).any() and k not in dups]
  if not present:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
  all_y = np.concatenate([series(records, k)[1] for k in present])
  limits = _fraction_limits(all_y)
  for ax, x in zip(axes, ("step", "wall_time")):
    styles = _STYLES if len(present) > 1 else ({"linewidth": 1.5},)
    for k, style in zip(present, (styles[i % len(styles)] for i in range(len(present)))):
      xs, ys = series(records, k, x)
      steps, finite = series(records, k)[0], np.isfinite(ys)  # a NaN row is "not measured": no point
      xs, ys = _with_gaps(xs[finite], ys[finite], steps[finite], resumed)
      style = dict(style)
      if xs.size < 50 or k.startswith("eval/"):  # sparse series (few steps, evaluations): show the points
        style.setdefault("marker", ".")
      same = [d for d, kept in dups.items() if kept == k]
      ax.plot(xs, ys, label=k + (f" (= {', '.join(same)})" if same else ""), **style)
    for name, value in (hlines or {}).items():
      ax.axhline(value, color="k", linestyle="--", linewidth=1.0, label=name)
    if x == "step":
      for i, s in enumerate(resumed):
        ax.axvline(s, color="0.5", linestyle=":", linewidth=1.0, label="resumed" if i == 0 else None)
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel(textwrap.fill(ylabel, YLABEL_WIDTH))
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    if limits is not None:
      ax.set_ylim(*limits)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(textwrap.fill(f"{title}: {run}" if run else title, TITLE_WIDTH))
  return fig


def run_config(workdir: str) -> dict:
  """The run's config.json as a dict ({} when absent)."""
  path = fs.join(workdir, "config.json")
  return json.loads(fs.read_text(path)) if fs.exists(path) else {}


def _method_label(method) -> str:
  """A config.json's method in a few words: its tree's preset (rl.choices.describe), or a run's older preset name."""
  if not isinstance(method, dict):
    return str(method or "?")
  from vcpo_jax.rl import choices  # imports jax: only to label a tree; this module is numpy only

  try:
    return choices.describe(choices.build(method))
  except ValueError:
    return "?"


def identity(workdir: str) -> dict:
  """{method, mode, k, lr, seed, label} of a run, from its config.json (k = 0 in sync mode)."""
  c = run_config(workdir)
  mode = c.get("mode", "?")
  k = 0 if mode == "sync" else int((c.get("lag") or {}).get("k", 0))
  out = dict(method=_method_label(c.get("method")), mode=mode, k=k, lr=(c.get("optim") or {}).get("lr"))
  out["seed"] = c.get("seed")
  lag = "" if mode == "sync" else f" k={k}"
  lr = f" lr={out['lr']:g}" if isinstance(out["lr"], (int, float)) else ""
  out["label"] = f"{out['method']} {mode}{lag}{lr} seed={out['seed']}"
  return out


def _clip_norm(workdir: str) -> float | None:
  """optim.clip_norm from the run's config.json (None when absent or off)."""
  value = (run_config(workdir).get("optim") or {}).get("clip_norm")
  return float(value) if isinstance(value, (int, float)) and value > 0 else None


def plot_run(workdir: str) -> list[str]:
  """Writes one PNG per PLOTS entry (`figure`) into workdir/plots (any fs URL); returns the paths written."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = read_jsonl(fs.join(workdir, "metrics.jsonl"))
  out_dir = fs.join(workdir, "plots")
  run = identity(workdir)["label"] if fs.exists(fs.join(workdir, "config.json")) else ""
  clip = _clip_norm(workdir)
  written = []
  for stem, title, keys, ylabel in PLOTS:
    hlines = {f"clip norm {clip:g}": clip} if stem == "grad_norm" and clip else None
    fig = figure(records, title, keys, ylabel, hlines=hlines, run=run, resumed=resume_steps(workdir))
    if fig is None:
      continue
    path = fs.join(out_dir, f"{stem}.png")
    with fs.open(path, "wb") as f:
      fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    written.append(path)
  return written
