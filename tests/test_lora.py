"""LoRA adapters (vcpo_jax.model.lora): the model, the exact per-example norms over them, the learner step.

References: the model with LoRA off (same seed, same bits), brute-force per-example gradients (vmap of
jax.grad over the adapters only) on the ragged batch of test_grad_norms, jax.grad of the surrogate, and the
adapters folded into the base weights by hand (W + alpha / r A B).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.test_grad_norms import CHUNKS, N, V, _batch, _random_coef, _rel, _tree_rel
from vcpo_jax import estimator, learner, optim
from vcpo_jax import grad_norms as gn
from vcpo_jax.model import config, lora
from vcpo_jax.model import transformer as tf

RANK = 3
CONFIGS = {  # tied head + q/k/v bias; untied head; q/k norms (all of them frozen with LoRA on)
  "qwen2": config.tiny_qwen2(vocab_size=V, num_layers=1, lora_rank=RANK, lora_alpha=6.0, **CHUNKS),
  "llama": config.tiny_llama(vocab_size=V, num_layers=1, lora_rank=RANK, **CHUNKS),
  "qwen3": config.tiny_qwen3(vocab_size=V, num_layers=1, lora_rank=RANK, lora_targets=("q_proj", "down_proj")),
}


def _flat(tree):
  return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(tree)}


def _with_random_b(params, seed=5):
  """B != 0 (at init B = 0, so g_A = 0 and the A half of the norms would go untested)."""
  keys = iter(jax.random.split(jax.random.key(seed), 200))
  ad, base = lora.split(params)
  ad = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), ad)
  return lora.combine(ad, base)


@functools.lru_cache(maxsize=None)
def _setup(name):
  graphdef, params = tf.split(tf.init(CONFIGS[name], seed=1))
  params = _with_random_b(params)
  adapters, frozen = lora.split(params)
  logp_fn = learner.make_logp_fn(graphdef, frozen)
  batch = _batch()
  ref = jax.jit(gn.vmap_sq_norms, static_argnums=0)(logp_fn, adapters, batch, batch["loss_mask"])
  return graphdef, params, logp_fn, batch, ref


def test_lora_off_is_todays_model_and_base_bits_do_not_move():
  """Default fields: no adapters. LoRA on: the same base weights (same seed), only LoRAParam leaves added."""
  cfg = config.tiny_qwen2(vocab_size=V)
  assert cfg.lora_rank == 0 and not cfg.lora
  _, plain = tf.split(tf.init(cfg, seed=2))
  assert not lora.has_adapters(plain) and lora.split(plain) == (plain, None)
  _, with_lora = tf.split(tf.init(cfg.replace(lora_rank=4), seed=2))
  ad, base = lora.split(with_lora)
  assert _flat(base).keys() == _flat(plain).keys()
  for k, v in _flat(plain).items():
    np.testing.assert_array_equal(_flat(base)[k], v, err_msg=k)
  names = sorted(_flat(ad))
  assert len(names) == 2 * 7 and all(n.endswith(("lora_a/kernel", "lora_b/kernel")) for n in names)
  assert all(v.shape[0] == cfg.num_layers for v in _flat(ad).values())  # stacked over layers
  assert all(np.all(v == 0) for k, v in _flat(ad).items() if "lora_b" in k)  # B = 0
  assert all(np.any(v != 0) for k, v in _flat(ad).items() if "lora_a" in k)


@pytest.mark.slow
def test_step_zero_equals_the_base_model_and_adapters_change_it():
  cfg = config.tiny_llama(vocab_size=V, num_layers=1)
  tok = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 9)), jnp.int32)
  valid = jnp.ones((2, 9), bool)
  g0, p0 = tf.split(tf.init(cfg, seed=4))
  g1, p1 = tf.split(tf.init(cfg.replace(lora_rank=2), seed=4))
  base = tf.sequence_logprobs(g0, p0, tok, valid)
  np.testing.assert_array_equal(tf.sequence_logprobs(g1, p1, tok, valid), base)
  moved = tf.sequence_logprobs(g1, _with_random_b(p1), tok, valid)
  assert float(jnp.max(jnp.abs(moved - base))) > 1e-3  # the adapters are really on the forward path


@pytest.mark.slow
def test_merged_weights_equal_the_unmerged_adapters():
  """merge_into_base: W + alpha / r A B by hand, and the plain model on it gives the LoRA model's log-probs."""
  graphdef, params, _, batch, _ = _setup("qwen2")
  cfg = CONFIGS["qwen2"]
  base_cfg, merged = lora.merge_into_base(params, cfg)
  assert base_cfg.lora_rank == 0 and not lora.has_adapters(merged)
  flat, mflat = _flat(params), _flat(merged)
  a, b = flat["layers/mlp/up_proj/lora_a/kernel"][0], flat["layers/mlp/up_proj/lora_b/kernel"][0]
  by_hand = flat["layers/mlp/up_proj/kernel"][0] + (6.0 / RANK) * a @ b  # layer 0 of the stacked [L, ...]
  np.testing.assert_allclose(mflat["layers/mlp/up_proj/kernel"][0], by_hand, rtol=1e-6, atol=1e-7)
  g_plain, _ = tf.split(nnx.eval_shape(lambda: tf.init(base_cfg)))
  want = tf.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid_mask"])
  got = tf.sequence_logprobs(g_plain, merged, batch["tokens"], batch["valid_mask"])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "name,method,budget,passes",
  [
    ("qwen2", "gram", 0, 1),
    ("qwen2", "direct", 0, 1),
    ("qwen2", "materialize", gn.DEFAULT_BUDGET_BYTES, 1),
    ("llama", "auto", gn.DEFAULT_BUDGET_BYTES, 1),
    ("llama", "gram", 0, 2),
    ("qwen3", "direct", gn.DEFAULT_BUDGET_BYTES, 2),
  ],
)
@pytest.mark.slow
def test_ghost_norms_over_adapters_equal_brute_force(name, method, budget, passes):
  """S_n = sum over adapters ||g_A||^2 + ||g_B||^2 from (x, u = xA, dL/dy): ghost == vmap(jax.grad), and the
  update equals jax.grad of the surrogate over the adapters only."""
  _, params, logp_fn, batch, ref = _setup(name)
  adapters, _ = lora.split(params)
  fn = jax.jit(
    lambda p, b: gn.ghost_sq_norms_and_grad(
      logp_fn, p, b, b["loss_mask"], _random_coef, method=method, memory_budget_bytes=budget, passes=passes
    )
  )
  res = fn(adapters, batch)
  assert float(jnp.min(ref)) > 0  # every row has a response token, every norm is material
  assert _rel(res.sq_norms_n, ref) < 1e-4
  coef, _ = _random_coef(None, None)
  grads = jax.grad(lambda p: -jnp.sum(coef * jnp.sum(batch["loss_mask"] * logp_fn(p, batch), axis=1)))(adapters)
  assert _tree_rel(res.grads, grads) < 1e-5
  assert jax.tree.structure(res.grads) == jax.tree.structure(adapters)  # adapters only: nothing else trains


