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
  step = _step(graphdef, tx, "vcpo")
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
  return params, tx, step, batch, graphdef


def _step(graphdef, tx, preset, **lkw):
  pg = estimator.pg_config_from_preset(preset)
  return jax.jit(learner.make_train_step(graphdef, tx, learner.LearnerConfig(pg=pg, grad_path="ghost", **lkw)))


def _same(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_finite_step_updates_and_reports(setup):
  params, tx, step, batch, _ = setup
  state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
  new, m = step(state, batch)
  assert float(m["nonfinite"]) == 0.0
  assert float(m["grad_norm"]) > 0
  assert 0.0 < float(m["lr_scale"]) <= 1.0  # stale-looking ratios: the ESS brake is engaged, capped at 1
  assert float(m["ess_ratio"]) < 1.0
  assert int(new.step) == 1
  assert not _same(new.params, params)


def test_nonfinite_step_is_skipped(setup):
  params, tx, step, batch, _ = setup
  bad = dict(batch, rewards=batch["rewards"].copy())
  bad["rewards"][0] = np.nan  # a corrupt reward: its group's statistics are NaN
  state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
  opt_before = jax.tree.map(np.asarray, state.opt_state)
  new, m = step(state, bad)
  assert float(m["nonfinite"]) == 1.0
  assert _same(new.params, params)  # parameters untouched ...
  assert _same(new.opt_state, opt_before)  # ... and so are the Adam moments
  assert int(new.step) == 1  # the step still counts (the trainer logs it and decides skip / abort)


def test_nonfinite_log_ratio_row_is_masked_and_counted(setup):
  # A NaN behavior log-prob (a corrupt sampler row) masks that row out (issue 12 item 5): the step
  # is applied, equals the step with the row's loss mask emptied, and train/nonfinite_rows counts it.
  params, tx, step, batch, _ = setup
  bad = dict(batch, behavior_logp=batch["behavior_logp"].copy())
  bad["behavior_logp"][0, 5] = np.nan
  pad = dict(batch, loss_mask=batch["loss_mask"].copy())
  pad["loss_mask"][0] = False
  new_b, m_b = step(learner.init_state(jax.tree.map(jnp.copy, params), tx), bad)
  new_p, m_p = step(learner.init_state(jax.tree.map(jnp.copy, params), tx), pad)
  assert float(m_b["nonfinite"]) == 0.0 and float(m_b["nonfinite_rows"]) == 1.0
  assert float(m_p["nonfinite_rows"]) == 0.0
  for k in ("ess_ratio", "lr_scale", "grad_norm", "update_norm", "pg_loss"):
    assert float(m_b[k]) == pytest.approx(float(m_p[k]), rel=1e-5, abs=1e-8), k
  for a, b in zip(jax.tree.leaves(new_b.params), jax.tree.leaves(new_p.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_ess_brake_scales_the_update_exactly(setup):
  # Issue 12 item 15a: on a batch with stale rows, the VCPO update is lr_scale times the update of the
  # same method without the ESS brake (the scale multiplies the final AdamW update; the gradients and
  # Adam's moments do not see it). A learner that forgot ess_scale=lr_scale would fail here.
  params, tx, _, batch, graphdef = setup
  rng = np.random.default_rng(1)
  stale = dict(batch)
  noise = rng.standard_normal((N, T)) * np.linspace(0.1, 1.0, N)[:, None]  # rows from near to far off-policy
  stale["behavior_logp"] = np.where(batch["loss_mask"], batch["behavior_logp"] + noise, 0).astype(np.float32)
  runs = {}
  for preset in ("vcpo", "vcpo_no_esslr"):
    state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
    new, m = _step(graphdef, tx, preset)(state, stale)
    runs[preset] = (
      jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), new.params, params),
      m,
    )
  (d_vcpo, m_vcpo), (d_off, m_off) = runs["vcpo"], runs["vcpo_no_esslr"]
  s = float(m_vcpo["lr_scale"])
  assert 0.05 < s < 0.8  # the brake is engaged (an almost on-policy batch would not test it)
  assert s == pytest.approx(np.sqrt(float(m_vcpo["ess_ratio"])), rel=1e-6)
  assert float(m_off["lr_scale"]) == 1.0
  assert float(m_vcpo["grad_norm"]) == pytest.approx(float(m_off["grad_norm"]), rel=1e-6)  # same gradient
  assert float(m_vcpo["update_norm"]) == pytest.approx(s * float(m_off["update_norm"]), rel=1e-5)
  for a, b in zip(jax.tree.leaves(d_vcpo), jax.tree.leaves(d_off)):
    np.testing.assert_allclose(a, s * b, rtol=1e-3, atol=1e-6)
