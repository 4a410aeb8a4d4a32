"""MetricsWriter: jsonl contents, truncation on every (re)start, tensorboard purge, plots, fs URLs."""

import json
import os
import struct
import uuid

import numpy as np
import pytest

from vcpo_jax import fs, metrics


def test_jsonl_records_and_plots(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path), total_steps=3, progress=False)
  for s in range(3):
    w.write(
      s,
      {
        "train/reward_mean": 0.1 * s,
        "train/ess_ratio": 1.0 - 0.2 * s,
        "train/lr_scale": 1.0,
        "train/text": "ignored",
        "train/bad": float("nan"),
      },
      advance=True,
    )
  w.close()
  recs = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in recs] == [0, 1, 2]
  assert recs[2]["train/reward_mean"] == 0.2
  assert "train/text" not in recs[0]
  assert recs[0]["train/bad"] == "nan"  # non-finite values are kept visibly, not dropped
  xs, ys = metrics.series(recs, "train/ess_ratio")
  assert list(xs) == [0, 1, 2] and abs(ys[-1] - 0.6) < 1e-9
  paths = metrics.plot_run(str(tmp_path))
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ["ess.png", "lr_scale.png", "reward.png"]
  assert all(os.path.getsize(p) > 1000 for p in paths)
  assert os.listdir(tmp_path / "tb")


def _sync_records(n=30):
  """Metrics of a sync-mode run: ESS ratio and lr scale are 1 up to float32 rounding; reward = accuracy (0/1)."""
  rng = np.random.default_rng(0)
  recs = []
  for s in range(1, n + 1):
    acc = float(np.float32(0.1 + 0.01 * s))
    recs.append(
      {
        "step": s,
        "wall_time": 2.0 * s,
        "train/reward_mean": acc,
        "train/accuracy": acc,
        "train/ess_ratio": float(np.float32(1.0) - np.float32(rng.integers(0, 3)) * np.float32(6e-8)),
        "train/ess_ratio_applied": 1.0,
        "train/lr_scale": float(np.float32(1.0) + np.float32(rng.integers(-1, 2)) * np.float32(1.2e-7)),
        "train/grad_norm": 2.0 + 0.1 * s,
      }
    )
    if s % 10 == 0:
      recs[-1]["eval/accuracy"] = 0.2 + 0.01 * s
  return recs


