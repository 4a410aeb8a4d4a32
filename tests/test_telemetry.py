"""vcpo_jax.telemetry: hand-made norms and coefficients, then brute force (vmap of per-example grads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import fixtures
from vcpo_jax import estimator, learner, optim, telemetry
from vcpo_jax.model import transformer


def f(x):
  return float(np.asarray(x))


# ----------------------------------------------------------------------------- hand-checkable numbers


def test_top_shares_by_hand():
  m2 = jnp.array([4.0, 1.0, 0.0, 3.0])  # sum 8
  assert f(telemetry.top_share(m2)) == pytest.approx(0.5)
  assert f(telemetry.top_share(m2, 0.05)) == pytest.approx(0.5)  # ceil(0.05 * 4) = 1 row
  assert f(telemetry.top_share(m2, 0.5)) == pytest.approx(7 / 8)  # the two largest
  # 40 rows: the top 5% is 2 rows; m2 = 10, 6, then 38 ones -> (10 + 6) / 54
  m2 = jnp.concatenate([jnp.array([6.0, 10.0]), jnp.ones(38)])
  assert f(telemetry.top_share(m2, 0.05)) == pytest.approx(16 / 54)
  # invalid rows do not count, neither in the sum nor in n (a bug summing them would give 10 / 1010)
  valid = jnp.array([True] * 40 + [False])
  m2v = jnp.concatenate([m2, jnp.array([1000.0])])
  assert f(telemetry.top_share(m2v, None, valid)) == pytest.approx(10 / 54)
  assert f(telemetry.top_share(jnp.zeros(3))) == 0.0


def test_magnitude_ess_by_hand():
  # m = 2, 1, 1, 0: (4)^2 / (4 + 1 + 1) = 8 / 3; equal magnitudes give n; one non-zero gives 1
  assert f(telemetry.magnitude_ess(jnp.array([4.0, 1.0, 1.0, 0.0]))) == pytest.approx(8 / 3)
  assert f(telemetry.magnitude_ess(jnp.full(5, 2.0))) == pytest.approx(5.0)
  assert f(telemetry.magnitude_ess(jnp.array([0.0, 7.0, 0.0]))) == pytest.approx(1.0)
  # tiny terms ((1 / (N L))^2 S can be ~1e-30) are fine
  assert f(telemetry.magnitude_ess(jnp.array([4e-30, 1e-30, 1e-30]))) == pytest.approx(8 / 3, rel=1e-3)


def test_cov_trace_by_hand():
  # u = (1, 0), (0, 1), (1, 1): G = (2, 2), ||G||^2 = 8, sum ||u||^2 = 4 -> 3 / 2 * (4 - 8 / 3) = 2;
  # np.cov: per-coordinate variance 1 / 3 each, 2 / 3 in all, times n = 3 -> 2.
  u = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
  m2 = (u**2).sum(1)
  g2 = (u.sum(0) ** 2).sum()
  assert f(telemetry.cov_trace(m2, g2)) == pytest.approx(2.0)
  assert f(telemetry.cov_trace(m2, g2)) == pytest.approx(3 * np.trace(np.cov(u.T)))
  # identical terms: no spread, trace 0 (a bug using ||G||^2 / n^2 would give 3 / 2 * (3 - 1/3) = 4)
  assert f(telemetry.cov_trace(np.ones(3), 9.0)) == pytest.approx(0.0, abs=1e-6)
  assert f(telemetry.cov_trace(np.ones(1), 1.0)) == 0.0  # one row: undefined, reported 0


def test_min_variance_baseline_by_hand():
  # group 0: k = 1, 2, S = 1, 1, R = 0, 1 -> a = 1, 4, b = 4 / 5; group 1: a = 0 everywhere -> its mean 0.5
  r = jnp.array([0.0, 1.0, 0.0, 1.0])
  k = jnp.array([1.0, 2.0, 0.0, 0.0])
  s = jnp.ones(4)
  gid = jnp.array([0, 0, 1, 1])
  b = np.asarray(telemetry.min_variance_baseline(r, k, s, gid))
  np.testing.assert_allclose(b, [0.8, 0.8, 0.5, 0.5], rtol=1e-6)
  # V(0.8) = 1 * 0.64 + 4 * 0.04 = 0.8; V(mean 0.5) = 0.25 + 4 * 0.25 = 1.25
  assert f(telemetry.baseline_variance(r, b, k, s)) == pytest.approx(0.8)
  assert f(telemetry.baseline_variance(r, jnp.full(4, 0.5), k, s)) == pytest.approx(1.25)


def test_min_variance_baseline_minimises_v_on_a_grid():
  rng = np.random.default_rng(1)
  r = rng.random(12).astype(np.float32)
  k = rng.random(12).astype(np.float32)
  s = (rng.random(12) * 5).astype(np.float32)
  gid = np.repeat(np.arange(3), 4)
  b = np.asarray(telemetry.min_variance_baseline(r, k, s, gid))
  grid = np.linspace(0, 1, 2001)
  for g in range(3):
    sel = gid == g
    v = ((k[sel, None] * (r[sel, None] - grid[None])) ** 2 * s[sel, None]).sum(0)
    assert abs(b[sel][0] - grid[np.argmin(v)]) < 1e-3


# ----------------------------------------------------------------------------- brute force on a tiny model

N, T = 8, 10


@pytest.fixture(scope="module")
def tiny():
  graphdef, params = transformer.split(transformer.init(fixtures.micro_config(32), seed=0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 32, (N, T)).astype(np.int32)
  valid = np.ones((N, T), bool)
  loss_mask = np.zeros((N, T), bool)
  loss_mask[:, 3:] = True
  loss_mask[1, 7:] = False  # unequal lengths: the 1 / L_n of the applied update matters
  logp = np.asarray(transformer.sequence_logprobs(graphdef, params, tokens, valid))
  # strongly off-policy on a few rows, so that TIS truncates (w > 8) and OPOB's weights differ from applied
  blogp = logp - 0.4 * rng.standard_normal((N, T))
  rewards = np.array([0, 1, 1, 0, 1, 0, 0, 0], np.float32)
  batch = fixtures.learner_batch(tokens, valid, loss_mask, blogp, rewards, np.repeat(np.arange(2), 4).astype(np.int32))
  return graphdef, params, batch


def _per_example_grads(graphdef, params, batch):
  """[N, P] flat per-example score gradients s_n = grad sum_t mask_nt logp_nt (vmap of grad)."""
  logp_fn = learner.make_logp_fn(graphdef)

  def score(p, ex):
    ex1 = jax.tree.map(lambda x: x[None], ex)
    return jnp.sum(logp_fn(p, ex1)[0] * ex1["loss_mask"][0])

  g = jax.vmap(jax.grad(score), in_axes=(None, 0))(params, batch)
  return np.concatenate([np.asarray(x).reshape(N, -1) for x in jax.tree.leaves(g)], axis=1).astype(np.float64)


@pytest.mark.parametrize("preset", ["vcpo", "seq_tis", "vcpo_applied_opob"])
@pytest.mark.parametrize("grad_path", ["ghost", "vmap"])
@pytest.mark.slow
def test_step_telemetry_equals_brute_force(tiny, preset, grad_path):
  graphdef, params, batch = tiny
  pg = estimator.method_from_preset(preset)
  # A method without OPOB computes norms only for the "norms" telemetry (only the ghost path has it).
  tele = "norms" if grad_path == "ghost" else True
  lcfg = learner.LearnerConfig(method=pg, grad_path=grad_path, grad_telemetry=tele)
  grads, aux = jax.jit(lambda p, b: learner._gradient(graphdef, p, b, lcfg))(params, batch)
  if not lcfg.computes_norms:
    assert "sq_norm_n" not in aux
    assert telemetry.step_telemetry(aux, 1.0, batch["rewards"], batch["group_id"], pg, T) == {}
    return
  g2 = float(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(grads)))
  tel = {k: f(v) for k, v in telemetry.step_telemetry(aux, g2, batch["rewards"], batch["group_id"], pg, T).items()}

  s = _per_example_grads(graphdef, params, batch)  # [N, P]
  coef = np.asarray(aux["coef_n"], np.float64)
  u = coef[:, None] * s  # the per-trajectory terms; G = sum_n u_n = -grads
  flat = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(grads)])
  np.testing.assert_allclose(-u.sum(0), flat, rtol=2e-3, atol=1e-6)  # the brute-force terms ARE the update
  m2 = (u**2).sum(1)
  np.testing.assert_allclose(np.asarray(aux["sq_norm_n"]), (s**2).sum(1), rtol=1e-3)
  assert tel["grad/top1_share"] == pytest.approx(m2.max() / m2.sum(), rel=1e-3)
  assert tel["grad/top5pct_share"] == pytest.approx(m2.max() / m2.sum(), rel=1e-3)  # ceil(0.05 * 8) = 1
  m = np.sqrt(m2)
  assert tel["grad/ess"] == pytest.approx(m.sum() ** 2 / m2.sum(), rel=1e-3)
  assert tel["grad/ess_ratio"] == pytest.approx(m.sum() ** 2 / m2.sum() / N, rel=1e-3)
  assert tel["grad/cov_trace"] == pytest.approx(N * np.trace(np.cov(u.T)), rel=2e-3)
  # the baseline part: V(b_used) is sum_n ||u_n||^2 (k_n is the coefficient's own multiplier) ...
  assert tel["grad/var_b_used"] == pytest.approx(m2.sum(), rel=1e-3)
  # ... and V(b_min) is sum_n ||k_n (R_n - b_min) s_n||^2 with b_min found by brute force on a grid
  r = batch["rewards"].astype(np.float64)
  k = np.where(np.abs(r - np.asarray(aux["baseline_n"])) > 1e-6, coef / (r - np.asarray(aux["baseline_n"])), 0)
  grid = np.linspace(0, 1, 4001)
  v_min = 0.0
  for g in range(2):
    sel = batch["group_id"] == g
    ks = k[sel]
    if not np.any(ks):  # a zero-std group counts nothing
      continue
    v = (((ks[:, None] * (r[sel, None] - grid[None])) ** 2) * (s[sel] ** 2).sum(1)[:, None]).sum(0)
    v_min += v.min()
  assert tel["grad/var_b_min"] == pytest.approx(v_min, rel=2e-3)
  assert tel["grad/var_b_min"] <= tel["grad/var_b_used"] * (1 + 1e-5)
  assert tel["grad/var_ratio"] >= 1 - 1e-5
  if preset == "seq_tis":  # GRPO's baseline is the group mean
    assert tel["grad/var_b_mean"] == pytest.approx(tel["grad/var_b_used"], rel=1e-5)


def test_microbatched_telemetry_equals_single_pass(tiny):
  graphdef, params, batch = tiny
  pg = estimator.method_from_preset("vcpo")
  tx = optim.make_optimizer(1e-3, weight_decay=0.0)
  outs = []
  for mbs in (None, 4):
    lcfg = learner.LearnerConfig(method=pg, grad_path="ghost", microbatch_size=mbs)
    step = jax.jit(learner.make_train_step(graphdef, tx, lcfg))
    _, m = step(learner.init_state(jax.tree.map(jnp.copy, params), tx), batch)
    outs.append({k: f(v) for k, v in m.items() if k.startswith("grad/")})
  assert set(outs[0]) == set(outs[1]) and "grad/cov_trace" in outs[0]
  for key in outs[0]:
    assert outs[1][key] == pytest.approx(outs[0][key], rel=1e-4, abs=1e-9), key


def test_grad_telemetry_off_logs_no_grad_metrics_and_trains_the_same(tiny):
  # learner.grad_telemetry=False drops the grad/ metrics only: same parameters, same other metrics.
  graphdef, params, batch = tiny
  pg = estimator.method_from_preset("vcpo")
  tx = optim.make_optimizer(1e-3, weight_decay=0.0)
  runs = []
  for on in (True, False):
    step = jax.jit(learner.make_train_step(graphdef, tx, learner.LearnerConfig(method=pg, grad_telemetry=on)))
    runs.append(step(learner.init_state(jax.tree.map(jnp.copy, params), tx), batch))
  (s_on, m_on), (s_off, m_off) = runs
  assert any(k.startswith("grad/") for k in m_on) and not any(k.startswith("grad/") for k in m_off)
  assert set(m_on) - set(m_off) == {k for k in m_on if k.startswith("grad/")}
  for a, b in zip(jax.tree.leaves(s_on.params), jax.tree.leaves(s_off.params)):  # two programs: float rounding
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)
  for k in m_off:
    assert f(m_off[k]) == pytest.approx(f(m_on[k]), rel=1e-5, abs=1e-8), k


def _compiled_step(graphdef, params, batch, lcfg):
  """(XLA's flop count of the compiled train step, its metrics after one step)."""
  tx = optim.make_optimizer(1e-3, weight_decay=0.0)
  step = jax.jit(learner.make_train_step(graphdef, tx, lcfg))
  state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
  cost = step.lower(state, batch).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"]), {k: f(v) for k, v in step(state, batch)[1].items()}


@pytest.mark.parametrize("preset,microbatch_size", [("seq_tis", None), ("seq_tis", 4), ("none", None)])
def test_a_method_without_norms_does_not_compute_them_under_the_default_telemetry(tiny, preset, microbatch_size):
  """grad_telemetry=True (the default) for seq_tis and the plain GRPO step (none; no OPOB): no grad/ metrics and
  the compiled step's flops are those of grad_telemetry=False and of the vmap path without norms (the plain
  gradient: the ghost path's taps and per-example plans are not built); "norms"
  computes them (more flops) and logs the norm telemetry. A bug that hands the norms to the telemetry under the
  default fails the flop check."""
  graphdef, params, batch = tiny
  pg = estimator.method_from_preset(preset)
  assert not estimator.needs_sq_norms(pg)
  cfgs = {
    t: learner.LearnerConfig(method=pg, grad_telemetry=t, microbatch_size=microbatch_size)
    for t in (True, False, "norms")
  }
  cfgs["plain"] = learner.LearnerConfig(method=pg, grad_path="vmap", microbatch_size=microbatch_size)
  runs = {t: _compiled_step(graphdef, params, batch, lcfg) for t, lcfg in cfgs.items()}
  (flops_on, m_on), (flops_off, m_off), (flops_norms, m_norms) = runs[True], runs[False], runs["norms"]
  assert flops_on == pytest.approx(flops_off, rel=1e-6)
  assert flops_on == pytest.approx(runs["plain"][0], rel=1e-6)  # one forward + one backward, no ghost taps
  assert flops_norms > flops_off * 1.01  # the per-example norms: >= 1% of this tiny step's flops
  assert not any(k.startswith("grad/") for k in m_on) and set(m_on) == set(m_off)
  assert {"grad/top1_share", "grad/cov_trace", "grad/var_ratio"} <= set(m_norms)


def test_vcpo_still_computes_its_norms_and_their_telemetry_by_default(tiny):
  """VCPO's OPOB needs S_n: under the default its grad/ metrics are logged, equal to those of "norms"."""
  graphdef, params, batch = tiny
  pg = estimator.method_from_preset("vcpo")
  assert learner.LearnerConfig(method=pg).telemetry_norms
  _, m_on = _compiled_step(graphdef, params, batch, learner.LearnerConfig(method=pg))
  _, m_norms = _compiled_step(graphdef, params, batch, learner.LearnerConfig(method=pg, grad_telemetry="norms"))
  assert {"grad/top1_share", "grad/cov_trace", "grad/var_ratio"} <= set(m_on)
  for k in m_norms:
    assert m_on[k] == pytest.approx(m_norms[k], rel=1e-5, abs=1e-9), k


@pytest.mark.parametrize(
  "kw,match",
  [
    ({"grad_telemetry": "yes"}, "choose True"),
    ({"grad_telemetry": "norms", "grad_path": "vmap"}, "only the ghost path"),
    ({"grad_telemetry": "norms", "preset": "ppo_clip"}, "only the ghost path"),
  ],
)
def test_grad_telemetry_values_are_checked(kw, match):
  kw = dict(kw)
  pg = estimator.method_from_preset(kw.pop("preset", "seq_tis"))
  with pytest.raises(ValueError, match=match):
    learner.LearnerConfig(method=pg, **kw)


def test_cosine():
  a = {"x": jnp.array([1.0, 0.0]), "y": jnp.array([[0.0]])}
  b = {"x": jnp.array([1.0, 1.0]), "y": jnp.array([[0.0]])}
  assert f(telemetry.cosine(a, b)) == pytest.approx(1 / np.sqrt(2))
  assert f(telemetry.cosine(a, jax.tree.map(jnp.zeros_like, a))) == 0.0


# ----------------------------------------------------------------------------- in a run


@pytest.mark.slow
def test_run_logs_grad_metrics_and_the_reference_cosine_without_changing_the_run(tmp_path):
  import json

  from tests import fixtures
  from vcpo_jax import trainer

  rows = {}
  for every in (0, 2):
    c = fixtures.tiny_countdown_config(
      **{
        "mode": "lag",
        "lag.k": 1,
        "steps": 4,
        "optim.lr": 1e-2,
        "log.norm_overhead_every": 0,
        "log.ref_grad_every": every,
      }
    )
    wd = tmp_path / f"ref{every}"
    trainer.run(c, str(wd))
    rows[every] = [json.loads(line) for line in open(wd / "metrics.jsonl") if "train/pg_loss" in line]
  for a, b in zip(rows[0], rows[2]):  # the reference batch has rngs of its own: the run is the same
    assert {k: v for k, v in a.items() if k.startswith("train/")} == {
      k: v for k, v in b.items() if k.startswith("train/")
    }
  assert all("grad/top1_share" in r and "grad/cov_trace" in r for r in rows[0])  # every step, under grad/
  assert not any(k.startswith("train/grad/") for r in rows[0] for k in r)
  assert [r["step"] for r in rows[2] if "grad/ref_cosine" in r] == [2, 4]
  assert not any("grad/ref_cosine" in r for r in rows[0])
  assert all(-1.0 <= r["grad/ref_cosine"] <= 1.0 for r in rows[2] if "grad/ref_cosine" in r)


def test_ref_grad_every_is_rejected_in_async_mode():
  from tests import fixtures
  from vcpo_jax.run_config import ConfigError, parse_config

  with pytest.raises(ConfigError, match="ref_grad_every"):
    parse_config(fixtures.tiny_countdown_config(**{"mode": "async", "lag.k": 1, "log.ref_grad_every": 2}))


def test_nothing_is_compiled_after_the_first_step_with_telemetry_on(tiny):
  """The grad/ metrics are part of the one compiled step: later steps (new values, same shapes) reuse it."""
  graphdef, params, batch = tiny
  tx = optim.make_optimizer(1e-3, weight_decay=0.0)
  lcfg = learner.LearnerConfig(method=estimator.method_from_preset("vcpo"), grad_path="ghost")
  step = jax.jit(learner.make_train_step(graphdef, tx, lcfg), donate_argnums=0)
  state, m = step(learner.init_state(jax.tree.map(jnp.copy, params), tx), batch)
  assert "grad/var_ratio" in m and "grad/cov_trace" in m
  compiles, active = [], [True]
  event = "/jax/core/compile/backend_compile_duration"
  jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: compiles.append(e) if active[0] and e == event else None
  )
  try:
    rng = np.random.default_rng(1)
    for _ in range(3):
      b = dict(batch, rewards=rng.permutation(batch["rewards"]))
      state, m = step(state, b)
      jax.block_until_ready((state, m))
    assert compiles == [] and step._cache_size() == 1
    jax.jit(lambda x: x + 1)(np.ones(3, np.float32))  # the listener does see a compile when there is one
    assert compiles and set(compiles) == {event}
  finally:
    active[0] = False
