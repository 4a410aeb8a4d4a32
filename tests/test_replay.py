"""vcpo_jax.experiments.replay: the stale batch is the run's own, the numbers are deterministic, the CLI writes."""

import dataclasses
import json

import numpy as np
import pytest

from tests import fixtures
from vcpo_jax import trainer
from vcpo_jax.experiments import replay


@pytest.fixture(scope="module")
def lag_run(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("replay") / "run")
  c = fixtures.tiny_countdown_config(
    **{"mode": "lag", "lag.k": 2, "steps": 5, "checkpoint.every": 4, "optim.lr": 1e-2, "log.norm_overhead_every": 0}
  )
  trainer.run(c, wd)
  return wd


@pytest.mark.slow
def test_stale_batch_is_the_runs_batch_of_that_step(lag_run):
  data = replay.load_step(lag_run, 4)
  assert (data.step, data.version) == (4, 2)  # k = 2: step 4 samples with version 2 (from the ring)
  batch, _ = data.maker.make(data.stale_params, 4, replay.jax.random.fold_in(data.key, 4), data.version)
  rows = [json.loads(line) for line in open(f"{lag_run}/metrics.jsonl")]
  row = next(r for r in rows if r["step"] == 5 and "train/reward_mean" in r)  # the update at step 4, logged as 5
  assert float(batch["rewards"].mean()) == pytest.approx(row["train/reward_mean"])
  assert row["train/lag_mean"] == 2.0
  # the run's learner saw these rows: its ESS of the unclipped weights is the replayed vcpo step's
  res = replay.replay(data, ["vcpo"], batches=1, fresh=2, bootstrap=2, log=lambda *_: None)
  assert res["presets"]["vcpo"]["ess_ratio"] == pytest.approx(row["train/ess_ratio"], rel=1e-4)


def _token_rewards(data):
  """The untrained tiny policy scores 0 everywhere (a zero gradient): reward a token-sum parity instead."""
  make = data.maker.make

  def made(*a, **kw):
    b, info = make(*a, **kw)
    r = (np.asarray(b.tokens).sum(1) % 2).astype(np.float32)
    return dataclasses.replace(b, rewards=r), info

  data.maker.make = made
  return data


@pytest.mark.slow
def test_replay_is_deterministic_and_the_cli_writes(lag_run, tmp_path):
  data = _token_rewards(replay.load_step(lag_run, 4))
  kw = dict(batches=2, fresh=2, bootstrap=3, seed=1, log=lambda *_: None)
  a = replay.replay(data, ["vcpo", "seq_tis", "ppo_clip"], **kw)
  b = replay.replay(data, ["vcpo", "seq_tis", "ppo_clip"], **kw)
  assert a == b
  for name, r in a["presets"].items():
    assert -1.0 <= r["cos_onpolicy"] <= 1.0 and r["grad_norm"] > 0 and r["boot_var_rel"] >= 0, name
    assert np.isfinite(r["dreward"]), name
  assert a["presets"]["ppo_clip"]["grad_ess_ratio"] == 0.0  # a policy loss: no per-example norms
  assert 0 < a["presets"]["vcpo"]["grad_ess_ratio"] <= 1
  out = tmp_path / "out"
  replay.main(
    ["--workdir", lag_run, "--step", "4", "--out", str(out), "--presets", "vcpo,sync", "--batches", "1", "--fresh", "2"]
  )
  assert (out / "replay.png").stat().st_size > 0
  res = json.loads((out / "replay.json").read_text())
  assert res[0]["k"] == 2 and set(res[0]["presets"]) == {"vcpo", "sync"}
  assert "| vcpo |" in (out / "replay.md").read_text()
