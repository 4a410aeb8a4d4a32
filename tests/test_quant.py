"""Int8 sampler weights (vcpo_jax.model.quant): the quantizer by hand, the int8 model's logits against float32's,
the behaviour log-probs an int8 sampler records, the config knob, stacked layers and LoRA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import sampler as S
from vcpo_jax.model import config, quant
from vcpo_jax.model import transformer as tf

CFG = config.tiny_qwen2()
PROMPTS = [[3, 17, 42], [7, 8, 9, 10, 11], [5]]
SMALL = dict(prompt_buckets=(8,), new_token_buckets=(8,), batch_buckets=(8,), max_new_tokens=8)


@functools.lru_cache(maxsize=None)
def _model(lora=False):
  cfg = CFG.replace(lora_rank=2) if lora else CFG
  gd, params = tf.split(tf.init(cfg, seed=0))
  return cfg, gd, params


def _logits(gd, params, tokens):
  valid = jnp.ones(tokens.shape, bool)
  pos, mask = tf.padded_positions_and_mask(valid)
  return np.asarray(jax.jit(lambda p: tf.forward(gd, p, tokens, pos, mask)[0])(params))


def test_quantize_by_hand_and_the_error_bound():
  w = np.array([[1.0, -0.5], [-2.54, 0.25], [0.0, 0.1]], np.float32)  # [Din=3, Dout=2]
  qa = quant.quantize(w)
  np.testing.assert_allclose(qa.scale, [2.54 / 127, 0.5 / 127], rtol=1e-6)  # per output column: max |w| / 127
  # column 0: 1.0 / 0.02 = 50, -2.54 / 0.02 = -127; column 1: -0.5 -> -127, 0.25 -> 63.5 -> 64 (half to even), 0.1 -> 25.4
  np.testing.assert_array_equal(qa.q, [[50, -127], [-127, 64], [0, 25]])
  assert qa.q.dtype == jnp.int8
  # Random kernels with a leading layer axis: |w - q s| <= s / 2 = max |w[:, o]| / 254 per entry, and it is tight.
  w = np.asarray(jax.random.normal(jax.random.key(0), (3, 64, 16))) * np.linspace(0.01, 3, 16)
  qa = quant.quantize(w)
  assert qa.q.shape == (3, 64, 16) and qa.scale.shape == (3, 16)
  err = np.abs(w - np.asarray(qa.dequantize()))
  bound = np.abs(w).max(axis=-2, keepdims=True) / 254
  assert (err <= bound * (1 + 1e-5)).all() and (err > 0.5 * bound).any()
  zero = quant.quantize(np.zeros((4, 2), np.float32))  # an all-zero column: scale 1, q 0, exact
  np.testing.assert_array_equal(zero.dequantize(), 0.0)
  with pytest.raises(TypeError, match=r"QArray supports only \[\.\.\.\]"):
    qa[0]


def test_quantize_params_picks_the_block_projections_and_keeps_the_rest():
  _, _, params = _model()
  qp = quant.quantize_params(params)
  layers = qp["layers"]
  for mod, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))):
    for n in names:
      k = layers[mod][f"{n}_proj"]["kernel"][...]
      ref = params["layers"][mod][f"{n}_proj"]["kernel"][...]
      assert isinstance(k, quant.QArray) and k.q.shape == ref.shape  # stacked [L, Din, Dout]
      assert k.scale.shape == (CFG.num_layers, ref.shape[-1])
  assert not isinstance(qp["embed_tokens"]["embedding"][...], quant.QArray)  # tied head and embedding: float
  assert not isinstance(layers["input_layernorm"]["scale"][...], quant.QArray)
  assert quant.quantize_params(qp) is not None  # idempotent on a quantized tree (QArrays are left as they are)
  again = quant.quantize_params(qp)["layers"]["mlp"]["up_proj"]["kernel"][...]
  np.testing.assert_array_equal(again.q, layers["mlp"]["up_proj"]["kernel"][...].q)


@pytest.mark.parametrize("scan", [True, False])
def test_int8_logits_equal_the_dequantized_model_and_are_close_to_float32(scan):
  cfg = CFG.replace(scan_layers=scan)
  gd, params = tf.split(tf.init(cfg, seed=0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  qp = quant.quantize_params(params)
  int8 = _logits(gd, qp, tokens)
  # Dequantizing inside the matmul = the float model with the dequantized weights (the scale commutes out).
  np.testing.assert_allclose(int8, _logits(gd, quant.dequantize_params(qp), tokens), atol=1e-5)
  # Against float32: the per-entry error <= max|w| / 254 moves the logits by a small fraction of their spread
  # (stated tolerance: max |diff| <= 5% of the float32 logits' standard deviation, log-softmax within 0.02 nats).
  ref = _logits(gd, params, tokens)
  diff = np.abs(int8 - ref)
  assert 0 < diff.max() <= 0.05 * ref.std()
  lsm = lambda x: x - jax.scipy.special.logsumexp(x, axis=-1, keepdims=True)
  assert np.abs(lsm(int8) - lsm(ref)).max() < 0.02


def test_int8_sampler_records_the_int8_models_log_probs():
  """behaviour log-probs = the dequantized (int8) model's, so log(pi_fp32 / mu) measures the precision mismatch."""
  _, gd, params = _model()
  smp = S.Sampler(gd, CFG, S.SamplerConfig(**SMALL, param_dtype="int8"))
  prepared = smp.prepare_params(params)
  assert isinstance(prepared["layers"]["mlp"]["down_proj"]["kernel"][...], quant.QArray)
  assert prepared["layers"]["mlp"]["down_proj"]["kernel"][...].q.dtype == jnp.int8
  r = smp.generate(prepared, PROMPTS, jax.random.key(3), num_samples=2)
  r_unprepared = smp.generate(params, PROMPTS, jax.random.key(3), num_samples=2)  # quantized inside the call
  np.testing.assert_array_equal(r.tokens, r_unprepared.tokens)
  np.testing.assert_allclose(r.behavior_logp, r_unprepared.behavior_logp, atol=1e-6)
  valid = jnp.asarray(r.prompt_mask | r.response_mask)
  score = jax.jit(tf.sequence_logprobs, static_argnums=0)
  m = r.response_mask
  int8_logp = np.asarray(
    score(gd, quant.dequantize_params(quant.quantize_params(params)), jnp.asarray(r.tokens), valid)
  )
  np.testing.assert_allclose(np.where(m, int8_logp, 0.0), r.behavior_logp, atol=1e-4)
  fp32_logp = np.asarray(score(gd, params, jnp.asarray(r.tokens), valid))
  log_ratio = np.where(m, fp32_logp - r.behavior_logp, 0.0)
  assert np.abs(log_ratio).max() > 1e-4  # the learner's (float32) ratio sees the mismatch


