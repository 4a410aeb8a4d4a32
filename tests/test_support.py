"""vcpo_jax/model/support.py: the sampler records each token's kept support, the learner scores over it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import fixtures
from vcpo_jax import batch as batch_lib
from vcpo_jax import estimator, learner
from vcpo_jax import sampler as sampler_lib
from vcpo_jax.model import support, transformer

V = 256  # > top_k = 50, so both filters act
FILTERS = dict(temperature=1.0, top_p=0.9, top_k=50)


def _model(vocab_chunk=0, chunk=0, tied=True, seed=0):
  cfg = fixtures.micro_config(V, tied, logprob_chunk=chunk, logprob_vocab_chunk=vocab_chunk)
  graphdef, params = transformer.split(transformer.init(cfg, seed=seed))
  # a sharper policy than the random init's near-uniform one, so that top-p keeps a fraction of the vocabulary
  params = jax.tree.map(lambda x: 4.0 * x if x.ndim == 2 and V in x.shape else x, params)
  return cfg, graphdef, params


def _sample(cfg, graphdef, params, decode="static", **kw):
  scfg = sampler_lib.SamplerConfig(
    max_new_tokens=8, prompt_buckets=(4,), new_token_buckets=(8,), batch_buckets=(8,), chunk_tokens=3, **kw
  )
  prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
  return sampler_lib.Sampler(graphdef, cfg, scfg).generate(params, prompts, jax.random.key(7), 2, decode=decode)


def _batch(ro, with_support=True):
  n, tn = ro.tokens.shape[0], ro.behavior_logp.shape[1] - 4
  b = dict(
    tokens=ro.tokens,
    valid_mask=ro.prompt_mask | ro.response_mask,
    loss_mask=ro.response_mask,
    behavior_logp=ro.behavior_logp,
    rewards=np.linspace(0.0, 1.0, n).astype(np.float32),
    group_id=np.repeat(np.arange(n // 2, dtype=np.int32), 2),
  )
  if with_support:
    assert ro.support_thr.shape == (n, tn)  # the response columns only
    b["support_thr"] = ro.support_thr
  return b


def test_record_threshold_by_hand():
  """x = [3, 2, 2, 1, 0] with top-k 3 keeps the tie at 2 with it (3 tokens); the cut sits mid-gap between the
  last kept (2) and the first dropped (1) logit, relative to the drawn token: token 1 (x = 2) -> 1.5 - 2."""
  x = jnp.array([[3.0, 2.0, 2.0, 1.0, 0.0]])
  xf = sampler_lib.filter_logits(x, 1.0, 3, 1.0)
  assert np.isfinite(np.asarray(xf)).sum() == 3
  np.testing.assert_allclose(support.record_threshold(x, xf, jnp.array([1]), 1.0), [-0.5])
  np.testing.assert_allclose(support.record_threshold(x, xf, jnp.array([0]), 1.0), [-1.5])
  # at temperature 2 the sampler's x is logits / 2: the record is in the learner's logit units
  np.testing.assert_allclose(support.record_threshold(x / 2, xf / 2, jnp.array([1]), 2.0), [-0.5])
  # no filter: no cut
  assert np.isneginf(np.asarray(support.record_threshold(x, x, jnp.array([1]), 1.0)))[0]
  # the rebuild: the learner keeps {v : z_v >= z_y + thr}, the same 3 tokens, and y always
  lg = jnp.array([[[3.0, 2.0, 2.0, 1.0, 0.0]]])
  assert int(support.keep(lg, jnp.arange(5), jnp.array([[1]]), jnp.array([[1.5]])).sum()) == 3
  # a shift of every logit moves no token across the cut (it is relative to y's logit)
  thr = jnp.array([[-0.5]])
  toks = jnp.array([[0, 1]])
  for shift in (0.0, 7.0):
    assert int(support.support_sizes(jnp.pad(lg + shift, ((0, 0), (0, 1), (0, 0))), toks, thr)[0, 0]) == 3


@pytest.mark.parametrize("decode", ["static", "chunked", "refill"])
def test_on_policy_log_ratios_are_zero_with_replay_and_not_without(decode):
  """top-p 0.9 and top-k 50 at temperature 1: the learner's log-probs renormalised over the recorded support equal
  the sampler's behaviour log-probs within 1e-5 on every response token (every engine); the full softmax's do
  not (log mu > log pi on a filtered distribution)."""
  cfg, graphdef, params = _model()
  ro = _sample(cfg, graphdef, params, decode=decode, record_support=True, **FILTERS)
  m = ro.response_mask
  logp_fn = learner.make_logp_fn(graphdef)
  with_replay = np.asarray(logp_fn(params, _batch(ro)))
  without = np.asarray(logp_fn(params, _batch(ro, with_support=False)))
  np.testing.assert_allclose(with_replay[m], ro.behavior_logp[m], atol=1e-5)
  assert np.abs(without[m] - ro.behavior_logp[m]).max() > 1e-2
  # the filters did act: supports smaller than the vocabulary on most tokens, and never empty
  positions, mask = transformer.padded_positions_and_mask(ro.prompt_mask | ro.response_mask)
  logits, _ = transformer.forward(graphdef, params, ro.tokens, positions, mask)
  sizes = np.asarray(support.support_sizes(logits, ro.tokens, ro.support_thr))[m[:, 1:]]
  assert sizes.min() >= 1 and sizes.max() <= 50 and np.mean(sizes < V) > 0.9
  np.testing.assert_array_equal(np.isneginf(ro.support_thr), ~m[:, 4:])  # -inf off the response only


def test_the_engines_record_the_same_support():
  cfg, graphdef, params = _model()
  ref = _sample(cfg, graphdef, params, record_support=True, record_topk=4, **FILTERS)
  for decode in ("chunked", "refill"):
    ro = _sample(cfg, graphdef, params, decode=decode, record_support=True, record_topk=4, **FILTERS)
    np.testing.assert_array_equal(ro.tokens, ref.tokens)
    np.testing.assert_allclose(ro.support_thr, ref.support_thr, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ro.topk_ids, ref.topk_ids)


@pytest.mark.parametrize("vocab_chunk,chunk", [(0, 0), (48, 0), (48, 5)])
def test_chunked_heads_replay_like_the_dense_reference(vocab_chunk, chunk):
  """The learner's head in token and vocab chunks (online logsumexp; chunks wholly off the support) gives the
  dense reference's replayed log-probs and gradients."""
  cfg, graphdef, params = _model()
  ro = _sample(cfg, graphdef, params, record_support=True, **FILTERS)
  b = _batch(ro)
  _, c_graphdef, _ = _model(vocab_chunk, chunk)
  positions, mask = transformer.padded_positions_and_mask(b["valid_mask"])
  w = jnp.asarray(ro.response_mask, jnp.float32)

  def ref(p):
    logits, _ = transformer.forward(graphdef, p, b["tokens"], positions, mask)
    return support.replayed_logprobs(logits, b["tokens"], b["support_thr"])

  def got(p):
    return learner.make_logp_fn(c_graphdef)(p, b)

  np.testing.assert_allclose(got(params), ref(params), atol=1e-5)
  g_ref = jax.grad(lambda p: jnp.sum(w * ref(p)))(params)
  g_got = jax.grad(lambda p: jnp.sum(w * got(p)))(params)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  np.testing.assert_allclose(flat(g_got), flat(g_ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tied,vocab_chunk", [(True, 0), (False, 48)])
def test_ghost_and_vmap_paths_agree_under_replay(tied, vocab_chunk):
  """Off-policy (a second version scores the batch): the ghost path's per-example norms and gradient, whose head
  pass rebuilds softmax chunks from the forward's record, equal the vmap reference's with the replayed support."""
  cfg, graphdef, params = _model(vocab_chunk, tied=tied)
  _, _, other = _model(vocab_chunk, tied=tied, seed=1)
  newer = jax.tree.map(lambda a, b: a + 0.2 * (b - a), params, other)
  ro = _sample(cfg, graphdef, params, record_support=True, **FILTERS)
  b = {k: jnp.asarray(v) for k, v in _batch(ro).items()}
  pg = estimator.method_from_preset("vcpo")
  lf = learner.make_logp_fn(graphdef)
  g_ghost, a_ghost = learner.policy_gradient("ghost")(lf, newer, b, pg)
  g_vmap, a_vmap = learner.policy_gradient("vmap")(lf, newer, b, pg)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  scale = np.abs(flat(g_vmap)).max()
  np.testing.assert_allclose(flat(g_ghost), flat(g_vmap), rtol=2e-4, atol=1e-6 * scale)
  np.testing.assert_allclose(np.asarray(a_ghost["sq_norm_n"]), np.asarray(a_vmap["sq_norm_n"]), rtol=2e-4)
  assert np.isfinite(np.asarray(a_ghost["sq_norm_n"])).all()


@pytest.mark.parametrize("tied,vocab_chunk", [(True, 0), (False, 48)])
def test_topk_centering_over_the_replayed_support_agrees_on_both_paths(tied, vocab_chunk):
  """Top-k score centering with replay: p is the replayed distribution (0 at recorded ids off the support) on the
  vmap path (dense) and the ghost path (from the head record's cuts): same gradient, norms and drift."""
  from vcpo_jax import score_centering as S

  cfg, graphdef, params = _model(vocab_chunk, tied=tied)
  _, _, other = _model(vocab_chunk, tied=tied, seed=1)
  newer = jax.tree.map(lambda a, b: a + 0.2 * (b - a), params, other)
  ro = _sample(cfg, graphdef, params, record_support=True, record_topk=64, **FILTERS)  # K > |S|: ids off S too
  b = {k: jnp.asarray(v) for k, v in dict(_batch(ro), topk_ids=ro.topk_ids, topk_logp=ro.topk_logp).items()}
  pg = estimator.method_from_preset("vcpo", {"loss.score_centering": "topk", "loss.sc_topk": 64})
  cent, lf = S.TopkCentering(graphdef, pg.weights.token_cap), learner.make_logp_fn(graphdef)
  g_ghost, a_ghost = learner.policy_gradient("ghost")(lf, newer, b, pg, centering=cent)
  g_vmap, a_vmap = learner.policy_gradient("vmap")(lf, newer, b, pg, centering=cent)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  scale = np.abs(flat(g_vmap)).max()
  np.testing.assert_allclose(flat(g_ghost), flat(g_vmap), rtol=2e-4, atol=1e-6 * scale)
  np.testing.assert_allclose(np.asarray(a_ghost["sq_norm_n"]), np.asarray(a_vmap["sq_norm_n"]), rtol=2e-4)
  for k in ("drift_coef_l1_n", "drift_p_head_mass_n"):
    np.testing.assert_allclose(a_ghost[k], a_vmap[k], rtol=1e-4, atol=1e-6)
  # on-policy the replayed p puts all its mass on the sampler's support, which the K = 64 > 50 recorded ids cover
  _, a_on = learner.policy_gradient("ghost")(lf, params, b, pg, centering=cent)
  np.testing.assert_allclose(np.asarray(a_on["drift_p_head_mass_n"]), np.asarray(a_on["drift_tokens_n"]), rtol=1e-4)


def test_the_record_survives_the_queue_and_a_checkpoint(tmp_path):
  """A Batch with the support record (and -inf off the response) crosses the shared-memory queue and a checkpoint
  of queued batches (restored into the queue schema's template) bit for bit."""
  from vcpo_jax.checkpoint import Checkpointer
  from vcpo_jax.rollout import async_
  from vcpo_jax.rollout.process.shm_queue import ShmQueue

  cfg, graphdef, params = _model()
  ro = _sample(cfg, graphdef, params, record_support=True, record_topk=3, **FILTERS)
  arrays = dict(
    _batch(ro),
    topk_ids=ro.topk_ids,
    topk_logp=ro.topk_logp,
    correct=np.zeros(8, np.float32),
    policy_version=np.zeros(8, np.int32),
    token_version=np.where(ro.response_mask, 0, -1).astype(np.int32),
  )
  batch = batch_lib.Batch.from_arrays(arrays)
  assert (batch.r, batch.topk, batch.support) == (8, 3, True)
  schema = async_.batch_schema(8, 12, 3, 8, True)
  with ShmQueue(schema, nslots=1) as q:
    q.put(dict(batch), {"step": 0})
    item = q.get(timeout=10.0)
  got = batch_lib.Batch.from_arrays(item.arrays)
  for k in batch:
    np.testing.assert_array_equal(got[k], batch[k])
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  try:
    ckpt.save(1, {"queued": [dict(got)]}, {"step": 1})
    ckpt.wait()
    template = {"queued": [{n: np.zeros(f.shape, f.dtype) for n, f in schema.fields.items()}]}
    tree, _ = ckpt.restore(1, template)
  finally:
    ckpt.close()
  for k in batch:
    np.testing.assert_array_equal(np.asarray(tree["queued"][0][k]), batch[k])


def test_support_replay_switch():
  s = sampler_lib.SamplingConfig
  assert not s().replays_support and s(top_p=0.9).replays_support and s(top_k=50).replays_support
  assert not s(top_p=0.9, support_replay="off").replays_support and s(support_replay="on").replays_support
  assert "support_replay" not in s(top_p=0.9).sampler_kwargs()
  with pytest.raises(ValueError, match="sampler.support_replay"):
    s(support_replay="yes")
  with pytest.raises(ValueError, match="record_support"):
    sampler_lib.SamplerConfig(temperature=0.0, record_support=True)


@pytest.mark.slow
def test_sync_run_with_top_p_is_on_policy_with_replay(tmp_path):
  """trainer.run in sync mode with top-p 0.9: with the default switch (auto) the training sampler records the
  support and every step's log-ratios are 0 (ESS ratio 1); with sampler.support_replay='off' they are not."""
  from tests import fixtures
  from vcpo_jax import metrics as metrics_lib
  from vcpo_jax import trainer

  def run(name, **kw):
    cfg = fixtures.tiny_countdown_config(**{"steps": 2, "sampler.top_p": 0.9, "log.norm_overhead_every": 0, **kw})
    trainer.run(cfg, str(tmp_path / name))
    return [r for r in metrics_lib.read_jsonl(str(tmp_path / name / "metrics.jsonl")) if "train/pg_loss" in r]

  on, off = run("replay"), run("full", **{"sampler.support_replay": "off"})
  spread = lambda r: max(abs(r["train/log_ratio_min"]), abs(r["train/log_ratio_max"]))  # per-row sums over tokens
  assert len(on) == 2 and all(spread(r) < 1e-4 and r["train/ess_ratio"] == pytest.approx(1.0, abs=1e-6) for r in on)
  assert spread(off[0]) > 1e-2
