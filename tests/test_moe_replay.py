"""MoE routing replay end to end: the sampler records each response token's experts (every decode engine), the
Batch carries them, and the learner's log-probs replay them (transformer.replay_routing, learner.make_logp_fn).

A tiny Qwen3-MoE (config.tiny_qwen3_moe) with a sharpened router, so that routing decisions matter.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import batch as batch_lib
from vcpo_jax import learner
from vcpo_jax import sampler as S
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import moe
from vcpo_jax.model import transformer as tf

CFG = mconfig.tiny_qwen3_moe(routing_replay=True)
PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13]]
SMALL = dict(temperature=1.0, eos_id=7, max_new_tokens=12, prompt_buckets=(8,), new_token_buckets=(12,))


@functools.lru_cache(maxsize=None)
def _model():
  gd, params = tf.split(tf.init(CFG, seed=0))
  params["layers"]["mlp"]["gate"]["kernel"].value = params["layers"]["mlp"]["gate"]["kernel"].value * 20.0
  return gd, params


def _logp(params, tokens, valid, experts=None, replay=None):
  gd = _model()[0]
  cfg = CFG if replay is None else CFG.replace(routing_replay=replay)
  with tf.replay_routing(cfg, experts, force=replay):
    return np.asarray(tf.sequence_logprobs(gd, params, jnp.asarray(tokens), jnp.asarray(valid)))


@pytest.mark.parametrize("decode", S.DECODE_MODES)
def test_sampler_records_routing_and_cache_equals_full_forward(decode):
  """Every engine records, per response column but the last, the experts its fed token went through (-1
  elsewhere); at equal parameters they are the full forward's top-K there, and the KV-cache log-probs equal the
  full forward's (with or without replay)."""
  gd, params = _model()
  smp = S.Sampler(gd, CFG, S.SamplerConfig(**SMALL, record_routing=True, decode=decode, chunk_tokens=4))
  r = smp.generate(params, PROMPTS, jax.random.key(1), num_samples=2)
  n, t = r.tokens.shape
  tn = SMALL["max_new_tokens"]  # the record covers the response columns only: [N, Tn, L K]
  assert r.expert_ids.shape == (n, tn, CFG.num_layers * 2) and r.expert_ids.dtype == np.int16
  experts = batch_lib.at_token_columns(r.expert_ids, t, fill=-1)  # [N, T, L K], prompt columns -1
  valid = r.prompt_mask | r.response_mask
  last = r.response_mask & ~np.pad(r.response_mask[:, 1:], ((0, 0), (0, 1)))  # each row's last response token
  rec = experts[..., 0] >= 0
  np.testing.assert_array_equal(rec, r.response_mask & ~last)
  assert (experts[~rec] == -1).all()
  with moe.routing() as own:
    tf.sequence_logprobs(gd, params, jnp.asarray(r.tokens), jnp.asarray(valid))
  full = np.moveaxis(np.asarray(own.expert_ids), 0, 2).reshape(n, t, -1)  # [N, T, L K]
  np.testing.assert_array_equal(np.sort(experts[rec].reshape(-1, 2), -1), np.sort(full[rec].reshape(-1, 2), -1))
  for replay in (False, True):
    logp = _logp(params, r.tokens, valid, jnp.asarray(experts), replay)
    np.testing.assert_allclose(np.where(r.response_mask, logp, 0.0), r.behavior_logp, atol=2e-5)


