"""Tests of vcpo_jax.score_centering: the paper's hand example, the peer's reference formula transcribed in
numpy (value and an independently derived logit gradient), a brute-force check on a tiny model that the
correction's gradient is sum_v c_v grad log p_v and that it cancels the drift E_q[w grad log p_y] exactly,
top-k converging to exact as k grows to V, p = q giving exactly the plain update, chunked = dense, masking.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import score_centering as S
from vcpo_jax.model import logprobs as lpm

jax.config.update("jax_enable_x64", False)


def f32(x):
  return jnp.asarray(x, jnp.float32)


# ---------------------------------------------------------------------------
# Hand-checkable coefficients
# ---------------------------------------------------------------------------


def test_hand_example_coefficients():
  # tails 0.2 and 0.2: rho = 1, c = q - p = [0.1, -0.1]
  c, alpha = S.head_coefficients(f32([0.4, 0.4]), f32([0.5, 0.3]))
  np.testing.assert_allclose(np.asarray(c), [0.1, -0.1], atol=1e-6)
  assert float(alpha) == pytest.approx(1.0)
  # cap C = 2: no ratio truncated, so the token weight p / q already removes the drift: c = 0
  c, _ = S.head_coefficients(f32([0.4, 0.4]), f32([0.5, 0.3]), max_ratio=2.0)
  np.testing.assert_allclose(np.asarray(c), [0.0, 0.0], atol=1e-7)
  # cap C = 1.2: p_2 / q_2 = 4/3 > 1.2 is truncated: c_2 = 1.2 * 0.3 - 0.4 = -0.04, alpha = min(1, 1.2) = 1
  c, alpha = S.head_coefficients(f32([0.4, 0.4]), f32([0.5, 0.3]), max_ratio=1.2)
  np.testing.assert_allclose(np.asarray(c), [0.0, -0.04], atol=1e-6)
  # unequal tails: q_tail = 0.3, p_tail = 0.1 -> rho = 3; uncapped c = q - 3 p
  c, alpha = S.head_coefficients(f32([0.5, 0.4]), f32([0.4, 0.3]))
  np.testing.assert_allclose(np.asarray(c), [0.4 - 1.5, 0.3 - 1.2], rtol=1e-5)
  assert float(alpha) == pytest.approx(3.0, rel=1e-5)
  with pytest.raises(ValueError, match="max_ratio=0.5"):
    S.head_coefficients(f32([0.4]), f32([0.5]), max_ratio=0.5)


# ---------------------------------------------------------------------------
# The peer's formula, transcribed in numpy (float64)
# ---------------------------------------------------------------------------


def np_reference_loss(z, ids, lq_head, y, lq_y, A, C=None, eps=1e-6):
  """torchtitan / martin-marek reference: -A (w(p_y/q_y) log p_y - sum_H sg[q w(p/q) - alpha p] log p), mean."""
  w = (lambda r: np.ones_like(r)) if C is None else (lambda r: np.minimum(r, C))
  lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  lp_h = np.take_along_axis(lp, ids, -1)
  lp_y = np.take_along_axis(lp, y[..., None], -1)[..., 0]
  p_h, q_h = np.exp(lp_h), np.exp(lq_head)
  rho = np.maximum(1 - q_h.sum(-1), eps) / np.maximum(1 - p_h.sum(-1), eps)
  alpha = rho * w(1 / rho)
  c = q_h * w(np.exp(lp_h - lq_head)) - alpha[..., None] * p_h
  tokw = w(np.exp(lp_y - lq_y))
  loss = -(A * (tokw * lp_y - (c * lp_h).sum(-1))).mean()
  # d/dz_j, derived by hand: d log p_v / dz_j = [j = v] - p_j, and sum_k c_k is a constant
  p = np.exp(lp)
  onehot_y = np.eye(z.shape[-1])[y]
  head = np.zeros_like(z)
  np.put_along_axis(head, ids, c, -1)
  g = -(A[..., None] * (tokw[..., None] * (onehot_y - p) - (head - c.sum(-1, keepdims=True) * p))) / A.size
  return loss, g


@pytest.mark.parametrize("C", [None, 1.2])
def test_topk_matches_reference_formula(C):
  rng = np.random.default_rng(0)
  N, T, V, K = 3, 4, 11, 4
  z = rng.normal(size=(N, T, V))
  zq = z + 0.7 * rng.normal(size=(N, T, V))
  lq = zq - np.log(np.exp(zq).sum(-1, keepdims=True))
  ids = np.argsort(-lq, -1)[..., :K]
  lq_head = np.take_along_axis(lq, ids, -1)
  y = rng.integers(0, V, (N, T))
  lq_y = np.take_along_axis(lq, y[..., None], -1)[..., 0]
  A = rng.normal(size=(N, T))
  want, want_g = np_reference_loss(z, ids, lq_head, y, lq_y, A, C)

  def loss(zz):
    lp = jax.nn.log_softmax(zz, -1)
    lp_h = jnp.take_along_axis(lp, jnp.asarray(ids), -1)
    lp_y = jnp.take_along_axis(lp, jnp.asarray(y)[..., None], -1)[..., 0]
    corr, _ = S.topk_correction(lp_h, f32(lq_head), C)
    tokw = S.token_weight(lp_y, f32(lq_y), C)
    return -jnp.mean(f32(A) * (tokw * lp_y - corr))

  got, g = jax.value_and_grad(loss)(f32(z))
  assert float(got) == pytest.approx(want, rel=1e-4, abs=1e-6)
  np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-3, atol=1e-6)


# ---------------------------------------------------------------------------
# A tiny model: h = tanh(x W1 + b), logits = h W  (W untied [D, V])
# ---------------------------------------------------------------------------

B, T, D, V = 2, 4, 3, 7
SPEC = lpm.HeadSpec(tied=False)


def tiny(seed=0, spread=0.6):
  rng = np.random.default_rng(seed)
  x = f32(rng.normal(size=(B, T, D)))
  params = {"w1": f32(rng.normal(size=(D, D))), "b": f32(rng.normal(size=D)), "w": f32(rng.normal(size=(D, V)))}
  beh = jax.tree.map(lambda a: a + f32(spread * rng.normal(size=a.shape)), params)
  return x, params, beh


def hidden(p, x):
  return jnp.tanh(x @ p["w1"] + p["b"])


def full_logp(p, x):
  """[B, T - 1, V]: position t's distribution over the token at t + 1."""
  return jax.nn.log_softmax(hidden(p, x)[:, :-1] @ p["w"], -1)


