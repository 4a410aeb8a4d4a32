"""MetricsWriter: jsonl contents, resume truncation, plots."""

import json
import os

from vcpo_jax import metrics


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


def test_resume_truncates_future_records(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(6)))
  w = metrics.MetricsWriter(str(tmp_path), total_steps=6, resume_step=3, progress=False, tensorboard=False)
  w.write(4, {"x": 40})  # initial_step = updates done: the next record is step 4
  w.close()
  recs = metrics.read_jsonl(str(path))
  assert [(r["step"], r["x"]) for r in recs] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 40)]
