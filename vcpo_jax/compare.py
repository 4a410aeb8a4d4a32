"""What a run shows, and several runs side by side: the end-of-run summary and the compare figure.

  python -m vcpo_jax.compare RUN_DIR [RUN_DIR ...] --out=compare.png [--smooth=10]

draws every run in one figure: eval accuracy, train accuracy, ESS ratio, lr scale and lag (mean) against the
learner step (left) and wall-clock seconds (right), and, when some run logs them (vcpo_jax.telemetry), the
gradient ESS, top-1 share, signal-to-noise, baseline variance ratio and reference cosine (GRAD_PANELS). Each curve is labelled with the run's identity, read from
its config.json: method, mode, lag bound k, lr and seed (`identity`). `--smooth=W` draws the per-step series
as a trailing mean over W steps (evaluations are never smoothed); y-ranges are fitted to the data.

`summarize(workdir)` reduces a finished run's metrics.jsonl / eval.jsonl to the numbers main.py prints at
the end of a run (`format_summary`): eval accuracy at step 0 and at the end, min and median ESS ratio and lr
scale, lag min / mean / max, learner steps per second, wall time, and where the outputs are.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

import numpy as np

from vcpo_jax import fingerprint, fs
from vcpo_jax.metrics import identity, read_jsonl, run_config, series

# (metric key, panel title, y label) of the compare figure's rows.
PANELS = (
  ("eval/accuracy", "held-out eval accuracy", "accuracy (mean@n)"),
  ("train/accuracy", "training-rollout accuracy", "accuracy (mean over rollouts)"),
  ("train/ess_ratio", "ESS ratio of the importance weights", "ESS / N"),
  ("train/lr_scale", "learning-rate scale", "lr scale (x configured lr)"),
  ("train/lag_mean", "policy lag (mean over the batch)", "lag (learner steps)"),
)
# Rows added when some run logs them (vcpo_jax.telemetry's grad/ metrics: ghost-norm paths only).
GRAD_PANELS = (
  ("grad/ess_ratio", "gradient ESS of the per-trajectory update magnitudes", "gradient ESS / N"),
  ("grad/top1_share", "share of sum c^2 ||g||^2 held by the largest trajectory", "top-1 share"),
  ("grad/snr", "gradient signal-to-noise ||G||^2 / tr Cov(G)", "SNR (ratio)"),
  ("grad/var_ratio", "baseline variance: applied / minimum-variance", "V(b used) / V(b min)"),
  ("grad/ref_cosine", "cosine of the update to the on-policy reference gradient", "cosine"),
)
X_AXES = (("step", "learner step"), ("wall_time", "wall-clock (s since the run started)"))
TITLE_FIELDS = 4  # differing config fields the default title names (then "and N more")
TITLE_FIRST = ("method", "mode", "lag.k", "optim.lr", "seed")  # named first when they differ (identity's fields)
TITLE_WIDTH = 120  # characters per title line (the title wraps)
RUN_RECORD_KEYS = ("provenance", "config_history", "from_step")  # config.json entries that are not config


def differing_fields(workdirs: list[str]) -> dict[str, list]:
  """{dotted config path: [value per run]} of the trajectory fields (vcpo_jax.fingerprint) whose values
  differ between the runs' config.json files; a field one run lacks counts as differing (value None)."""
  flat = []
  for w in workdirs:
    c = {k: v for k, v in run_config(w).items() if k not in RUN_RECORD_KEYS}
    flat.append(fingerprint.of(c) if c else {})
  paths = sorted(set().union(*flat), key=lambda p: (TITLE_FIRST.index(p) if p in TITLE_FIRST else len(TITLE_FIRST), p))
  return {p: [f.get(p) for f in flat] for p in paths if len({repr(f.get(p)) for f in flat}) > 1}