def exact_corr(p, q, x, C=None, spec=SPEC):
  return S.exact_correction(hidden(p, x), hidden(q, x), p["w"], q["w"], spec, C)


def flat(g):
  return np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(g)])


@pytest.mark.parametrize("C", [None, 1.5])
@pytest.mark.slow
def test_brute_force_expected_score_and_drift_cancellation(C):
  """Per position: grad corr == sum_v c_v grad log p_v, and sum_v q_v w_v grad log p_v - grad corr == 0."""
  x, params, beh = tiny(1)
  lq = np.asarray(full_logp(beh, x), np.float64)
  lp0 = np.asarray(full_logp(params, x), np.float64)
  corr_grad = jax.jacrev(lambda p: exact_corr(p, beh, x, C)[0])(params)  # leaves [B, T, ...]
  for b in range(B):
    for t in range(T - 1):
      scores = [flat(jax.grad(lambda p, v=v: full_logp(p, x)[b, t, v])(params)) for v in range(V)]
      q, p = np.exp(lq[b, t]), np.exp(lp0[b, t])
      w = np.ones(V) if C is None else np.minimum(p / q, C)
      c = q - p if C is None else np.minimum(p, C * q) - p
      expected_score = sum(c[v] * scores[v] for v in range(V))
      got = flat(jax.tree.map(lambda a: a[b, t + 1], corr_grad))
      np.testing.assert_allclose(got, expected_score, rtol=1e-3, atol=1e-5)
      drift = sum(q[v] * w[v] * scores[v] for v in range(V))  # E_q[w(p_y/q_y) grad log p_y]
      assert np.abs(drift).max() > 1e-2  # q != p: the uncentered expectation drifts
      np.testing.assert_allclose(drift - got, 0.0, atol=1e-5)  # the centered one does not
  assert np.all(np.asarray(jax.tree.leaves(corr_grad)[0])[:, 0] == 0.0)  # position 0 predicts nothing


