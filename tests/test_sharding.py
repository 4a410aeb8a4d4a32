"""Sharded vs single-device equivalence on 8 fake CPU devices (conftest sets XLA_FLAGS).

For each mesh (data, fsdp, tensor) in (8,1,1), (2,2,2), (1,4,2) the sharded
forward logits, gradients of a sequence-logprob surrogate, per-example squared
gradient norms and one full clipped-AdamW learner step must equal the
single-device results to 1e-5. A bug in the partition rules or in the batch
sharding (e.g. a batch split over "tensor" too, or a gradient summed over only
the local shard) gives errors of order 1, not 1e-7.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from vcpo_jax import sharding as sh
from vcpo_jax.model import config, transformer as tf

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2)]
N, T = 8, 12  # N divisible by data*fsdp for every mesh above
TOL = 1e-5


# ----------------------------------------------------------------------------- the learner-like functions


def _batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (N, T), dtype=np.int32)
  lengths = rng.integers(T // 2, T + 1, N)
  valid = np.arange(T)[None] < lengths[:, None]  # right padding
  loss_mask = valid & (np.arange(T)[None] >= 3)  # "response" tokens after a 3-token prompt
  coef = rng.normal(size=N).astype(np.float32)  # per-trajectory PG coefficients (advantage-like)
  return dict(tokens=tokens, valid=valid, loss_mask=loss_mask.astype(np.float32), coef=coef)


def _surrogate_n(graphdef, params, batch):
  """Per-trajectory surrogate l_n = c_n * sum_t logp_nt * mask_nt  ->  [N]."""
  logp_nt = tf.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid"])
  return batch["coef"] * jnp.sum(logp_nt * batch["loss_mask"], axis=1)


def _loss(graphdef, params, batch):
  return -jnp.mean(_surrogate_n(graphdef, params, batch))


def _sq_tree_norm(tree):
  return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def _per_example_sq_norms(graphdef, params, batch):
  """||grad_theta l_n||^2 for each n, brute force with vmap(grad) -> [N]."""
  def one(ex):
    ex1 = jax.tree.map(lambda x: x[None], ex)
    return _sq_tree_norm(jax.grad(lambda p: _surrogate_n(graphdef, p, ex1)[0])(params))
  return jax.vmap(one)(batch)


# Adam's first step is g / (|g| + eps): its slope 1/eps amplifies float reordering
# noise on gradient components near zero (with eps = 1e-8 a 1e-10 difference in a
# 1e-9 gradient moves the update by 10% of lr). eps = 1e-6 bounds that
# amplification so that the comparison tests the sharding, not float noise.
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-6, weight_decay=0.01))


def _learner_step(graphdef, state, batch):
  """One learner-style step plus every intermediate the test compares.

  Returns ((new_params, new_opt_state), aux) with aux = logits [N, T, V], grads
  (params tree), per-example squared grad norms [N], loss and grad_norm scalars.
  """
  params, opt_state = state
  loss, grads = jax.value_and_grad(lambda p: _loss(graphdef, p, batch))(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  aux = dict(logits=_logits(graphdef, state[0], batch), grads=grads,
             sq_norms=_per_example_sq_norms(graphdef, state[0], batch),
             loss=loss, grad_norm=optax.global_norm(grads))
  return (params, opt_state), aux


def _logits(graphdef, params, batch):
  pos, mask = tf.padded_positions_and_mask(batch["valid"])
  return tf.forward(graphdef, params, batch["tokens"], pos, mask)[0]


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------------------- single-device reference

CONFIGS = {  # one layer: the rules are per-layer, and compile time dominates this file
    "qwen2": config.tiny_qwen2(num_layers=1),  # GQA, q/k/v bias, tied embeddings
    "llama": config.tiny_llama(num_layers=1),  # one kv head, untied lm_head
}
CASES = [("qwen2", s) for s in MESHES] + [("llama", (1, 4, 2))]
_REFERENCE = {}


def _reference(name):
  """Single-device params, batch and step outputs for config `name`, computed once."""
  if name not in _REFERENCE:
    cfg = CONFIGS[name]
    batch = _batch(cfg)
    graphdef, params = tf.split(tf.init(cfg, seed=3))
    params, batch_d = jax.device_put((params, batch), jax.devices()[0])
    state = (params, jax.jit(TX.init)(params))
    (new_params, _), aux = jax.jit(_learner_step, static_argnums=0)(graphdef, state, batch_d)
    _REFERENCE[name] = (cfg, batch, params, new_params, aux)
  return _REFERENCE[name]


@pytest.mark.parametrize("name,shape", CASES, ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c)))
def test_sharded_equals_single_device(name, shape):
  cfg, batch, ref_params, ref_new_params, ref = _reference(name)
  mesh = sh.make_mesh(sh.MeshConfig(shape))
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
  graphdef, params = sh.init_sharded(cfg, 3, mesh)

  # Parameters are created sharded, with the values of the unsharded initializer.
  assert _max_diff(params, ref_params) < 1e-6
  p_shard = sh.param_shardings(params, sh.TRANSFORMER_RULES, mesh)
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(p_shard)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  if shape[1] * shape[2] > 1:  # fsdp/tensor really split the embedding table
    emb = params["embed_tokens"]["embedding"][...]
    assert emb.addressable_shards[0].data.size == emb.size // (shape[1] * shape[2])

  b_shard, rep = sh.batch_sharding(mesh), sh.replicated(mesh)
  batch_s = jax.device_put(batch, b_shard)
  opt_state = jax.jit(TX.init, out_shardings=sh.param_shardings(
      jax.eval_shape(TX.init, params), sh.TRANSFORMER_RULES, mesh))(params)
  state = (params, opt_state)
  s_shard = sh.param_shardings(state, sh.TRANSFORMER_RULES, mesh)
  aux_shard = dict(logits=b_shard, grads=p_shard, sq_norms=b_shard, loss=rep, grad_norm=rep)

  # The learner step: NamedSharding in/out, donated state.
  step = jax.jit(_learner_step, static_argnums=0, in_shardings=(s_shard, b_shard),
                 out_shardings=(s_shard, aux_shard), donate_argnums=1)
  old_leaf = jax.tree.leaves(params)[0]
  (new_params, new_opt), aux = step(graphdef, state, batch_s)
  assert old_leaf.is_deleted()  # the state buffers were donated

  assert _max_diff(aux["logits"], ref["logits"]) < TOL
  assert _max_diff(aux["grads"], ref["grads"]) < TOL
  np.testing.assert_allclose(aux["sq_norms"], ref["sq_norms"], rtol=TOL, atol=TOL)
  np.testing.assert_allclose(aux["loss"], ref["loss"], rtol=TOL)
  np.testing.assert_allclose(aux["grad_norm"], ref["grad_norm"], rtol=TOL)
  assert _max_diff(new_params, ref_new_params) < TOL
  for x, s in zip(jax.tree.leaves((new_params, new_opt)), jax.tree.leaves(s_shard)):
    assert x.sharding.is_equivalent_to(s, x.ndim)


# ----------------------------------------------------------------------------- mesh config and rules


def test_mesh_config_validation():
  assert sh.MeshConfig((-1, 2, 1)).resolve(8) == (4, 2, 1)
  assert sh.MeshConfig((2, 2, 2)).resolve(8) == (2, 2, 2)
  with pytest.raises(ValueError, match="product of the axis sizes"):
    sh.MeshConfig((2, 2, 1)).resolve(8)
  with pytest.raises(ValueError, match="not divisible"):
    sh.MeshConfig((-1, 3, 1)).resolve(8)
  with pytest.raises(ValueError, match="3 entries"):
    sh.MeshConfig((8, 1))
  with pytest.raises(ValueError, match="at most one -1"):
    sh.MeshConfig((-1, -1, 2))
  with pytest.raises(ValueError, match="'fsdp'"):
    sh.MeshConfig((2, 0, 4))
  with pytest.raises(ValueError, match="must equal the device count"):
    sh.make_mesh(sh.MeshConfig((2, 2, 1)))  # 8 devices available


def test_make_mesh_on_device_subset():
  mesh = sh.make_mesh(sh.MeshConfig((2, 1, 2)), devices=jax.devices()[4:])
  assert set(mesh.devices.flat) == set(jax.devices()[4:])
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}


def test_unmatched_parameter_is_named():
  mesh = sh.make_mesh(sh.MeshConfig((8, 1, 1)))
  _, params = tf.split(tf.init(config.tiny_llama()))
  rules = [r for r in sh.TRANSFORMER_RULES if "lm_head" not in r[0]]
  with pytest.raises(ValueError, match=r"lm_head\.kernel"):
    sh.param_shardings(params, rules, mesh)


def test_non_divisible_dim_falls_back_to_replication():
  mesh = sh.make_mesh(sh.MeshConfig((1, 2, 4)))
  rules = [(r"w$", P("fsdp", "tensor"))]
  with pytest.warns(UserWarning, match="not divisible"):
    spec = sh.spec_for("layer.w", (64, 6), rules, mesh)  # 6 % 4 != 0
  assert spec == P("fsdp")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert sh.spec_for("layer.w", (64, 8), rules, mesh) == P("fsdp", "tensor")
    assert sh.spec_for("opt.count", (), rules, mesh) == P()  # scalars need no rule
  with pytest.raises(ValueError, match="rank 1"):
    sh.spec_for("layer.w", (64,), rules, mesh)
  with pytest.raises(ValueError, match="'model'"):
    sh.spec_for("layer.w", (64, 8), [(r"w$", P("model"))], mesh)


def test_rules_shard_optimizer_state_like_params():
  mesh = sh.make_mesh(sh.MeshConfig((1, 4, 2)))
  _, params = tf.split(tf.init(config.tiny_qwen2()))
  opt = jax.eval_shape(TX.init, params)
  specs = {sh.path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
      sh.param_specs(opt, sh.TRANSFORMER_RULES, mesh), is_leaf=lambda x: isinstance(x, P))[0]}
  mu = [v for k, v in specs.items() if k.endswith("mu.layers.0.mlp.up_proj.kernel")]
  assert mu == [P("fsdp", "tensor")]
  assert all(v == P() for k, v in specs.items() if k.endswith("count"))


def test_global_batch_and_rows():
  mesh = sh.make_mesh(sh.MeshConfig((2, 2, 2)))
  x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  assert sh.process_rows(8, sh.batch_sharding(mesh)) == slice(0, 8)  # one process owns all rows
  g = sh.make_global_batch({"x": x}, mesh, 8)["x"]
  np.testing.assert_array_equal(np.asarray(g), x)
  assert g.sharding.spec == P(("data", "fsdp"))
  with pytest.raises(ValueError, match="divisible by data\\*fsdp=4"):
    sh.make_global_batch({"x": x[:6]}, mesh, 6)


def test_split_devices():
  devs = jax.devices()
  sampler, learner = sh.split_devices(2, devs)
  assert sampler == devs[6:] and learner == devs[:6]
  assert not set(sampler) & set(learner)
  assert sh.split_devices(0, devs) == (devs, devs)  # colocated
  for bad in (8, -1, 1.5):
    with pytest.raises(ValueError, match="sampler_devices"):
      sh.split_devices(bad, devs)


def test_maybe_initialize_distributed_validation():
  assert sh.maybe_initialize_distributed(None, 1, 0) is False  # single process: no-op
  with pytest.raises(ValueError, match="process_id=2"):
    sh.maybe_initialize_distributed("127.0.0.1:1234", 2, 2)
  with pytest.raises(ValueError, match="num_processes"):
    sh.maybe_initialize_distributed("127.0.0.1:1234", None, 0)
  with pytest.raises(ValueError, match="host:port"):
    sh.maybe_initialize_distributed("localhost", 2, 0)
  with pytest.raises(ValueError, match="num_processes must be >= 1"):
    sh.maybe_initialize_distributed(None, 0, 0)
