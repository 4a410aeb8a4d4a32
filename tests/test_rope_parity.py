"""Qwen3 and scaled RoPE (llama3, yarn, linear, dynamic) against transformers' PyTorch models.

Checkpoints are written by transformers' own `save_pretrained` (random weights, every
parameter randomized as in `tests.fixtures.make_hf_model`), read by our `hf_io.load_hf`.
Sequences run past original_max_position_embeddings (O = 16; "dynamic": M = 16) so the
scaling matters: full-forward logits, greedy KV-cache generation, and the export round trip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import fixtures
from vcpo_jax.model import hf_io, load_hf, save_hf
from vcpo_jax.model import rope as rope_lib
from vcpo_jax.model import transformer as tf
from vcpo_jax.model.config import ModelConfig
from vcpo_jax.model.rope import RopeScaling, static_inv_freq
from vcpo_jax.sampler import Sampler, SamplerConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 101
O = 16  # original context: the sequences below (40 tokens, 8 + 32 generated) run past it
T_LONG = 40

ROPES = {
  "default": {"rope_type": "default"},
  "llama3": {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": O,
  },
  "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": O},
  "linear": {"rope_type": "linear", "factor": 2.0},
  "dynamic": {"rope_type": "dynamic", "factor": 4.0},  # max_position 16 x 4 = 64 (sampler buckets 32 + 32)
}
# (family, rope, tied): Qwen3 (tied and untied, q/k norms, head_dim 32 != 64 / 4), Llama 3.x.
CASES = [
  ("qwen3", "default", True),
  ("qwen3", "yarn", False),
  ("llama", "llama3", False),
  ("llama", "linear", False),
  ("llama", "dynamic", True),
]
IDS = [f"{f}-{r}-{'tied' if t else 'untied'}" for f, r, t in CASES]


def hf_config(family, rope, tied):
  theta = 1e6 if family == "qwen3" else 5e5
  common = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    # "dynamic" scales past max_position_embeddings itself, the others past O
    max_position_embeddings=O if rope == "dynamic" else 256,
    rms_norm_eps=1e-6,
    rope_parameters={**ROPES[rope], "rope_theta": theta},
    tie_word_embeddings=tied,
    attn_implementation="eager",
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
  )
  if family == "qwen3":
    return transformers.Qwen3Config(head_dim=32, **common)
  return transformers.LlamaConfig(**common)


def hf_model(family, rope, tied, seed):
  return fixtures.randomized_hf_model(hf_config(family, rope, tied), seed)


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def ckpt(request, tmp_path_factory):
  family, rope, tied = request.param
  model = hf_model(family, rope, tied, seed=len(request.node.name))
  out = tmp_path_factory.mktemp(f"{family}-{rope}")
  model.save_pretrained(out)
  return request.param, str(out), model


def _tokens(b, t, seed=0):
  return np.random.default_rng(seed).integers(1, V, size=(b, t)).astype(np.int32)


def _our_logits(path, tokens):
  _, model = load_hf(path)
  return np.asarray(hf_io._logits(*tf.split(model), tokens, np.ones(tokens.shape, bool)))


def test_config_and_q_k_norm_weights_load(ckpt):
  (family, rope, tied), path, model = ckpt
  cfg, ours = load_hf(path)
  assert (cfg.model_type, cfg.qk_norm, cfg.qkv_bias, cfg.tie_embeddings) == (family, family == "qwen3", False, tied)
  assert cfg.rope_scaling.rope_type == rope
  if family == "qwen3":
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    theirs = model.model.layers[1].self_attn.k_norm.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(ours.layers.self_attn.k_norm.scale[...][1]), theirs)


@pytest.mark.slow
def test_logits_match_transformers_past_the_original_context(ckpt):
  (_, rope, _), path, model = ckpt
  tokens = _tokens(2, T_LONG, seed=1)
  theirs = fixtures.hf_logits(model, tokens)
  ours = _our_logits(path, tokens)
  print(
    f"[parity] {path.rsplit('/', 1)[-1]}: max |ours - transformers| / std = {np.abs(ours - theirs).max() / theirs.std():.2e}"
  )
  assert np.abs(ours - theirs).max() <= 1e-4 * theirs.std(), np.abs(ours - theirs).max() / theirs.std()
  if rope != "default":  # the scaling matters at these positions: plain RoPE is far off
    cfg, m = load_hf(path)
    graphdef, params = tf.split(m)
    graphdef = tf.split(tf.Transformer(cfg.replace(rope_scaling=RopeScaling()), rngs=nnx.Rngs(0)))[0]
    plain = np.asarray(hf_io._logits(graphdef, params, tokens, np.ones(tokens.shape, bool)))
    assert np.abs(plain - theirs).max() > 1e-2 * theirs.std()


@pytest.mark.slow
def test_greedy_kv_cache_generation_matches_transformers(ckpt):
  _, path, model = ckpt
  cfg, ours = load_hf(path)
  graphdef, params = tf.split(ours)
  prompts = _tokens(2, 8, seed=2)
  smp = Sampler(graphdef, cfg, SamplerConfig(temperature=0.0, eos_id=None, pad_id=0, max_new_tokens=32))
  out = smp.generate(params, [list(map(int, p)) for p in prompts], jax.random.key(0), max_new_tokens=32)
  toks, resp = np.asarray(out.tokens), np.asarray(out.response_mask)
  mine = [list(map(int, toks[i][resp[i]])) for i in range(len(prompts))]
  with torch.no_grad():
    gen = model.generate(
      torch.tensor(prompts, dtype=torch.long),
      do_sample=False,
      max_new_tokens=32,
      min_new_tokens=32,
      attention_mask=torch.ones(prompts.shape, dtype=torch.long),
    )
  assert gen[:, 8:].tolist() == mine


@pytest.mark.slow
def test_export_reloads_in_transformers_with_equal_logits(ckpt, tmp_path):
  (family, _, _), path, model = ckpt
  cfg, ours = load_hf(path)
  out = save_hf(ours, cfg, tmp_path / "export")
  back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  assert type(back).__name__ == ("Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM")
  want = {k: v for k, v in model.config.rope_parameters.items()}
  got = {k: v for k, v in back.config.rope_parameters.items()}
  assert {k: got[k] for k in want} == want
  tokens = _tokens(2, T_LONG, seed=3)
  theirs, again = fixtures.hf_logits(model, tokens), fixtures.hf_logits(back, tokens)
  np.testing.assert_array_less(np.abs(again - theirs).max(), 1e-4 * theirs.std())
  assert load_hf(out)[0] == cfg


@pytest.mark.parametrize("rope", ["default", "linear", "llama3", "yarn"])
def test_inverse_frequencies_equal_transformers(rope):
  """inv_freq and the attention factor, bitwise-close to ROPE_INIT_FUNCTIONS (float32)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf = hf_config("llama", rope, False)
  if rope == "default":
    theirs, m_theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
  else:
    theirs, m_theirs = ROPE_INIT_FUNCTIONS[rope](hf, "cpu")
  ours, m = static_inv_freq(16, 5e5, RopeScaling.from_hf(hf.rope_parameters, hf.max_position_embeddings))
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
  assert m == pytest.approx(m_theirs, rel=1e-7)


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotation_table_reads_what_the_layers_compute(rope):
  """The sampler's decode loop reads its RoPE from a table made once per call (`rotation_table`); it equals,
  bit for bit, the rotation a layer computes at those positions (`rope.apply`), and the "dynamic" type (its
  frequencies depend on the call's largest position) gets no table."""
  cfg = ModelConfig.from_hf(hf_config("llama", rope, False))
  table = tf.rotation_table(cfg, 48)
  if rope == "dynamic":
    assert table is None
    return
  positions = jnp.array([[0, 5, 47], [16, 17, 3]], jnp.int32)
  rot = tf.rotation_at(table, positions)
  np.testing.assert_array_equal(np.asarray(rot[0]), np.asarray(tf.rotation(cfg, positions)[0]))
  np.testing.assert_array_equal(np.asarray(rot[1]), np.asarray(tf.rotation(cfg, positions)[1]))
  x = jax.random.normal(jax.random.key(0), (2, 3, cfg.num_heads, cfg.head_dim))
  inv, m = rope_lib.inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, positions)
  np.testing.assert_array_equal(np.asarray(rope_lib.rotate(x, *rot)), np.asarray(rope_lib.apply(x, positions, inv, m)))