@pytest.mark.slow
def test_norms_split_into_the_a_and_b_halves():
  """Brute force per factor: both halves are material, and the sum is the adapters' S_n (not the model's)."""
  _, params, logp_fn, batch, ref = _setup("llama")
  adapters, frozen = lora.split(params)
  only = lambda keep: jax.jit(gn.vmap_sq_norms, static_argnums=0)(
    lambda p, b: logp_fn(lora.combine(p, rest[keep]), b), parts[keep], batch, batch["loss_mask"]
  )
  a_part = nnx.filter_state(adapters, lambda path, _: "lora_a" in path)
  b_part = nnx.filter_state(adapters, lambda path, _: "lora_b" in path)
  parts, rest = {"a": a_part, "b": b_part}, {"a": lora.combine(b_part, frozen), "b": lora.combine(a_part, frozen)}
  sa, sb = only("a"), only("b")
  assert float(jnp.min(sa)) > 0 and float(jnp.min(sb)) > 0
  np.testing.assert_allclose(sa + sb, ref, rtol=1e-5)


def test_learner_step_trains_only_the_adapters_and_ghost_equals_vmap():
  """VCPO (OPOB: the norms matter): base bits unchanged, adapters moved, optimizer state over adapters only;
  the ghost step equals the vmap reference step."""
  graphdef, params, _, batch, _ = _setup("qwen2")
  pg = estimator.method_from_preset("vcpo_reference")
  tx = optim.make_optimizer(1e-2, weight_decay=0.1)
  out = {}
  for path in ("ghost", "vmap"):
    step = jax.jit(learner.make_train_step(graphdef, tx, learner.LearnerConfig(method=pg, grad_path=path)))
    state0 = learner.init_state(params, tx)
    out[path] = step(state0, batch)
  (s_g, m_g), (s_v, m_v) = out["ghost"], out["vmap"]
  mu = state0.opt_state[1][0].mu  # clip -> adamw(scale_by_adam state) -> ess
  assert jax.tree.structure(mu) == jax.tree.structure(lora.split(params)[0])
  new_ad, new_base = lora.split(s_g.params)
  old_ad, old_base = lora.split(params)
  for k, v in _flat(old_base).items():
    np.testing.assert_array_equal(_flat(new_base)[k], v, err_msg=k)
  assert _tree_rel(new_ad, old_ad) > 1e-4
  assert float(m_g["nonfinite"]) == 0.0
  assert _tree_rel(lora.split(s_g.params)[0], lora.split(s_v.params)[0]) < 1e-5
  np.testing.assert_allclose(m_g["grad_norm"], m_v["grad_norm"], rtol=1e-5)


