"""Sharded vs single-device equivalence on 8 fake CPU devices (conftest sets XLA_FLAGS).

For each mesh (data, fsdp, tensor) in (8,1,1), (2,2,2), (1,4,2) one jitted
function (NamedSharding in/out, donated state) computes the forward logits, the
gradient of a sequence-logprob surrogate, per-example squared gradient norms
(brute-force `jax.vmap(jax.grad)`) and one full learner step (`learner.make_train_step`: VCPO
coefficients, clip -> AdamW -> ESS scale). Every output must equal the
single-device result to 1e-5. A bug in the partition rules or in the batch
sharding (a batch split over "tensor" too, a gradient summed over the local
shard only, a permuted shard) gives errors of order 1e-2..1, not 1e-7.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from vcpo_jax import estimator, learner, optim
from vcpo_jax import mesh as mesh_lib
from vcpo_jax import sharding as sh
from vcpo_jax.model import config, policy
from vcpo_jax.model import transformer as tf

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2)]
N, T, G = 8, 12, 4  # N divisible by data*fsdp for every mesh above; P = N / G = 2 prompts
TOL = 1e-5

# ----------------------------------------------------------------------------- the learner-like step

# Adam's first step is g / (|g| + eps): its slope 1/eps amplifies float reordering
# noise on gradient components near zero (with eps = 1e-8 a 1e-10 difference in a
# 1e-9 gradient moves the update by 10% of lr). eps = 1e-6 bounds that
# amplification so that the comparison tests the sharding, not float noise.
TX = optim.make_optimizer(1e-3, weight_decay=0.01, clip_norm=1.0, eps=1e-6)
LEARNER_CFG = learner.LearnerConfig(method=estimator.method_from_preset("vcpo"), grad_path="ghost")


def _batch(cfg, seed=0):
  """A learner batch without behavior_logp (added from the policy in `_reference`)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (N, T), dtype=np.int32)
  valid = np.arange(T)[None] < rng.integers(T // 2, T + 1, N)[:, None]  # right padding
  loss_mask = valid & (np.arange(T)[None] >= 3)  # "response" tokens after a 3-token prompt
  return dict(
    tokens=tokens,
    valid_mask=valid,
    loss_mask=loss_mask.astype(np.float32),
    rewards=rng.integers(0, 2, N).astype(np.float32),
    group_id=(np.arange(N) // G).astype(np.int32),
    coef=rng.normal(size=N).astype(np.float32),
  )  # surrogate coefficients (advantage-like)


def _score_n(graphdef, params, batch):
  """Per-trajectory score sum_t logp_nt * mask_nt -> [N]."""
  logp_nt = tf.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid_mask"])
  return jnp.sum(logp_nt * batch["loss_mask"], axis=1)


def _loss(graphdef, params, batch):
  """Sequence-logprob surrogate -mean_n c_n * score_n."""
  return -jnp.mean(batch["coef"] * _score_n(graphdef, params, batch))


def _sq_tree_norm(tree):
  return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def _vmap_sq_norms(graphdef, params, batch):
  """||grad_theta score_n||^2 for each n, brute force with jax.vmap(jax.grad) -> [N]."""

  def one(ex):
    ex1 = jax.tree.map(lambda x: x[None], ex)
    return _sq_tree_norm(jax.grad(lambda p: _score_n(graphdef, p, ex1)[0])(params))

  return jax.vmap(one)(batch)


def _learner_step(graphdef, state, batch):
  """The real learner step plus every intermediate the test compares.

  Returns (new TrainState, aux): aux = logits [N, T, V], surrogate grads, [N]
  squared score norms (brute-force vmap) and the step's scalar metrics. The
  learner step runs the ghost path (norms -> OPOB -> VCPO gradient), so its
  outputs also check the ghost norms under sharding; the ghost path equals the
  estimator's vmap reference on one device (tests/test_grad_norms.py). One path
  per quantity keeps compiles short.
  """
  params = state.params
  pos, mask = tf.padded_positions_and_mask(batch["valid_mask"])
  aux = dict(
    logits=tf.forward(graphdef, params, batch["tokens"], pos, mask)[0],
    grads=jax.grad(lambda p: _loss(graphdef, p, batch))(params),
    sq_norms=_vmap_sq_norms(graphdef, params, batch),
  )
  new_state, metrics = learner.make_train_step(graphdef, TX, LEARNER_CFG)(state, batch)
  return new_state, dict(aux, metrics=metrics)


def _max_diff(a, b):
  return max(
    float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


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
    graphdef, params = tf.split(tf.init(cfg, seed=3))
    params = jax.device_put(params, jax.devices()[0])
    batch = _batch(cfg)
    # Off-policy data: behavior log-probs = policy log-probs + noise, so that the IS
    # weights, ESS learning-rate scale and OPOB baseline are all non-trivial.
    logp = np.asarray(
      jax.jit(tf.sequence_logprobs, static_argnums=0)(graphdef, params, batch["tokens"], batch["valid_mask"])
    )
    noise = np.random.default_rng(1).normal(scale=0.3, size=logp.shape).astype(np.float32)
    batch["behavior_logp"] = (logp + noise) * batch["loss_mask"]
    state = learner.init_state(params, TX)
    new_state, aux = jax.jit(_learner_step, static_argnums=0)(graphdef, state, batch)
    _REFERENCE[name] = (cfg, batch, params, new_state, aux)
  return _REFERENCE[name]


@pytest.mark.parametrize("name,shape", CASES, ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c)))
@pytest.mark.slow
def test_sharded_equals_single_device(name, shape):
  cfg, batch, ref_params, ref_state, ref = _reference(name)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(shape))
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
  graphdef, params = policy.init_sharded(cfg, 3, mesh)

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
  state_shapes = jax.eval_shape(lambda p: learner.init_state(p, TX), params)
  s_shard = sh.param_shardings(state_shapes, sh.TRANSFORMER_RULES, mesh)
  state = jax.jit(lambda p: learner.init_state(p, TX), out_shardings=s_shard)(params)
  aux_shard = dict(logits=b_shard, grads=p_shard, sq_norms=b_shard, metrics=rep)

  # The learner step: NamedSharding in/out, donated state.
  step = jax.jit(
    _learner_step,
    static_argnums=0,
    in_shardings=(s_shard, b_shard),
    out_shardings=(s_shard, aux_shard),
    donate_argnums=1,
  )
  old_leaf = jax.tree.leaves(state)[0]
  with jax.set_mesh(mesh):  # traced under the mesh: the model's activation constraints are active
    new_state, aux = step(graphdef, state, batch_s)
  assert old_leaf.is_deleted()  # the state buffers were donated

  for key in ("logits", "grads"):
    assert _max_diff(aux[key], ref[key]) < TOL, key
  np.testing.assert_allclose(aux["sq_norms"], ref["sq_norms"], rtol=TOL, atol=TOL)
  for key, value in ref["metrics"].items():
    np.testing.assert_allclose(aux["metrics"][key], value, rtol=TOL, atol=TOL, err_msg=key)
  assert float(ref["metrics"]["lr_scale"]) < 0.99  # the ESS scaling is really exercised
  assert int(new_state.step) == 1 and float(aux["metrics"]["nonfinite"]) == 0.0
  assert _max_diff(new_state.params, ref_state.params) < TOL
  assert _max_diff(new_state.opt_state, ref_state.opt_state) < TOL
  for x, s in zip(jax.tree.leaves(new_state), jax.tree.leaves(s_shard)):
    assert x.sharding.is_equivalent_to(s, x.ndim)