def test_replay_equals_behaviour_where_own_routing_differs():
  """Behaviour log-probs from a run routed through other experts than the learner's router picks (forced per
  response token): at equal parameters the learner's log-probs equal them with replay, and not without."""
  gd, params = _model()
  rng = np.random.default_rng(0)
  n, t, L, K, E = 4, 12, CFG.num_layers, 2, CFG.num_experts
  tokens = rng.integers(0, CFG.vocab_size, (n, t)).astype(np.int32)
  valid = np.ones((n, t), bool)
  resp = np.zeros((n, t), bool)
  resp[:, 5:] = True
  forced = np.stack([rng.permutation(E)[:K] for _ in range(n * t * L)]).reshape(n, t, L * K).astype(np.int16)
  experts = np.where(resp[..., None], forced, -1).astype(np.int16)
  mu = _logp(params, tokens, valid, jnp.asarray(experts), replay=True)  # the "sampler's" run
  replayed = _logp(params, tokens, valid, jnp.asarray(experts), replay=True)
  own = _logp(params, tokens, valid, jnp.asarray(experts), replay=False)
  # The learner's own step: make_logp_fn reads the batch's record over the R = 7 response columns [N, R, L K]
  # (model.routing_replay on in CFG) and places it on the token columns.
  experts_nre = experts[:, 5:]
  batch = {"tokens": jnp.asarray(tokens), "valid_mask": jnp.asarray(valid), "expert_ids": jnp.asarray(experts_nre)}
  step_logp = np.asarray(learner.make_logp_fn(gd)(params, batch))
  loss = np.pad(resp[:, 1:], ((0, 0), (1, 0))) & resp  # tokens whose prediction saw replayed positions
  np.testing.assert_allclose(replayed[loss], mu[loss], atol=1e-6)
  np.testing.assert_allclose(step_logp[loss], mu[loss], atol=1e-6)
  assert np.abs(own - mu)[loss].max() > 1e-2  # without replay the learner's log-probs differ
  full = {
    "tokens": tokens,
    "valid_mask": valid,
    "loss_mask": loss,
    "behavior_logp": np.where(loss, mu, 0.0),
    "expert_ids": experts_nre,
  }
  m = jax.jit(learner.routing_replay_metrics, static_argnums=0)(gd, params, full)
  assert float(m["moe/route_mismatch"]) > 0.5  # random expert sets: most differ from the router's top-2
  assert float(m["moe/log_ratio_std_replay"]) < 1e-5 < float(m["moe/log_ratio_std"])
  assert abs(float(m["moe/ess_replay"]) - 1.0) < 1e-5 and float(m["moe/ess"]) < 1.0


def test_dense_model_ignores_the_record_and_metrics_are_empty():
  cfg = mconfig.tiny_qwen3(routing_replay=True)
  gd, params = tf.split(tf.init(cfg))
  tokens = jnp.ones((2, 6), jnp.int32)
  valid = jnp.ones((2, 6), bool)
  experts = jnp.zeros((2, 6, 4), jnp.int16)
  a = tf.sequence_logprobs(gd, params, tokens, valid, expert_ids=experts)
  np.testing.assert_array_equal(a, tf.sequence_logprobs(gd, params, tokens, valid))
  batch = {"tokens": tokens, "expert_ids": experts[:, 3:]}  # the Batch's layout: response columns [N, R, E]
  assert learner.routing_replay_metrics(gd, params, batch) == {}


def test_batch_carries_the_routing_record():
  n, t, r, e = 4, 6, 4, 6  # E routing entries per token over the R response columns
  arrays = {k: np.zeros(batch_lib.shape(k, n, t), d) for k, (d, _) in batch_lib.FIELDS.items()}
  arrays["expert_ids"] = np.full((n, r, e), -1, np.int32)
  b = batch_lib.Batch.from_arrays(arrays)
  assert b.routing == e and b.r == r and b.expert_ids.dtype == np.int16
  assert "expert_ids" in b.device() and "expert_ids" in dict(b)
  assert batch_lib.schema(n, t, r=r, e=e)["expert_ids"] == (np.int16, (n, r, e))
  assert "expert_ids" not in batch_lib.schema(n, t)
  with pytest.raises(ValueError, match="E >= 1"):
    batch_lib.Batch.from_arrays({**arrays, "expert_ids": np.zeros((n, r, 0), np.int16)})
  with pytest.raises(ValueError, match="R < T"):  # the record covers the response columns only
    batch_lib.Batch.from_arrays({**arrays, "expert_ids": np.zeros((n, t, e), np.int16)})
  leaves = jax.tree.leaves(b)
  assert any(x.dtype == np.int16 for x in leaves)  # a pytree leaf: it travels wherever the Batch goes
