"""docs/results/moe_replay_table.py: the protocol's endpoints and paired differences, on hand-made runs."""

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "moe_replay_table.py")
_spec = importlib.util.spec_from_file_location("moe_replay_table", _PATH)
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def test_paired_difference_by_hand():
  # d = (0.1, 0, 0.1): mean 1/15, sd = sqrt(1/300), SE = sd / sqrt(3) = 1/30; t(0.975, 2) = 4.302653
  p = table.paired([0.3, 0.4, 0.5], [0.2, 0.4, 0.4])
  assert p["mean"] == pytest.approx(1 / 15) and p["se"] == pytest.approx(1 / 30)
  assert p["ci95"] == pytest.approx((1 / 15 - 4.302653 / 30, 1 / 15 + 4.302653 / 30), rel=1e-6)


def _write(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def test_endpoints_take_the_last_eval_and_the_last_50_steps(tmp_path):
  evals = [{"step": s, "mean_at_n": a} for s, a in ((150, 0.5), (0, 0.2), (100, 0.4))]  # any order
  metrics = [{"step": 0, "wall_time": 1.0}]  # a row without learner metrics (the step-0 record) is skipped
  for s in range(1, 151):  # ESS/N 0 on steps 1..100, then 1: the window (100, 150] sees only the 1s
    late = s > 100
    metrics.append(
      {
        "step": s,
        "train/ess_ratio": float(late),
        "train/log_ratio_max": 2.0 if late else 9.0,
        "train/log_ratio_min": -1.0,
        "train/lag_mean": 8.0,
        "train/moe/route_mismatch": 0.04 if late else 0.5,
      }
    )
  _write(tmp_path / "eval.jsonl", evals)
  _write(tmp_path / "metrics.jsonl", metrics)
  e = table.endpoints(str(tmp_path))
  assert (e["final_step"], e["final_acc"], e["acc_by_step"][0]) == (150, 0.5, 0.2)
  assert e["ess_ratio"] == 1.0 and e["log_ratio_range"] == 3.0 and e["moe/route_mismatch"] == pytest.approx(0.04)
  assert e["moe/ess_replay"] is None  # absent from the run (replay off): None, not 0