# ----------------------------------------------------------------------------- activation sharding


def _logp_grad_step(cfg, mesh, n, t):
  """jit(value_and_grad(sum of sequence log-probs)) with the learner's shardings, lowered abstractly."""
  graphdef, abstract = tf.split(nnx.eval_shape(lambda: tf.init(cfg, 0)))
  p_shard, b_shard = sh.param_shardings(abstract, sh.TRANSFORMER_RULES, mesh), sh.batch_sharding(mesh)
  loss = lambda p, tok, valid: jnp.sum(tf.sequence_logprobs(graphdef, p, tok, valid))
  args = (abstract, jax.ShapeDtypeStruct((n, t), jnp.int32), jax.ShapeDtypeStruct((n, t), jnp.bool_))
  return sh.MeshJit(mesh, jax.value_and_grad(loss), in_shardings=(p_shard, b_shard, b_shard)).lower(*args)


def test_batch_dependent_memory_falls_with_fsdp():
  """Temp bytes per device of a 1-layer forward + backward fall ~4x from 2 to 8 fsdp devices.

  Parameters are tiny here (0.1 MiB); the temporaries (activations, [N, T, V] logits and
  their gradients, ~110 MiB on 2 devices) all depend on the batch. Without the model's
  activation constraints the compiler gathered part of the batch: 2 -> 8 devices only
  cut the temporaries 1.76x (119 -> 68 MB); with them 3.9x (110 -> 28 MB).
  """
  cfg = config.tiny_qwen2(vocab_size=512, num_layers=1, hidden_size=64, intermediate_size=256)
  temp = {}
  for d in (2, 8):
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, d, 1)), jax.devices()[:d])
    temp[d] = _logp_grad_step(cfg, mesh, 32, 256).compile().memory_analysis().temp_size_in_bytes
  assert temp[2] > 50e6, temp  # the batch-dependent part dominates
  assert temp[8] < temp[2] / 3.5, temp  # ideal: / 4


