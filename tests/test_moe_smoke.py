"""Smoke: a Qwen3-MoE checkpoint written by transformers trains 2 steps through the real trainer, with routing
replay on (the sampler records the routing, the learner replays it and logs the moe/ metrics)."""

import json

import jax
import numpy as np
import pytest

from tests import fixtures
from vcpo_jax import trainer
from vcpo_jax.model import hf_io
from vcpo_jax.model.tokenizer import build_char_tokenizer
from vcpo_jax.rollout import common as rollout_common

pytest.importorskip("torch")


@pytest.mark.slow
def test_qwen3_moe_checkpoint_trains_two_steps_with_replay(tmp_path, monkeypatch):
  ckpt = str(tmp_path / "qwen3_moe")
  fixtures.make_hf_model("qwen3_moe", 101, seed=5).save_pretrained(ckpt)
  build_char_tokenizer(ckpt)
  saved = {}
  real_save = trainer._save

  def recording_save(c, step, state, *a, **k):
    saved[step] = jax.tree.map(lambda x: np.array(x, copy=True), state.params)
    return real_save(c, step, state, *a, **k)

  monkeypatch.setattr(trainer, "_save", recording_save)
  dense = lambda problems, outputs, extraction=None: ([sum(map(str.isdigit, o)) / max(len(o), 1) for o in outputs], 0)
  monkeypatch.setattr(rollout_common.tasks, "score_problems", dense)
  c = fixtures.tiny_countdown_config(
    steps=2,
    **{
      "model.checkpoint": ckpt,
      "model.routing_replay": True,
      "optim.lr": 1e-2,
      "checkpoint.every": 2,
      "eval.every": 2,
      "log.plots": False,
    },
  )
  for field in ("hidden_size", "intermediate_size", "num_layers"):
    c.model[field] = None
  trainer.run(c, str(tmp_path / "run"))
  _, start = hf_io.load_hf(ckpt)
  final = saved[2]
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