def test_base_is_stored_in_the_compute_dtype_adapters_in_float32():
  cfg = config.tiny_qwen2(vocab_size=V, num_layers=1, dtype="bfloat16", lora_rank=2)
  _, params = tf.split(tf.init(cfg))
  ad, base = lora.split(params)
  assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(ad)} == {jnp.dtype(jnp.float32)}
  # the plain bf16 model keeps float32 parameters, as before
  _, plain = tf.split(tf.init(cfg.replace(lora_rank=0)))
  assert {x.dtype for x in jax.tree.leaves(plain)} == {jnp.dtype(jnp.float32)}
  # optax: moments only for the adapters
  tx = optim.make_optimizer(1e-3)
  state = learner.init_state(params, tx)
  assert lora.num_bytes(state.opt_state) < 3 * lora.num_bytes(ad) + 64


@pytest.mark.parametrize(
  "kw,needle",
  [
    ({"lora_rank": -1}, "lora_rank=-1"),
    ({"lora_rank": 2.5}, "lora_rank=2.5"),
    ({"lora_rank": 4, "lora_alpha": 0}, "lora_alpha=0"),
    ({"lora_rank": 4, "lora_targets": ("q_proj", "qproj")}, "unknown: ['qproj']"),
    ({"lora_rank": 4, "lora_targets": ()}, "lora_targets=()"),
  ],
)
def test_bad_lora_fields_raise_naming_the_field(kw, needle):
  with pytest.raises(ValueError, match="ModelConfig.lora_") as e:
    config.tiny_qwen2(**kw)
  assert needle in str(e.value)


def test_lora_targets_from_a_saved_config_list():
  assert config.tiny_qwen2(lora_rank=2, lora_targets=["q_proj", "v_proj"]).lora_targets == ("q_proj", "v_proj")
  assert config.tiny_qwen2(lora_rank=2, lora_targets="v_proj").lora_targets == ("v_proj",)
  assert config.tiny_qwen2(lora_rank=2, lora_targets="q_proj, down_proj").lora_targets == ("q_proj", "down_proj")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.slow