@pytest.mark.slow
def test_p_equals_q_gives_the_plain_update():
  x, params, _ = tiny(2)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, V, (B, T)))
  coef = f32(rng.normal(size=B))
  mask = f32(np.ones((B, T)) * (np.arange(T) > 0))
  lp_fn = lambda p: lpm.head_logprobs(hidden(p, x), p["w"], tokens, SPEC)

  def loss(p, centered, C):
    lp = lp_fn(p)
    corr = exact_corr(p, params, x, C)[0] if centered == "exact" else jnp.zeros_like(lp)
    if centered == "topk":
      ids = jnp.argsort(-jnp.concatenate([jnp.zeros((B, 1, V)), full_logp(params, x)], 1), -1)[..., :3]
      h_lp = S.head_logprobs_at(hidden(p, x), p["w"], ids, SPEC)
      corr = S.topk_correction(
        h_lp, jax.lax.stop_gradient(S.head_logprobs_at(hidden(params, x), params["w"], ids, SPEC)), C, mask
      )[0]
    tokw = mask * S.token_weight(lp, jax.lax.stop_gradient(lp), C)
    return S.centered_surrogate(lp, corr, coef, tokw, mask)

  plain = flat(jax.grad(loss)(params, "none", None))
  for mode in ("exact", "topk"):
    for C in (None, 2.0):
      np.testing.assert_allclose(flat(jax.grad(loss)(params, mode, C)), plain, rtol=1e-5, atol=1e-7)
  corr, diag = exact_corr(params, params, x)
  np.testing.assert_allclose(np.asarray(diag["coef_l1"]), 0.0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(diag["kl_qp"]), 0.0, atol=1e-6)


@pytest.mark.slow
def test_topk_converges_to_exact_as_k_grows_to_v():
  x, params, beh = tiny(4)
  lq = jnp.concatenate([jnp.zeros((B, 1, V)), full_logp(beh, x)], 1)  # row 0 is a placeholder
  order = jnp.argsort(-lq, -1)
  mask = f32(np.arange(T)[None, :] > 0) * jnp.ones((B, 1))

  def topk_total(p, k, C):
    ids = order[..., :k]
    h_lp = S.head_logprobs_at(hidden(p, x), p["w"], ids, SPEC)
    return jnp.sum(S.topk_correction(h_lp, jnp.take_along_axis(lq, ids, -1), C, mask)[0])

  for C in (None, 1.5):
    exact_val, exact_g = jax.value_and_grad(lambda p: jnp.sum(exact_corr(p, beh, x, C)[0]))(params)
    errs = []
    for k in range(1, V + 1):
      val, g = jax.value_and_grad(topk_total)(params, k, C)
      errs.append(np.abs(flat(g) - flat(exact_g)).max())
    assert errs[-1] < 1e-5 and float(val) == pytest.approx(float(exact_val), abs=1e-5)  # K = V: exact
    assert errs[0] > 1e-3  # K = 1 is not (the modelled tail is wrong)
    assert max(errs[V - 2 :]) < errs[0] / 5  # and it closes as K grows


