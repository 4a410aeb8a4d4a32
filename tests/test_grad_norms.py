"""Ghost norms: exact per-example ||s_n||^2 and the one-backward VCPO gradient.

References: per_example_sq_grad_norms (vmap of per-example grads, itself checked
against a python loop), a one-backward-per-trajectory loop, jax.grad of the surrogate,
and learner.policy_gradient("vmap"). Tiny Qwen2 (tied head, q/k/v bias) and Llama
(untied) models, left-padded prompts, right-padded responses, loss on the
response only, tokens drawn from a small range so that embedding rows repeat
within a sequence (the shared-row and tied cross terms are exercised).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vcpo_jax import estimator, learner
from vcpo_jax import grad_norms as gn
from vcpo_jax.model import config
from vcpo_jax.model import transformer as tf
from vcpo_jax.model.rope import RopeScaling

N, P_LEN, R_LEN = 6, 6, 7
T = P_LEN + R_LEN
V = 144
# One layer keeps compiles short; every kind of tap (linear +- bias, scale, embed, tied/untied head) occurs.
# The log-prob head is chunked (5 positions, 40 vocab entries: neither divides T - 1 = 12 or V), so the
# references (vmap, jax.grad) differentiate through the chunked scans and the ghost path reads its lse.
CHUNKS = dict(logprob_chunk=5, logprob_vocab_chunk=40)
YARN = RopeScaling("yarn", factor=4.0, original_max_position=4)
CONFIGS = {
  "qwen2": config.tiny_qwen2(vocab_size=V, num_layers=1, **CHUNKS),
  "llama": config.tiny_llama(vocab_size=V, num_layers=1, **CHUNKS),
  # Qwen3: per-head q/k RMSNorm scales [H] (tapped over [B, T, heads, H]), yarn RoPE, H != D / heads.
  "qwen3": config.tiny_qwen3(vocab_size=V, num_layers=1, rope_scaling=YARN, **CHUNKS),
}
# (model, method, per-device budget): budget 0 forces the smallest temporaries, i.e. the ghost head's
# own vocab chunks of 128 (144 = 128 + a clamped, overlap-masked chunk), direct one example at a time,
# and the gram form of the embedding norm (with the tied [N, M, T] cross term); with a materialized tied
# head and the default budget the scatter form (T^2 = 169 > T + V = 157) and ||B_n + C_n||^2.
CASES = [
  ("qwen2", "gram", 0),
  ("qwen2", "direct", 0),
  ("qwen2", "materialize", gn.DEFAULT_BUDGET_BYTES),
  ("llama", "gram", gn.DEFAULT_BUDGET_BYTES),
  ("llama", "direct", gn.DEFAULT_BUDGET_BYTES),
  ("llama", "materialize", 0),
  ("qwen2", "auto", gn.DEFAULT_BUDGET_BYTES),
  ("qwen3", "gram", 0),
  ("qwen3", "direct", gn.DEFAULT_BUDGET_BYTES),
]


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b) / np.abs(b)))


def _tree_rel(ga, gb):
  """Global relative error ||ga - gb|| / ||gb|| over all leaves (and matching structure)."""
  assert jax.tree.structure(ga) == jax.tree.structure(gb)
  num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)))
  den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(gb))
  return (num / den) ** 0.5


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  # Few distinct ids (rows repeat) spread over every vocab chunk, overlaps of clamped chunks included.
  ids = np.array([0, 3, 39, 40, 90, 101, 120, 127, 128, 135, 140, 143])
  tokens = ids[rng.integers(0, len(ids), (N, T))].astype(np.int32)
  prompt_len = rng.integers(2, P_LEN + 1, N)
  resp_len = rng.integers(1, R_LEN + 1, N)
  prompt = np.arange(P_LEN)[None] >= P_LEN - prompt_len[:, None]  # left-padded
  resp = np.arange(R_LEN)[None] < resp_len[:, None]  # right-padded
  loss_mask = np.concatenate([np.zeros_like(prompt), resp], 1)
  valid = np.concatenate([prompt, resp], 1)
  tokens = np.where(valid, tokens, 0)
  group_id = np.repeat(np.arange(N // 3), 3).astype(np.int32)
  return dict(
    tokens=jnp.asarray(tokens),
    valid_mask=jnp.asarray(valid),
    loss_mask=jnp.asarray(loss_mask, jnp.float32),
    behavior_logp=jnp.asarray(rng.normal(-2.5, 0.5, (N, T)) * loss_mask, jnp.float32),
    rewards=jnp.asarray(rng.integers(0, 2, N), jnp.float32).at[0].set(1.0).at[1].set(0.0),
    group_id=jnp.asarray(group_id),
  )


def _prepare(cfg):
  """(logp_fn, params, batch, brute-force vmap norms) of a model built from `cfg`."""
  graphdef, params = tf.split(tf.init(cfg, seed=1))
  # Random (non-identity) norm scales and biases so every closed form is exercised.
  keys = iter(jax.random.split(jax.random.key(7), 100))
  # (Scales and biases: [D] outside the blocks, [L, ...] inside them, the blocks' parameters being stacked.)
  vector = lambda path, x: x.ndim == 1 or (x.ndim == 2 and str(path[0].key) == "layers")
  params = jax.tree_util.tree_map_with_path(
    lambda path, x: x + 0.1 * jax.random.normal(next(keys), x.shape) if vector(path, x) else x, params
  )
  logp_fn = gn.sequence_logp_fn(graphdef)
  batch = _batch()
  ref = jax.jit(gn.vmap_sq_norms, static_argnums=0)(logp_fn, params, batch, batch["loss_mask"])
  return logp_fn, params, batch, ref


@functools.lru_cache(maxsize=None)
def _setup(name):
  return _prepare(CONFIGS[name])


def _random_coef(logp_nt, sq_n):
  coef = jnp.asarray(np.random.default_rng(3).normal(size=N), jnp.float32)
  return coef, {"sq": sq_n}


@functools.lru_cache(maxsize=None)
def _ghost(name, method, budget):
  logp_fn, params, batch, _ = _setup(name)
  fn = jax.jit(
    lambda p, b: gn.ghost_sq_norms_and_grad(
      logp_fn, p, b, b["loss_mask"], _random_coef, method=method, memory_budget_bytes=budget
    )
  )
  return fn(params, batch)


@functools.lru_cache(maxsize=None)
def _surrogate_value_and_grad(name):
  """(loss, grads) of jax.value_and_grad of the surrogate -sum_n coef_n sum_t mask_nt logp_nt: one compile per
  model, shared by every case of that model (the reference does not depend on the method or budget)."""
  logp_fn, params, batch, _ = _setup(name)
  coef, _ = _random_coef(None, None)
  mask = batch["loss_mask"]

  def surrogate(p):
    return -jnp.sum(coef * jnp.sum(mask * logp_fn(p, batch), axis=1))

  return jax.jit(jax.value_and_grad(surrogate))(params)


@functools.lru_cache(maxsize=None)
def _vmap_policy_gradient(name, preset, overrides=()):
  """learner.policy_gradient("vmap") (the brute-force reference) of a preset: one compile for both `passes`."""
  logp_fn, params, batch, _ = _setup(name)
  cfg = estimator.method_from_preset(preset, dict(overrides))
  return jax.jit(learner.policy_gradient("vmap"), static_argnums=(0, 3))(logp_fn, params, batch, cfg)


@pytest.mark.slow
def test_cases_cover_the_head_paths():
  """The CASES really exercise chunked head scans and blocked direct (plans read off the shapes)."""
  logp_fn, params, batch, _ = _setup("qwen2")
  infos, ins, _, outs = gn._tapped_forward(logp_fn, params, batch)
  assert [i.kind for i in infos.values()].count("head") == 1
  small = gn.plan_layers(infos, ins, outs, "direct", 0)
  head = next(p for p in small.values() if p.kind == "head")
  assert (head.block, head.dout, head.t) == (128, V, T - 1)
  assert all(p.block == 1 for p in small.values() if p.kind == "linear")
  big = gn.plan_layers(infos, ins, outs, "direct", gn.DEFAULT_BUDGET_BYTES)
  assert all(p.block == (V if p.kind == "head" else N) for p in big.values())


@pytest.mark.parametrize("name,method,budget", CASES)
@pytest.mark.slow
def test_ghost_norms_equal_vmap_reference(name, method, budget):
  _, _, batch, ref = _setup(name)
  res = _ghost(name, method, budget)
  assert _rel(res.sq_norms_n, ref) < 1e-4
  # Norms differ a lot across examples (lengths differ), so this is not a trivial match.
  assert float(jnp.max(ref) / jnp.min(ref)) > 1.5
  assert res.aux["sq"].shape == (N,)


@pytest.mark.parametrize("name,method,budget", CASES)
@pytest.mark.slow
def test_fast_gradient_equals_jax_grad_of_surrogate(name, method, budget):
  _, params, _, _ = _setup(name)
  res = _ghost(name, method, budget)
  loss, grads = _surrogate_value_and_grad(name)
  assert _tree_rel(res.grads, grads) < 1e-5
  np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
  # The gradient is the params' own type (nnx.State), so optax can consume it as is.
  assert type(res.grads) is type(params)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_taps_grad_equals_jax_grad_of_surrogate(name):
  """The fair plain step (same taps-based backward, fixed coefficients, no norms) is the same gradient."""
  logp_fn, params, batch, _ = _setup(name)
  coef, _ = _random_coef(None, None)
  res = jax.jit(lambda p, b: gn.taps_grad(logp_fn, p, b, b["loss_mask"], coef, memory_budget_bytes=0))(params, batch)
  _, grads = _surrogate_value_and_grad(name)  # jax.grad of -sum_n coef_n sum_t mask_nt logp_nt
  assert _tree_rel(res.grads, grads) < 1e-5 and res.sq_norms_n is None


@pytest.mark.parametrize("name,method", [("qwen2", "direct"), ("llama", "materialize"), ("qwen3", "gram")])
@pytest.mark.slow
def test_ghost_on_a_mesh_equals_reference(name, method):
  """Under a 2-device FSDP mesh (3 rows per device): per-device blocks of one row (the direct form's
  regrouped map), gradients constrained to their parameters' layouts; same norms and gradient."""
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding

  logp_fn, params, batch, ref = _setup(name)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 1)), jax.devices()[:2])
  params_m = jax.device_put(params, sharding.param_shardings(params, sharding.TRANSFORMER_RULES, mesh))
  batch_m = jax.device_put(batch, sharding.batch_sharding(mesh))
  fn = lambda p, b: gn.ghost_sq_norms_and_grad(
    logp_fn, p, b, b["loss_mask"], _random_coef, method=method, memory_budget_bytes=0
  )
  with jax.set_mesh(mesh):
    res = jax.jit(fn)(params_m, batch_m)
  assert _rel(res.sq_norms_n, ref) < 1e-4
  assert _tree_rel(res.grads, _ghost(name, method, 0).grads) < 1e-5