def default_title(workdirs: list[str]) -> str:
  """The compare figure's title: one run's identity; several runs' differing config fields with their values
  ("method vcpo vs seq_tis, lag.k 4 vs 8"); runs of one config are "N runs of <identity>"."""
  if len(workdirs) == 1:
    return identity(workdirs[0])["label"]
  diff = differing_fields(workdirs)
  if not diff:
    return f"{len(workdirs)} runs of {identity(workdirs[0])['label']}"

  def value(v):
    text = f"{v:g}" if isinstance(v, float) else str(v)
    return text if len(text) <= 24 else text[:21] + "..."

  parts = [f"{p} {' vs '.join(value(v) for v in vals)}" for p, vals in list(diff.items())[:TITLE_FIELDS]]
  more = len(diff) - TITLE_FIELDS
  return "runs differ in " + ", ".join(parts) + (f" and {more} more field{'s' * (more > 1)}" if more > 0 else "")


def summarize(workdir: str) -> dict:
  """The run's headline numbers (see the module docstring); absent quantities are None."""
  records = read_jsonl(fs.join(workdir, "metrics.jsonl"))
  evals = [r for r in read_jsonl(fs.join(workdir, "eval.jsonl")) if "mean_at_n" in r]
  train = [r for r in records if "train/ess_ratio" in r]

  def stat(key, fn):
    v = np.asarray([r[key] for r in train if isinstance(r.get(key), (int, float))], np.float64)
    return float(fn(v)) if v.size else None

  steps = [r["step"] for r in train]
  wall = max((r.get("wall_time", 0.0) for r in records), default=0.0)
  learn = [r.get("wall_time") for r in train if isinstance(r.get("wall_time"), (int, float))]
  rate = (len(learn) - 1) / (learn[-1] - learn[0]) if len(learn) > 1 and learn[-1] > learn[0] else None
  return dict(
    run=identity(workdir)["label"],
    steps=max(steps) if steps else 0,
    eval_first=(evals[0]["step"], evals[0]["mean_at_n"]) if evals else None,
    eval_last=(evals[-1]["step"], evals[-1]["mean_at_n"]) if evals else None,
    ess_min=stat("train/ess_ratio", np.min),
    ess_median=stat("train/ess_ratio", np.median),
    lr_scale_min=stat("train/lr_scale", np.min),
    lr_scale_median=stat("train/lr_scale", np.median),
    lag_min=stat("train/lag_min", np.min),
    lag_mean=stat("train/lag_mean", np.mean),
    lag_max=stat("train/lag_max", np.max),
    steps_per_s=rate,
    wall_s=wall,
    plots=fs.join(workdir, "plots"),
    metrics=fs.join(workdir, "metrics.jsonl"),
    tensorboard=fs.join(workdir, "tb"),
  )


def format_summary(s: dict) -> str:
  """The summary as a few aligned lines (what main.py prints on stdout at the end of a run)."""

  def f(v, fmt="{:.3f}"):
    return "n/a" if v is None else fmt.format(v)

  lines = [f"run        {s['run']}, {s['steps']} learner steps in {f(s['wall_s'], '{:.0f}')} s"]
  if s["eval_first"] and s["eval_last"]:
    (s0, a0), (s1, a1) = s["eval_first"], s["eval_last"]
    lines.append(f"eval acc   {a0:.1%} at step {s0} -> {a1:.1%} at step {s1} ({(a1 - a0) * 100:+.1f} points)")
  lines += [
    f"ESS ratio  min {f(s['ess_min'])}, median {f(s['ess_median'])}",
    f"lr scale   min {f(s['lr_scale_min'])}, median {f(s['lr_scale_median'])}",
    f"lag        min {f(s['lag_min'], '{:.0f}')}, mean {f(s['lag_mean'], '{:.2f}')}, max {f(s['lag_max'], '{:.0f}')}"
    " (learner steps)",
    f"speed      {f(s['steps_per_s'], '{:.2f}')} learner steps/s",
    f"outputs    {s['plots']}/*.png, {s['metrics']}, {s['tensorboard']}/",
  ]
  return "\n".join(lines)


def smooth(y: np.ndarray, window: int) -> np.ndarray:
  """Trailing mean over `window` points (the first points average what exists); window <= 1 is the identity."""
  if window <= 1 or y.size == 0:
    return y
  c = np.cumsum(np.insert(y, 0, 0.0))
  n = np.minimum(np.arange(1, y.size + 1), window)
  return (c[1:] - c[np.arange(1, y.size + 1) - n]) / n


