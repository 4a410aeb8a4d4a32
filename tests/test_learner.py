"""The jitted learner step: a real update moves the parameters, a non-finite one is skipped."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import fixtures
from tests import test_policy_losses as TPL
from vcpo_jax import estimator, learner, optim, policy_losses
from vcpo_jax.model import transformer
from vcpo_jax.rl.advantages import opob, reinforce

N, T = 8, 12


@pytest.fixture(scope="module")
def setup():
  graphdef, params = transformer.split(transformer.init(fixtures.micro_config(32), seed=0))
  tx = optim.make_optimizer(1e-2, weight_decay=0.0)
  step = _step(graphdef, tx, "vcpo")
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 32, (N, T)).astype(np.int32)
  valid = np.ones((N, T), bool)
  loss_mask = np.zeros((N, T), bool)
  loss_mask[:, 4:] = True
  logp = np.asarray(transformer.sequence_logprobs(graphdef, params, tokens, valid))
  blogp = logp - 0.05 * rng.standard_normal((N, T))
  rewards = rng.integers(0, 2, N).astype(np.float32)
  batch = fixtures.learner_batch(tokens, valid, loss_mask, blogp, rewards, np.repeat(np.arange(2), 4).astype(np.int32))
  return params, tx, step, batch, graphdef


def _step(graphdef, tx, preset, **lkw):
  pg = estimator.method_from_preset(preset)
  return jax.jit(learner.make_train_step(graphdef, tx, learner.LearnerConfig(method=pg, grad_path="ghost", **lkw)))


def _same(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow
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


# ---------------------------------------------------------------------------
# Micro-batched step == single-pass step (issue 10 item 5)
# ---------------------------------------------------------------------------

# The presets micro-batching accepts (the policy losses and tis_ess are rejected: test_microbatch_config_errors).
MB_CONFIGS = {
  **{n: {} for n in estimator.PRESETS if not estimator.batch_wide_coefficients(estimator.method_from_preset(n))},
  # geo_mask's default interval rejects this batch
  "geo_mask": {"preset": "geo_mask", "weights.lower": 0.8, "weights.upper": 1.25},
  # the whole-batch normalisers in their other forms: kept-row counts, token counts, a constant T
  "mask_kept_token_mean": {"preset": "mask", "loss.mask_normalizer": "kept", "loss.loss_agg": "token-mean"},
  "geo_mask_kept": {"preset": "geo_mask", "loss.mask_normalizer": "kept", "weights.lower": 0.8, "weights.upper": 1.25},
  "vcpo_token_sum_norm": {"preset": "vcpo", "loss.loss_agg": "seq-mean-token-sum-norm"},
}


@pytest.fixture(scope="module")
def mb_setup(setup):
  """A stale batch of N = 8 rows in 4 groups of G = 2, with ragged loss masks and one padding row."""
  params, _, _, batch, graphdef = setup
  # Plain SGD behind the learner's clip and ESS scale: the update is linear in the gradient (Adam's first
  # step, ~lr * sign(g), would amplify float noise in gradient entries near 0), and the global-norm
  # clip is engaged (grad_norm > 1e-3 is asserted), so it must run after accumulation.
  # lr 100 makes the update (norm <= 0.1) large against the float32 rounding of the parameters it is added to.
  tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(100.0), optim.scale_by_ess())
  rng = np.random.default_rng(2)
  mb = dict(batch, group_id=np.repeat(np.arange(4), 2).astype(np.int32))
  loss_mask = batch["loss_mask"].copy()
  loss_mask[1, 9:] = False
  loss_mask[4, 6:] = False
  loss_mask[6] = False  # padding: out of every count
  noise = rng.standard_normal((N, T)) * np.linspace(0.05, 0.6, N)[rng.permutation(N)][:, None]
  mb["loss_mask"] = loss_mask
  mb["behavior_logp"] = np.where(loss_mask, batch["behavior_logp"] + noise, 0).astype(np.float32)
  mb["rewards"] = np.array([1, 0, 1, 1, 0, 1, 1, 0], np.float32)  # group 1 has zero std
  return params, tx, mb, graphdef


def _mb_pg(name):
  kw = dict(MB_CONFIGS[name])
  return estimator.method_from_preset(kw.pop("preset", name), kw)


def _assert_same_step(out1, out4, params):
  (s1, m1), (s4, m4) = out1, out4
  assert set(m1) == set(m4)
  assert float(m1["nonfinite"]) == 0.0 and float(m1["grad_norm"]) > 1e-3  # the clip is engaged
  for k in m1:
    # pg_loss sums signed per-row terms that largely cancel (|pg_loss| ~ 0.05 under OPOB), so its float32
    # noise is relative to the terms, not to the sum: the order of the sums (per layer, over the layer axis)
    # moves it by ~1e-5 relative while every other metric agrees to ~1e-7.
    tol = {"abs": 2e-6} if k == "pg_loss" else {"rel": 1e-5, "abs": 1e-7}
    assert float(m4[k]) == pytest.approx(float(m1[k]), **tol), k

  def update(state):  # the step's change of every parameter, in float64
    return [
      np.asarray(a, np.float64) - np.asarray(p, np.float64)
      for a, p in zip(*map(jax.tree.leaves, (state.params, params)))
    ]

  d1, d4 = update(s1), update(s4)
  scale = max(np.abs(d).max() for d in d1)
  assert scale > 0
  for a, b in zip(d4, d1):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)


def _lcfg(pg, mbs, grad_path="ghost", passes=1):
  return learner.LearnerConfig(
    method=pg, grad_path=grad_path, microbatch_size=mbs, group_size=2, batch_size=N, ghost_passes=passes
  )


def _step_from_start(setup, pg, mbs, grad_path="ghost", passes=1, jit=False):
  """(state, metrics) of one train step from mb_setup's parameters (a fresh copy each call)."""
  params, tx, batch, graphdef = setup
  step = learner.make_train_step(graphdef, tx, _lcfg(pg, mbs, grad_path, passes))
  return (jax.jit(step) if jit else step)(learner.init_state(jax.tree.map(jnp.copy, params), tx), batch)