@functools.lru_cache(maxsize=None)
def _setup2(name, remat):
  """_setup's model and batch at 2 layers with remat on or off (the two-pass step's cases)."""
  return _prepare(CONFIGS[name].replace(num_layers=2, remat=remat))


@functools.lru_cache(maxsize=None)
def _two_pass(name, method, budget, remat):
  """The jitted passes=2 ghost step on _setup2's model and batch (single device)."""
  logp_fn, params, batch, _ = _setup2(name, remat)
  fn = lambda p, b: gn.ghost_sq_norms_and_grad(
    logp_fn, p, b, b["loss_mask"], _random_coef, method=method, memory_budget_bytes=budget, passes=2
  )
  return jax.jit(fn)(params, batch)


@pytest.mark.parametrize(
  "name,method,budget,remat",
  [
    ("qwen2", "auto", gn.DEFAULT_BUDGET_BYTES, "none"),
    ("qwen2", "direct", 0, "block"),
    ("llama", "gram", 0, "block"),
    ("qwen3", "direct", 0, "block"),
  ],
)
@pytest.mark.slow
def test_two_pass_equals_vmap_reference_and_jax_grad(name, method, budget, remat):
  """passes=2 (norm sinks inside the first backward, then the update's backward): 2 layers, remat on and off,
  left-padded prompts and right-padded responses; tied (qwen2: the cross term) and untied heads."""
  logp_fn, params, batch, ref = _setup2(name, remat)
  res = _two_pass(name, method, budget, remat)
  assert _rel(res.sq_norms_n, ref) < 1e-4 and float(jnp.max(ref) / jnp.min(ref)) > 1.5
  coef, _ = _random_coef(None, None)
  surrogate = lambda p: -jnp.sum(coef * jnp.sum(batch["loss_mask"] * logp_fn(p, batch), axis=1))
  loss, grads = jax.jit(jax.value_and_grad(surrogate))(params)
  assert _tree_rel(res.grads, grads) < 1e-5 and type(res.grads) is type(params)
  np.testing.assert_allclose(res.loss, loss, rtol=1e-5)


