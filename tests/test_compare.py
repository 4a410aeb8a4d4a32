"""vcpo_jax.compare: run identity, the end-of-run summary (hand-made logs), the compare figure and CLI;
the per-run plots' duplicate-series rule, resume gaps and clip-norm line (vcpo_jax.metrics)."""

import json
from pathlib import Path

import numpy as np
import pytest

from vcpo_jax import compare, metrics


def _write_run(path, method="vcpo", mode="async", k=4, lr=2e-4, seed=0, ess=(1.0, 0.5, 0.8, 0.9), evals=(0.2, 0.6)):
  path.mkdir(parents=True)
  cfg = {"method": method, "mode": mode, "lag": {"k": k}, "optim": {"lr": lr, "clip_norm": 1.0}, "seed": seed}
  (path / "config.json").write_text(json.dumps(cfg))
  rows = []
  for i, e in enumerate(ess):
    step = i + 1
    rows.append(
      {
        "step": step,
        "wall_time": 2.0 + 0.5 * i,
        "train/ess_ratio": e,
        "train/lr_scale": min(1.0, e**0.5),
        "train/lag_min": 0.0,
        "train/lag_mean": float(min(step - 1, k)),
        "train/lag_max": float(min(step - 1, k)),
        "train/accuracy": 0.25 * i,
        "train/reward_mean": 0.25 * i,
        "train/grad_norm": 2.0,
      }
    )
  ev = [{"step": s, "mean_at_n": a} for s, a in zip((0, len(ess)), evals)]
  walls = (1.0, 2.0 + 0.5 * (len(ess) - 1) + 0.25)  # before the first update; after the last
  rows += [{"step": e["step"], "wall_time": t, "eval/accuracy": e["mean_at_n"]} for e, t in zip(ev, walls)]
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ev))
  return str(path)


def test_identity_labels_the_run_from_its_config(tmp_path):
  run = _write_run(tmp_path / "a", method="seq_tis", mode="lag", k=32, lr=3e-4, seed=2)
  ident = compare.identity(run)
  assert (ident["method"], ident["mode"], ident["k"], ident["lr"], ident["seed"]) == ("seq_tis", "lag", 32, 3e-4, 2)
  assert ident["label"] == "seq_tis lag k=32 lr=0.0003 seed=2"
  sync = compare.identity(_write_run(tmp_path / "b", mode="sync", k=0))
  assert sync["label"] == "vcpo sync lr=0.0002 seed=0"  # no k in sync mode
  # a run's config.json holds its method's tree (rl/choices.py): labelled by the preset and what differs from it
  from vcpo_jax.rl import choices, presets

  tree = choices.tree(presets.method_from_preset("vcpo", {"lr.rho_on": 0.5})).to_dict()
  assert (
    compare.identity(_write_run(tmp_path / "c", method=tree))["label"]
    == "vcpo (lr.rho_on=0.5) async k=4 lr=0.0002 seed=0"
  )


def test_summary_numbers_by_hand(tmp_path):
  run = _write_run(tmp_path / "a", ess=(1.0, 0.5, 0.8, 0.9), evals=(0.2, 0.6))
  s = compare.summarize(run)
  assert s["eval_first"] == (0, 0.2) and s["eval_last"] == (4, 0.6)
  assert s["ess_min"] == 0.5 and s["ess_median"] == pytest.approx(0.85)  # median of 0.5, 0.8, 0.9, 1.0
  assert s["lr_scale_min"] == pytest.approx(0.5**0.5)
  assert (s["lag_min"], s["lag_max"]) == (0.0, 3.0) and s["lag_mean"] == pytest.approx((0 + 1 + 2 + 3) / 4)
  assert s["steps_per_s"] == pytest.approx(3 / 1.5)  # 3 steps between wall times 2.0 and 3.5
  assert s["steps"] == 4 and s["wall_s"] == 3.75
  text = compare.format_summary(s)
  assert "20.0% at step 0 -> 60.0% at step 4 (+40.0 points)" in text
  assert "ESS ratio  min 0.500, median 0.850" in text
  assert "lag        min 0, mean 1.50, max 3" in text
  assert "2.00 learner steps/s" in text and f"{run}/metrics.jsonl" in text and f"{run}/tb/" in text


def test_smooth_is_a_trailing_mean():
  y = np.array([1.0, 3.0, 5.0, 7.0])
  np.testing.assert_allclose(compare.smooth(y, 2), [1.0, 2.0, 4.0, 6.0])
  np.testing.assert_allclose(compare.smooth(y, 3), [1.0, 2.0, 3.0, 5.0])
  np.testing.assert_array_equal(compare.smooth(y, 1), y)