@pytest.mark.parametrize("name", sorted(MB_CONFIGS))
@pytest.mark.slow
def test_microbatched_step_equals_single_pass(mb_setup, name):
  # Every preset (and the other whole-batch normalisers): 2 micro-batches of 2 groups == 1 pass, to 1e-5.
  # Run op by op (jax.disable_jit: the scan is a Python loop over the same body) so that the 16 configs
  # share compiled primitives; the compiled scan is checked below.
  pg = _mb_pg(name)
  with jax.disable_jit():
    out = {mbs: _step_from_start(mb_setup, pg, mbs) for mbs in (None, 4)}
  _assert_same_step(out[None], out[4], mb_setup[0])


@pytest.mark.slow
def test_microbatched_step_compiled_and_smaller(mb_setup):
  # The jitted lax.scan gives the single-pass step too, and holds one micro-batch's activations:
  # its compiled temporary memory is below the single pass's (deterministic, not a timing).
  params, tx, batch, graphdef = mb_setup
  pg = estimator.method_from_preset("vcpo")
  out, temp = {}, {}
  for mbs in (None, 2):
    state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
    compiled = jax.jit(learner.make_train_step(graphdef, tx, _lcfg(pg, mbs))).lower(state, batch).compile()
    temp[mbs] = compiled.memory_analysis().temp_size_in_bytes
    out[mbs] = compiled(state, batch)
  _assert_same_step(out[None], out[2], params)
  print("temp bytes, single pass vs 4 micro-batches:", temp)
  assert temp[2] < 0.7 * temp[None]