def test_yarn_attention_factor_and_errors():
  s = RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64)
  assert static_inv_freq(16, 1e4, s)[1] == pytest.approx(0.1 * np.log(4.0) + 1.0)  # 1.1386
  ds = RopeScaling("yarn", factor=4.0, original_max_position=16, mscale=1.0, mscale_all_dim=1.0)
  assert static_inv_freq(16, 1e4, ds)[1] == 1.0  # mscale / mscale_all_dim cancel
  no_factor = RopeScaling.from_hf({"rope_type": "yarn", "original_max_position_embeddings": 16}, 64)
  assert no_factor.factor == 4.0  # M / O
  with pytest.raises(ValueError, match=r"rope_type='su' is not supported; supported: \('default'"):
    RopeScaling.from_hf({"rope_type": "su"}, 64)
  with pytest.raises(ValueError, match="RopeScaling.low_freq_factor is required for rope_type='llama3'"):
    RopeScaling("llama3", factor=8.0, original_max_position=16, high_freq_factor=4.0)


# One full-width layer of the released 8B models (vocabulary cut to 512 to keep the test light on CPU).
FULL_WIDTH = {
  "qwen3_8b": (
    transformers.Qwen3Config,
    dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    {"rope_type": "default", "rope_theta": 1e6},
  ),
  "llama_3_1_8b": (
    transformers.LlamaConfig,
    dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    {
      "rope_type": "llama3",
      "rope_theta": 5e5,
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192,
    },
  ),
}


@pytest.mark.parametrize("name", sorted(FULL_WIDTH))
@pytest.mark.slow
def test_one_full_width_8b_layer_matches_transformers(name, tmp_path):
  cls, shape, rope = FULL_WIDTH[name]
  hf = cls(
    vocab_size=512,
    num_hidden_layers=1,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters=rope,
    tie_word_embeddings=False,
    attn_implementation="eager",
    **shape,
  )
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1.0 + 0.1 * noise if pname.endswith("norm.weight") else 0.02 * noise)
  model.eval().save_pretrained(tmp_path)
  tokens = np.random.default_rng(0).integers(0, 512, size=(1, 24)).astype(np.int32)
  theirs = fixtures.hf_logits(model, tokens)
  del model
  _, ours = load_hf(str(tmp_path))
  mine = np.asarray(hf_io._logits(*tf.split(ours), tokens, np.ones(tokens.shape, bool)))
  print(
    f"[parity] one full-width {name} layer: max |ours - transformers| / std = {np.abs(mine - theirs).max() / theirs.std():.2e}"
  )
  assert np.abs(mine - theirs).max() <= 1e-4 * theirs.std(), np.abs(mine - theirs).max() / theirs.std()
