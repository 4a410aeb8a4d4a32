"""End-to-end: the real run() for a few steps, resume equivalence, config errors."""

import json
import os

import pytest

from tests import fixtures
from vcpo_jax import metrics as metrics_lib
from vcpo_jax import run_config, trainer
from vcpo_jax.rollout import common as rollout_common


def _dense_score(task, text, reference, extraction=None):
  """A test reward with signal for a random policy: fraction of digits in the response."""
  del task, reference, extraction
  return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def _tiny(**overrides):
  return fixtures.tiny_countdown_config(**{"optim.lr": 1e-2, **overrides})


def _train_records(workdir):
  keys = (
    "train/reward_mean",
    "train/grad_norm",
    "train/ess_ratio",
    "train/lr_scale",
    "train/pg_loss",
    "train/lag_max",
    "train/baseline_mean",
  )
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/pg_loss" in r]
  return [(r["step"],) + tuple(r.get(k) for k in keys) for r in recs]


@pytest.fixture()
def dense_reward(monkeypatch):
  monkeypatch.setattr(rollout_common.tasks, "score", _dense_score)


def test_lag_run_resumes_bit_for_bit(tmp_path, dense_reward):
  """A 6-step lag run equals a 3-step run resumed for 3 more (parameters, optimizer, kept versions)."""
  base = dict(mode="lag", **{"lag.k": 2, "checkpoint.every": 3, "method": "vcpo"})
  full = str(tmp_path / "full")
  trainer.run(_tiny(steps=6, **base), full)
  part = str(tmp_path / "part")
  trainer.run(_tiny(steps=3, **base), part)
  trainer.run(_tiny(steps=6, **base), part)  # same workdir: resumes from step 3
  a, b = _train_records(full), _train_records(part)
  assert [r[0] for r in a] == [1, 2, 3, 4, 5, 6]
  assert a == b
  # The run learned something (a zero gradient would make resume equality vacuous) and was stale.
  assert max(r[2] for r in a) > 0
  assert max(r[6] for r in a) == 2
  summary = json.load(open(os.path.join(part, "summary.json")))
  assert summary["step"] == 6
  assert os.path.exists(os.path.join(full, "eval.jsonl"))


BAD_CONFIGS = [
  ({"lag.k": -1, "mode": "lag"}, "lag.k"),
  ({"method": "ppo_magic"}, "config.method"),
  ({"vcpo.advantage": "foo"}, "advantage"),
  ({"task.group_size": 1}, "task.group_size"),
  ({"mesh.shape": (3, 1, 1)}, "divisible"),
  ({"model.checkpoint": "/nonexistent/ckpt"}, "model.checkpoint"),
  ({"method": "clip", "vcpo.clip_lower": 3.0, "vcpo.clip_upper": 2.0}, "clip_lower"),
  ({"mode": "turbo"}, "config.mode"),
  ({"mode": "sync", "lag.k": 4}, "mode='lag'"),
  ({"mode": "async", "lag.k": 0}, "k >= 1"),
  ({"sampler.temperature": 0.0}, "sampler.temperature"),
  ({"optim.lr": -1.0}, "optim.lr"),
  ({"task.name": "chess"}, "task.name"),
  ({"eval.pass_at_k": (1, 8), "eval.n": 3}, "pass_at_k"),
  ({"learner.on_nonfinite": "ignore"}, "on_nonfinite"),
  ({"learner.grad_path": "magic"}, "grad_path"),
  ({"task.data_path": "/no/such/file.parquet"}, "task.data_path"),
  ({"eval.dataset": "chess"}, "eval.dataset"),
  ({"eval.data_path": "/no/such/test.jsonl"}, "eval.data_path"),
]


@pytest.mark.parametrize("overrides,needle", BAD_CONFIGS, ids=[n for _, n in BAD_CONFIGS])
def test_bad_config_is_a_clear_error(overrides, needle):
  with pytest.raises(run_config.ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
    run_config.parse_config(_tiny(**overrides))


def test_bad_config_fails_before_anything_is_built(tmp_path):
  with pytest.raises(run_config.ConfigError):
    trainer.run(_tiny(**{"lag.k": -3, "mode": "lag"}), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")