def test_peft_adapter_and_merged_export_give_the_same_logits(family, tmp_path):
  """The run's frozen base as a HF checkpoint + our PEFT adapter dir, loaded by peft (torch CPU): equal logits;
  the merged export loaded by transformers: equal logits too."""
  pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  import transformers

  from tests.fixtures import hf_logits
  from vcpo_jax.model import hf_io

  _, params, _, batch, _ = _setup(family)
  cfg = CONFIGS[family]
  graphdef = tf.split(nnx.eval_shape(lambda: tf.init(cfg)))[0]
  ours = tf.forward(graphdef, params, batch["tokens"][:2], *tf.padded_positions_and_mask(batch["valid_mask"][:2]))[0]
  ours = np.asarray(ours)
  valid = np.asarray(batch["valid_mask"][:2])
  hf_io.save_hf(lora.split(params)[1], cfg.replace(lora_rank=0), tmp_path / "base")
  hf_io.save_peft_adapter(params, cfg, tmp_path / "adapter", base_model=str(tmp_path / "base"))
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype="float32")
  model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
  got = hf_logits(model, np.asarray(batch["tokens"][:2]), valid.astype(np.int64))
  np.testing.assert_allclose(got[valid], ours[valid], rtol=1e-4, atol=1e-4)
  with model.disable_adapter():  # the adapters are material: without them the logits differ
    plain = hf_logits(model, np.asarray(batch["tokens"][:2]), valid.astype(np.int64))
  assert float(np.max(np.abs(plain[valid] - ours[valid]))) > 1e-3
  base_cfg, merged = lora.merge_into_base(params, cfg)
  hf_io.save_hf(merged, base_cfg, tmp_path / "merged")
  m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="float32")
  np.testing.assert_allclose(hf_logits(m, np.asarray(batch["tokens"][:2]), valid)[valid], ours[valid], atol=1e-4)


@pytest.mark.slow
def test_sharded_lora_step_equals_the_single_device_step():
  """fsdp = 2 x tensor = 2 (4 fake devices): adapters laid out by the LoRA partition rules (split, not
  replicated), the VCPO ghost step equals the single-device one."""
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding

  graphdef, params, _, batch, _ = _setup("qwen2")
  pg = estimator.method_from_preset("vcpo_reference")
  tx = optim.make_optimizer(1e-2)
  step = learner.make_train_step(graphdef, tx, learner.LearnerConfig(method=pg))
  state = learner.init_state(params, tx)
  want, m_want = jax.jit(step)(state, batch)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 2)), jax.devices()[:4])
  state_sh = sharding.param_shardings(state, sharding.TRANSFORMER_RULES, mesh)
  specs = {k: v.spec for k, v in nnx.to_flat_state(lora.split(state_sh.params)[0])}
  assert specs[("layers", "mlp", "up_proj", "lora_b", "kernel")] == jax.sharding.PartitionSpec(
    None, None, ("fsdp", "tensor")
  )  # stacked [L, r, F]: the layer axis never split
  assert specs[("layers", "self_attn", "o_proj", "lora_a", "kernel")] == jax.sharding.PartitionSpec(
    None, ("tensor", "fsdp")
  )
  jitted = sharding.MeshJit(mesh, step, in_shardings=(state_sh, sharding.batch_sharding(mesh)))
  got, m_got = jitted(jax.device_put(state, state_sh), jax.device_put(batch, sharding.batch_sharding(mesh)))
  assert _tree_rel(lora.split(got.params)[0], lora.split(want.params)[0]) < 1e-5
  np.testing.assert_allclose(m_got["grad_norm"], m_want["grad_norm"], rtol=1e-5)


@pytest.mark.parametrize("field,value", [("lora_rank", -1), ("lora_alpha", 0.0), ("lora_targets", "q_proj,foo")])
def test_bad_lora_run_config_is_one_config_error_naming_the_field(field, value):
  """Through the run config (what main.py turns into one line on stderr and exit code 2)."""
  from tests import fixtures
  from vcpo_jax import run_config

  c = fixtures.tiny_countdown_config(**{f"model.{field}": value, "model.lora_rank": 4})
  if field == "lora_rank":
    c.model.lora_rank = value
  with pytest.raises(run_config.ConfigError, match=f"config.model.{field}=") as e:
    run_config.parse_config(c, check_prompts=False)
  assert "\n" not in str(e.value)