def test_plots_have_labelled_axes_readable_ratios_and_every_series_visible():
  """Each panel: x "learner step" / wall-clock, a y label with its unit, plain tick labels (no 1e-7 offset), ratios
  on [0, 1.05]; reward_mean and accuracy (equal for a 0/1 reward) drawn in different widths and dashes, in the legend."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  recs = _sync_records()
  figs = {stem: metrics.figure(recs, title, keys, ylabel) for stem, title, keys, ylabel in metrics.PLOTS}
  assert figs["lag"] is None  # no lag keys logged: no plot
  assert all("(" in ylabel and ylabel.endswith(")") for *_, ylabel in metrics.PLOTS)  # name (unit)
  for stem, fig in figs.items():
    if fig is None:
      continue
    fig.canvas.draw()  # tick labels and the offset text exist only after a draw
    step_ax, wall_ax = fig.axes[:2]
    assert step_ax.get_xlabel() == "learner step"
    assert wall_ax.get_xlabel().startswith("wall-clock (s")
    for ax in (step_ax, wall_ax):
      ylabel = {s: y for s, _, _, y in metrics.PLOTS}[stem]
      assert ax.get_ylabel().replace("\n", " ") == ylabel and ylabel  # long labels wrap
      assert ax.yaxis.get_offset_text().get_text() == ""  # no "1e-7 + 9.9999e-1" offset
      assert ax.get_legend() is not None
      if stem in ("ess", "lr_scale", "reward"):
        assert ax.get_ylim() == (0.0, 1.05)
  assert figs["grad_norm"].axes[0].get_ylim() != (0.0, 1.05)  # not a fraction: autoscaled
  lines = {ln.get_label(): ln for ln in figs["reward"].axes[0].get_lines()}
  # train/accuracy equals train/reward_mean here (a 0/1 reward): one curve, whose label names both
  assert set(lines) == {"train/reward_mean (= train/accuracy)", "eval/accuracy"}
  assert lines["eval/accuracy"].get_marker() not in (None, "None", "")  # 3 eval points are drawn as points
  legend_texts = [t.get_text() for t in figs["reward"].axes[0].get_legend().get_texts()]
  assert legend_texts == ["train/reward_mean (= train/accuracy)", "eval/accuracy"]
  plt.close("all")


def test_plot_limits_follow_the_data():
  """A fraction series slightly above 1 by float32 rounding still gets [0, 1.05]; a reward in [-1, 1] is autoscaled."""
  assert metrics._fraction_limits(np.array([0.2, 1.0000001])) == (0.0, 1.05)
  assert metrics._fraction_limits(np.array([-1.0, 0.5])) is None
  assert metrics._fraction_limits(np.array([0.0, 3.0])) is None


def test_resume_truncates_future_records(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(6)))
  w = metrics.MetricsWriter(str(tmp_path), total_steps=6, resume_step=3, progress=False, tensorboard=False)
  w.write(4, {"x": 40})  # initial_step = updates done: the next record is step 4
  w.close()
  recs = metrics.read_jsonl(str(path))
  assert [(r["step"], r["x"]) for r in recs] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 40)]


def read_tensorboard(logdir: str) -> list[tuple[str, int, float]]:
  """(tag, step, value) of every scalar tensorboard shows: event files in name order, purges applied.

  A SessionLog START event at step s (tensorboardX's purge_step) hides the scalars at steps >= s that
  earlier files hold, which is how tensorboard itself reads a restarted run.
  """
  from tensorboardX.proto import event_pb2

  shown: list[tuple[str, int, float]] = []
  for name in sorted(n for n in fs.listdir(logdir) if ".tfevents." in n):
    data, pos = fs.read_bytes(fs.join(logdir, name)), 0
    while pos < len(data):
      (n,) = struct.unpack("Q", data[pos : pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
      pos += 12 + n + 4  # length, its crc, the record, its crc
      if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
        shown = [s for s in shown if s[1] < event.step]
      for v in event.summary.value:
        shown.append((v.tag, int(event.step), v.simple_value))
  return shown


def _run_logs(workdir, steps, resume_step=None, crash_after=None, **kw):
  """A writer logging steps (resume_step or 0) + 1 .. steps, an eval every 2 steps; stops after crash_after."""
  w = metrics.MetricsWriter(workdir, total_steps=steps, resume_step=resume_step, progress=False, **kw)
  for s in range((resume_step or 0) + 1, steps + 1):
    w.write(s, {"x": float(s), "attempt": float(crash_after or 0)})
    if s % 2 == 0:
      w.write_eval({"kind": "eval", "step": s, "tag": None, "mean_at_n": 0.1 * s})
    if s == crash_after:
      break
  w.close()


@pytest.mark.parametrize("where", ["local", "memory", "object_store"])
def test_crash_and_rerun_log_each_step_once(where, tmp_path, monkeypatch):
  """A crash before any checkpoint, then one after the checkpoint at step 2, then a resume from it:
  every log (metrics.jsonl, eval.jsonl, tensorboard) shows steps 1..6 once, from the surviving attempts."""
  if where == "local":
    workdir = str(tmp_path)
  else:
    workdir = f"memory://test_metrics/{uuid.uuid4().hex}"
  if where == "object_store":  # memory:// without append: rows are buffered and the object rewritten
    monkeypatch.setattr(fs, "_APPENDABLE", frozenset({"file", "local"}))
  _run_logs(workdir, 6, crash_after=3)  # no checkpoint: its rows are a discarded timeline
  _run_logs(workdir, 6, crash_after=5)  # fresh rerun (no checkpoint exists); checkpoint at 2, crash after 5
  _run_logs(workdir, 6, resume_step=2)  # resumed from step 2: rows 3..5 of the crashed attempt go
  recs = metrics.read_jsonl(fs.join(workdir, "metrics.jsonl"))
  assert [(r["step"], r["attempt"]) for r in recs] == [(1, 5), (2, 5), (3, 0), (4, 0), (5, 0), (6, 0)]
  evals = metrics.read_jsonl(fs.join(workdir, "eval.jsonl"))
  assert [r["step"] for r in evals] == [2, 4, 6]
  tb = read_tensorboard(fs.join(workdir, "tb"))
  got = sorted((s, v) for tag, s, v in tb if tag == "attempt")
  assert got == [(1, 5.0), (2, 5.0), (3, 0.0), (4, 0.0), (5, 0.0), (6, 0.0)]


def test_torn_last_line_is_dropped(tmp_path):
  """A SIGKILL mid-append leaves a partial last line: readers skip it, a resume rewrites the file without it."""
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)) + '{"step": 3, "x')
  assert [r["step"] for r in metrics.read_jsonl(str(path))] == [0, 1, 2]
  metrics.truncate_jsonl(str(path), 2)
  assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
  path.write_text('{"step": 0}\n{"ste\n{"step": 2}\n')  # a corrupt line in the middle is an error
  with pytest.raises(ValueError, match="line 2"):
    metrics.read_jsonl(str(path))


def test_plots_and_tensorboard_through_memory_url():
  root = f"memory://test_metrics/{uuid.uuid4().hex}"
  w = metrics.MetricsWriter(root, total_steps=2, progress=False)
  for s in range(2):
    w.write(s, {"train/reward_mean": 0.5 * s, "train/lr_scale": 1.0})
  w.close()
  paths = metrics.plot_run(root)
  assert sorted(paths) == [fs.join(root, "plots", "lr_scale.png"), fs.join(root, "plots", "reward.png")]
  assert all(fs.read_bytes(p).startswith(b"\x89PNG") for p in paths)
  assert sorted((t, s) for t, s, _ in read_tensorboard(fs.join(root, "tb")) if t.startswith("train/")) == [
    ("train/lr_scale", 0),
    ("train/lr_scale", 1),
    ("train/reward_mean", 0),
    ("train/reward_mean", 1),
  ]


def test_only_the_primary_process_writes(tmp_path):
  """On a multi-host run every process runs the loop; only process 0 touches the (shared) workdir."""
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5}) + "\n")
  w = metrics.MetricsWriter(str(tmp_path), total_steps=3, primary=False)
  w.write(1, {"x": 1.0})
  w.write_eval({"kind": "eval", "step": 1})
  w.close()
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no eval.jsonl, no tb/
  assert metrics.read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 5}]  # not truncated either


def test_grad_plots_are_drawn_from_hand_made_rows():
  rows = [
    {
      "step": s,
      "wall_time": 0.5 * s,
      "grad/sq_norm": 2.0 * s,
      "grad/cov_trace": 1.0 + s,
      "grad/var_ratio": 1.0 + s / 10,
    }
    for s in (1, 2, 3)
  ]
  plots = {p[0]: p for p in metrics.PLOTS}
  _, title, keys, ylabel = plots["grad_noise"]
  fig = metrics.figure(rows, title, keys, ylabel, run="vcpo lag k=8")
  step_ax, wall_ax = fig.axes
  assert [ln.get_label() for ln in step_ax.get_lines()] == ["grad/sq_norm", "grad/cov_trace"]
  np.testing.assert_allclose(step_ax.get_lines()[0].get_ydata(), [2.0, 4.0, 6.0])
  np.testing.assert_allclose(wall_ax.get_lines()[1].get_xdata(), [0.5, 1.0, 1.5])
  assert (step_ax.get_xlabel(), step_ax.get_ylabel().replace("\n", " ")) == ("learner step", ylabel)
  assert fig._suptitle.get_text() == f"{title}: vcpo lag k=8"
  _, title, keys, ylabel = plots["grad_baseline"]
  (line,) = metrics.figure(rows, title, keys, ylabel).axes[0].get_lines()
  np.testing.assert_allclose(line.get_ydata(), [1.1, 1.2, 1.3])
  assert metrics.figure(rows, *plots["grad_concentration"][1:]) is None  # no concentration keys: no plot


def _full_rows(n=200):
  """Rows with every PLOTS key (a telemetry run with a sparse, partly unmeasured reference cosine)."""
  rng = np.random.default_rng(0)
  rows = []
  for s in range(1, n + 1):
    r = {"step": s, "wall_time": 1.5 * s}
    r.update({k: float(rng.uniform(0.1, 0.9)) for _, _, keys, _ in metrics.PLOTS for k in keys})
    r.update({"train/grad_norm": float(rng.uniform(1, 5)), "grad/sq_norm": 3.0 * s, "grad/cov_trace": 50.0 + s})
    r.update({"train/lag_min": 0.0, "train/lag_mean": 1.5, "train/lag_max": 4.0, "grad/var_ratio": 1.2})
    r["grad/ref_cosine"] = 0.4 if s % 10 == 0 else float("nan")
    if s % 20:
      del r["eval/accuracy"]
    rows.append(r)
  return rows


def test_every_run_plot_reads():
  """tests/readability.py on every PLOTS figure of a full telemetry run (resumed once, with the clip line): no
  label clipped by the figure or over another, the title names the run, the legend lists only drawn series (a
  key whose every value is NaN is not in it)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from tests import readability

  run = "vcpo_sc_top64 async k=128 lr=0.0003 seed=12"
  rows = _full_rows()
  for stem, title, keys, ylabel in metrics.PLOTS:
    hlines = {"clip norm 1": 1.0} if stem == "grad_norm" else None
    fig = metrics.figure(rows, title, keys, ylabel, hlines=hlines, run=run, resumed=[80])
    readability.check(fig, identity=[run])
    plt.close(fig)
  unmeasured = [dict(r, **{"grad/ref_cosine": float("nan")}) for r in rows]
  fig = metrics.figure(unmeasured, *{p[0]: p for p in metrics.PLOTS}["grad_concentration"][1:], run=run)
  assert "grad/ref_cosine" not in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  readability.check(fig, identity=[run])
  plt.close("all")


def test_the_readability_check_fails_on_the_old_grad_concentration_figure():
  """The figure as drawn before the check (figsize 10 x 3.5, tight_layout, the long y label, three styles for
  four keys): its y labels run past the figure's edge and into the title."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from tests import readability

  rows = _full_rows()
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for ax in axes:
    for k in ("grad/top1_share", "grad/top5pct_share", "grad/ess_ratio"):
      ax.plot(*metrics.series(rows, k), label=k)
    ax.set_ylabel("share, gradient ESS / N, cosine (fractions of sum c^2 g^2, of N; cosine)")
    ax.set_xlabel("learner step")
    ax.legend(fontsize=8)
  fig.suptitle("update concentration (per-trajectory |c_n| ||g_n||): vcpo sync lr=0.0003 seed=0")
  fig.tight_layout()
  found = readability.problems(fig, identity=["vcpo sync lr=0.0003 seed=0"])
  assert any("y label is clipped" in p for p in found) and any("overlaps" in p for p in found), found
  plt.close(fig)
