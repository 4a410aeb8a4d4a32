"""Tests of vcpo_jax.rl.method: a Method value gives the learner's loss and gradient on a hand-made batch;
adding a weight variant is one decorated function, a peer loss one registered function plus one preset line;
the config's method tree maps onto the Method's parts: tests/test_rl_choices.py."""

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


def _learner_path(m):
  grads, aux = learner.policy_gradient("vmap")(lambda p, b: p, jnp.asarray(LOGP), BATCH, m)
  return float(aux["pg_loss"]), np.asarray(grads)


def _method_path(m):
  batch = dict(BATCH, sq_norm=MASK.sum(-1))
  (loss, _), grad = jax.value_and_grad(lambda lp: m.loss_fn(lp, batch), has_aux=True)(jnp.asarray(LOGP))
  return float(loss), np.asarray(grad)


def test_every_preset_is_a_hashable_method():
  assert presets.PRESETS is method.PRESETS and estimator.PRESETS is method.PRESETS
  for name, m in method.PRESETS.items():
    assert isinstance(m, method.Method) and estimator.method_from_preset(name) == m, name
    hash(m)  # a value: jit-static


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
@pytest.mark.slow
def test_each_preset_method_gives_the_learners_loss_and_gradient(name):
  loss_ref, grad_ref = _learner_path(method.PRESETS[name])
  loss, grad = _method_path(method.PRESETS[name])
  np.testing.assert_allclose(grad, grad_ref, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6, atol=1e-7)
  assert np.any(grad != 0), name  # the batch exercises every method


def test_a_peer_loss_with_hyper_parameters_is_its_config_tree():
  m = method.Method(loss=losses.ppo_clip(eps_high=0.28, dual_clip_c=3.0))
  assert m.loss.kwargs == dict(losses.ppo_clip().kwargs, dual_clip_c=3.0, eps_high=0.28)  # the others: defaults
  assert presets.method_from_preset("ppo_clip", {"loss.eps_high": 0.28, "loss.dual_clip_c": 3.0}) == m
  np.testing.assert_allclose(_method_path(m)[1], _learner_path(m)[1], rtol=1e-6, atol=1e-7)


def test_factories_take_only_their_own_arguments_and_check_them():
  assert weights.tis(4.0) == weights.Weights("tis", (("c", 4.0),)) == weights.tis(c=4.0)
  assert weights.geo_mask(0.9, 1.1).params == (("lower", 0.9), ("upper", 1.1))
  assert weights.tis_ess().params == (("target", 0.5),)  # the default, written once: the function's signature
  assert isinstance(losses.ppo_clip(), losses.PeerLoss)  # keyword arguments only: the factory
  args = (LOGP, LOGP - 0.1, BEHAVIOR, np.linspace(-1.0, 1.0, 6, dtype=np.float32), MASK)
  loss, _ = losses.ppo_clip(*args, eps_high=0.28)  # with the arrays: the loss itself
  assert float(loss) == float(losses.make_policy_loss("ppo_clip", eps_high=0.28)(*args)[0])
  with pytest.raises(ValueError, match=r"unknown hyper-parameters \['budget'\]"):
    losses.ppo_clip(budget=0.04)
  with pytest.raises(ValueError, match=r"unknown parameters \['upper'\]"):
    weights.tis(upper=2.0)
  with pytest.raises(ValueError, match=r"c=0\.0: variant 'tis' needs a truncation level c > 0"):
    weights.tis(0.0)
  with pytest.raises(ValueError, match=r"std='ddof2'"):
    advantages.grpo(std="ddof2")
  with pytest.raises(ValueError, match=r"loss='gspo' with weights='tis'"):
    method.Method(weights=weights.tis(8.0), loss=losses.gspo())
  with pytest.raises(ValueError, match=r"OPOB is derived for sequence-level weights"):
    method.Method(weights=weights.token_tis(), baseline=advantages.opob())
  with pytest.raises(ValueError, match=r"needs \['pi_prox'\]"):
    losses.PeerLoss("ppo_clip", needs=("pi_prox",))


def test_weights_value_is_importance_weights():
  l_n = jnp.array([-1.0, 0.0, 1.0, 3.0])
  np.testing.assert_array_equal(weights.tis(2.0)(l_n), estimator.importance_weights(l_n, "tis", c=2.0))
  np.testing.assert_allclose(weights.clip(0.5, 2.0)(l_n), [0.5, 1.0, 2.0, 2.0], rtol=1e-6)


# Every variant at a NON-default parameter value against a numpy transcription of its definition.
L_N = np.array([-3.0, -0.5, 0.0, 0.2, 1.0, 2.5], np.float32)
LEN_N = np.array([4.0, 1.0, 2.0, 5.0, 2.0, 10.0], np.float32)
NUMPY_WEIGHTS = {
  "tis": (dict(c=3.0), lambda: np.minimum(np.exp(L_N), 3.0)),
  "clip": (dict(lower=0.3, upper=1.5), lambda: np.clip(np.exp(L_N), 0.3, 1.5)),
  "mask": (dict(lower=0.3, upper=1.5), lambda: np.where((np.exp(L_N) >= 0.3) & (np.exp(L_N) <= 1.5), np.exp(L_N), 0)),
  "geo_mask": (dict(lower=0.9, upper=1.2), lambda: ((np.exp(L_N / LEN_N) >= 0.9) & (np.exp(L_N / LEN_N) <= 1.2)) * 1.0),
  "token_tis": (dict(c=1.5), lambda: np.minimum(np.exp(L_N), 1.5)),
  "is": ({}, lambda: np.exp(L_N)),
  "none": ({}, lambda: np.ones_like(L_N)),
}


