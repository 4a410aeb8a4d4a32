"""Smoke: a Qwen3-MoE checkpoint written by transformers trains 2 steps through the real trainer, with routing
replay on (the sampler records the routing, the learner replays it and logs the moe/ metrics)."""

import json

import jax
import numpy as np
import pytest

from tests import fixtures
from vcpo_jax.model import hf_io

pytest.importorskip("torch")


@pytest.mark.slow
def test_qwen3_moe_checkpoint_trains_two_steps_with_replay(tmp_path, monkeypatch):
  model = fixtures.make_hf_model("qwen3_moe", 101, seed=5)
  ckpt, final = fixtures.train_hf_checkpoint(
    tmp_path, monkeypatch, model, "qwen3_moe", **{"model.routing_replay": True}
  )
  _, start = hf_io.load_hf(ckpt)
  before = np.asarray(start.layers.mlp.experts.down_proj[...])
  after = np.asarray(final["layers"]["mlp"]["experts"]["down_proj"][...])
  assert after.shape == before.shape == (2, 8, 32, 64)
  assert np.abs(after - before).max() > 1e-4  # the experts train
  router = np.asarray(final["layers"]["mlp"]["gate"]["kernel"][...])
  assert np.abs(router - np.asarray(start.layers.mlp.gate.kernel[...])).max() > 1e-4  # and the router
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(final))
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  moe_rows = [r for r in rows if "train/moe/ess_replay" in r]
  assert moe_rows, sorted(rows[-1])
  # At k = 0 with equal parameters, replay makes every ratio 1 (up to float noise).
  assert all(r["train/moe/log_ratio_std_replay"] < 1e-3 for r in moe_rows)