@pytest.mark.parametrize("chunk,vocab_chunk", [(2, 0), (0, 3), (2, 3), (1, 7)])
@pytest.mark.slow
def test_chunked_exact_equals_dense(chunk, vocab_chunk):
  x, params, beh = tiny(5)
  spec = lpm.HeadSpec(tied=False, chunk=chunk, vocab_chunk=vocab_chunk)
  for C in (None, 1.5):
    dense = jax.value_and_grad(lambda p: jnp.sum(jnp.sin(exact_corr(p, beh, x, C)[0])))(params)
    chunked = jax.value_and_grad(lambda p: jnp.sum(jnp.sin(exact_corr(p, beh, x, C, spec)[0])))(params)
    assert float(chunked[0]) == pytest.approx(float(dense[0]), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(flat(chunked[1]), flat(dense[1]), rtol=1e-4, atol=1e-6)
    d_diag = exact_corr(params, beh, x, C)[1]
    c_diag = exact_corr(params, beh, x, C, spec)[1]
    for k in d_diag:
      np.testing.assert_allclose(np.asarray(c_diag[k]), np.asarray(d_diag[k]), rtol=1e-5, atol=1e-6)


def test_exact_kl_and_metrics():
  x, params, beh = tiny(6)
  _, diag = exact_corr(params, beh, x)
  lq, lp = np.asarray(full_logp(beh, x)), np.asarray(full_logp(params, x))
  kl = (np.exp(lq) * (lq - lp)).sum(-1)
  np.testing.assert_allclose(np.asarray(diag["kl_qp"])[:, 1:], kl, rtol=1e-4, atol=1e-6)
  l1 = np.abs(np.exp(lq) - np.exp(lp)).sum(-1)
  np.testing.assert_allclose(np.asarray(diag["coef_l1"])[:, 1:], l1, rtol=1e-4, atol=1e-6)
  mask = f32(np.arange(T)[None, :] > 0) * jnp.ones((B, 1))
  m = S.drift_metrics(f32(np.zeros((B, T))), f32(np.full((B, T), -0.5)), mask, diag)
  assert float(m["k1_kl_qp"]) == pytest.approx(-0.5)
  assert float(m["kl_qp"]) == pytest.approx(kl.mean(), rel=1e-4)


def test_masked_topk_rows_carry_nothing():
  rng = np.random.default_rng(7)
  lp = f32(np.log(rng.dirichlet(np.ones(5), (2, 3))[..., :3]))
  lq = np.log(rng.dirichlet(np.ones(5), (2, 3))[..., :3])
  lq[0, 0] = np.nan  # garbage in a masked row
  mask = f32([[0, 1, 1], [1, 1, 0]])
  corr_g = jax.grad(lambda a: jnp.sum(S.topk_correction(a, f32(lq), None, mask)[0]))(lp)
  g = np.asarray(corr_g)
  assert np.all(np.isfinite(g)) and np.all(g[0, 0] == 0) and np.all(g[1, 2] == 0)
  corr, diag = S.topk_correction(lp, f32(lq), None, mask)
  assert np.all(np.isfinite(np.asarray(corr))) and all(np.all(np.isfinite(np.asarray(v))) for v in diag.values())


# ---------------------------------------------------------------------------
# Through a real (tiny) model, composed with the estimator: VCPO + exact score centering
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_setup():
  from tests import fixtures

  n, t = 4, 6
  loss_mask = np.zeros((n, t), bool)
  loss_mask[:, 2:] = True
  return fixtures.stale_policy_batch(fixtures.micro_config(16), np.ones((n, t), bool), loss_mask)


@pytest.mark.slow
def test_model_p_equals_q_is_the_learner_gradient(model_setup):
  from vcpo_jax import estimator, learner

  graphdef, params, _, batch = model_setup
  pg = estimator.method_from_preset("vcpo")
  fn = S.make_centered_logp_fn(graphdef, pg.weights.token_cap)
  got, aux = S.centered_gradient(fn, params, params, batch, pg)
  # the ghost path: the plain gradient and exact norms from an independent computation
  want, waux = learner.policy_gradient("ghost")(learner.make_logp_fn(graphdef), params, batch, pg)
  np.testing.assert_allclose(flat(got), flat(want), rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(np.asarray(aux["sq_norm_n"]), np.asarray(waux["sq_norm_n"]), rtol=1e-4)
  assert float(aux["drift/coef_l1"]) < 1e-5 and float(aux["lr_scale"]) == pytest.approx(float(waux["lr_scale"]))


@pytest.mark.parametrize("preset,overrides", [("vcpo", {}), ("token_tis", {"weights.c": 1.01})])
@pytest.mark.slow
def test_model_centered_gradient_and_norms_by_brute_force(model_setup, preset, overrides):
  """VCPO (OPOB norms of the centered score) and TIS+SC, against per-row jax.grad of the centered score."""
  from vcpo_jax import estimator

  graphdef, params, beh, batch = model_setup
  pg = estimator.method_from_preset(preset, overrides)
  C = pg.weights.token_cap
  assert C == (1.01 if preset == "token_tis" else None)
  fn = S.make_centered_logp_fn(graphdef, C)
  got, aux = S.centered_gradient(fn, params, beh, batch, pg)
  n = batch["tokens"].shape[0]
  mask = f32(batch["loss_mask"])
  rows = [jax.tree.map(lambda a, i=i: a[i : i + 1], batch) for i in range(n)]

  def centered_score(p, row):
    lp, corr, _ = fn(p, beh, row)
    return jnp.sum((lp - corr) * f32(row["loss_mask"]))

  def plain_score(p, row):
    return jnp.sum(fn(p, beh, row)[0] * f32(row["loss_mask"]))

  sq = np.array([np.sum(flat(jax.grad(centered_score)(params, r)) ** 2) for r in rows])
  plain = np.array([np.sum(flat(jax.grad(plain_score)(params, r)) ** 2) for r in rows])
  if pg.baseline is not None:
    np.testing.assert_allclose(np.asarray(aux["sq_norm_n"]), sq, rtol=1e-4)
    assert np.abs(sq - plain).max() > 1e-3 * plain.max()  # the correction is in the norm
  lp0, _, _ = fn(params, beh, batch)
  coef, _ = estimator.pg_coefficients(
    jax.lax.stop_gradient(lp0),
    batch["behavior_logp"],
    mask,
    batch["rewards"],
    batch["group_id"],
    f32(sq) if pg.baseline is not None else None,
    pg,
  )
  tokw = estimator.pg_token_weights(jax.lax.stop_gradient(lp0), batch["behavior_logp"], mask, pg)

  def surrogate(p):
    lp, corr, _ = fn(p, beh, batch)
    return S.centered_surrogate(lp, corr, coef, tokw, mask)

  want = jax.grad(surrogate)(params)
  np.testing.assert_allclose(flat(got), flat(want), rtol=2e-4, atol=1e-7)
  assert float(aux["drift/coef_l1"]) > 1e-3 and float(aux["drift/kl_qp"]) > 0


# ---------------------------------------------------------------------------
# In the pure exact-lag run: q is the ring's behaviour version
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_pure_lag_run_with_exact_centering():
  from vcpo_jax import estimator
  from vcpo_jax.experiments import pure_lag as pl

  import dataclasses

  from tests.test_stability import CFG

  cfg = dataclasses.replace(CFG, debug_trace=False)  # test_stability's tiny pure-lag run
  pg = estimator.method_from_preset("vcpo")
  key, lr = jax.random.key(3), jnp.float32(3e-2)
  plain = jax.device_get(jax.jit(pl.make_run_fn(cfg, pg, 2))(key, lr, 0))
  centered_fn = jax.jit(pl.make_run_fn(cfg, pg, 2, score_centering_exact=True))
  sync = jax.device_get(centered_fn(key, lr, 0))
  # k = 0: the batch is sampled by the current parameters, q = p, corr = 0: the same run
  np.testing.assert_allclose(sync["drift_coef_l1"], 0.0, atol=1e-5)
  np.testing.assert_allclose(sync["reward"], plain["reward"], atol=1e-6)
  np.testing.assert_allclose(sync["grad_norm"], plain["grad_norm"], rtol=1e-3)
  lag = jax.device_get(centered_fn(key, lr, 2))
  assert np.all(lag["drift_coef_l1"][3:] > 1e-4) and np.all(lag["drift_kl_qp"][3:] > 0)  # stale from step 3
  assert all(np.all(np.isfinite(v)) for v in lag.values())
  with pytest.raises(ValueError, match="centers the surrogate only"):
    pl.make_run_fn(cfg, estimator.method_from_preset("ipo"), 2, score_centering_exact=True)
  with pytest.raises(ValueError, match="needs score_centering_exact=True"):
    pl.make_run_fn(cfg, pg, 2, score_centering_topk=4)


@pytest.mark.slow
def test_topk_centered_logp_fn_with_k_equal_v_is_exact(model_setup):
  graphdef, params, beh, batch = model_setup
  exact = S.make_centered_logp_fn(graphdef)
  full = S.make_topk_centered_logp_fn(graphdef, 16)  # V = 16
  part = S.make_topk_centered_logp_fn(graphdef, 4)

  def total(fn):
    return lambda p: jnp.sum(fn(p, beh, batch)[1] * f32(batch["loss_mask"]))

  ge, gf, gp = (flat(jax.grad(total(f))(params)) for f in (exact, full, part))
  np.testing.assert_allclose(gf, ge, rtol=1e-4, atol=1e-7)
  assert np.abs(gp - ge).max() > 1e-4 * np.abs(ge).max()  # a 4-id head with a modelled tail is not exact
  with pytest.raises(ValueError, match="topk=0"):
    S.make_topk_centered_logp_fn(graphdef, 0)


def test_exact_correction_chunked_memory_stays_below_one_nt_v():
  """Compiled temporaries (XLA's memory analysis, nothing allocated): the chunked exact correction and its
  gradient never hold a [B, T, V] float32 array; the dense one holds several."""
  b, t, d, v = 2, 257, 16, 8192
  nt_v = b * (t - 1) * v * 4  # one [B, T - 1, V] float32: 16 MiB
  h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, v), jnp.float32)

  def temp_bytes(spec):
    f = jax.jit(jax.grad(lambda h, hq, w, wq: jnp.sum(S.exact_correction(h, hq, w, wq, spec)[0]), argnums=(0, 2)))
    return f.lower(h, h, w, w).compile().memory_analysis().temp_size_in_bytes

  dense = temp_bytes(lpm.HeadSpec(tied=False))
  chunked = temp_bytes(lpm.HeadSpec(tied=False, chunk=32, vocab_chunk=1024))
  assert dense >= 2 * nt_v
  assert chunked < nt_v / 4, (chunked, nt_v)


@pytest.mark.slow
def test_study_smoke(tmp_path):
  """The study's main end to end on one tiny cell (10 steps, one seed), then again from the saved cell."""
  import json

  from vcpo_jax.experiments import score_centering_study as study

  argv = ["--out", str(tmp_path), "--ks", "2", "--seeds", "0", "--steps", "10", "--methods", "vcpo_sc,ipo"]
  study.main([*argv, "--time-rounds", "1"])
  s = json.loads((tmp_path / "summary.json").read_text())
  rows = {r["method"]: r for r in s["rows"]}
  assert set(rows) == {"vcpo_sc", "ipo"} and rows["vcpo_sc"]["drift_kl_qp"] > 0 and "drift_kl_qp" not in rows["ipo"]
  assert set(s["interleaved_seconds_per_step"]) == {"vcpo_sc"}
  study.main([*argv, "--time-rounds", "0"])  # cells reused, the timing kept
  assert json.loads((tmp_path / "summary.json").read_text())["interleaved_seconds_per_step"]["vcpo_sc"]
  assert "| vcpo_sc | 2 |" in (tmp_path / "summary.md").read_text()
