"""Smoke: a Qwen3 checkpoint written by transformers (yarn RoPE, q/k norms) trains through the real trainer."""

import jax
import numpy as np
import pytest

from tests import fixtures
from tests.test_rope_parity import hf_model
from vcpo_jax import trainer
from vcpo_jax.model import hf_io
from vcpo_jax.model.tokenizer import build_char_tokenizer
from vcpo_jax.rollout import common as rollout_common

pytest.importorskip("torch")


def train_checkpoint(tmp_path, monkeypatch, model_type: str, rope: str, seed: int):
  """Writes a transformers checkpoint (hf_model(model_type, rope, untied)), trains it 2 steps through
  trainer.run with a dense reward; returns (the checkpoint dir, the parameters saved at step 2)."""
  ckpt = str(tmp_path / model_type)
  hf_model(model_type, rope, False, seed=seed).save_pretrained(ckpt)
  build_char_tokenizer(ckpt)
  saved = {}
  real_save = trainer._save

  def recording_save(c, step, state, *a, **k):
    saved[step] = jax.tree.map(lambda x: np.array(x, copy=True), state.params)
    return real_save(c, step, state, *a, **k)

  monkeypatch.setattr(trainer, "_save", recording_save)
  # A reward with signal for a random policy (the fraction of digits), so that every step moves the weights.
  dense = lambda problems, outputs, extraction=None: ([sum(map(str.isdigit, o)) / max(len(o), 1) for o in outputs], 0)
  monkeypatch.setattr(rollout_common.tasks, "score_problems", dense)
  c = fixtures.tiny_countdown_config(
    steps=2, **{"model.checkpoint": ckpt, "optim.lr": 1e-2, "checkpoint.every": 2, "eval.every": 2, "log.plots": False}
  )
  for field in ("hidden_size", "intermediate_size", "num_layers"):  # the checkpoint's architecture, not a preset's
    c.model[field] = None
  trainer.run(c, str(tmp_path / "run"))
  return ckpt, saved[2]


@pytest.mark.slow
def test_qwen3_checkpoint_trains_a_few_steps(tmp_path, monkeypatch):
  ckpt, final = train_checkpoint(tmp_path, monkeypatch, "qwen3", "yarn", seed=7)
  _, start = hf_io.load_hf(ckpt)
  q_norm = lambda p: np.asarray(p["layers"]["self_attn"]["q_norm"]["scale"][...][0])
  before = np.asarray(start.layers.self_attn.q_norm.scale[...][0])
  assert q_norm(final).shape == (32,)  # head_dim, not hidden_size // num_heads
  assert np.abs(q_norm(final) - before).max() > 1e-4  # the per-head norm weights are trained
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(final))
