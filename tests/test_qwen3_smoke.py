"""Smoke: a Qwen3 checkpoint written by transformers (yarn RoPE, q/k norms) trains through the real trainer."""

import jax
import numpy as np
import pytest

from tests import fixtures
from tests.test_rope_parity import hf_model
from vcpo_jax.model import hf_io

pytest.importorskip("torch")


def train_checkpoint(tmp_path, monkeypatch, model_type: str, rope: str, seed: int):
  """Writes a transformers checkpoint (hf_model(model_type, rope, untied)), trains it 2 steps through trainer.run
  with a dense reward (fixtures.train_hf_checkpoint); returns (the checkpoint dir, the step-2 parameters)."""
  return fixtures.train_hf_checkpoint(tmp_path, monkeypatch, hf_model(model_type, rope, False, seed=seed), model_type)


@pytest.mark.slow
def test_qwen3_checkpoint_trains_a_few_steps(tmp_path, monkeypatch):
  ckpt, final = train_checkpoint(tmp_path, monkeypatch, "qwen3", "yarn", seed=7)
  _, start = hf_io.load_hf(ckpt)
  q_norm = lambda p: np.asarray(p["layers"]["self_attn"]["q_norm"]["scale"][...][0])
  before = np.asarray(start.layers.self_attn.q_norm.scale[...][0])
  assert q_norm(final).shape == (32,)  # head_dim, not hidden_size // num_heads
  assert np.abs(q_norm(final) - before).max() > 1e-4  # the per-head norm weights are trained
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(final))