def test_activation_constraints_follow_the_mesh():
  """No mesh: no constraint in the program. A (1, 2, 2) mesh: batch over fsdp, heads and MLP over tensor."""
  cfg = config.tiny_qwen2(num_layers=1)
  graphdef, params = tf.split(nnx.eval_shape(lambda: tf.init(cfg, 0)))
  tok, valid = jax.ShapeDtypeStruct((4, 8), jnp.int32), jax.ShapeDtypeStruct((4, 8), jnp.bool_)
  plain = jax.jit(tf.sequence_logprobs, static_argnums=0).lower(graphdef, params, tok, valid).as_text()
  assert "sharding_constraint" not in plain
  text = _logp_grad_step(cfg, mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 2)), jax.devices()[:4]), 4, 8).as_text()
  assert '[{"data", "fsdp"}, {}, {}]' in text  # residual stream [B, T, D]: batch split, D whole
  assert '[{"data", "fsdp"}, {}, {"tensor"}, {}]' in text  # q/k/v [B, T, heads, H]
  assert '[{"data", "fsdp"}, {}, {"tensor"}]' in text  # SwiGLU hidden [B, T, F]


def test_constrain_drops_axes_that_do_not_divide():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((2, 2, 2)))
  with jax.set_mesh(mesh):
    text = jax.jit(lambda x: sh.constrain(x, sh.HEADS_BTNH)).lower(jnp.ones((1, 3, 4, 2))).as_text()
  assert "sharding_constraint" in text and '[{?}, {}, {"tensor"}, {}]' in text  # batch of 1: left to XLA
  assert sh.constrain(jnp.ones((4, 2)), sh.RESIDUAL_BTD).shape == (4, 2)  # no mesh, or lower rank: identity


# ----------------------------------------------------------------------------- mesh config and rules


def test_mesh_config_validation():
  assert mesh_lib.MeshConfig((-1, 2, 1)).resolve(8) == (4, 2, 1)
  assert mesh_lib.MeshConfig((2, 2, 2)).resolve(8) == (2, 2, 2)
  with pytest.raises(ValueError, match="product of the axis sizes"):
    mesh_lib.MeshConfig((2, 2, 1)).resolve(8)
  with pytest.raises(ValueError, match="not divisible"):
    mesh_lib.MeshConfig((-1, 3, 1)).resolve(8)
  with pytest.raises(ValueError, match="3 entries"):
    mesh_lib.MeshConfig((8, 1))
  with pytest.raises(ValueError, match="at most one -1"):
    mesh_lib.MeshConfig((-1, -1, 2))
  with pytest.raises(ValueError, match="'fsdp'"):
    mesh_lib.MeshConfig((2, 0, 4))
  with pytest.raises(ValueError, match="must equal the device count"):
    mesh_lib.make_mesh(mesh_lib.MeshConfig((2, 2, 1)))  # 8 devices available


def test_make_mesh_on_device_subset():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((2, 1, 2)), devices=jax.devices()[4:])
  assert set(mesh.devices.flat) == set(jax.devices()[4:])
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}


def test_unmatched_parameter_is_named():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((8, 1, 1)))
  _, params = tf.split(tf.init(config.tiny_llama()))
  rules = [r for r in sh.TRANSFORMER_RULES if "lm_head" not in r[0]]
  with pytest.raises(ValueError, match=r"lm_head\.kernel"):
    sh.param_shardings(params, rules, mesh)


