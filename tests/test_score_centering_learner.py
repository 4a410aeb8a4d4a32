"""Score centering in the real learner step (learner._gradient / make_train_step) and trainer.run: the ghost
path's exact per-example norms of the CENTERED score against brute-force per-example jax.grad on ragged masks
(tied and untied heads, vocabulary chunks), the gradient against the centered surrogate's jax.grad, the vmap
path equal to the ghost path, p = q giving the plain update, and the config's refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import estimator, learner
from vcpo_jax import score_centering as S

V, N, T = 16, 4, 7


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _model(tied: bool, vocab_chunk: int = 0, chunk: int = 0):
  from vcpo_jax.model import config, transformer

  make = config.tiny_qwen2 if tied else config.tiny_llama
  cfg = make(
    vocab_size=V,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    logprob_chunk=chunk,
    logprob_vocab_chunk=vocab_chunk,
  )
  assert cfg.tie_embeddings == tied
  graphdef, params = transformer.split(transformer.init(cfg, seed=0))
  _, other = transformer.split(transformer.init(cfg, seed=1))
  beh = jax.tree.map(lambda a, b: a + 0.3 * (b - a), params, other)  # a nearby stale version
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, V, (N, T)).astype(np.int32)
  valid = np.ones((N, T), bool)
  valid[2, 5:] = False  # a shorter row (right padding)
  loss_mask = np.zeros((N, T), bool)
  loss_mask[:, 2:] = True
  loss_mask[1, 4:] = False  # ragged
  loss_mask &= valid
  blogp = np.asarray(transformer.sequence_logprobs(graphdef, beh, tokens, valid))
  batch = dict(
    tokens=tokens,
    valid_mask=valid,
    loss_mask=loss_mask,
    behavior_logp=np.where(loss_mask, blogp, 0).astype(np.float32),
    rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32),
    group_id=np.array([0, 0, 1, 1], np.int32),
  )
  return graphdef, params, beh, batch


@pytest.mark.parametrize(
  "tied,vocab_chunk,preset",
  [(False, 0, "vcpo_sc"), (True, 0, "vcpo_sc"), (True, 5, "vcpo_sc"), (False, 5, "tis_sc"), (True, 0, "tis_sc")],
)
def test_ghost_centered_norms_and_gradient_by_brute_force(tied, vocab_chunk, preset):
  graphdef, params, beh, batch = _model(tied, vocab_chunk)
  pg = estimator.pg_config_from_preset(preset, **({"token_tis_c": 1.01} if preset == "tis_sc" else {}))
  cent = S.StepCentering(graphdef, pg, beh)
  fn = S.make_centered_logp_fn(graphdef, S.centering_cap(pg))
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
  if pg.opob:
    np.testing.assert_allclose(np.asarray(a_vmap["sq_norm_n"]), sq, rtol=2e-4)

  args = (batch["behavior_logp"], mask, batch["rewards"], batch["group_id"])
  coef, _ = estimator.pg_coefficients(lp0, *args, jnp.asarray(sq, jnp.float32) if pg.opob else None, pg)

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