def figure(workdirs: list[str], smoothing: int = 0, title: str | None = None):
  """The compare Figure: one row per PANELS entry, columns against learner step and wall-clock seconds.

  title: None = `default_title` (the runs' differing config fields); the legend names each run's identity.
  Constrained layout keeps every label inside the figure and clear of the others (tests/readability.py)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  labels = [identity(w)["label"] for w in workdirs]
  # Runs whose identities coincide (e.g. two configs that differ in a task knob) are told apart by directory.
  labels = [
    f"{lab} ({w.rstrip('/').split('/')[-1]})" if labels.count(lab) > 1 else lab for lab, w in zip(labels, workdirs)
  ]
  runs = [(lab, read_jsonl(fs.join(w, "metrics.jsonl"))) for lab, w in zip(labels, workdirs)]
  panels = list(PANELS) + [p for p in GRAD_PANELS if any(series(r, p[0])[0].size for _, r in runs)]
  fig, axes = plt.subplots(len(panels), 2, figsize=(12, 2.6 * len(panels)), squeeze=False, layout="constrained")
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for row, (key, panel, ylabel) in enumerate(panels):
    values = []
    for col, (x, xlabel) in enumerate(X_AXES):
      ax = axes[row, col]
      for i, (label, records) in enumerate(runs):
        xs, ys = series(records, key, x)
        if not xs.size:
          continue
        sparse = key.startswith("eval/")
        ys = ys if sparse else smooth(ys, smoothing)
        values.append(ys)
        ax.plot(xs, ys, color=colors[i % len(colors)], label=label, marker="o" if sparse else None, ms=3, lw=1.4)
      ax.set_xlabel(xlabel)
      ax.set_ylabel(ylabel)
      ax.set_title(panel, fontsize=10)
      ax.grid(alpha=0.3)
    if values:
      v = np.concatenate(values)
      v = v[np.isfinite(v)]
      if v.size:
        lo, hi = float(v.min()), float(v.max())
        # at least 0.1 wide: a constant series (sync-mode ESS = 1 up to float32 rounding) stays a flat line
        pad = max(0.05 * (hi - lo), (0.1 - (hi - lo)) / 2, 0.0)
        for ax in axes[row]:
          ax.set_ylim(lo - pad, hi + pad)
          ax.ticklabel_format(axis="y", style="plain", useOffset=False)
  smooth_note = f"; train series smoothed over {smoothing} steps" if smoothing > 1 else ""
  fig.suptitle(textwrap.fill((title or default_title(workdirs)) + smooth_note, TITLE_WIDTH), fontsize=11)
  # every run that drew a curve, in the runs' order (a run may lack the first panel's series)
  drawn = {ln.get_label(): ln for ax in axes.flat for ln in ax.get_lines()}
  handles = [(drawn[lab], lab) for lab in labels if lab in drawn]
  if handles:
    fig.legend(*zip(*handles), loc="outside lower center", ncol=2, fontsize=9, frameon=False)
  return fig


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m vcpo_jax.compare", description=__doc__.split("\n\n")[0])
  p.add_argument("runs", nargs="+", help="run directories (each with config.json and metrics.jsonl)")
  p.add_argument("--out", default="compare.png", help="PNG file to write")
  p.add_argument("--smooth", type=int, default=0, help="trailing-mean window of the per-step series (0 = off)")
  p.add_argument("--title", default=None, help="figure title (default: the config fields the runs differ in)")
  args = p.parse_args(argv)
  if args.smooth < 0:
    print(f"error: --smooth={args.smooth}: must be >= 0 (0 = no smoothing).", file=sys.stderr)
    return 2
  for w in args.runs:
    if not fs.exists(fs.join(w, "metrics.jsonl")):
      print(f"error: {w}: no metrics.jsonl there; pass run directories written by main.py.", file=sys.stderr)
      return 2
  fig = figure(args.runs, args.smooth, args.title)
  with fs.open(args.out, "wb") as f:
    fig.savefig(f, format="png", dpi=100)
  print(f"wrote {args.out} ({len(args.runs)} runs)")
  for w in args.runs:
    print(format_summary(summarize(w)), end="\n\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