@pytest.mark.slow
def test_two_pass_on_a_mesh_equals_reference():
  """passes=2 under a 2-device FSDP mesh, direct norms one row per device at a time (the regrouped map)."""
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding

  logp_fn, params, batch, ref = _setup2("qwen2", "block")
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 1)), jax.devices()[:2])
  params_m = jax.device_put(params, sharding.param_shardings(params, sharding.TRANSFORMER_RULES, mesh))
  batch_m = jax.device_put(batch, sharding.batch_sharding(mesh))
  fn = lambda p, b: gn.ghost_sq_norms_and_grad(
    logp_fn, p, b, b["loss_mask"], _random_coef, method="direct", memory_budget_bytes=0, passes=2
  )
  with jax.set_mesh(mesh):
    res = jax.jit(fn)(params_m, batch_m)
  assert _rel(res.sq_norms_n, ref) < 1e-4
  # The same step on one device (its gradient is checked against jax.grad above): one compile shared with that test.
  assert _tree_rel(res.grads, _two_pass("qwen2", "direct", 0, "block").grads) < 1e-5


def test_two_pass_bad_choices_raise():
  logp_fn, params, batch, _ = _setup("llama")
  with pytest.raises(ValueError, match="passes=3"):
    gn.ghost_sq_norms_and_grad(logp_fn, params, batch, batch["loss_mask"], _random_coef, passes=3)
  with pytest.raises(ValueError, match="materialize"):
    gn.ghost_sq_norms_and_grad(logp_fn, params, batch, batch["loss_mask"], _random_coef, method="materialize", passes=2)
  with pytest.raises(ValueError, match="learner.ghost_passes=0"):
    learner.LearnerConfig(method=estimator.method_from_preset("vcpo"), ghost_passes=0)


