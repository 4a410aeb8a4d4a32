"""The jitted learner step: a real update moves the parameters, a non-finite one is skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import estimator, learner, optim
from vcpo_jax.model import config, transformer

N, T = 8, 12


@pytest.fixture(scope="module")
def setup():
  cfg = config.tiny_llama(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
  )
  graphdef, params = transformer.split(transformer.init(cfg, seed=0))
  tx = optim.make_optimizer(1e-2, weight_decay=0.0)
  step = jax.jit(
    learner.make_train_step(
      graphdef, tx, learner.LearnerConfig(pg=estimator.pg_config_from_preset("vcpo"), grad_path="ghost")
    )
  )
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 32, (N, T)).astype(np.int32)
  valid = np.ones((N, T), bool)
  loss_mask = np.zeros((N, T), bool)
  loss_mask[:, 4:] = True
  logp = np.asarray(transformer.sequence_logprobs(graphdef, params, tokens, valid))
  batch = dict(
    tokens=tokens,
    valid_mask=valid,
    loss_mask=loss_mask,
    behavior_logp=np.where(loss_mask, logp - 0.05 * rng.standard_normal((N, T)), 0).astype(np.float32),
    rewards=rng.integers(0, 2, N).astype(np.float32),
    group_id=np.repeat(np.arange(2), 4).astype(np.int32),
  )
  return params, tx, step, batch


def _same(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_finite_step_updates_and_reports(setup):
  params, tx, step, batch = setup
  state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
  new, m = step(state, batch)
  assert float(m["nonfinite"]) == 0.0
  assert float(m["grad_norm"]) > 0
  assert 0.0 < float(m["lr_scale"]) <= 1.0  # stale-looking ratios: the ESS brake is engaged, capped at 1
  assert float(m["ess_ratio"]) < 1.0
  assert int(new.step) == 1
  assert not _same(new.params, params)


@pytest.mark.parametrize("field", ["rewards", "behavior_logp"])
def test_nonfinite_step_is_skipped(setup, field):
  params, tx, step, batch = setup
  bad = dict(batch)
  bad[field] = batch[field].copy()
  bad[field][0] = np.nan  # a corrupt row from the sampler or the reward function
  state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
  opt_before = jax.tree.map(np.asarray, state.opt_state)
  new, m = step(state, bad)
  assert float(m["nonfinite"]) == 1.0
  assert _same(new.params, params)  # parameters untouched ...
  assert _same(new.opt_state, opt_before)  # ... and so are the Adam moments
  assert int(new.step) == 1  # the step still counts (the trainer logs it and decides skip / abort)