@pytest.mark.parametrize("name", sorted(NUMPY_WEIGHTS))
def test_each_weight_variant_at_a_non_default_value_matches_numpy(name):
  params, want = NUMPY_WEIGHTS[name]
  w = weights.WEIGHT_VARIANTS[name](**params)
  assert all(dict(w.params)[k] != d for k, d in weights.WEIGHT_VARIANTS[name].defaults.items())  # non-default
  np.testing.assert_allclose(w(L_N, lengths_n=LEN_N), want(), rtol=1e-6)


def test_tis_ess_at_a_non_default_target_reaches_it():
  # the cap c_t is solved so that ESS(w) / n = target: at target 0.8 (default 0.5) check it with numpy
  w = np.asarray(weights.tis_ess(0.8)(L_N, lengths_n=LEN_N), np.float64)
  assert np.isclose(w.sum() ** 2 / (w**2).sum() / len(w), 0.8, atol=2e-3)
  np.testing.assert_allclose(w, np.minimum(np.exp(L_N), w.max()), rtol=1e-5)  # a truncation at one cap


def test_a_loss_declares_the_step_inputs_the_learner_binds():
  """decoupled PPO's log-linear pi_prox needs the rows' versions and the learner's: declared, bound by name."""
  m = dataclasses.replace(method.PRESETS["decoupled_ppo"], loss=losses.decoupled_ppo_loglinear())
  assert m.loss.needs == ("behavior_version", "current_version")
  batch = dict(BATCH, policy_version=np.array([3, 3, 2, 2, 3, 3], np.int32))
  grads, _ = learner.policy_gradient("vmap")(lambda p, b: p, jnp.asarray(LOGP), batch, m, current_version=4)
  assert np.all(np.isfinite(np.asarray(grads))) and np.any(np.asarray(grads) != 0)
  with pytest.raises(ValueError, match=r"needs the step inputs \['behavior_version'\]"):
    learner.policy_gradient("vmap")(lambda p, b: p, jnp.asarray(LOGP), BATCH, m, current_version=4)


@pytest.fixture
def scratch_registries():
  """Restores POLICY_LOSSES, WEIGHT_VARIANTS and method.PRESETS (in place: other modules hold the same dicts)."""
  saved = [(d, dict(d)) for d in (losses.POLICY_LOSSES, weights.WEIGHT_VARIANTS, method.PRESETS)]
  yield
  for d, before in saved:
    d.clear()
    d.update(before)


def test_adding_a_weight_variant_is_one_decorated_function(scratch_registries):
  """The whole diff of a new IS-weight variant: one function, registered by its decorator (its factory)."""

  # --- the diff
  @weights.variant("sequence")
  def power(lc, raw, L, *, alpha=0.5):
    """w = exp(alpha l) (a tempered IS weight)"""
    return jnp.exp(alpha * lc)

  # --- end of the diff

  m = method.Method(weights=power(alpha=0.25))
  assert m.weights == weights.Weights("power", (("alpha", 0.25),))
  loss, grad = _method_path(m)
  loss_ref, grad_ref = _learner_path(m)  # the learner runs it unchanged
  np.testing.assert_allclose([loss, *grad.ravel()], [loss_ref, *grad_ref.ravel()], rtol=1e-6, atol=1e-7)
  # numpy: coef_n = A_n w_n / (n L_n) with l_n = sum_t mask (logp - mu), GRPO sample std, n = 5 valid rows
  l_n = ((LOGP - BEHAVIOR) * MASK).sum(-1)
  a = np.array([0.70711, -0.70711, -0.70711, 0.70711, 0.0, 0.0])
  L = np.maximum(MASK.sum(-1), 1.0)
  np.testing.assert_allclose(grad, -(a * np.exp(0.25 * l_n) / (5 * L))[:, None] * MASK, atol=1e-5)


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
  assert m.loss == losses.PeerLoss("plain_pg", (("loss_agg", "token-mean"), ("scale", 2.0)))
  assert presets.preset_doc("plain_pg").startswith("plain_pg: Plain policy gradient")
  loss, grad = _method_path(m)
  loss_ref, grad_ref = _learner_path(m)  # the learner runs it unchanged
  np.testing.assert_allclose([loss, *grad.ravel()], [loss_ref, *grad_ref.ravel()], rtol=1e-6, atol=1e-7)
  # Hand check: token-mean over 14 loss tokens, GRPO sample-std advantages +-1/sqrt(1/2) = +-0.7071 in each
  # group of two with different rewards (group 2 has one valid row: A = 0), times scale 2.
  a = np.array([0.70711, -0.70711, -0.70711, 0.70711, 0.0, 0.0])
  np.testing.assert_allclose(grad, -2.0 * a[:, None] * MASK / 14.0, atol=1e-5)
  assert plain_pg().kwargs == {"scale": 1.0, "loss_agg": "token-mean"}  # the defaults, from the signature
