"""Score centering in the real learner step (learner._gradient / make_train_step) and trainer.run: the ghost
path's exact per-example norms of the CENTERED score against brute-force per-example jax.grad on ragged masks
(tied and untied heads, vocabulary chunks), the gradient against the centered surrogate's jax.grad, the vmap
path equal to the ghost path, p = q giving the plain update, and the config's refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import batch as batch_lib
from vcpo_jax import estimator, learner
from vcpo_jax import score_centering as S

V, N, T = 16, 4, 7


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _model(tied: bool, vocab_chunk: int = 0, chunk: int = 0):
  from tests import fixtures

  cfg = fixtures.micro_config(V, tied, logprob_chunk=chunk, logprob_vocab_chunk=vocab_chunk)
  assert cfg.tie_embeddings == tied
  valid = np.ones((N, T), bool)
  valid[2, 5:] = False  # a shorter row (right padding)
  loss_mask = np.zeros((N, T), bool)
  loss_mask[:, 2:] = True
  loss_mask[1, 4:] = False  # ragged
  loss_mask &= valid
  return fixtures.stale_policy_batch(cfg, valid, loss_mask)


@pytest.mark.parametrize(
  "tied,vocab_chunk,preset",
  [(False, 0, "vcpo_sc"), (True, 0, "vcpo_sc"), (True, 5, "vcpo_sc"), (False, 5, "tis_sc"), (True, 0, "tis_sc")],
)
@pytest.mark.slow
def test_ghost_centered_norms_and_gradient_by_brute_force(tied, vocab_chunk, preset):
  graphdef, params, beh, batch = _model(tied, vocab_chunk)
  pg = estimator.method_from_preset(preset, {"weights.c": 1.01} if preset == "tis_sc" else None)
  cent = S.StepCentering(graphdef, pg.weights.token_cap, beh)
  fn = S.make_centered_logp_fn(graphdef, pg.weights.token_cap)
  lf = learner.make_logp_fn(graphdef)
  g_ghost, a_ghost = learner.policy_gradient("ghost")(lf, params, batch, pg, centering=cent)
  g_vmap, a_vmap = learner.policy_gradient("vmap")(lf, params, batch, pg, centering=cent)

  lp0 = jax.lax.stop_gradient(fn(params, beh, batch)[0])
  mask = jnp.asarray(batch["loss_mask"], jnp.float32)
  tokw = estimator.pg_token_weights(lp0, batch["behavior_logp"], mask, pg)  # the mask, or token-TIS weights
  rows = [(jax.tree.map(lambda a, i=i: a[i : i + 1], batch), tokw[i : i + 1]) for i in range(N)]

  def centered_score(p, row, w):  # the ghost norms are of the tokw-weighted centered score (OPOB: tokw = mask)
    lp, corr, _ = fn(p, beh, row)
    return jnp.sum(w * lp - corr * jnp.asarray(row["loss_mask"], jnp.float32))

  def plain_score(p, row, w):
    return jnp.sum(fn(p, beh, row)[0] * w)

  sq = np.array([np.sum(flat(jax.grad(centered_score)(params, *r)) ** 2) for r in rows])
  plain = np.array([np.sum(flat(jax.grad(plain_score)(params, *r)) ** 2) for r in rows])
  np.testing.assert_allclose(np.asarray(a_ghost["sq_norm_n"]), sq, rtol=2e-4)
  assert np.abs(sq - plain).max() > 1e-4 * plain.max()  # the correction term is in the norm (ghost: to ~1e-7)
  if pg.baseline is not None:
    np.testing.assert_allclose(np.asarray(a_vmap["sq_norm_n"]), sq, rtol=2e-4)

  args = (batch["behavior_logp"], mask, batch["rewards"], batch["group_id"])
  coef, _ = estimator.pg_coefficients(lp0, *args, jnp.asarray(sq, jnp.float32) if pg.baseline is not None else None, pg)

  def surrogate(p):
    lp, corr, _ = fn(p, beh, batch)
    return S.centered_surrogate(lp, corr, coef, tokw, mask)

  loss, want = jax.value_and_grad(surrogate)(params)
  scale = np.abs(flat(want)).max()
  np.testing.assert_allclose(flat(g_ghost), flat(want), rtol=2e-4, atol=1e-6 * scale)
  np.testing.assert_allclose(flat(g_vmap), flat(want), rtol=2e-4, atol=1e-6 * scale)
  for a in (a_ghost, a_vmap):
    assert float(a["pg_loss"]) == pytest.approx(float(loss), rel=1e-4, abs=1e-7)
  # the drift rows: the same coefficient L1 on both paths, > 0 since q != p
  np.testing.assert_allclose(a_ghost["drift_coef_l1_n"], a_vmap["drift_coef_l1_n"], rtol=1e-4)
  np.testing.assert_allclose(a_ghost["drift_k1_n"], a_vmap["drift_k1_n"], rtol=1e-4, atol=1e-6)
  assert np.all(np.asarray(a_ghost["drift_coef_l1_n"])[np.asarray(batch["loss_mask"]).any(1)] > 1e-3)


# ---------------------------------------------------------------------------
# The real train step and trainer.run
# ---------------------------------------------------------------------------


def test_train_step_exact_centering_with_q_equal_p_is_the_plain_step():
  """behavior_params = None (sync, k = 0): q = p, so the centered VCPO step equals the plain one (float
  tolerance: the coefficients c = q - p are computed from two forwards, ~1e-8, not structurally 0)."""
  import optax

  from vcpo_jax import optim

  from vcpo_jax.model import transformer

  graphdef, params, _, batch = _model(tied=True)
  logp = np.asarray(transformer.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid_mask"]))
  batch = dict(batch, behavior_logp=np.where(batch["loss_mask"], logp, 0).astype(np.float32))  # on-policy
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0), optim.scale_by_ess())
  out = {}
  for name in ("vcpo", "vcpo_sc"):
    cfg = learner.LearnerConfig(method=estimator.method_from_preset(name))
    state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
    out[name] = jax.jit(learner.make_train_step(graphdef, tx, cfg))(state, batch)
  (s0, m0), (s1, m1) = out["vcpo"], out["vcpo_sc"]
  np.testing.assert_allclose(flat(s1.params), flat(s0.params), rtol=1e-6, atol=1e-7)
  for k in m0:
    assert float(m1[k]) == pytest.approx(float(m0[k]), rel=1e-5, abs=1e-7), k
  assert float(m1["drift/coef_l1"]) < 1e-5 and abs(float(m1["drift/k1_kl_qp"])) < 1e-5


def _run(tmp_path, name, **kw):
  from tests import fixtures
  from vcpo_jax import metrics as metrics_lib
  from vcpo_jax import trainer

  cfg = fixtures.tiny_countdown_config(**{"optim.lr": 1e-2, "log.norm_overhead_every": 0, "steps": 3, **kw})
  trainer.run(cfg, str(tmp_path / name))
  rows = [r for r in metrics_lib.read_jsonl(str(tmp_path / name / "metrics.jsonl")) if "train/pg_loss" in r]
  return rows


@pytest.fixture()
def dense_reward(monkeypatch):
  """A reward that varies within every group of a random policy's outputs: the parity of the characters' sum."""
  from vcpo_jax.rollout import common as rollout_common

  def score(problems, outputs, extraction=None):
    return [float(sum(map(ord, o)) % 2) for o in outputs], 0

  monkeypatch.setattr(rollout_common.tasks, "score_problems", score)


@pytest.mark.slow
def test_lag_run_with_exact_centering_logs_drift_and_k0_equals_plain(tmp_path, dense_reward):
  """trainer.run in lag mode (k = 2) with vcpo_sc: each step re-reads the behaviour version from the lag ring,
  the drift diagnostics are logged and grow once the data is stale; with k = 0 the run equals plain VCPO's
  to float tolerance: q = p is recomputed by a second forward (c ~ 1e-9, not structurally 0) and Adam at lr 1e-2
  carries such differences on, so the rows agree to rel 1e-4 and the sampled data (rewards) exactly."""
  lag = _run(tmp_path, "lag", mode="lag", method="vcpo_sc", **{"lag.k": 2})
  assert [r["train/lag_max"] for r in lag] == [0, 1, 2]
  for r in lag:
    assert {"train/drift/k1_kl_qp", "train/drift/coef_l1"} <= set(r), sorted(r)
    assert np.isfinite(r["train/drift/coef_l1"]) and np.isfinite(r["train/pg_loss"])
  assert lag[0]["train/drift/coef_l1"] < 1e-5  # step 0 samples with the current parameters: q = p
  assert lag[1]["train/grad_norm"] > 0 and lag[2]["train/drift/coef_l1"] > 1e-4  # 2 updates stale: q != p
  sync_sc = _run(tmp_path, "sync_sc", method="vcpo_sc")
  sync = _run(tmp_path, "sync", method="vcpo")
  for a, b in zip(sync_sc, sync, strict=True):
    assert a["train/reward_mean"] == b["train/reward_mean"]
    for k in ("train/pg_loss", "train/grad_norm", "train/ess_ratio", "train/lr_scale"):
      assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-7), (a["step"], k)


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(mode="async", **{"lag.k": 2}), r"method.loss.score_centering='exact': needs the behaviour parameters"),
    ({"sampler.temperature": 0.7}, r"method.loss.score_centering='exact': recomputes q"),
    ({"learner.ghost_passes": 2}, r"learner.ghost_passes=2 with method.loss.score_centering='exact'"),
    (
      {"method.loss.score_centering": "topk", "method.loss.sc_topk": 8, "model.lora_rank": 4},
      r"method.loss.score_centering='topk': the centered score's forward takes a whole model",
    ),
  ],
)
def test_exact_centering_refused_where_q_is_unavailable(kw, match):
  from tests import fixtures
  from vcpo_jax import run_config

  method = "vcpo" if kw.get("method.loss.score_centering") == "topk" else "vcpo_sc"
  with pytest.raises(run_config.ConfigError, match=match):
    run_config.parse_config(fixtures.tiny_countdown_config(method=method, **kw))


TOPK_V = {"method.loss.score_centering": "topk", "method.loss.sc_topk": 256}  # the tiny config's whole vocabulary


@pytest.mark.slow
def test_lag_run_with_topk_of_the_whole_vocabulary_equals_exact_centering(tmp_path, dense_reward):
  """trainer.run in lag mode (k = 2): VCPO centered from the sampler's recorded top-k with k = V (the record
  travels sampler -> Batch -> lag source -> ghost learner step) equals VCPO centered exactly from the lag ring's
  behaviour version, row by row: the same sampled data, drift and update."""
  exact = _run(tmp_path, "exact", mode="lag", method="vcpo_sc", **{"lag.k": 2})
  topk = _run(tmp_path, "topk", mode="lag", method="vcpo", **{"lag.k": 2}, **TOPK_V)
  for a, b in zip(topk, exact, strict=True):
    assert a["train/reward_mean"] == b["train/reward_mean"]
    for k in ("train/pg_loss", "train/grad_norm", "train/ess_ratio", "train/drift/coef_l1", "train/drift/k1_kl_qp"):
      assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-6), (a["step"], k)
  assert topk[2]["train/drift/coef_l1"] > 1e-4


@pytest.mark.slow
def test_async_run_with_inflight_updates_centers_from_the_queued_topk(tmp_path, monkeypatch):
  """Async mode with in-flight updates (the sampler process's refill engine, per-token versions): the top-k
  record crosses the shared-memory queue with its batch intact (with k = V every sampled token is in it, at its
  behaviour log-prob, and each row's record is a whole distribution), and every step is centered from it (the
  step raises when a batch lacks it) and logs the drift (0 here: the sampler process grades with the real task,
  on which the untrained policy scores 0, so p stays q; lag mode's drift is tested above)."""
  from vcpo_jax import rollout

  got, build = [], rollout.build_source

  def recording_build_source(*a, **kw):
    src = build(*a, **kw)
    nxt = src.next
    src.next = lambda step: got.append(nxt(step)) or got[-1]
    return src

  monkeypatch.setattr(rollout, "build_source", recording_build_source)
  over = {"lag.k": 2, "async_.inflight_updates": True, **TOPK_V}
  rows = _run(tmp_path, "async", mode="async", method="tis_sc", **over)
  assert [r["step"] for r in rows] == [1, 2, 3] and len(got) == 3
  for batch, _ in got:
    resp = lambda x, r=batch.r: np.asarray(x)[:, -r:]  # the record covers the R response columns only
    m = resp(batch["loss_mask"])
    assert batch.r < batch.t and not np.asarray(batch["loss_mask"])[:, : -batch.r].any()
    ids, lq = batch["topk_ids"][m], batch["topk_logp"][m]  # [tokens, K]
    hit = ids == resp(batch["tokens"])[m][:, None]
    assert batch.topk == 256 and np.all(hit.sum(-1) == 1)
    np.testing.assert_allclose(lq[hit], resp(batch["behavior_logp"])[m], atol=1e-5)
    np.testing.assert_allclose(np.logaddexp.reduce(lq, axis=-1), 0.0, atol=1e-4)
    assert np.all(batch["topk_ids"][~m] == 0) and np.all(batch["topk_logp"][~m] == 0)
  for r in rows:
    assert np.isfinite(r["train/drift/coef_l1"]) and np.isfinite(r["train/pg_loss"])
  assert rows[-1]["train/lag_max"] >= 1


def test_centering_config_checks():
  with pytest.raises(ValueError, match=r"score_centering='full'"):
    estimator.method_from_preset("vcpo", {"loss.score_centering": "full"})
  with pytest.raises(ValueError, match=r"sc_topk=0: score_centering='topk' needs"):
    estimator.method_from_preset("vcpo", {"loss.score_centering": "topk"})
  with pytest.raises(ValueError, match=r"sc_topk=8: only with score_centering='topk'"):
    estimator.method_from_preset("vcpo_sc", {"loss.sc_topk": 8})
  with pytest.raises(
    ValueError, match=r"score_centering='exact': unknown field; .* loss 'ipo' has"
  ):  # a field of the surrogate only
    estimator.method_from_preset("ipo", {"loss.score_centering": "exact"})


def _behaviour_topk(graphdef, beh, batch, k):
  """[N, T - 1, K] top-k ids and log-probs of the behaviour version's temperature-1 distribution, row r for token
  r + 1 (what a sampler without filters records over response columns 1 .. T - 1)."""
  from flax import nnx

  from vcpo_jax.model import transformer

  positions, mask = transformer.padded_positions_and_mask(batch["valid_mask"])
  logits, _ = nnx.merge(graphdef, beh)(batch["tokens"], positions, mask)
  lq = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
  vals, ids = jax.lax.top_k(lq, k)
  return np.asarray(ids).astype(np.int32), np.asarray(vals).astype(np.float32)


@pytest.mark.parametrize("preset", ["vcpo_sc", "tis_sc"])
@pytest.mark.slow
def test_topk_centering_with_k_equal_v_is_exact_in_the_learner(preset):
  graphdef, params, beh, batch = _model(tied=True)
  ids, lq = _behaviour_topk(graphdef, beh, batch, V)
  over = {"weights.c": 1.01} if preset == "tis_sc" else {}
  pg_exact = estimator.method_from_preset(preset, over)
  pg_topk = estimator.method_from_preset(preset, {"loss.score_centering": "topk", "loss.sc_topk": V, **over})
  lf = learner.make_logp_fn(graphdef)
  vmap = learner.policy_gradient("vmap")
  g_e, a_e = vmap(lf, params, batch, pg_exact, centering=S.StepCentering(graphdef, pg_exact.weights.token_cap, beh))
  tb = dict(batch, topk_ids=ids, topk_logp=lq)
  g_t, a_t = vmap(lf, params, tb, pg_topk, centering=S.TopkCentering(graphdef, pg_topk.weights.token_cap))
  np.testing.assert_allclose(flat(g_t), flat(g_e), rtol=1e-4, atol=1e-6 * np.abs(flat(g_e)).max())
  if pg_exact.baseline is not None:
    np.testing.assert_allclose(np.asarray(a_t["sq_norm_n"]), np.asarray(a_e["sq_norm_n"]), rtol=1e-4)
  np.testing.assert_allclose(a_t["drift_coef_l1_n"], a_e["drift_coef_l1_n"], rtol=1e-4)
  # k < V models the tail: a different (non-zero) correction
  ids4, lq4 = _behaviour_topk(graphdef, beh, batch, 4)
  pg4 = estimator.method_from_preset(preset, {"loss.score_centering": "topk", "loss.sc_topk": 4, **over})
  g_4, _ = vmap(
    lf,
    params,
    dict(batch, topk_ids=ids4, topk_logp=lq4),
    pg4,
    centering=S.TopkCentering(graphdef, pg4.weights.token_cap),
  )
  assert np.abs(flat(g_4) - flat(g_e)).max() > 1e-6 * np.abs(flat(g_e)).max()


def test_topk_centering_needs_the_recorded_head():
  graphdef, params, _, batch = _model(tied=True)
  pg = estimator.method_from_preset("vcpo", {"loss.score_centering": "topk", "loss.sc_topk": 4})
  with pytest.raises(ValueError, match=r"the batch lacks \['topk_ids', 'topk_logp'\]"):
    learner.policy_gradient("vmap")(
      learner.make_logp_fn(graphdef), params, batch, pg, centering=S.TopkCentering(graphdef, pg.weights.token_cap)
    )
  with pytest.raises(ValueError, match=r"the batch lacks \['topk_ids', 'topk_logp'\]"):
    learner.policy_gradient("ghost")(
      learner.make_logp_fn(graphdef), params, batch, pg, centering=S.TopkCentering(graphdef, pg.weights.token_cap)
    )


@pytest.mark.parametrize(
  "tied,vocab_chunk,preset,k",
  [
    (False, 0, "vcpo_sc", 4),
    (True, 0, "vcpo_sc", 4),
    (True, 5, "vcpo_sc", 6),
    (False, 5, "tis_sc", 3),
    (True, 3, "tis_sc", V),
  ],
)
@pytest.mark.slow
def test_ghost_topk_centering_norms_and_gradient_by_brute_force(tied, vocab_chunk, preset, k):
  """The ghost path with the sampler's top-k (k < V: the tail modelled; vocabulary chunks that split the ids;
  tied heads' cross term): per-example norms of the centered score equal per-row jax.grad of it, and the
  gradient, loss and coefficient L1 equal the vmap reference path's."""
  graphdef, params, beh, batch = _model(tied, vocab_chunk)
  ids, lq = _behaviour_topk(graphdef, beh, batch, k)
  over = {"weights.c": 1.01} if preset == "tis_sc" else {}
  pg = estimator.method_from_preset(preset, {"loss.score_centering": "topk", "loss.sc_topk": k, **over})
  tb = dict(batch, topk_ids=ids, topk_logp=lq)
  cent, lf = S.TopkCentering(graphdef, pg.weights.token_cap), learner.make_logp_fn(graphdef)
  g_ghost, a_ghost = learner.policy_gradient("ghost")(lf, params, tb, pg, centering=cent)
  g_vmap, a_vmap = learner.policy_gradient("vmap")(lf, params, tb, pg, centering=cent)

  lp0 = jax.lax.stop_gradient(cent.logp_fn(params, tb)[0])
  mask = jnp.asarray(batch["loss_mask"], jnp.float32)
  tokw = estimator.pg_token_weights(lp0, batch["behavior_logp"], mask, pg)

  def centered_score(p, i):  # the tokw-weighted centered score of row i alone
    row = jax.tree.map(lambda a: a[i : i + 1], tb)
    lp, corr, _ = cent.logp_fn(p, row)
    return jnp.sum(tokw[i : i + 1] * lp - corr * jnp.asarray(row["loss_mask"], jnp.float32))

  sq = np.array([np.sum(flat(jax.grad(centered_score)(params, i)) ** 2) for i in range(N)])
  np.testing.assert_allclose(np.asarray(a_ghost["sq_norm_n"]), sq, rtol=2e-4)
  scale = np.abs(flat(g_vmap)).max()
  np.testing.assert_allclose(flat(g_ghost), flat(g_vmap), rtol=2e-4, atol=1e-6 * scale)
  assert float(a_ghost["pg_loss"]) == pytest.approx(float(a_vmap["pg_loss"]), rel=1e-4, abs=1e-7)
  np.testing.assert_allclose(a_ghost["drift_coef_l1_n"], a_vmap["drift_coef_l1_n"], rtol=1e-4)
  assert np.all(np.asarray(a_ghost["drift_coef_l1_n"])[np.asarray(batch["loss_mask"]).any(1)] > 1e-4)
  # the head masses: the same on both paths; q's is the recorded mass, 1 per token when k = V
  for m in ("p_head_mass", "q_head_mass"):
    np.testing.assert_allclose(a_ghost[f"drift_{m}_n"], a_vmap[f"drift_{m}_n"], rtol=1e-5)
  q_mass = np.where(batch["loss_mask"][:, 1:], np.exp(lq).sum(-1), 0).sum(1)  # lq: columns 1 .. T - 1
  np.testing.assert_allclose(a_ghost["drift_q_head_mass_n"], q_mass, rtol=1e-5)
  if k == V:
    np.testing.assert_allclose(a_ghost["drift_p_head_mass_n"], batch["loss_mask"].sum(1), rtol=1e-5)


# ---------------------------------------------------------------------------
# The sampler's recorded top-k (SamplerConfig.record_topk)
# ---------------------------------------------------------------------------


def _sample(graphdef, model_cfg, params, **kw):
  from vcpo_jax.sampler import Sampler, SamplerConfig

  cfg = SamplerConfig(max_new_tokens=6, prompt_buckets=(4,), new_token_buckets=(6,), batch_buckets=(4,), **kw)
  return Sampler(graphdef, model_cfg, cfg).generate(params, [[1, 2, 3], [4, 5]], jax.random.key(3), num_samples=2)


def _model_cfg():
  from tests import fixtures

  return fixtures.micro_config(V, tied=True)


def _prompt_cols(ro) -> int:
  """Tp: the prompt bucket of a rollout (its records cover the other Tn = T - Tp columns)."""
  return int(np.flatnonzero(ro.response_mask.any(0))[0])


def _at_tokens(ro):
  """The rollout's top-k record placed on its token columns ([N, T, K], 0 on the prompt)."""
  t = ro.tokens.shape[1]
  return batch_lib.at_token_columns(ro.topk_ids, t), batch_lib.at_token_columns(ro.topk_logp, t)


def test_recorded_topk_is_the_top_k_of_the_filtered_distribution():
  """Each response token's recorded top-k = top-k of log softmax(filter_logits(logits / T, top_k, top_p)) of the
  sampling parameters, recomputed by a full forward (post-filter: removed tokens are never recorded with a
  finite log-prob, and the sampled token's behaviour log-prob is its recorded one)."""
  from flax import nnx

  from vcpo_jax import sampler as sampler_lib
  from vcpo_jax.model import transformer

  graphdef, params = transformer.split(transformer.init(_model_cfg(), seed=0))
  kw = dict(temperature=0.7, top_k=6, top_p=0.9, record_topk=4)
  ro = _sample(graphdef, _model_cfg(), params, **kw)
  tn = ro.tokens.shape[1] - _prompt_cols(ro)
  assert ro.topk_ids.shape == (ro.tokens.shape[0], tn, 4) and ro.topk_logp.dtype == np.float32  # response columns
  top_ids, top_lp = _at_tokens(ro)
  positions, mask = transformer.padded_positions_and_mask(ro.prompt_mask | ro.response_mask)
  logits, _ = nnx.merge(graphdef, params)(ro.tokens, positions, mask)
  cfg = sampler_lib.SamplerConfig(**kw)
  for n, t in zip(*np.nonzero(ro.response_mask)):
    ids, vals = sampler_lib.sampled_topk(logits[n, t - 1][None], cfg)
    fin = np.isfinite(np.asarray(vals[0]))
    np.testing.assert_array_equal(top_ids[n, t][fin], np.asarray(ids[0])[fin])
    np.testing.assert_allclose(top_lp[n, t][fin], np.asarray(vals[0])[fin], rtol=1e-4, atol=1e-5)
    assert np.all(np.isneginf(top_lp[n, t][~fin]))  # filtered out: -inf, not the unfiltered log-prob
    hit = top_ids[n, t] == ro.tokens[n, t]
    if hit.any():
      assert top_lp[n, t][hit][0] == pytest.approx(ro.behavior_logp[n, t], abs=1e-5)
  assert np.all(top_lp[~ro.response_mask] == 0) and np.all(top_ids[~ro.response_mask] == 0)


def test_an_inflight_update_records_the_topk_of_the_version_that_drew_each_token():
  """on_chunk swaps in a second version after the first chunk (KV recomputed): every token's record is the
  top-k of the version in its token_version, recomputed by a full forward of that version."""
  from flax import nnx

  from vcpo_jax import sampler as sampler_lib
  from vcpo_jax.model import transformer

  graphdef, params = transformer.split(transformer.init(_model_cfg(), seed=0))
  _, other = transformer.split(transformer.init(_model_cfg(), seed=1))
  kw = dict(temperature=0.7, top_k=6, top_p=0.9, record_topk=4)
  cfg = sampler_lib.SamplerConfig(
    max_new_tokens=6, prompt_buckets=(4,), new_token_buckets=(6,), batch_buckets=(4,), chunk_tokens=2, **kw
  )
  swaps = iter([(other, 1)])
  ro = sampler_lib.Sampler(graphdef, _model_cfg(), cfg).generate(
    params,
    [[1, 2, 3], [4, 5]],
    jax.random.key(3),
    num_samples=2,
    decode="refill",
    on_chunk=lambda steps: next(swaps, None),
    recompute_kv=True,
  )
  assert {0, 1} <= set(np.unique(ro.token_version[ro.response_mask]))
  positions, mask = transformer.padded_positions_and_mask(ro.prompt_mask | ro.response_mask)
  logits = {v: nnx.merge(graphdef, p)(ro.tokens, positions, mask)[0] for v, p in ((0, params), (1, other))}
  top_ids, top_lp = _at_tokens(ro)
  for n, t in zip(*np.nonzero(ro.response_mask)):
    ids, vals = sampler_lib.sampled_topk(logits[int(ro.token_version[n, t])][n, t - 1][None], cfg)
    fin = np.isfinite(np.asarray(vals[0]))
    np.testing.assert_array_equal(top_ids[n, t][fin], np.asarray(ids[0])[fin])
    np.testing.assert_allclose(top_lp[n, t][fin], np.asarray(vals[0])[fin], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("decode", ["chunked", "refill"])
def test_the_chunked_engines_record_the_static_loops_topk(decode):
  """The host-driven engines (chunked, refill: in-flight updates and budgets run on them) draw every row's tokens
  with the same keys as the static loop, so they record the same top-k ids and log-probs, row by row."""
  from vcpo_jax.model import transformer

  graphdef, params = transformer.split(transformer.init(_model_cfg(), seed=0))
  kw = dict(temperature=0.7, top_k=6, top_p=0.9, record_topk=4)
  ref = _sample(graphdef, _model_cfg(), params, **kw)
  ro = _sample(graphdef, _model_cfg(), params, decode=decode, chunk_tokens=2, **kw)
  np.testing.assert_array_equal(ro.tokens, ref.tokens)
  np.testing.assert_array_equal(ro.topk_ids, ref.topk_ids)
  np.testing.assert_allclose(ro.topk_logp, ref.topk_logp, rtol=1e-5, atol=1e-6)
  assert ro.topk_ids.shape == (ro.tokens.shape[0], ro.tokens.shape[1] - _prompt_cols(ro), 4)  # response columns


def test_sampler_topk_with_k_equal_v_centering_equals_exact():
  """Sampled at temperature 1 without filters, recording k = V: the learner's top-k centering (behaviour = the
  sampling parameters) equals exact centering from those parameters on the same batch."""
  from vcpo_jax.model import transformer

  graphdef, params = transformer.split(transformer.init(_model_cfg(), seed=0))
  _, other = transformer.split(transformer.init(_model_cfg(), seed=1))
  beh = jax.tree.map(lambda a, b: a + 0.3 * (b - a), params, other)
  ro = _sample(graphdef, _model_cfg(), beh, record_topk=V)
  batch = dict(
    tokens=ro.tokens,
    valid_mask=ro.prompt_mask | ro.response_mask,
    loss_mask=ro.response_mask,
    behavior_logp=ro.behavior_logp,
    rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32),
    group_id=np.array([0, 0, 1, 1], np.int32),
  )
  pg_e = estimator.method_from_preset("vcpo_sc")
  pg_t = estimator.method_from_preset("vcpo", {"loss.score_centering": "topk", "loss.sc_topk": V})
  lf, vmap = learner.make_logp_fn(graphdef), learner.policy_gradient("vmap")
  g_e, a_e = vmap(lf, params, batch, pg_e, centering=S.StepCentering(graphdef, pg_e.weights.token_cap, beh))
  tb = dict(batch, topk_ids=ro.topk_ids, topk_logp=ro.topk_logp)
  g_t, a_t = vmap(lf, params, tb, pg_t, centering=S.TopkCentering(graphdef, pg_t.weights.token_cap))
  np.testing.assert_allclose(flat(g_t), flat(g_e), rtol=1e-3, atol=1e-5 * np.abs(flat(g_e)).max())
  np.testing.assert_allclose(np.asarray(a_t["sq_norm_n"]), np.asarray(a_e["sq_norm_n"]), rtol=1e-3)