def test_int8_with_lora_quantizes_the_frozen_base_only():
  cfg, gd, params = _model(lora=True)
  smp = S.Sampler(gd, cfg, S.SamplerConfig(**SMALL, param_dtype="int8"))
  prepared = smp.prepare_params(params)
  q = prepared["layers"]["self_attn"]["q_proj"]
  assert isinstance(q["kernel"][...], quant.QArray)
  assert not isinstance(q["lora_a"]["kernel"][...], quant.QArray)  # adapters stay float (trained, small)
  r = smp.generate(prepared, PROMPTS, jax.random.key(0))
  assert np.isfinite(r.behavior_logp).all() and (r.behavior_logp[r.response_mask] < 0).all()


def test_config_knob():
  assert S.resolve_param_dtype("int8", "cpu") is None and S.resolve_param_dtype("int8", "gpu") == jnp.bfloat16
  from vcpo_jax import run_spec

  assert run_spec.SamplingConfig(param_dtype="int8").sampler_kwargs()["param_dtype"] == "int8"
  with pytest.raises(run_spec.ConfigError, match=r"config.sampler.param_dtype='int4'.*int8") as e:
    run_spec.SamplingConfig(param_dtype="int4")
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="param_dtype"):
    S.SamplerConfig(param_dtype="int4")
