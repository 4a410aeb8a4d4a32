"""Tests of vcpo_jax.rl.method: a Method value is its preset's PGConfig, and gives the learner's loss and
gradient on a hand-made batch; adding a peer loss is one registered function plus one preset line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import estimator, learner
from vcpo_jax.rl import advantages, losses, method, presets, weights

# N = 6 rows in 3 groups of 2, T = 4 tokens; row 5 is padding (empty mask). The learner's logp_fn is the
# identity on params = logp_nt, so its gradient w.r.t. params is d loss / d logp_nt and the squared
# score norm of row n is ||mask_n||^2 = L_n.
LOGP = np.array(
  [
    [-0.3, -1.2, -0.7, -2.0],
    [-0.9, -0.4, -1.5, -0.2],
    [-2.2, -0.1, -0.6, -1.1],
    [-0.5, -0.8, -0.3, -0.9],
    [-1.4, -0.6, -0.2, -0.7],
    [-0.1, -0.1, -0.1, -0.1],
  ],
  np.float32,
)
BEHAVIOR = LOGP + np.array(
  [
    [0.2, -0.5, 0.1, 0.3],
    [-0.4, 0.2, 0.6, -0.1],
    [0.9, -0.3, 0.0, 0.4],
    [0.02, -0.03, 0.01, 0.0],  # l = 0: the row geo_mask keeps
    [0.5, 0.5, -0.8, 0.2],
    [0.0, 0.0, 0.0, 0.0],
  ],
  np.float32,
)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
BATCH = {
  "tokens": np.zeros((6, 4), np.int32),
  "behavior_logp": BEHAVIOR,
  "loss_mask": MASK,
  "rewards": np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], np.float32),
  "group_id": np.array([0, 0, 1, 1, 2, 2], np.int32),
}


def _learner_path(cfg):
  grads, aux = learner.policy_gradient("vmap")(lambda p, b: p, jnp.asarray(LOGP), BATCH, cfg)
  return float(aux["pg_loss"]), np.asarray(grads)


def _method_path(m):
  batch = dict(BATCH, sq_norm=MASK.sum(-1))
  (loss, _), grad = jax.value_and_grad(lambda lp: m.loss_fn(lp, batch), has_aux=True)(jnp.asarray(LOGP))
  return float(loss), np.asarray(grad)


def test_every_preset_is_a_method_with_the_same_pg_config():
  assert set(method.PRESETS) == set(presets.PRESETS)
  for name, m in method.PRESETS.items():
    assert m.pg_config() == estimator.pg_config_from_preset(name), name
    hash(m)  # a value: jit-static


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
@pytest.mark.slow
def test_each_preset_method_gives_the_learners_loss_and_gradient(name):
  loss_ref, grad_ref = _learner_path(estimator.pg_config_from_preset(name))
  loss, grad = _method_path(method.PRESETS[name])
  np.testing.assert_allclose(grad, grad_ref, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6, atol=1e-7)
  assert np.any(grad != 0), name  # the batch exercises every method


def test_a_peer_loss_with_hyper_parameters_is_the_policy_loss_kw_string():
  m = method.Method(loss=losses.ppo_clip(eps_high=0.28, dual_clip_c=3.0))
  cfg = m.pg_config()
  assert (cfg.policy_loss, cfg.policy_loss_kw) == ("ppo_clip", "dual_clip_c=3.0,eps_high=0.28")
  ref = estimator.pg_config_from_preset("ppo_clip", policy_loss_kw="eps_high=0.28,dual_clip_c=3")
  assert estimator.policy_loss_kwargs(cfg) == estimator.policy_loss_kwargs(ref)
  np.testing.assert_allclose(_method_path(m)[1], _learner_path(ref)[1], rtol=1e-6, atol=1e-7)


def test_factories_take_only_their_own_arguments_and_check_them():
  assert weights.tis(4.0).pg_fields() == {"is_variant": "tis", "tis_c": 4.0}
  assert weights.geo_mask(0.9, 1.1).pg_fields() == {"is_variant": "geo_mask", "geo_lower": 0.9, "geo_upper": 1.1}
  assert weights.tis_ess(0.3).pg_fields() == {"is_variant": "tis_ess", "tis_ess_target": 0.3}
  assert isinstance(losses.ppo_clip(), losses.PeerLoss)  # keyword arguments only: the factory
  args = (LOGP, LOGP - 0.1, BEHAVIOR, np.linspace(-1.0, 1.0, 6, dtype=np.float32), MASK)
  loss, _ = losses.ppo_clip(*args, eps_high=0.28)  # with the arrays: the loss itself
  assert float(loss) == float(losses.make_policy_loss("ppo_clip", eps_high=0.28)(*args)[0])
  with pytest.raises(ValueError, match=r"unknown hyper-parameters \['budget'\]"):
    losses.ppo_clip(budget=0.04)
  with pytest.raises(ValueError, match=r"c=0\.0: variant 'tis' needs a truncation level c > 0"):
    weights.tis(0.0)
  with pytest.raises(ValueError, match=r"std='ddof2'"):
    advantages.grpo(std="ddof2")
  with pytest.raises(ValueError, match=r"PGConfig.policy_loss='gspo' with is_variant='tis'"):
    method.Method(weights=weights.tis(8.0), loss=losses.gspo()).pg_config()


def test_weights_value_is_importance_weights():
  l_n = jnp.array([-1.0, 0.0, 1.0, 3.0])
  np.testing.assert_array_equal(weights.tis(2.0)(l_n), estimator.importance_weights(l_n, "tis", c=2.0))
  np.testing.assert_allclose(weights.clip(0.5, 2.0)(l_n), [0.5, 1.0, 2.0, 2.0], rtol=1e-6)


@pytest.fixture
def scratch_registries():
  """Restores POLICY_LOSSES and method.PRESETS (in place: other modules hold the same dicts)."""
  saved = [(d, dict(d)) for d in (losses.POLICY_LOSSES, method.PRESETS)]
  yield
  for d, before in saved:
    d.clear()
    d.update(before)


def test_adding_a_peer_loss_is_one_factory_and_one_preset_line(scratch_registries):
  """The whole diff of a new peer loss: the registered function (its factory) and its preset line."""

  # --- the diff: one factory ...
  @losses.register("a test: the on-policy REINFORCE loss -A log pi, token-mean")
  def plain_pg(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt, *, scale=1.0, loss_agg="token-mean"):
    """Plain policy gradient: loss = -scale * aggregate(A log pi_theta)."""
    m = jnp.asarray(mask_nt) != 0
    adv = jax.lax.stop_gradient(jnp.broadcast_to(jnp.asarray(advantages)[:, None], m.shape))
    return -scale * losses.aggregate(jnp.where(m, adv * logp_nt, 0.0), m, loss_agg), {}

  # ... and one preset line
  method.PRESETS["plain_pg"] = method.Method(loss=plain_pg(scale=2.0))
  # --- end of the diff

  m = method.PRESETS["plain_pg"]
  cfg = m.pg_config()
  assert (cfg.policy_loss, cfg.policy_loss_kw) == ("plain_pg", "scale=2.0")
  loss, grad = _method_path(m)
  loss_ref, grad_ref = _learner_path(cfg)  # the learner runs it unchanged
  np.testing.assert_allclose([loss, *grad.ravel()], [loss_ref, *grad_ref.ravel()], rtol=1e-6, atol=1e-7)
  # Hand check: token-mean over 14 loss tokens, GRPO sample-std advantages +-1/sqrt(1/2) = +-0.7071 in each
  # group of two with different rewards (group 2 has one valid row: A = 0), times scale 2.
  a = np.array([0.70711, -0.70711, -0.70711, 0.70711, 0.0, 0.0])
  np.testing.assert_allclose(grad, -2.0 * a[:, None] * MASK / 14.0, atol=1e-5)
  assert dataclasses.replace(m, loss=plain_pg()).pg_config().policy_loss_kw == ""