def test_non_divisible_dim_falls_back_to_replication():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 4)))
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
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 4, 2)))
  _, params = tf.split(tf.init(config.tiny_qwen2()))
  opt = jax.eval_shape(TX.init, params)  # chain(clip, adamw, scale_by_ess) state
  specs = {
    sh.path_str(p): s
    for p, s in jax.tree_util.tree_flatten_with_path(
      sh.param_specs(opt, sh.TRANSFORMER_RULES, mesh), is_leaf=lambda x: isinstance(x, P)
    )[0]
  }
  mu = [v for k, v in specs.items() if k.endswith("mu.layers.mlp.up_proj.kernel")]
  assert mu == [P(None, "fsdp", "tensor")]  # stacked [L, D, F]: the layer axis never split
  assert all(v == P() for k, v in specs.items() if k.endswith("count"))


def test_global_batch_and_rows():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((2, 2, 2)))
  x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  assert mesh_lib.process_rows(8, sh.batch_sharding(mesh)) == slice(0, 8)  # one process owns all rows
  g = mesh_lib.make_global_batch({"x": x}, mesh, 8)["x"]
  np.testing.assert_array_equal(np.asarray(g), x)
  assert g.sharding.spec == P(("data", "fsdp"))
  with pytest.raises(ValueError, match="divisible by data\\*fsdp=4"):
    mesh_lib.make_global_batch({"x": x[:6]}, mesh, 6)


def test_split_devices():
  devs = jax.devices()
  sampler, learner = mesh_lib.split_devices(2, devs)
  assert sampler == devs[6:] and learner == devs[:6]
  assert not set(sampler) & set(learner)
  assert mesh_lib.split_devices(0, devs) == (devs, devs)  # colocated
  assert mesh_lib.split_devices("", devs) == (devs, devs)
  sampler, learner = mesh_lib.split_devices("1, 3", devs)
  assert [d.id for d in sampler] == [1, 3] and [d.id for d in learner] == [0, 2, 4, 5, 6, 7]
  assert mesh_lib.split_devices([7], devs)[0] == [devs[7]]
  for bad in (8, -1, 1.5, True, "a,b", "9", "1,1", list(range(8))):
    with pytest.raises(ValueError, match="sampler_devices"):
      mesh_lib.split_devices(bad, devs)


def test_maybe_initialize_distributed_validation():
  with pytest.raises(ValueError, match="process_id=2"):
    mesh_lib.maybe_initialize_distributed("127.0.0.1:1234", 2, 2)
  with pytest.raises(ValueError, match="num_processes"):
    mesh_lib.maybe_initialize_distributed("127.0.0.1:1234", None, 0)
  with pytest.raises(ValueError, match="host:port"):
    mesh_lib.maybe_initialize_distributed("localhost", 2, 0)
  with pytest.raises(ValueError, match="num_processes must be >= 1"):
    mesh_lib.maybe_initialize_distributed(None, 0, 0)
  assert mesh_lib.maybe_initialize_distributed("127.0.0.1:1234", 1, 0) is False  # single process: no-op
  assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("n,shape", [(1, (1, 1, 1)), (4, (1, 2, 2))], ids=lambda c: str(c))
def test_init_sharded_equals_host_init_bit_for_bit(n, shape):
  """The trainer's born-sharded parameters are the host initializer's, bit for bit, on 1 and 4 devices.

  Without the barrier in transformer._INIT, XLA folds the 0.02 scale into the normal sampler under jit
  and about a quarter of the weights differ in the last bit from the eager values (7e-9 at 0.02)."""
  cfg = config.tiny_qwen2().replace(num_layers=2)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(shape), devices=jax.devices()[:n])
  graphdef, params = policy.init_sharded(cfg, 7, mesh)
  ref_graphdef, ref = tf.split(tf.init(cfg, seed=7))
  assert graphdef == ref_graphdef
  leaves, ref_leaves = jax.tree.leaves(params), jax.tree.leaves(ref)
  assert len(leaves) == len(ref_leaves) > 10
  for x, r in zip(leaves, ref_leaves):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(r))
  emb = params["embed_tokens"]["embedding"][...]
  assert set(emb.sharding.device_set) == set(jax.devices()[:n])  # placed on the mesh, not on one device
  if shape[1] * shape[2] > 1:  # and really split: each device holds 1 / (fsdp * tensor) of the table
    assert emb.addressable_shards[0].data.size == emb.size // (shape[1] * shape[2])


