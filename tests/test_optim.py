"""Tests of vcpo_jax.optim: the ESS-scaled AdamW chain."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vcpo_jax import optim

PARAMS = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]]), "b": jnp.array([0.1, -0.3])}
GRADS = [
  {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([-1.0, 0.5])},
  {"w": jnp.array([[-0.3, 0.7], [1.5, -0.2]]), "b": jnp.array([0.2, 0.9])},
  {"w": jnp.array([[2.0, 0.1], [-0.4, 0.6]]), "b": jnp.array([-0.5, -0.5])},
]
KW = dict(weight_decay=0.1, clip_norm=1.0, b1=0.9, b2=0.999, eps=1e-8)


def _plain(lr=1e-2):
  return optax.chain(
    optax.clip_by_global_norm(KW["clip_norm"]),
    optax.adamw(lr, b1=KW["b1"], b2=KW["b2"], eps=KW["eps"], weight_decay=KW["weight_decay"]),
  )


def _run(opt, scales, **extra):
  params, state, ups = PARAMS, opt.init(PARAMS), []
  for g, s in zip(GRADS, scales):
    kw = {} if s is None else {"ess_scale": s}
    u, state = opt.update(g, state, params, **kw)
    ups.append(u)
    params = optax.apply_updates(params, u)
  return ups, params


def _assert_tree_equal(a, b, rtol=0.0):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=0)


def test_scale_one_equals_plain_adamw_chain_exactly():
  ups, params = _run(optim.make_optimizer(1e-2, **KW), [1.0, 1.0, None])
  ref_ups, ref_params = _run(_plain(), [None] * 3)
  for u, r in zip(ups, ref_ups):
    _assert_tree_equal(u, r)
  _assert_tree_equal(params, ref_params)


def test_scale_multiplies_the_step_and_does_not_touch_state():
  opt = optim.make_optimizer(1e-2, **KW)
  state0 = opt.init(PARAMS)
  u1, st_scaled = opt.update(GRADS[0], state0, PARAMS, ess_scale=0.3)
  u1_ref, st_ref = opt.update(GRADS[0], state0, PARAMS, ess_scale=1.0)
  for x, y in zip(jax.tree_util.tree_leaves(u1), jax.tree_util.tree_leaves(u1_ref)):
    np.testing.assert_allclose(np.asarray(x), 0.3 * np.asarray(y), rtol=1e-6)
  # The moments (and count) are identical: the scale never enters the state.
  _assert_tree_equal(st_scaled, st_ref)
  # Next step with scale 1, same grads and params: equals the unscaled run.
  u2, _ = opt.update(GRADS[1], st_scaled, PARAMS, ess_scale=1.0)
  u2_ref, _ = opt.update(GRADS[1], st_ref, PARAMS)
  _assert_tree_equal(u2, u2_ref)


@pytest.mark.parametrize("scale,expected", [(2.5, 1.0), (-1.0, 0.0), (float("nan"), 0.0), (0.49, 0.49)])
def test_scale_is_capped_and_nan_safe(scale, expected):
  t = optim.scale_by_ess()
  u, _ = t.update({"a": jnp.ones(3)}, t.init(None), ess_scale=scale)
  np.testing.assert_allclose(np.asarray(u["a"]), expected, rtol=1e-7)


def test_scale_is_traceable_under_jit():
  opt = optim.make_optimizer(1e-2, **KW)

  @jax.jit
  def step(params, state, g, s):
    u, state = opt.update(g, state, params, ess_scale=s)
    return u, state

  state = opt.init(PARAMS)
  u_half, _ = step(PARAMS, state, GRADS[0], 0.5)
  u_one, _ = step(PARAMS, state, GRADS[0], 1.0)
  np.testing.assert_allclose(np.asarray(u_half["w"]), 0.5 * np.asarray(u_one["w"]), rtol=1e-6)


def test_schedules():
  s = optim.make_schedule(1.0, "warmup_constant", warmup_steps=4)
  np.testing.assert_allclose([float(s(i)) for i in (0, 2, 4, 10)], [0.0, 0.5, 1.0, 1.0])
  c = optim.make_schedule(1.0, "warmup_cosine", warmup_steps=2, total_steps=10)
  assert float(c(2)) == pytest.approx(1.0) and float(c(10)) == pytest.approx(0.0, abs=1e-6)
  assert float(optim.make_schedule(3e-6)(123)) == pytest.approx(3e-6)


@pytest.mark.parametrize(
  "kw,field",
  [
    (dict(schedule="cos"), "schedule"),
    (dict(clip_norm=0.0), "clip_norm"),
    (dict(schedule="warmup_cosine"), "total_steps"),
  ],
)
def test_bad_input_names_the_field(kw, field):
  with pytest.raises(ValueError, match=field):
    optim.make_optimizer(1e-3, **kw)
