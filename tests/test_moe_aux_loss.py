"""The router's load-balancing loss in the learner's loss (learner.router_aux_loss_coef, off by default).

References: transformers' Qwen3MoeForCausalLM(..., output_router_logits=True).aux_loss (torch CPU, float32, a
checkpoint written by save_pretrained, left-padded rows), and brute force: the learner's gradient with a coefficient c
minus the one with c = 0 is c x jax.grad of the aux (per micro-batch mean when micro-batched).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import fixtures
from vcpo_jax import estimator, learner
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import hf_io
from vcpo_jax.model import transformer as tf

N, T, P_LEN = 8, 10, 4
CFG = mconfig.tiny_qwen3_moe(routing_replay=True)


def test_aux_value_equals_transformers_on_a_padded_batch(tmp_path):
  torch = pytest.importorskip("torch")
  path, ref = fixtures.make_hf_checkpoint(tmp_path / "moe", "qwen3_moe", 101, seed=4)
  _, model = hf_io.load_hf(path)
  graphdef, params = tf.split(model)
  tokens = np.random.default_rng(0).integers(0, 101, (3, 9)).astype(np.int32)
  mask = np.array([[0] * 3 + [1] * 6, [0] + [1] * 8, [1] * 9])
  ours = learner.router_aux_loss(
    graphdef, params, {"tokens": jnp.asarray(tokens), "valid_mask": jnp.asarray(mask, bool)}
  )
  pos = (np.cumsum(mask, -1) - 1).clip(min=0)
  with torch.no_grad():
    out = ref(
      input_ids=torch.as_tensor(tokens, dtype=torch.long),
      attention_mask=torch.as_tensor(mask),
      position_ids=torch.as_tensor(np.where(mask == 1, pos, 1)),
      output_router_logits=True,
    )
  theirs = float(out.aux_loss)
  assert theirs > 1.0  # E sum_e f_e P_e: 1 at perfect balance, the tiny random routers are near it
  np.testing.assert_allclose(float(ours), theirs, rtol=1e-5)
  unmasked = learner.router_aux_loss(
    graphdef, params, {"tokens": jnp.asarray(tokens), "valid_mask": jnp.ones((3, 9), bool)}
  )
  assert abs(float(unmasked) - theirs) > 1e-4  # the padding is left out: the mask matters here


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.vocab_size, (N, T)).astype(np.int32)
  valid = np.ones((N, T), bool)
  valid[1, :2] = False  # a left-padded row
  loss_mask = np.zeros((N, T), bool)
  loss_mask[:, P_LEN:] = True
  L, K, E = CFG.num_layers, CFG.num_experts_per_tok, CFG.num_experts
  forced = np.stack([rng.permutation(E)[:K] for _ in range(N * (T - P_LEN) * L)]).reshape(N, T - P_LEN, L * K)
  return {
    "tokens": jnp.asarray(np.where(valid, tokens, 0)),
    "valid_mask": jnp.asarray(valid),
    "loss_mask": jnp.asarray(loss_mask),
    "behavior_logp": jnp.asarray(np.where(loss_mask, -4.0 + 0.1 * rng.standard_normal((N, T)), 0), jnp.float32),
    "rewards": jnp.asarray(rng.integers(0, 2, N), jnp.float32),
    "group_id": jnp.asarray(np.repeat(np.arange(4), 2), jnp.int32),
    "expert_ids": jnp.asarray(forced, jnp.int16),  # replayed (routing_replay): the aux counts these experts
  }


@pytest.mark.parametrize("microbatch", [0, 4])
def test_coefficient_adds_exactly_coef_times_the_aux_gradient(microbatch):
  graphdef, params = tf.split(tf.init(CFG, seed=1))
  batch = _batch()
  c = 0.37
  lcfg = lambda coef: learner.LearnerConfig(
    method=estimator.method_from_preset("vcpo"),
    microbatch_size=microbatch,
    group_size=2,
    batch_size=N,
    router_aux_loss_coef=coef,
  )
  grad = jax.jit(lambda p, b, coef: learner._gradient(graphdef, p, b, lcfg(coef))[0], static_argnums=2)
  g0, g1 = grad(params, batch, 0.0), grad(params, batch, c)
  aux = lambda p, b: learner.router_aux_loss(graphdef, p, b)
  if microbatch:  # the mean over the micro-batches (whole groups, in order) of each one's aux
    parts = [
      jax.tree.map(lambda x, i=i: x[i * microbatch : (i + 1) * microbatch], batch) for i in range(N // microbatch)
    ]
    ga = jax.tree.map(lambda *g: sum(g) / len(g), *[jax.grad(aux)(params, b) for b in parts])
  else:
    ga = jax.grad(aux)(params, batch)
  router = lambda g: g["layers"]["mlp"]["gate"]["kernel"].value
  assert float(jnp.linalg.norm(router(ga))) > 1e-3  # the aux moves the router
  np.testing.assert_allclose(
    router(g1) - router(g0), c * router(ga), rtol=1e-4, atol=1e-6 * float(jnp.abs(router(ga)).max())
  )
  for d1, d0, da in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), jax.tree.leaves(ga), strict=True):
    np.testing.assert_allclose(d1 - d0, c * da, atol=1e-5 * max(float(jnp.abs(da).max()), 1e-3))


def test_off_by_default_and_bad_values_are_one_line_errors():
  pg = estimator.method_from_preset("vcpo")
  assert learner.LearnerConfig(method=pg).router_aux_loss_coef == 0.0
  assert learner.LearnerConfig().router_aux_loss_coef == 0.0
  for bad in (-0.1, "0.01", True, float("nan")):
    with pytest.raises(ValueError, match="learner.router_aux_loss_coef"):
      learner.LearnerConfig(method=pg, router_aux_loss_coef=bad)
  dense = mconfig.tiny_qwen3()
  graphdef, params = tf.split(tf.init(dense, seed=0))
  b = {"tokens": jnp.zeros((2, 4), jnp.int32), "valid_mask": jnp.ones((2, 4), bool)}
  with pytest.raises(ValueError, match="dense model"):
    learner.router_aux_loss(graphdef, params, b)