@pytest.mark.slow
def test_one_pass_bytes_and_auto_passes():
  """one_pass_bytes: the (A, D) of the body taps, by hand for a 1-layer model (distinct inputs once), linear
  in rows, per layer and split over batch shards; passes="auto" takes 1 under the budget, 2 above, and gives
  the explicit choice's numbers."""
  cfg = config.tiny_llama(vocab_size=V, num_layers=1, **CHUNKS)
  logp_fn, params, batch, _ = _setup("llama")
  n, t = batch["tokens"].shape
  d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  # A: the embedding's token ids (int32); per block the residual into each RMSNorm (2 x d), the normed input
  # shared by q / k / v and by gate / up (2 x d), o's input (q), down's input (f); the final norm's input (d).
  # D (float32): the embedding (d); per block the two norms (2 x d), q, k, v, o (d), gate, up (2 x f), down
  # (d); the final norm (d). The head's (A, D) are in neither count (a vocab-chunk scan in both passes).
  a = 4 + 4 * (4 * d + q + f + d)
  dd = 4 * (d + 2 * d + q + 2 * kv + d + 2 * f + d + d)
  assert gn.one_pass_bytes(logp_fn, params, batch, batch_shards=1) == n * t * (a + dd)
  assert gn.one_pass_bytes(logp_fn, params, batch, batch_shards=2) == n * t * (a + dd) // 2
  half = jax.tree.map(lambda x: x[: n // 2], batch)
  assert 2 * gn.one_pass_bytes(logp_fn, params, half, batch_shards=1) == n * t * (a + dd)
  block = 4 * (4 * d + q + f) + 4 * (2 * d + q + 2 * kv + d + 2 * f + d)  # one more layer's (A, D) per token

  def nbytes(layers, remat):
    graphdef, p = tf.split(tf.init(cfg.replace(num_layers=layers, remat=remat), seed=1))
    return gn.one_pass_bytes(gn.sequence_logp_fn(graphdef), p, batch, batch_shards=1)

  assert nbytes(2, "none") - nbytes(1, "none") == n * t * block
  # Under block remat too: the scanned body returns each distinct input once (q / k / v and gate / up share).
  assert nbytes(2, "block") - nbytes(1, "block") == n * t * block
  need = n * t * (a + dd)
  assert gn.choose_passes(logp_fn, params, batch, "auto", need, batch_shards=1) == 1
  assert gn.choose_passes(logp_fn, params, batch, "auto", need - 1, batch_shards=1) == 2
  assert gn.choose_passes(logp_fn, params, batch, "materialize", 0, batch_shards=1) == 1  # one pass only
  run = lambda passes, budget: jax.jit(
    lambda p, b: gn.ghost_sq_norms_and_grad(
      logp_fn, p, b, b["loss_mask"], _random_coef, passes=passes, one_pass_budget_bytes=budget
    )
  )(params, batch)
  auto2, explicit2 = run("auto", need - 1), run(2, None)
  assert _rel(auto2.sq_norms_n, explicit2.sq_norms_n) == 0 and _tree_rel(auto2.grads, explicit2.grads) == 0
  with pytest.raises(ValueError, match="learner.one_pass_budget_gib=0"):
    learner.LearnerConfig(method=estimator.method_from_preset("vcpo"), ghost_passes="auto", one_pass_budget_gib=0)
  assert learner.LearnerConfig(method=estimator.method_from_preset("vcpo"), ghost_passes="auto").ghost_passes == "auto"


def test_tie_is_the_identity_and_only_barriers_under_fsdp():
  """sharding.tie: values and gradients unchanged; a barrier only where weights are FSDP-gathered."""
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding

  x, w = jnp.arange(3.0), jnp.arange(6.0).reshape(3, 2)
  f = lambda x, w: jnp.sum(jnp.tanh(jnp.dot(*sharding.tie(x, w))))
  ref = jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w)), argnums=(0, 1))(x, w)
  for shape, barrier in [((1, 2, 1), True), ((2, 1, 1), False)]:
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(shape), jax.devices()[:2])
    with jax.set_mesh(mesh):
      assert ("optimization_barrier" in str(jax.make_jaxpr(f)(x, w))) == barrier
      got = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    for a, b in zip(got, ref):
      np.testing.assert_allclose(a, b, rtol=1e-6)