@pytest.mark.parametrize("name", ["vcpo", "vcpo_loo_opob"])  # OPOB: the coefficients read the norms
@pytest.mark.slow
def test_two_pass_ghost_step_equals_one_pass(mb_setup, name):
  """learner.ghost_passes=2 (norms block by block, then the update), micro-batched or not, == the one-pass step."""
  params = mb_setup[0]
  pg = _mb_pg(name)
  with jax.disable_jit():
    out = {(mbs, p): _step_from_start(mb_setup, pg, mbs, passes=p) for mbs, p in ((None, 1), (None, 2), (4, 2))}
  _assert_same_step(out[None, 1], out[None, 2], params)
  _assert_same_step(out[None, 1], out[4, 2], params)


@pytest.mark.parametrize("name", ["vcpo"])  # the vmap path differs from ghost only in the norms: OPOB
@pytest.mark.slow
def test_microbatched_vmap_path_equals_single_pass(mb_setup, name):
  # Jitted: one config, two compiles (28 CPU s) cost less than op by op (81 CPU s), whose primitives the
  # ghost-path sweep above does not share.
  pg = _mb_pg(name)
  out = {mbs: _step_from_start(mb_setup, pg, mbs, "vmap", jit=True) for mbs in (None, 4)}
  _assert_same_step(out[None], out[4], mb_setup[0])


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(microbatch_size=3, group_size=2), r"learner\.microbatch_size=3 is not a multiple of the group size 2"),
    (dict(microbatch_size=4, group_size=2, batch_size=6), r"learner\.microbatch_size=4 does not divide .*N=6"),
    (dict(microbatch_size=-1), r"learner\.microbatch_size=-1"),
    (dict(microbatch_size=4, method=estimator.Method(advantage=reinforce())), r"microbatch_size=4 with .*'reinforce'"),
    (dict(microbatch_size=4, method=estimator.Method(baseline=opob(scope="minibatch"))), "OPOB scope 'minibatch'"),
    (dict(microbatch_size=4, method=estimator.method_from_preset("ppo_clip")), r"loss 'ppo_clip'"),
    (dict(microbatch_size=4, method=estimator.method_from_preset("vcpo_tis_ess")), r"weights 'tis_ess'"),
  ],
)
def test_microbatch_config_errors(kw, match):
  kw = {"method": estimator.method_from_preset("vcpo"), **kw}
  with pytest.raises(ValueError, match=match):
    learner.LearnerConfig(**kw)


def test_microbatch_off_is_the_single_pass():
  pg = estimator.method_from_preset("vcpo")
  for mbs in (None, 0, 8, 16):
    assert learner.LearnerConfig(method=pg, microbatch_size=mbs).microbatches(8) == 1
  assert learner.LearnerConfig(method=pg, microbatch_size=2).microbatches(8) == 4
  with pytest.raises(ValueError, match="microbatch_size=3 does not divide"):
    learner.LearnerConfig(method=pg, microbatch_size=3).microbatches(8)


# ---------------------------------------------------------------------------
# The policy-loss presets (issue 13): learner update == the numpy-transcribed loss's gradient
# ---------------------------------------------------------------------------

POLICY_LOSS_PRESETS = sorted(policy_losses.POLICY_LOSSES)


def _np_grpo_advantages(r, gid, valid):
  """(R - group mean) / group sample std over the valid rows; 0 for a group with std <= 1e-6."""
  adv = np.zeros(len(r))
  for i in np.nonzero(valid)[0]:
    grp = [j for j in range(len(r)) if valid[j] and gid[j] == gid[i]]
    sd = np.std(r[grp], ddof=1) if len(grp) > 1 else 0.0
    adv[i] = (r[i] - np.mean(r[grp])) / sd if sd > 1e-6 else 0.0
  return adv


def _sgd_tx():
  # update = -grad * lr_scale exactly (lr 1, no clip): the update IS the gradient
  return optax.chain(optax.sgd(1.0), optim.scale_by_ess())


