"""experiments/lora_curves: the per-run numbers, the selection score, the table and the figure, on fake runs."""

import argparse
import json

import numpy as np

from vcpo_jax.experiments import lora_curves


def _run(path, evals, learn_s=0.5):
  path.mkdir(parents=True)
  recs = [{"step": s, "eval/accuracy": a} for s, a in evals]
  recs += [{"step": t, "train/pg_loss": 0.0, "wall_time": 2.0 * t, "time/learn_s": learn_s} for t in range(1, 6)]
  (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  return lora_curves.read(path)


def test_read_score_and_report(tmp_path):
  a = argparse.Namespace(k=8, rank=8, alpha=16.0, tune_seed=3, seeds=[0, 1])
  full = [_run(tmp_path / f"f{i}", [(0, 0.2), (150, 0.4), (175, 0.5), (200, 0.6 + 0.1 * i)]) for i in range(2)]
  r = full[0]
  assert r["step"].tolist() == [0, 150, 175, 200] and r["steps_per_s"] == 0.5 and r["learn_ms"] == 500.0
  assert lora_curves.score(r) == np.mean([0.4, 0.5, 0.6])  # the last three evaluations
  lora = [_run(tmp_path / f"l{i}", [(0, 0.2), (150, 0.3), (175, 0.3), (200, 0.3)], learn_s=0.25) for i in range(2)]
  sizes = {"params": 10, "trainable": 10, "publish_bytes": 40}
  sides = {
    "full": {"lr": 1e-4, "scores": {1e-4: 0.5, 2e-4: 0.4}, "runs": full, "sizes": sizes},
    "LoRA r 8": {
      "lr": 1e-3,
      "scores": {1e-3: 0.3, 2e-3: 0.2},
      "runs": lora,
      "sizes": dict(sizes, trainable=1, publish_bytes=4),
    },
  }
  text = lora_curves.report(a, sides, "python -m vcpo_jax.experiments.lora_curves")
  assert "| full | 0.0001 | 0.200 +- 0.000 | 0.650 +- 0.050 |" in text  # final acc: 0.6, 0.7
  assert "| LoRA r 8 | 0.001 | 0.200 +- 0.000 | 0.300 +- 0.000 |" in text and "| 1 of 10 | 4 |" in text
  assert "| 0.50 | 500.0 |" in text and "| 0.50 | 250.0 |" in text
  lora_curves.plot(a, sides, tmp_path / "fig.png")
  assert (tmp_path / "fig.png").stat().st_size > 1000
