"""The NNX transformer and its config: invariances and hand-checkable pieces.

Parity with transformers' PyTorch implementation lives in test_hf_io.py; here the
model is checked against itself (cache vs full pass, padded vs unpadded, GQA vs
the equivalent multi-head model) and against small hand computations.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vcpo_jax.model import ModelConfig, Transformer
from vcpo_jax.model import attention as attn
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import transformer as tf
from vcpo_jax.model.rope import RopeScaling

V = 64
LLAMA3 = RopeScaling("llama3", factor=8.0, original_max_position=64, low_freq_factor=1.0, high_freq_factor=4.0)
YARN = RopeScaling("yarn", factor=4.0, original_max_position=4)
PRESETS = {
  "qwen2": mconfig.tiny_qwen2,
  "llama": mconfig.tiny_llama,
  "qwen3": mconfig.tiny_qwen3,
  "llama3": functools.partial(mconfig.tiny_llama, rope_scaling=LLAMA3),
  "qwen3_yarn": functools.partial(mconfig.tiny_qwen3, rope_scaling=YARN),
}


@functools.partial(jax.jit, static_argnums=0)
def _fwd(graphdef, params, tokens, positions, mask, cache=None, cache_index=None):
  return tf.forward(graphdef, params, tokens, positions, mask, cache, cache_index)


@functools.partial(jax.jit, static_argnums=0)
def _seq_logp(graphdef, params, tokens, valid):
  return tf.sequence_logprobs(graphdef, params, tokens, valid)


def _random_model(cfg, seed):
  """(graphdef, params) with every parameter random (biases too, scales near 1).

  Larger weights than the 0.02 init so that logits vary by O(1) and bugs show;
  drawn in numpy on the abstract model (no eager init: it costs seconds on CPU).
  """
  graphdef, abstract = tf.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)
  flat = [
    (p, v.replace(jnp.asarray(float(p[-1] == "scale") + 0.1 * rng.standard_normal(v.shape), jnp.float32)))
    for p, v in nnx.to_flat_state(abstract)
  ]
  return graphdef, nnx.from_flat_state(flat)


@pytest.fixture(scope="module", params=sorted(PRESETS))
def model(request):
  cfg = PRESETS[request.param](vocab_size=V, num_layers=2)
  return (cfg,) + _random_model(cfg, seed=3)


def _tokens(b, t, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, (b, t)), jnp.int32)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
  "kw, field",
  [
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(dtype="float16"), "dtype"),
    (dict(model_type="gpt2"), "model_type"),
    (dict(hidden_size=0), "hidden_size"),
  ],
)
def test_config_validation_names_field(kw, field):
  with pytest.raises(ValueError, match=field):
    mconfig.tiny_qwen2(**kw)


@pytest.mark.parametrize("family", sorted(PRESETS))
def test_num_params_matches_model(family):
  cfg = PRESETS[family](vocab_size=V)
  _, abstract = tf.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  assert cfg.num_params == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))


def test_from_hf_config_objects():
  import transformers

  q = transformers.Qwen2Config(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
  )
  cfg = ModelConfig.from_hf(q, dtype="bfloat16")
  assert (
    cfg.head_dim,
    cfg.num_kv_heads,
    cfg.rope_theta,
    cfg.qkv_bias,
    cfg.tie_embeddings,
    cfg.dtype,
    cfg.model_type,
  ) == (8, 2, 5e5, True, True, "bfloat16", "qwen2")
  ll = transformers.LlamaConfig(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    head_dim=32,
    tie_word_embeddings=False,
  )
  cfg = ModelConfig.from_hf(ll)
  assert (cfg.head_dim, cfg.num_kv_heads, cfg.qkv_bias, cfg.tie_embeddings) == (32, 4, False, False)
  with pytest.raises(ValueError, match="gpt2"):
    ModelConfig.from_hf(transformers.GPT2Config())
  scaled = transformers.LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
  assert ModelConfig.from_hf(scaled).rope_scaling == RopeScaling("linear", factor=2.0)
  # A type transformers knows but the model does not: one line naming the field, the value, the choices.
  unsupported = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
  longrope = transformers.LlamaConfig(head_dim=16, rope_parameters=unsupported)
  with pytest.raises(ValueError, match=r"rope_type='longrope' is not supported; supported: \('default'"):
    ModelConfig.from_hf(longrope)


# ----------------------------------------------------------------------------- pieces


def test_rope_depends_only_on_relative_position():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, 1, 2, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, 2, 16)), jnp.float32)
  at = lambda x, p: tf.rope(x, jnp.full((1, 1), p, jnp.int32), 1e4)
  np.testing.assert_allclose(at(q, 0), q, atol=0)  # position 0 is the identity
  np.testing.assert_allclose(jnp.linalg.norm(at(q, 7)), jnp.linalg.norm(q), rtol=1e-6)
  dot = lambda a, b: jnp.sum(a * b, -1)
  np.testing.assert_allclose(dot(at(q, 9), at(k, 4)), dot(at(q, 105), at(k, 100)), rtol=1e-4)


def test_token_logprobs_hand_checked():
  # Two-token vocab, logits (0, log 3): p = (1/4, 3/4).
  logits = jnp.tile(jnp.asarray([0.0, np.log(3.0)], jnp.float32), (1, 3, 1))
  lp = tf.token_logprobs(logits, jnp.asarray([[1, 0, 1]]))
  np.testing.assert_allclose(lp, [[0.0, np.log(0.25), np.log(0.75)]], rtol=1e-6)


def test_padded_positions_and_mask_hand_checked():
  pos, mask = tf.padded_positions_and_mask(jnp.asarray([[0, 0, 1, 1, 1]], bool))
  np.testing.assert_array_equal(pos, [[0, 0, 0, 1, 2]])
  want = np.array([[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], bool)
  np.testing.assert_array_equal(mask.dense(5)[0], want)


# ----------------------------------------------------------------------------- invariances


@pytest.mark.slow
def test_causal(model):
  _, graphdef, params = model
  tokens = _tokens(2, 8, seed=1)
  pos, mask = tf.padded_positions_and_mask(jnp.ones(tokens.shape, bool))
  a, _ = _fwd(graphdef, params, tokens, pos, mask)
  b, _ = _fwd(graphdef, params, tokens.at[:, 5:].set((tokens[:, 5:] + 1) % V), pos, mask)
  np.testing.assert_array_equal(a[:, :5], b[:, :5])
  assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3
  assert a.dtype == jnp.float32 and np.abs(a).max() > 0.5


def test_left_padding_is_invisible(model):
  _, graphdef, params = model
  tokens = _tokens(2, 8, seed=2)
  valid = jnp.ones((2, 8), bool).at[0, :3].set(False)
  padded = _seq_logp(graphdef, params, tokens.at[0, :3].set(0), valid)
  # Row 0 unpadded: its 5 real tokens moved to the front (right padding with junk).
  moved = jnp.concatenate([tokens[:1, 3:], _tokens(1, 3, seed=9)], axis=1)
  alone = _seq_logp(graphdef, params, jnp.concatenate([moved, tokens[1:]]), jnp.ones((2, 8), bool).at[0, 5:].set(False))
  # logp of token t needs token t-1, so the first real token (logp 0 by convention) is skipped.
  np.testing.assert_allclose(padded[0, 4:], alone[0, 1:5], atol=2e-5)
  np.testing.assert_allclose(padded[1], alone[1], atol=2e-5)


@pytest.mark.slow
def test_kv_cache_matches_full_pass(model):
  """Chunked prefill (static slots: prefix-only attention), then traced decode steps (blockwise)."""
  cfg, graphdef, params = model
  b, t, s = 2, 9, 12
  tokens = _tokens(b, t, seed=3)
  valid = jnp.ones((b, t), bool).at[0, :2].set(False)
  pos, mask = tf.padded_positions_and_mask(valid)
  full, _ = _fwd(graphdef, params, tokens, pos, mask)
  mask_c = attn.AttentionMask(jnp.zeros((b, s), bool).at[:, :t].set(valid))
  cache = tf.init_cache(cfg, b, s)
  steps = []
  for lo, hi in ((0, 4), (4, 6)):  # two prefill chunks at static slots
    out, cache = _fwd(graphdef, params, tokens[:, lo:hi], pos[:, lo:hi], mask_c, cache, lo)
    steps.append(out)
  for i in range(6, t):  # one token at a time, as the sampler decodes
    out, cache = _fwd(graphdef, params, tokens[:, i : i + 1], pos[:, i : i + 1], mask_c, cache, jnp.int32(i))
    steps.append(out)
  inc = jnp.concatenate(steps, axis=1)
  np.testing.assert_allclose(inc[valid], full[valid], atol=2e-5)
  # The explicit dense [B, T, S] mask (the pre-AttentionMask interface) gives the same decode.
  dense_c = jnp.zeros((b, t, s), bool).at[:, :, :t].set(mask.dense(t))
  out, _ = _fwd(graphdef, params, tokens[:, 8:9], pos[:, 8:9], dense_c[:, 8:9], cache, jnp.int32(8))
  np.testing.assert_allclose(out[:, 0], full[:, 8], atol=2e-5)


def test_gqa_equals_expanded_multihead():
  """A GQA model equals the MHA model whose k/v heads are each kv head repeated R times."""
  cfg = mconfig.tiny_llama(vocab_size=V, num_layers=1, num_heads=4, num_kv_heads=2)
  mha_cfg = cfg.replace(num_kv_heads=4)
  graphdef, params = _random_model(cfg, seed=5)
  mha_graphdef, mha_params = _random_model(mha_cfg, seed=6)
  h, r = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
  flat = dict(nnx.to_flat_state(params))
  new = []
  for path, var in nnx.to_flat_state(mha_params):
    x = flat[path][...]
    if path[-3:-1] in (("self_attn", "k_proj"), ("self_attn", "v_proj")):
      x = jnp.repeat(x.reshape(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, h), r, axis=2).reshape(
        cfg.num_layers, cfg.hidden_size, -1
      )  # kv head j serves query heads j*R .. j*R+R-1 (kernels stacked [L, D, K*H])
    new.append((path, var.replace(x)))
  mha_params = nnx.from_flat_state(new)
  tokens = _tokens(2, 7, seed=4)
  pos, mask = tf.padded_positions_and_mask(jnp.ones(tokens.shape, bool))
  a, _ = _fwd(graphdef, params, tokens, pos, mask)
  b, _ = _fwd(mha_graphdef, mha_params, tokens, pos, mask)
  assert np.abs(a).max() > 0.5
  np.testing.assert_allclose(a, b, atol=1e-5)


def test_bf16_compute_close_and_params_stay_f32(model):
  cfg, graphdef, params = model
  bf_graphdef, _ = tf.split(nnx.eval_shape(lambda: Transformer(cfg.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  tokens = _tokens(2, 8, seed=5)
  pos, mask = tf.padded_positions_and_mask(jnp.ones(tokens.shape, bool))
  a, _ = _fwd(graphdef, params, tokens, pos, mask)
  b, _ = _fwd(bf_graphdef, params, tokens, pos, mask)
  assert b.dtype == jnp.float32 and bool(jnp.isfinite(b).all())
  err = float(jnp.abs(a - b).max())
  assert 0 < err < 0.05 * float(jnp.abs(a).max()), err


def test_config_with_rope_scaling_round_trips_through_asdict():
  """A saved config (dataclasses.asdict, as sft writes it) rebuilds the same ModelConfig, RopeScaling included."""
  import dataclasses

  cfg = mconfig.tiny_qwen3(rope_scaling=YARN)
  assert ModelConfig(**dataclasses.asdict(cfg)) == cfg
  assert cfg.num_params == mconfig.tiny_qwen3().num_params  # RoPE scaling has no parameters; q/k norms do
  assert cfg.num_params - mconfig.tiny_qwen3(qk_norm=False).num_params == 2 * 2 * 32  # 2 layers x (q, k) x H