def _np_loss_grad(graphdef, params, batch, name, old_logp=None, rows=None):
  """jax.grad over params of sum_nt c_nt logp_nt with c_nt = d loss / d logp_nt by central differences of
  the float64 numpy transcription (tests/test_policy_losses.REFS), advantages from _np_grpo_advantages over
  the WHOLE batch, pi_old = old_logp (default: the current log-probs). rows: the minibatch's row indices."""
  logp = np.asarray(learner.make_logp_fn(graphdef)(params, batch), np.float64)
  old = logp if old_logp is None else np.asarray(old_logp, np.float64)
  mask = np.asarray(batch["loss_mask"], np.float64)
  valid = mask.sum(1) > 0
  adv = _np_grpo_advantages(np.asarray(batch["rewards"], np.float64), np.asarray(batch["group_id"]), valid)
  rows = np.arange(len(adv)) if rows is None else rows
  beh = np.asarray(batch["behavior_logp"], np.float64)
  A = np.broadcast_to(adv[rows, None], logp[rows].shape)
  cot = np.zeros_like(logp)
  cot[rows] = TPL.fd_grad(TPL.REFS[name], logp[rows], old[rows], beh[rows], A, mask[rows])
  return _cot_grad(graphdef)(params, batch, jnp.asarray(cot, jnp.float32))


@functools.cache
def _cot_grad(graphdef):
  """jit(params, batch, cot_nt -> grad_params sum_nt cot_nt logp_nt): one compile per batch shape."""
  lp_fn = learner.make_logp_fn(graphdef)
  return jax.jit(jax.grad(lambda p, batch, cot: jnp.sum(cot * lp_fn(p, batch))))


def _update(new_params, params):
  return [
    np.asarray(a, np.float64) - np.asarray(b, np.float64)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params))
  ]


def _assert_close_trees(got, want, rtol=2e-4):
  scale = max(np.abs(np.asarray(w)).max() for w in want)
  assert scale > 0
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, np.asarray(b, np.float64), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("name", POLICY_LOSS_PRESETS)
@pytest.mark.slow
def test_policy_loss_preset_update_equals_numpy_loss_gradient(mb_setup, name):
  # One update per step (the default): new params - params = -grad of the transcribed loss (pi_old = pi_theta).
  # Op by op (jax.disable_jit), so that the presets share compiled primitives with the sweep above.
  params, _, batch, graphdef = mb_setup
  tx = _sgd_tx()
  cfg = learner.LearnerConfig(method=estimator.method_from_preset(name), group_size=2, batch_size=N)
  with jax.disable_jit():
    new, m = learner.make_train_step(graphdef, tx, cfg)(learner.init_state(params, tx), batch)
    want = _np_loss_grad(graphdef, params, batch, name)
  assert float(m["nonfinite"]) == 0.0 and float(m["lr_scale"]) == 1.0
  _assert_close_trees(_update(new.params, params), [-np.asarray(g) for g in jax.tree.leaves(want)])
  # the same ESS metric as every method: of l_n = sum_t log pi_theta - log mu, at pi_old
  assert float(m["ess_ratio"]) == pytest.approx(float(m["loss/ess_ratio"]), rel=1e-5)
  assert float(m["ess_ratio"]) < 0.9  # the batch is stale: the metric is informative


def test_ppo_epochs_and_minibatches_equal_sequential_updates_with_one_pi_old(mb_setup):
  # 2 epochs x 2 minibatches of whole groups = 4 SGD updates, pi_old computed ONCE at the start: each one
  # the numpy transcription's gradient on its minibatch (a learner that recomputed pi_old per update, or
  # split groups, or skipped an epoch, differs).
  params, _, batch, graphdef = mb_setup
  tx = _sgd_tx()
  name = "ppo_clip"
  cfg = learner.LearnerConfig(
    method=estimator.method_from_preset(name), group_size=2, batch_size=N, ppo_epochs=2, minibatches=2
  )
  new, m = jax.jit(learner.make_train_step(graphdef, tx, cfg))(learner.init_state(params, tx), batch)
  old = learner.make_logp_fn(graphdef)(params, batch)
  p = params
  for _ in range(2):
    for rows in (np.arange(4), np.arange(4, 8)):
      # the minibatch's loss (its rows only, its own token-mean) on the full-batch shapes (one compile);
      # advantages over the whole batch equal the minibatch's own: its groups are whole
      g = _np_loss_grad(graphdef, p, batch, name, old_logp=old, rows=rows)
      p = jax.tree.map(lambda a, b: a - b, p, g)
  assert float(m["updates"]) == 4.0 and float(m["nonfinite"]) == 0.0
  assert float(m["loss/clip_frac_first"]) == 0.0 < float(m["loss/clip_frac"])  # r = 1 at the first update only
  _assert_close_trees(_update(new.params, params), _update(p, params), rtol=5e-4)
  assert int(new.step) == 1  # one trainer step (one policy version), four optimizer updates