def test_build_mesh_keeps_the_sampler_devices_out_and_names_the_field():
  mesh = mesh_lib.build_mesh((-1, 1, 1), 12, sampler_devices="6,7")  # 8 fake devices: the learner gets 0..5
  assert [d.id for d in mesh.devices.flat] == [0, 1, 2, 3, 4, 5]
  assert dict(mesh_lib.build_mesh((2, -1, 1), 8).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
  with pytest.raises(ValueError, match=r"^config\.task\.prompts_per_step: the batch N = P\*G = 12 .* data\*fsdp = 8"):
    mesh_lib.build_mesh((-1, 1, 1), 12)
  with pytest.raises(ValueError, match=r"^config\.mesh\.shape: .*must equal the device count"):
    mesh_lib.build_mesh((2, 2, 1), 8)


# ----------------------------------------------------------------------------- no silent replication


def _sharded_step_inputs(shape=(8, 1, 1)):
  cfg = CONFIGS["qwen2"]
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(shape))
  graphdef, params = policy.init_sharded(cfg, 3, mesh)
  s_shard = sh.param_shardings(jax.eval_shape(lambda p: learner.init_state(p, TX), params), sh.TRANSFORMER_RULES, mesh)
  state = jax.jit(lambda p: learner.init_state(p, TX), out_shardings=s_shard)(params)
  batch = _batch(cfg)
  batch["behavior_logp"] = np.full(batch["tokens"].shape, -1.0, np.float32) * batch["loss_mask"]
  return mesh, graphdef, state, jax.device_put(batch, sh.batch_sharding(mesh)), s_shard


def test_plain_jit_of_the_learner_step_off_its_mesh_is_a_one_line_error():
  _mesh, graphdef, state, batch, _ = _sharded_step_inputs()
  step = learner.make_train_step(graphdef, TX, LEARNER_CFG)
  with pytest.raises(ValueError, match=r"traced without a mesh .*'data': 8.*sharding\.MeshJit") as err:
    jax.jit(step).lower(state, batch)  # tracing is enough: it fails before any compile
  assert "\n" not in str(err.value)
  # abstract inputs (benchmarks/memory.py's ShapeDtypeStructs) carry their mesh too
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), (state, batch))
  with pytest.raises(ValueError, match="traced without a mesh"):
    jax.jit(step).lower(*abstract)


def test_the_learner_step_traces_under_its_mesh_and_on_one_device():
  mesh, graphdef, state, batch, s_shard = _sharded_step_inputs()
  step = learner.make_train_step(graphdef, TX, LEARNER_CFG)
  lowered = sh.MeshJit(mesh, step, in_shardings=(s_shard, sh.batch_sharding(mesh))).lower(state, batch)
  assert "sharding_constraint" in lowered.as_text()  # the activation constraints are in the program
  with jax.set_mesh(mesh):
    jax.jit(step).lower(state, batch)
  # one device (the CPU tests, a notebook on one accelerator): nothing to replicate, a plain jit traces
  _, params1 = tf.split(tf.init(CONFIGS["qwen2"], seed=3))
  jax.jit(step).lower(learner.init_state(params1, TX), jax.device_get(batch))


def test_require_mesh_reads_the_inputs_mesh():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((2, 2, 2)))
  x = jax.device_put(jnp.ones((8, 4)), sh.batch_sharding(mesh))
  sh.require_mesh({"host": np.ones(3), "n": 3, "one_device": jnp.ones(2)}, "f")  # nothing on a mesh
  with pytest.raises(
    ValueError,
    match=r"^f is traced without a mesh but its inputs live on the mesh \{'data': 2, 'fsdp': 2, 'tensor': 2\}",
  ):
    sh.require_mesh({"x": x}, "f")
  with jax.set_mesh(mesh):
    sh.require_mesh({"x": x}, "f")
  jax.jit(lambda a: (sh.require_mesh(a, "f"), a)[1]).lower(jnp.ones((8, 4)))
  with pytest.raises(ValueError, match="traced without a mesh"):
    jax.jit(lambda a: (sh.require_mesh(a, "f"), a)[1]).lower(x)
