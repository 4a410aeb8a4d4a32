"""LoRA end to end: the real trainer.run in lag mode, crash and resume bit for bit, then export (merged + PEFT)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_trainer import InjectedCrash, _hook_source, _tiny, _train_records, dense_reward  # noqa: F401
from vcpo_jax import export, rollout, run_config, trainer
from vcpo_jax import mesh as mesh_lib
from vcpo_jax.model import hf_io, lora, policy
from vcpo_jax.model import transformer as tf

LORA = {"model.lora_rank": 4, "model.lora_alpha": 8.0, "model.lora_targets": "q_proj,v_proj,down_proj"}


@pytest.mark.slow
def test_lora_lag_run_resumes_bit_for_bit_and_exports_merged_and_peft(tmp_path, dense_reward, monkeypatch):  # noqa: F811
  """k = 2, VCPO (OPOB over the adapters' exact norms): a clean 4-step run equals one crashed after update 3
  and resumed from its step-2 checkpoint (adapters, their optimizer state and the ring's adapter versions
  restored). The export's merged weights give the log-probs of the run's base + the exported adapters."""
  over = dict(mode="lag", steps=4, **{"lag.k": 2, "checkpoint.every": 2, "eval.every": 0, "method": "vcpo"}, **LORA)
  real = rollout.build_source
  trainer.run(_tiny(**over), str(tmp_path / "full"))
  _hook_source(monkeypatch, crash_at=3)
  with pytest.raises(InjectedCrash):
    trainer.run(_tiny(**over), str(tmp_path / "part"))
  monkeypatch.setattr(rollout, "build_source", real)
  trainer.run(_tiny(**over), str(tmp_path / "part"))
  a, b = _train_records(str(tmp_path / "full")), _train_records(str(tmp_path / "part"))
  assert [r[0] for r in a] == [1, 2, 3, 4] and a == b
  assert max(r[2] for r in a) > 0 and max(r[6] for r in a) == 2  # it learned, and was stale

  out = tmp_path / "hf"
  export.export(str(tmp_path / "full"), str(out))
  assert (out / "adapter" / "adapter_config.json").is_file() and (
    out / "adapter" / "adapter_model.safetensors"
  ).is_file()
  from safetensors.numpy import load_file

  peft = load_file(str(out / "adapter" / "adapter_model.safetensors"))
  assert len(peft) == 2 * 3 and all(".lora_A." in k or ".lora_B." in k for k in peft)
  assert any(np.any(v != 0) for k, v in peft.items() if ".lora_B." in k)  # trained: B moved off zero
  # the run's base (frozen: the initializer's) + the exported adapters, unmerged, vs the merged export
  spec = run_config.parse_config(_tiny(**over), check_prompts=False)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 1, 1)), devices=jax.devices()[:1])
  cfg, _, graphdef, params = policy.build_policy(spec.model_cfg, mesh, seed=spec.seed)
  ad, base = lora.split(params)
  flat = {}
  for path, (x, y) in lora.lora_kernels(params).items():
    # stacked layers [L, ...]: PEFT names layer i model.layers.{i}.*, a [r, in] / [out, r] matrix each
    name = f"base_model.model.model.{path}".replace("model.layers.", "model.layers.{i}.")
    flat[path + ".lora_a.kernel"], flat[path + ".lora_b.kernel"] = (
      np.stack([peft[name.format(i=i) + ".lora_A.weight"].T for i in range(x.shape[0])]),
      np.stack([peft[name.format(i=i) + ".lora_B.weight"].T for i in range(x.shape[0])]),
    )
  from vcpo_jax.sharding import path_str

  ad = jax.tree_util.tree_map_with_path(lambda p, x: jnp.asarray(flat[path_str(p)]), ad)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 30, (2, 9)), jnp.int32)
  valid = jnp.ones(tokens.shape, bool)
  ours = tf.sequence_logprobs(graphdef, lora.combine(ad, base), tokens, valid)
  mcfg, model = hf_io.load_hf(str(out))
  assert mcfg.lora_rank == 0
  merged = tf.sequence_logprobs(*tf.split(model), tokens, valid)
  np.testing.assert_allclose(merged, ours, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(tf.sequence_logprobs(graphdef, params, tokens, valid) - ours))) > 1e-4


@pytest.mark.slow
def test_lora_warm_start_is_the_plain_models_with_fresh_adapters(tmp_path, monkeypatch):
  """With sft.steps > 0 the LoRA run's base is the plain model's warm start (the same cache entry as a full
  fine-tuning run of that seed: no training on the second call) and its adapters are the initializer's (B = 0),
  so RL step 0 is the warm-started model. A bug (the whole LoRA tree trained) misses the cache and trains."""
  from vcpo_jax import sft

  over = {"sft.steps": 3, "sft.batch_size": 4, "sft.cache_dir": str(tmp_path / "cache")}
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 1, 1)), devices=jax.devices()[:1])

  def warm(**extra):
    spec = run_config.parse_config(_tiny(**over, **extra), check_prompts=False)
    cfg, tok, graphdef, params = policy.build_policy(spec.model_cfg, mesh, seed=spec.seed)
    probs = spec.make_train_problems()
    return params, trainer._warm_start(spec, graphdef, params, cfg, tok, probs, None)

  _, full = warm()
  monkeypatch.setattr(sft, "train", lambda *a, **k: pytest.fail("the LoRA warm start must reuse the plain one"))
  init, warmed = warm(**LORA)
  ad, base = lora.split(warmed)
  for a, b in zip(jax.tree.leaves(lora.adapters(init)), jax.tree.leaves(ad)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(not np.any(np.asarray(b)) for _, b in lora.lora_kernels(warmed).values())
  assert jax.tree.structure(base) == jax.tree.structure(full)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