def test_a_nonfinite_minibatch_update_is_skipped_and_the_others_apply(mb_setup, monkeypatch):
  # One guard for every update: a fault injected into the second minibatch's gradient (the one holding
  # group 2) makes that update's gradient NaN. It is skipped (nonfinite = 1); the first minibatch's update
  # applies, equal to the numpy transcription's.
  params, _, batch, graphdef = mb_setup
  real = learner.policy_losses.loss_gradient

  def faulty(fn, logp_fn, p, mb, adv, old):
    grads, loss, lm = real(fn, logp_fn, p, mb, adv, old)
    poison = jnp.where(jnp.any(mb["group_id"] == 2), jnp.nan, 1.0)
    return jax.tree.map(lambda g: g * poison, grads), loss, lm

  monkeypatch.setattr(learner.policy_losses, "loss_gradient", faulty)
  tx = _sgd_tx()
  name = "ppo_clip"
  cfg = learner.LearnerConfig(
    method=estimator.method_from_preset(name), group_size=2, batch_size=N, ppo_epochs=1, minibatches=2
  )
  state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
  new, m = jax.jit(learner.make_train_step(graphdef, tx, cfg))(state, batch)
  assert float(m["nonfinite"]) == 1.0 and float(m["updates"]) == 2.0
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new.params))
  old = learner.make_logp_fn(graphdef)(params, batch)
  g = _np_loss_grad(graphdef, params, batch, name, old_logp=old, rows=np.arange(4))
  want = jax.tree.map(lambda a, b: a - b, params, g)
  _assert_close_trees(_update(new.params, params), _update(want, params), rtol=5e-4)


def test_one_epoch_one_minibatch_is_the_single_update(mb_setup):
  # The multi-update machinery with 1 x 1 gives the default step's numbers (to float rounding).
  params, _, batch, graphdef = mb_setup
  tx = _sgd_tx()
  for name in ("ppo_clip", "m2po_paper"):
    cfg = learner.LearnerConfig(method=estimator.method_from_preset(name), group_size=2, batch_size=N)
    with jax.disable_jit():
      s1, m1 = learner.make_train_step(graphdef, tx, cfg)(learner.init_state(params, tx), batch)
      s2, m2 = learner._multi_update_step(graphdef, tx, cfg, learner.init_state(params, tx), batch)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-7, atol=1e-7)
    for k in ("pg_loss", "grad_norm", "ess_ratio", "loss/token_log_ratio_abs_mean"):
      assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-6, abs=1e-7), (name, k)