def test_map_rows_blocks_per_device():
  """_map_rows regroups [N] rows into per-device blocks and restores the row order."""
  x = jnp.arange(24.0).reshape(12, 2)
  for block, shards in [(1, 1), (2, 3), (4, 3), (3, 2), (12, 4), (5, 2)]:
    out = gn._map_rows(lambda r: jnp.sum(r * r, axis=1) + r[:, 0], x, block, shards)
    np.testing.assert_array_equal(out, jnp.sum(x * x, axis=1) + x[:, 0])


def test_loop_reference_equals_vmap():
  logp_fn, params, batch, ref = _setup("qwen2")
  loop = jax.jit(gn.loop_sq_norms, static_argnums=0)(logp_fn, params, batch, batch["loss_mask"])
  assert _rel(loop, ref) < 1e-5


@pytest.mark.slow
def test_tied_cross_term_is_material():
  """The tied table's S_n = ||B_n||^2 + ||C_n||^2 + 2<B_n, C_n>; the cross term is not negligible here.

  An untied copy (lm_head.kernel = embedding^T, same logits) has per-example norms
  ||B||^2 + ||C||^2 for the table, so the two models' S_n differ by exactly the cross term;
  a ghost implementation without it would fail the 1e-4 comparison with the vmap reference.
  """
  logp_fn, params, batch, ref = _setup("qwen2")
  graphdef_u, params_u = tf.split(tf.init(CONFIGS["qwen2"].replace(tie_embeddings=False), seed=1))
  flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  params_u = jax.tree_util.tree_map_with_path(lambda path, x: flat.get(path, x), params_u)
  params_u["lm_head"]["kernel"][...] = params["embed_tokens"]["embedding"][...].T
  logp_u = gn.sequence_logp_fn(graphdef_u)
  np.testing.assert_allclose(logp_u(params_u, batch), logp_fn(params, batch), atol=1e-6)
  untied = jax.jit(gn.vmap_sq_norms, static_argnums=0)(logp_u, params_u, batch, batch["loss_mask"])
  assert float(jnp.max(jnp.abs(ref - untied) / ref)) > 1e-3
  res = jax.jit(
    lambda p, b: gn.ghost_sq_norms_and_grad(logp_u, p, b, b["loss_mask"], _random_coef, memory_budget_bytes=0)
  )(params_u, batch)
  assert _rel(res.sq_norms_n, untied) < 1e-4