@pytest.mark.slow
def test_compare_cli_draws_runs_and_refuses_non_runs(tmp_path, capsys):
  runs = [
    _write_run(tmp_path / "sync", mode="sync", k=0, ess=(1.0, 1.0, 1.0)),
    _write_run(tmp_path / "stale", method="none", mode="lag", k=8),
    _write_run(tmp_path / "vcpo", mode="lag", k=8),
  ]
  out = tmp_path / "cmp.png"
  assert compare.main([*runs, f"--out={out}", "--smooth=2"]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  printed = capsys.readouterr().out
  for label in ("vcpo sync lr=0.0002 seed=0", "none lag k=8", "vcpo lag k=8"):
    assert label in printed
  fig = compare.figure(runs, smoothing=2)
  labels = fig.legends[0].get_texts()
  assert [t.get_text() for t in labels] == [compare.identity(r)["label"] for r in runs]
  # y-ranges fitted to the data: the eval panel spans the evaluations (0.2..0.6) with a small margin
  lo, hi = fig.axes[0].get_ylim()
  assert 0.15 < lo < 0.2 and 0.6 < hi < 0.65
  assert compare.main([str(tmp_path / "nothing"), f"--out={out}"]) == 2
  assert "no metrics.jsonl" in capsys.readouterr().err
  assert compare.main([*runs, "--smooth=-1"]) == 2


def test_duplicate_labels_are_told_apart_by_directory(tmp_path):
  runs = [_write_run(tmp_path / "x1"), _write_run(tmp_path / "x2")]
  fig = compare.figure(runs)
  assert [t.get_text() for t in fig.legends[0].get_texts()] == [
    "vcpo async k=4 lr=0.0002 seed=0 (x1)",
    "vcpo async k=4 lr=0.0002 seed=0 (x2)",
  ]


def test_run_plots_title_dedupe_clip_line_and_resume_gap(tmp_path):
  run = _write_run(tmp_path / "r", ess=(1.0, 0.5, 0.8, 0.9, 0.7, 0.6))
  records = metrics.read_jsonl(f"{run}/metrics.jsonl")
  # The run is resumed from step 3 (what MetricsWriter records); the resumed attempt logs steps 4.. again.
  w = metrics.MetricsWriter(run, total_steps=6, resume_step=3, wall_offset=3.0, progress=False, tensorboard=False)
  for r in records:
    if r["step"] > 3:
      w.write(r["step"], {k: v for k, v in r.items() if k not in ("step", "wall_time")})
  w.close()
  assert metrics.resume_steps(run) == [3]
  fig = metrics.figure(
    records,
    "reward",
    ("train/reward_mean", "train/accuracy"),
    "acc",
    hlines={"clip norm 1": 1.0},
    run="vcpo",
    resumed=[3],
  )
  ax = fig.axes[0]
  names = [ln.get_label() for ln in ax.get_lines()]
  assert names.count("train/reward_mean (= train/accuracy)") == 1 and not any(n.startswith("train/acc") for n in names)
  assert "clip norm 1" in names and "resumed" in names
  assert fig._suptitle.get_text() == "reward: vcpo"
  ys = ax.get_lines()[0].get_ydata()
  assert np.isnan(ys).sum() == 1 and np.isnan(ys[3])  # the line breaks right after step 3
  written = metrics.plot_run(run)
  assert sorted(p.rsplit("/", 1)[1] for p in written) == [
    "ess.png",
    "grad_norm.png",
    "lag.png",
    "lr_scale.png",
    "reward.png",
  ]
  # A fresh start (no resume) empties the record; a rerun of a finished run adds nothing.
  metrics.MetricsWriter(run, total_steps=6, resume_step=6, progress=False, tensorboard=False).close()
  assert metrics.resume_steps(run) == [3]
  metrics.MetricsWriter(run, total_steps=6, resume_step=None, progress=False, tensorboard=False).close()
  assert metrics.resume_steps(run) == []


@pytest.mark.slow
def test_default_config_runs_async_and_prints_its_summary(tmp_path):
  """README's first command at smoke size: the default config's own code path (mode=async, k = 4: the
  sampler process and the shared-memory queue) for a few steps, ending with the summary on stdout and no
  start-up noise on stderr. Only sizes shrink; mode, k, method and task stay the default's."""
  import os
  import subprocess
  import sys

  from configs import countdown
  from vcpo_jax.rl import choices

  c = countdown.get_config()
  assert (c.mode, c.lag.k, c.method) == ("async", 4, choices.preset("vcpo"))  # what README's first command runs
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  work = tmp_path / "run"
  shrink = {
    "steps": 6,
    "sft.steps": 0,
    "task.prompts_per_step": 2,
    "task.group_size": 4,
    "eval.num_problems": 4,
    "eval.n": 1,
    "eval.every": 0,
    "model.hidden_size": 32,
    "model.intermediate_size": 64,
    "model.num_layers": 1,
    "log.progress": False,
  }
  r = subprocess.run(
    [sys.executable, "main.py", "--config=configs/countdown.py", f"--workdir={work}"]
    + [f"--config.{k}={v}" for k, v in shrink.items()],
    cwd=root,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout
  assert "vcpo async k=4" in out and "eval acc" in out and "ESS ratio  min" in out and "lag        min" in out
  assert f"{work}/metrics.jsonl" in out and f"{work}/tb/" in out
  assert "Unable to initialize backend" not in r.stderr and "shared memory of run" not in r.stderr
  s = compare.summarize(str(work))
  assert s["lag_max"] <= 4 and s["steps"] == 6
  for name in ("reward.png", "ess.png", "lr_scale.png", "grad_norm.png", "lag.png"):
    assert (work / "plots" / name).exists(), name


def _add_grad_rows(run, var_ratio=(1.0, 1.5, 2.0, 1.25)):
  """Appends telemetry fields (vcpo_jax.telemetry's grad/ keys) to each train row of a hand-made run."""
  path = Path(run) / "metrics.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  train = [r for r in rows if "train/ess_ratio" in r]
  for r, v in zip(train, var_ratio):
    r.update({"grad/ess_ratio": 0.5, "grad/top1_share": 0.25, "grad/snr": 4.0, "grad/var_ratio": v})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return run


def test_compare_figure_draws_the_grad_panels_only_when_logged(tmp_path):
  plain = _write_run(tmp_path / "plain")
  assert len(compare.figure([plain]).axes) == 2 * len(compare.PANELS)  # no grad/ data: no grad rows
  tele = _add_grad_rows(_write_run(tmp_path / "tele", mode="lag", k=8))
  fig = compare.figure([plain, tele])
  logged = [p for p in compare.GRAD_PANELS if p[0] != "grad/ref_cosine"]  # ref_cosine not in the rows
  assert len(fig.axes) == 2 * (len(compare.PANELS) + len(logged))
  for i, (key, title, ylabel) in enumerate(logged):
    row = fig.axes[2 * (len(compare.PANELS) + i) : 2 * (len(compare.PANELS) + i) + 2]
    assert [ax.get_title() for ax in row] == [title, title] and row[0].get_ylabel() == ylabel
    assert [ax.get_xlabel() for ax in row] == ["learner step", "wall-clock (s since the run started)"]
    (line,) = row[0].get_lines()  # only the telemetry run has the series
    assert line.get_label() == compare.identity(tele)["label"]
    if key == "grad/var_ratio":
      np.testing.assert_allclose(line.get_xdata(), [1, 2, 3, 4])
      np.testing.assert_allclose(line.get_ydata(), [1.0, 1.5, 2.0, 1.25])


def test_run_plots_include_the_grad_plots_when_logged(tmp_path):
  run = _add_grad_rows(_write_run(tmp_path / "r"))
  names = sorted(p.rsplit("/", 1)[1] for p in metrics.plot_run(run))
  assert "grad_concentration.png" in names and "grad_baseline.png" in names
  assert "grad_noise.png" not in names  # no grad/sq_norm or grad/cov_trace in these rows


def test_compare_figure_reads_and_its_title_names_the_differing_fields(tmp_path):
  """tests/readability.py on the compare figure of three runs (one with telemetry rows): nothing clipped or
  overlapping, the legend lists each run, and the default title names the config fields the runs differ in,
  with their values, instead of "3 runs"; one run's title is its identity; equal configs say so."""
  from tests import readability

  a = _write_run(tmp_path / "a")
  b = _add_grad_rows(_write_run(tmp_path / "b", mode="lag", k=8, lr=3e-4))
  c = _write_run(tmp_path / "c", method="seq_tis", seed=1)
  assert list(compare.differing_fields([a, b, c])) == ["method", "mode", "lag.k", "optim.lr", "seed"]
  fig = compare.figure([a, b, c], smoothing=3)
  title = fig._suptitle.get_text().replace("\n", " ")
  assert title.startswith("runs differ in method vcpo vs vcpo vs seq_tis, mode async vs lag vs async, lag.k 4 vs")
  assert title.endswith("and 1 more field; train series smoothed over 3 steps")
  readability.check(fig, identity=["method", "mode", "lag.k", "optim.lr"])
  assert [t.get_text() for t in fig.legends[0].get_texts()] == [compare.identity(w)["label"] for w in (a, b, c)]
  fig = compare.figure([a, b])
  readability.check(fig, identity=["runs differ in mode async vs lag, lag.k 4 vs 8, optim.lr 0.0002 vs 0.0003"])
  readability.check(compare.figure([a]), identity=[compare.identity(a)["label"]])
  twin = _write_run(tmp_path / "twin")
  assert compare.default_title([a, twin]) == f"2 runs of {compare.identity(a)['label']}"