@pytest.mark.slow
def test_decoupled_ppo_loglinear_uses_the_step_version(mb_setup):
  # decoupled_prox="loglinear": pi_prox = mu + alpha (pi_theta - mu), alpha = (v - v_mu) / (v + 1 - v_mu) with
  # v = state.step (the parameters at the start of the step; the update produces v + 1). Rows sampled with
  # the current version (v_mu = v: alpha = 0, pi_prox = mu) and older ones (v_mu = v - 2: alpha = 2 / 3).
  params, _, batch, graphdef = mb_setup
  tx = _sgd_tx()
  v = 5
  vb = dict(batch, policy_version=np.array([5, 5, 3, 3, 5, 5, 3, 3], np.int32))
  pg = estimator.method_from_preset("decoupled_ppo", {"loss": "decoupled_ppo_loglinear"})
  cfg = learner.LearnerConfig(method=pg, group_size=2, batch_size=N)
  with jax.disable_jit():
    state = learner.init_state(params, tx)._replace(step=jnp.int32(v))
    new, m = learner.make_train_step(graphdef, tx, cfg)(state, vb)
    logp = np.asarray(learner.make_logp_fn(graphdef)(params, vb), np.float64)
  mask = np.asarray(vb["loss_mask"], np.float64)
  beh = np.asarray(vb["behavior_logp"], np.float64)
  adv = _np_grpo_advantages(np.asarray(vb["rewards"], np.float64), np.asarray(vb["group_id"]), mask.sum(1) > 0)
  A = np.broadcast_to(adv[:, None], logp.shape)
  kw = dict(versions=(vb["policy_version"], v + 1))
  cot = TPL.fd_grad(TPL.ref_decoupled, logp, logp, beh, A, mask, **kw)
  want = _cot_grad(graphdef)(params, batch, jnp.asarray(cot, jnp.float32))
  _assert_close_trees(_update(new.params, params), [-np.asarray(g) for g in jax.tree.leaves(want)])
  assert float(m["pg_loss"]) == pytest.approx(TPL.ref_decoupled(logp, logp, logp, beh, A, mask, **kw), rel=1e-4)
  with pytest.raises(ValueError, match="policy_version"):
    with jax.disable_jit():
      learner.make_train_step(graphdef, tx, cfg)(state, batch)


def test_tis_ess_learner_step_logs_its_cap(mb_setup):
  # vcpo_tis_ess on the stale batch (unclipped ESS ratio 0.82; 0.86 with every weight > 1 cut to 1): the cap is active (c_t below the largest weight) and logged; the applied
  # weights' ESS ratio meets the target while the unclipped one (VCPO's brake) is below it.
  params, _, batch, graphdef = mb_setup
  tx = _sgd_tx()
  pg = estimator.method_from_preset("vcpo_tis_ess", {"weights.target": 0.85})
  with jax.disable_jit():
    _, m = learner.make_train_step(graphdef, tx, learner.LearnerConfig(method=pg))(
      learner.init_state(params, tx), batch
    )
  assert float(m["ess_ratio"]) < 0.85 <= float(m["ess_ratio_applied"]) + 1e-5
  assert float(m["ess_ratio_applied"]) == pytest.approx(0.85, abs=1e-3)  # the largest cap meeting the target
  assert float(m["tis_c"]) == pytest.approx(np.exp(float(m["tis_log_c"])), rel=1e-6)
  assert 1.0 <= float(m["tis_c"]) < float(m["weight_max"]) * 1.0001 and float(m["tis_ess_reached"]) == 1.0


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(ppo_epochs=0), r"learner\.ppo_epochs=0: must be an int >= 1"),
    (dict(minibatches=2.0), r"learner\.minibatches=2\.0: must be an int"),
    (dict(minibatches=3, batch_size=8, group_size=2), r"learner\.minibatches=3 does not divide the batch size N=8"),
    (dict(minibatches=8, batch_size=8, group_size=2), r"learner\.minibatches=8: .* not whole groups of G=2"),
    (dict(ppo_epochs=2, microbatch_size=4), r"learner\.microbatch_size=4 with ppo_epochs"),
    (
      dict(ppo_epochs=2, method=estimator.method_from_preset("vcpo")),
      r"learner\.ppo_epochs=2: several updates per step need a policy-loss method",
    ),
  ],
)
def test_ppo_epochs_minibatches_config_errors(kw, match):
  kw = {"method": estimator.method_from_preset("ppo_clip"), **kw}
  with pytest.raises(ValueError, match=match):
    learner.LearnerConfig(**kw)
