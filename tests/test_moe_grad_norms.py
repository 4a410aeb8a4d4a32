"""Exact per-example norms through the MoE experts and router of the full model (grad_norms' ghost path, one and
two passes), against brute-force per-example jax.grad (grad_norms.loop_sq_norms, one backward per row; the vmap
reference path agrees), with and without routing replay (the learner's log-prob function reads the batch's
expert_ids)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import grad_norms as gn
from vcpo_jax import learner
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import transformer as tf

N, T, P_LEN = 6, 10, 4
CFG = mconfig.tiny_qwen3_moe(routing_replay=True)


def _batch(replay: bool, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.vocab_size, (N, T)).astype(np.int32)
  resp_len = rng.integers(2, T - P_LEN + 1, N)
  resp = (np.arange(T)[None] >= P_LEN) & (np.arange(T)[None] < P_LEN + resp_len[:, None])
  valid = (np.arange(T)[None] < P_LEN) | resp
  out = dict(
    tokens=jnp.asarray(np.where(valid, tokens, 0)),
    valid_mask=jnp.asarray(valid),
    loss_mask=jnp.asarray(resp, jnp.float32),
  )
  if replay:  # other experts than the router's, on the response columns (the Batch's layout: [N, R, L K])
    L, K, E = CFG.num_layers, CFG.num_experts_per_tok, CFG.num_experts
    forced = np.stack([rng.permutation(E)[:K] for _ in range(N * T * L)]).reshape(N, T, L * K)
    out["expert_ids"] = jnp.asarray(np.where(resp[..., None], forced, -1)[:, P_LEN:], jnp.int16)
  return out


@functools.lru_cache(maxsize=None)
def _setup(replay: bool):
  graphdef, params = tf.split(tf.init(CFG, seed=1))
  params["layers"]["mlp"]["gate"]["kernel"].value = params["layers"]["mlp"]["gate"]["kernel"].value * 5.0
  logp_fn = learner.make_logp_fn(graphdef)
  batch = _batch(replay)
  ref = jax.jit(gn.loop_sq_norms, static_argnums=0)(logp_fn, params, batch, batch["loss_mask"])  # one grad per row
  coef = jnp.asarray(np.random.default_rng(3).normal(size=N), jnp.float32)
  surrogate = lambda p: -jnp.sum(coef * jnp.sum(batch["loss_mask"] * logp_fn(p, batch), axis=1))
  grads = jax.jit(jax.grad(surrogate))(params)
  return logp_fn, params, batch, ref, coef, grads


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("passes", [1, 2])
def test_ghost_norms_and_update_through_experts_equal_brute_force(replay, passes):
  logp_fn, params, batch, ref, coef, grads = _setup(replay)
  fn = jax.jit(
    lambda p, b: gn.ghost_sq_norms_and_grad(logp_fn, p, b, b["loss_mask"], lambda lp, sq: (coef, {}), passes=passes)
  )
  res = fn(params, batch)
  np.testing.assert_allclose(res.sq_norms_n, ref, rtol=2e-4)
  assert float(jnp.max(ref) / jnp.min(ref)) > 1.2  # the examples differ: not a vacuous match
  assert jax.tree.structure(res.grads) == jax.tree.structure(grads)
  for (path, g), mine in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(res.grads), strict=True):
    assert _rel(mine, g) < 1e-4, jax.tree_util.keystr(path)
  expert_share = {  # the expert and router weights carry gradient (the update is not trivially right)
    k: float(jnp.linalg.norm(grads["layers"]["mlp"][k1][k2].value))
    for k, (k1, k2) in {"router": ("gate", "kernel"), "down": ("experts", "down_proj")}.items()
  }
  assert min(expert_share.values()) > 0


def test_scan_grouped_matmul_equals_ragged_and_norms_agree():
  """moe_matmul="scan" (the CPU-sizing stand-in for ragged_dot) gives the same log-probs, norms and update."""
  logp_fn, params, batch, ref, coef, grads = _setup(True)
  graphdef_scan, _ = tf.split(tf.init(CFG.replace(moe_matmul="scan"), seed=1))
  logp_scan = learner.make_logp_fn(graphdef_scan)
  np.testing.assert_allclose(logp_scan(params, batch), logp_fn(params, batch), rtol=1e-5, atol=1e-5)
  res = jax.jit(
    lambda p, b: gn.ghost_sq_norms_and_grad(logp_scan, p, b, b["loss_mask"], lambda lp, sq: (coef, {}), passes=2)
  )(params, batch)
  np.testing.assert_allclose(res.sq_norms_n, ref, rtol=2e-4)
  for g, mine in zip(jax.tree.leaves(grads), jax.tree.leaves(res.grads), strict=True):
    assert _rel(mine, g) < 1e-4


@pytest.mark.parametrize("passes", [1, 2])
def test_on_a_mesh_each_device_dispatches_its_rows_and_norms_equal(passes):
  """Under a (data 1, fsdp 2, tensor 2) mesh every device dispatches its own tokens (sharding.batch_local, experts
  split over the tensor axis); the norms and the update equal the single-device brute force."""
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding as sh

  logp_fn, params, batch, ref, coef, grads = _setup(True)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 2)), jax.devices()[:4])
  p_sh = jax.device_put(params, sh.param_shardings(params, sh.TRANSFORMER_RULES, mesh))
  b_sh = jax.device_put(batch, sh.batch_sharding(mesh))
  step = lambda p, b: gn.ghost_sq_norms_and_grad(
    logp_fn, p, b, b["loss_mask"], lambda lp, sq: (coef, {}), passes=passes
  )
  with jax.set_mesh(mesh):
    res = jax.jit(step)(p_sh, b_sh)
  np.testing.assert_allclose(res.sq_norms_n, ref, rtol=2e-4)
  for g, mine in zip(jax.tree.leaves(grads), jax.tree.leaves(res.grads), strict=True):
    assert _rel(mine, g) < 1e-4


@pytest.mark.parametrize("replay", [False, True])
def test_vmap_reference_norms_equal_the_loop_on_moe(replay):
  """The vmap reference path (grad_norms.vmap_sq_norms, learner.grad_path='vmap') runs on MoE models (moe.ragged_dot
  maps itself over the examples) and gives the loop's per-example norms."""
  logp_fn, params, batch, ref, _, _ = _setup(replay)
  got = jax.jit(gn.vmap_sq_norms, static_argnums=0)(logp_fn, params, batch, batch["loss_mask"])
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-4)
