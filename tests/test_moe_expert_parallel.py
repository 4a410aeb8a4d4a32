"""Expert parallelism (moe._expert_parallel, sharding.expert_local): under a mesh whose expert axis splits the experts,
each device runs only its own experts on its tokens and the partial outputs are summed over the axis. Outputs and
gradients equal the single-device block's, with and without replay, and the experts enter the per-device program
split (never gathered whole). Fake CPU devices (tests/conftest.py gives the process 8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from vcpo_jax import learner
from vcpo_jax import mesh as mesh_lib
from vcpo_jax import sharding as sh
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import moe
from vcpo_jax.model import transformer as tf

M, D, E, F, K = 24, 16, 8, 12, 2


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
  shapes = [(D, E), (E, D, F), (E, D, F), (E, F, D)]
  ws = [jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32) for s in shapes]
  recorded = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(M)]), jnp.int32)
  replay = jnp.asarray(rng.random(M) < 0.5)
  return x, ws, recorded, replay


def _block(x, router, gate, up, down, recorded=None, replay=None):
  return moe.sparse_moe(x, router, gate, up, down, top_k=K, norm_topk_prob=True, recorded=recorded, replay=replay).y


def _loss(x, router, gate, up, down, recorded=None, replay=None):
  y = _block(x, router, gate, up, down, recorded, replay)
  return jnp.sum(jnp.sin(y) * jnp.arange(D, dtype=jnp.float32))  # every output column weighted differently


def _mesh(shape):
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(shape), jax.devices()[: int(np.prod(shape))])


def _shard_map_in_specs(jaxpr) -> list:
  """in_specs of every shard_map in a (closed) jaxpr, nested ones included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      found.append(tuple(eqn.params["in_specs"]))
    for sub in jax.core.jaxprs_in_params(eqn.params):
      found.extend(_shard_map_in_specs(sub))
  return found


@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2), (1, 1, 4), (1, 2, 4), (2, 2, 2)])
@pytest.mark.parametrize("replayed", [False, True])
def test_expert_parallel_block_equals_single_device_with_gradients(shape, replayed):
  x, ws, recorded, replay = _inputs()
  rec = (recorded, replay) if replayed else (None, None)
  ref = _block(x, *ws, *rec)
  grad = jax.grad(_loss, argnums=(0, 1, 2, 3, 4))
  ref_g = grad(x, *ws, *rec)
  mesh = _mesh(shape)
  w_sh = [jax.device_put(w, jax.sharding.NamedSharding(mesh, P(sh.EXPERT_AXIS) if w.ndim == 3 else P())) for w in ws]
  with jax.set_mesh(mesh):
    assert sh.expert_shards(E) == shape[2]
    y = jax.jit(_block)(x, *w_sh, *rec)
    g = jax.jit(grad)(x, *w_sh, *rec)
    specs = _shard_map_in_specs(jax.make_jaxpr(_block)(x, *w_sh, *rec).jaxpr)
  # the three expert matmuls (rows, group sizes, weights) take their weights split over the expert axis
  assert sum(len(s) == 3 and s[2] == P(sh.EXPERT_AXIS) for s in specs) == 3, specs
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(ref))) > 0.1  # a nonzero output
  for name, mine, want in zip(("x", "router", "gate", "up", "down"), g, ref_g, strict=True):
    np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want))), err_msg=name)
    assert float(jnp.max(jnp.abs(want))) > 0, name


def test_without_an_expert_axis_each_device_runs_every_expert():
  """(2, 2, 1): no expert axis; tokens dispatched per device with every expert (sharding.batch_local), same values."""
  x, ws, _, _ = _inputs(1)
  ref = _block(x, *ws)
  mesh = _mesh((2, 2, 1))
  with jax.set_mesh(mesh):
    assert sh.expert_shards(E) == 1
    y = jax.jit(_block)(x, *ws)
    specs = _shard_map_in_specs(jax.make_jaxpr(_block)(x, *ws).jaxpr)
  assert specs and not any(len(s) == 3 and s[2] == P(sh.EXPERT_AXIS) for s in specs)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_expert_shards_needs_an_axis_that_divides_the_experts():
  assert sh.expert_shards(E) == 1  # no mesh
  with jax.set_mesh(_mesh((1, 1, 4))):
    assert sh.expert_shards(8) == 4 and sh.expert_shards(6) == 1  # 6 experts do not split over 4 devices


def test_model_log_probs_and_gradient_on_an_expert_parallel_mesh():
  """tiny_qwen3_moe's log-probs and their gradient on a (1, 1, 4) mesh (2 experts per device, parameters sharded
  by TRANSFORMER_RULES) equal the single-device ones."""
  cfg = mconfig.tiny_qwen3_moe()
  graphdef, params = tf.split(tf.init(cfg, seed=2))
  rng = np.random.default_rng(0)
  n, t = 4, 9
  batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (n, t)), jnp.int32)}
  batch["valid_mask"] = jnp.ones((n, t), bool)
  logp_fn = learner.make_logp_fn(graphdef)
  loss = lambda p, b: jnp.sum(logp_fn(p, b) * jnp.linspace(0.5, 1.5, t)[None])
  ref, ref_g = jax.value_and_grad(loss)(params, batch)
  mesh = _mesh((1, 1, 4))
  p_sh = jax.device_put(params, sh.param_shardings(params, sh.TRANSFORMER_RULES, mesh))
  experts = p_sh["layers"]["mlp"]["experts"]["gate_proj"].value
  assert experts.addressable_shards[0].data.shape[1] == cfg.num_experts // 4  # born split over the expert axis
  with jax.set_mesh(mesh):
    got, got_g = jax.jit(jax.value_and_grad(loss))(p_sh, jax.device_put(batch, sh.batch_sharding(mesh)))
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  for (path, want), mine in zip(jax.tree_util.tree_leaves_with_path(ref_g), jax.tree.leaves(got_g), strict=True):
    rel = float(jnp.linalg.norm(mine - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))
    assert rel < 1e-4, jax.tree_util.keystr(path)