@pytest.mark.parametrize("preset,passes", [("vcpo_reference", 1), ("vcpo_reference", 2)])
def test_ghost_path_equals_vmap_path(preset, passes):
  """OPOB coefficients that depend on S_n: the one-backward path (and the two-pass one) equals brute force."""
  logp_fn, params, batch, _ = _setup("qwen2")
  cfg = estimator.method_from_preset(preset)
  g_ref, m_ref = _vmap_policy_gradient("qwen2", preset)
  ghost = functools.partial(learner.policy_gradient("ghost"), passes=passes)
  g, m = jax.jit(ghost, static_argnums=(0, 3))(logp_fn, params, batch, cfg)
  assert _tree_rel(g, g_ref) < 1e-5
  np.testing.assert_allclose(m["baseline_n"], m_ref["baseline_n"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m["pg_loss"], m_ref["pg_loss"], rtol=1e-5, atol=1e-7)
  # The baseline really is norm-weighted (differs from the plain group mean somewhere).
  assert float(jnp.max(jnp.abs(m["sq_norm_n"] - jnp.mean(m["sq_norm_n"])))) > 0


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.slow
def test_token_tis_weights_as_function_of_logp(passes):
  """tokw given as a function of logp (token-TIS): norms use those weights; gradient matches."""
  logp_fn, params, batch, _ = _setup("llama")
  cfg = estimator.method_from_preset("token_tis", {"weights.c": 1.05})
  g_ref, m_ref = _vmap_policy_gradient("llama", "token_tis", (("weights.c", 1.05),))
  ghost = functools.partial(learner.policy_gradient("ghost"), passes=passes)
  g, m = jax.jit(ghost, static_argnums=(0, 3))(logp_fn, params, batch, cfg)
  assert _tree_rel(g, g_ref) < 1e-5
  assert _rel(m["sq_norm_n"], _token_tis_sq_norms()) < 1e-4


@functools.lru_cache(maxsize=None)
def _token_tis_sq_norms():
  """vmap_sq_norms with token-TIS weights tokw(logp) (llama): the brute-force norms, shared by both `passes`."""
  logp_fn, params, batch, _ = _setup("llama")
  cfg = estimator.method_from_preset("token_tis", {"weights.c": 1.05})
  tokw = lambda logp: estimator.pg_token_weights(logp, batch["behavior_logp"], batch["loss_mask"], cfg)
  return jax.jit(gn.vmap_sq_norms, static_argnums=(0, 3))(logp_fn, params, batch, tokw)


def test_plan_layers_hand_checked_costs():
  info = {"a": gn.taps.TapInfo("linear", "a"), "b": gn.taps.TapInfo("linear", "b")}
  ins = {"a": (4, 256, 64), "b": (4, 8, 64)}
  outs = {"a": (4, 256, 64), "b": (4, 8, 64)}
  # a: gram 256^2*128 = 8.4M > direct 256*64*64 + 4096 = 1.05M flops; b: gram 8^2*128 = 8192 < 36864.
  # Temporaries: a gram 2*4*256^2*4 = 2 MiB, direct 4*64*64*4 = 64 KiB (16 KiB per example);
  # b gram 2*4*8^2*4 = 2 KiB.
  plan = gn.plan_layers(info, ins, outs, "direct", memory_budget_bytes=1 << 20)
  assert (plan["a"].method, plan["a"].block, plan["a"].temp_bytes) == ("direct", 4, 65536)
  assert gn.plan_layers(info, ins, outs, "direct", memory_budget_bytes=40000)["a"].block == 2
  assert gn.plan_layers(info, ins, outs, "gram")["b"].temp_bytes == 2048
  # A budget that fits nothing: the smallest temporaries, direct one example at a time.
  plan = gn.plan_layers(info, ins, outs, "auto", memory_budget_bytes=0)
  assert (plan["a"].method, plan["a"].block, plan["b"].method) == ("direct", 1, "gram")
  # Room for a's kept per-example gradients (64 KiB) and b's gram temporaries (2 KiB): a, which
  # saves the most flops per byte, is materialized; one byte less and it is not.
  plan = gn.plan_layers(info, ins, outs, "auto", memory_budget_bytes=65536 + 2048)
  assert (plan["a"].method, plan["a"].kept_bytes, plan["b"].method) == ("materialize", 65536, "gram")
  plan = gn.plan_layers(info, ins, outs, "auto", memory_budget_bytes=65536 + 2047)
  assert plan["a"].method == "direct" and plan["a"].block == 4
  # Per device: the batch split over 4 devices leaves 1 example each, 16 KiB kept for a.
  plan = gn.plan_layers(info, ins, outs, "auto", memory_budget_bytes=16384 + 512, batch_shards=4)
  assert (plan["a"].method, plan["a"].n, plan["b"].method) == ("materialize", 1, "gram")
  assert gn.plan_layers(info, ins, outs, "gram")["a"].method == "gram"
  # Embedding lookups: scatter (T D + V D flops) when T^2 > T + V, one example's [V, D] fits and is no
  # more floats than gram's [T, T] (V D <= T^2), or the tied head's [V, D] gradients are kept anyway.
  assert gn.embed_plan(4, 13, 64, 144, 1 << 30) == ("gram", 4)  # V D = 9216 > T^2 = 169
  assert gn.embed_plan(4, 13, 64, 144, 1 << 30, kept=True) == ("scatter", 4)
  assert gn.embed_plan(4, 13, 64, 144, 2 * 144 * 64 * 4, kept=True) == ("scatter", 2)
  assert gn.embed_plan(4, 13, 64, 144, 144 * 64 * 4 - 1, kept=True) == ("gram", 4)
  assert gn.embed_plan(4, 12, 64, 144, 1 << 30, kept=True) == ("gram", 4)  # 144 < 12 + 144
  assert gn.embed_plan(4, 100, 8, 144, 1 << 30) == ("scatter", 4)  # V D = 1152 <= T^2 = 10000
  assert gn.embed_plan(4, 100, 8, 144, 2 * 144 * 8 * 4) == ("scatter", 2)
  with pytest.raises(ValueError, match="method"):
    gn.plan_layers(info, ins, outs, "fast")
  with pytest.raises(ValueError, match="batch_shards"):
    gn.plan_layers(info, ins, outs, "auto", batch_shards=0)


def test_bad_inputs_raise():
  logp_fn, params, batch, _ = _setup("llama")
  with pytest.raises(ValueError, match="tokw_nt"):
    gn.ghost_sq_norms_and_grad(logp_fn, params, batch, jnp.ones((N, T + 1)), _random_coef)
  # A parameter the taps do not see (its norm would silently be missing) is an error.
  extra = dict(params.items(), stray=jnp.ones((3,)))
  stray_fn = lambda p, b: logp_fn(nnx.State({k: v for k, v in p.items() if k != "stray"}), b) + jnp.sum(p["stray"])
  with pytest.raises(ValueError, match="stray"):
    gn.ghost_sq_norms_and_grad(stray_fn, extra, batch, batch["loss_mask"], _random_coef)
  with pytest.raises(ValueError, match="no taps"):
    gn.ghost_sq_norms_and_grad(lambda p, b: jnp.zeros((N, T)), params, batch, batch["loss_mask"], _random_coef)


def test_ghost_step_memory_does_not_scale_with_n_t_v():
  """Compiled temp bytes of the VCPO ghost step grow far less than N T dV floats when V grows.

  Before the chunked head the step held D = dlogp/dlogits [N, T, V] (and the logits): at least
  N T dV * 4 bytes more for dV more vocabulary. Compilation is deterministic (not a timing).
  """
  n, t = 4, 128

  def temp(v):
    cfg = config.tiny_llama(vocab_size=v, num_layers=1, hidden_size=32, intermediate_size=64, logprob_chunk=16)
    graphdef, params = tf.split(nnx.eval_shape(lambda: tf.Transformer(cfg, rngs=nnx.Rngs(0))))
    logp_fn = gn.sequence_logp_fn(graphdef)
    sds = jax.ShapeDtypeStruct
    batch = dict(tokens=sds((n, t), jnp.int32), valid_mask=sds((n, t), bool), loss_mask=sds((n, t), jnp.float32))
    fn = lambda p, b: (
      gn.ghost_sq_norms_and_grad(
        logp_fn, p, b, b["loss_mask"], lambda lp, sq: (sq, None), memory_budget_bytes=1 << 20
      ).grads
    )
    return jax.jit(fn).lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  small, big = temp(1024), temp(8192)
  assert big - small < 0.25 * n * t * (8192 - 1024) * 4, (small, big)


# ---------------------------------------------------------------------------
# per_example_sq_grad_norms on any fn(params, example) -> scalar
# ---------------------------------------------------------------------------


def _loop_sq_norms(fn, params, batch):
  n = jax.tree_util.tree_leaves(batch)[0].shape[0]
  grad_fn = jax.jit(jax.grad(fn))  # one compile, then one example per call
  out = []
  for i in range(n):
    ex = jax.tree_util.tree_map(lambda x: x[i], batch)
    g = grad_fn(params, ex)
    out.append(sum(float(jnp.sum(jnp.square(x))) for x in jax.tree_util.tree_leaves(g)))
  return np.array(out)


def _mlp(params, ex):
  h = jnp.tanh(ex["x"] @ params["w1"] + params["b1"])
  return jnp.sum((h @ params["w2"] - ex["y"]) ** 2)


def _attention(params, ex):
  x = ex["x"]  # [T, D]
  q, k, v = x @ params["wq"], x @ params["wk"], x @ params["wv"]
  t = x.shape[0]
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), q @ k.T / jnp.sqrt(q.shape[-1]), -1e9)
  out = jax.nn.softmax(scores, axis=-1) @ v @ params["wo"]
  return jnp.sum(jax.nn.log_softmax(out, axis=-1)[jnp.arange(t), ex["y"]])


@pytest.mark.parametrize("model", ["mlp", "attention"])
@pytest.mark.slow
def test_per_example_sq_grad_norms_equals_loop(model):
  k = iter(jax.random.split(jax.random.PRNGKey(0), 8))
  if model == "mlp":
    fn = _mlp
    params = dict(
      w1=jax.random.normal(next(k), (4, 6)), b1=jax.random.normal(next(k), (6,)), w2=jax.random.normal(next(k), (6, 3))
    )
    batch = dict(x=jax.random.normal(next(k), (5, 4)), y=jax.random.normal(next(k), (5, 3)))
  else:
    fn = _attention
    params = {n: jax.random.normal(next(k), (4, 4)) for n in ("wq", "wk", "wv", "wo")}
    batch = dict(x=jax.random.normal(next(k), (5, 6, 4)), y=jax.random.randint(next(k), (5, 6), 0, 4))
  ref = _loop_sq_norms(fn, params, batch)
  np.testing.assert_allclose(gn.per_example_sq_grad_norms(fn, params, batch), ref, rtol=1e-5)
  np.testing.assert_allclose(gn.per_example_sq_grad_norms(fn, params, batch, batch_size=2), ref, rtol=1e-5)
