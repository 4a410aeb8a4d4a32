"""The decoder's blocks as one scan (ModelConfig.scan_layers): stacked parameters, equal to the unrolled loop.

The same stacked parameters run scanned (`jax.lax.scan` over the layer axis) and unrolled (a Python loop over
layer slices): logits, gradients, exact per-example norms (one and two ghost passes, with and without block
remat) and sampled tokens agree; the programs' size does not grow with depth; Hugging Face names map to layer
slices of the stacked parameters.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import grad_norms as gn
from vcpo_jax import schema
from vcpo_jax import sampler as S
from vcpo_jax.model import config, hf_io
from vcpo_jax.model import transformer as tf

L, N, T, V = 3, 4, 9, 96
CFGS = {
  "qwen2": config.tiny_qwen2(vocab_size=V, num_layers=L, logprob_chunk=4),  # q/k/v bias, tied head
  "llama": config.tiny_llama(vocab_size=V, num_layers=L, logprob_chunk=4),  # untied head
}


def _tokens(seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, V, (N, T)), jnp.int32)
  valid = jnp.asarray(np.arange(T)[None] >= rng.integers(0, 3, N)[:, None])  # left-padded rows
  return tokens, valid


@functools.cache
def _models(name, remat="none"):
  """(scanned graphdef, unrolled graphdef, the stacked params both run on)."""
  cfg = CFGS[name].replace(remat=remat)
  graphdef, params = tf.split(tf.init(cfg, seed=3))
  unrolled, _ = tf.split(tf.init(cfg.replace(scan_layers=False), seed=3))
  # Random (non-identity) norm scales and biases, so that every layer differs from the others.
  keys = iter(jax.random.split(jax.random.key(5), 64))
  params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape) if x.ndim < 3 else x, params)
  return graphdef, unrolled, params


def test_block_parameters_are_stacked():
  cfg = CFGS["qwen2"]
  _, params = tf.split(tf.init(cfg))
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  block = [k for k in flat if k.startswith("['layers']")]
  assert len(block) == 12 and all(flat[k].shape[0] == L for k in block)  # 7 kernels, 3 biases, 2 norm scales
  q = params["layers"]["self_attn"]["q_proj"]["kernel"][...]
  assert q.shape == (L, cfg.hidden_size, cfg.num_heads * cfg.head_dim)
  assert not np.allclose(q[0], q[1])  # each layer its own draw


@pytest.mark.parametrize("name", ["qwen2", "llama"])
@pytest.mark.parametrize("remat", ["none", "block"])
def test_logits_and_gradients_scanned_equal_unrolled(name, remat):
  graphdef, unrolled, params = _models(name, remat)
  tokens, valid = _tokens()
  pos, mask = tf.padded_positions_and_mask(valid)
  fwd = jax.jit(lambda g, p: tf.forward(g, p, tokens, pos, mask)[0], static_argnums=0)
  a, b = fwd(graphdef, params), fwd(unrolled, params)
  assert np.abs(a).max() > 0.1
  np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)

  def loss(g, p):
    return jnp.sum(jnp.where(valid, tf.sequence_logprobs(g, p, tokens, valid), 0.0))

  ga = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)(graphdef, params)
  gb = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)(unrolled, params)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
    np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-4)
  dq = ga["layers"]["self_attn"]["q_proj"]["kernel"][...]
  assert all(np.abs(dq[i]).max() > 0 for i in range(L))  # every layer's slice gets its gradient


@pytest.mark.parametrize("name", ["qwen2", "llama"])
@pytest.mark.parametrize("passes,remat", [(1, "none"), (1, "block"), (2, "block")])
def test_per_example_norms_scanned_equal_unrolled_and_reference(name, passes, remat):
  """Exact ||g_n||^2 of the ghost pass with stacked taps [L, ...]: the scanned model's equal the unrolled
  model's and the vmap reference's (per-example jax.grad); so do the update gradients."""
  graphdef, unrolled, params = _models(name, remat)
  tokens, valid = _tokens(1)
  loss_mask = (valid & (jnp.arange(T)[None] >= 4)).astype(jnp.float32)
  batch = {"tokens": tokens, "valid_mask": valid, "loss_mask": loss_mask}
  coef = lambda logp, sq: (jnp.linspace(-1.0, 1.0, N), None)

  def ghost(g):
    fn = lambda p, b: gn.ghost_sq_norms_and_grad(gn.sequence_logp_fn(g), p, b, b["loss_mask"], coef, passes=passes)
    return jax.jit(fn)(params, batch)

  a, b = ghost(graphdef), ghost(unrolled)
  ref = jax.jit(gn.vmap_sq_norms, static_argnums=0)(gn.sequence_logp_fn(graphdef), params, batch, loss_mask)
  np.testing.assert_allclose(a.sq_norms_n, b.sq_norms_n, rtol=1e-4)
  np.testing.assert_allclose(a.sq_norms_n, ref, rtol=1e-4)
  for x, y in zip(jax.tree.leaves(a.grads), jax.tree.leaves(b.grads), strict=True):
    np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-4)


def test_sampled_tokens_scanned_equal_unrolled():
  """Prefill (in chunks: a scan over chunks around the scan over layers) and decode with the stacked cache."""
  graphdef, unrolled, params = _models("qwen2")
  cfg = CFGS["qwen2"]
  scfg = S.SamplerConfig(
    prompt_buckets=(8,), new_token_buckets=(8,), batch_buckets=(4,), max_new_tokens=8, prefill_chunk=2
  )
  prompts = [[3, 17, 42], [7, 8, 9, 10, 11], [5]]
  run = lambda g: S.Sampler(g, cfg, scfg).generate(params, prompts, jax.random.key(2), max_new_tokens=8)
  a, b = run(graphdef), run(unrolled)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.behavior_logp, b.behavior_logp, atol=1e-5)
  assert tf.init_cache(cfg, 2, 8)[0].shape == (L, 2, cfg.num_kv_heads, cfg.head_dim, 8)


def _eqns(jaxpr) -> int:
  """Equations of a jaxpr, those of its sub-jaxprs (scan bodies, checkpoints, ...) included."""
  count = 0
  for eqn in jaxpr.eqns:
    count += 1
    for v in eqn.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          count += _eqns(inner)
  return count


def test_program_size_does_not_grow_with_depth():
  """The scanned forward + ghost step and the initializer trace to the same number of equations at 2 and 6
  layers (one scanned body; init draws each tensor once, batched over L); unrolled, they grow with L."""

  def sizes(layers, scan):
    cfg = CFGS["qwen2"].replace(num_layers=layers, scan_layers=scan)
    graphdef, params = tf.split(tf.init(cfg))
    tokens, valid = _tokens()
    batch = {"tokens": tokens, "valid_mask": valid, "loss_mask": valid.astype(jnp.float32)}
    coef = lambda logp, sq: (sq, None)
    step = lambda p: gn.ghost_sq_norms_and_grad(gn.sequence_logp_fn(graphdef), p, batch, batch["loss_mask"], coef)
    init = lambda: tf.split(tf.init(cfg, seed=1))[1]
    return _eqns(jax.make_jaxpr(step)(params).jaxpr), _eqns(jax.make_jaxpr(init)().jaxpr)

  (step2, init2), (step6, init6) = sizes(2, True), sizes(6, True)
  assert step6 == step2 and init6 == init2
  unrolled2, unrolled6 = sizes(2, False)[0], sizes(6, False)[0]
  assert unrolled6 > unrolled2 + 3 * (unrolled2 - step2)  # the loop's size is per layer


def test_hf_names_map_to_layer_slices(tmp_path):
  """model.layers.{i}.* <-> index i of the stacked parameter, both ways (export, then load)."""
  cfg = CFGS["llama"]
  model = tf.init(cfg, seed=4)
  tensors = hf_io.params_to_hf(model, cfg)
  q = np.asarray(model.layers.self_attn.q_proj.kernel[...])
  for i in range(L):
    np.testing.assert_array_equal(tensors[f"model.layers.{i}.self_attn.q_proj.weight"], q[i].T)
  back = hf_io.params_from_hf(tensors, cfg)
  np.testing.assert_array_equal(np.asarray(back.layers.self_attn.q_proj.kernel[...]), q)
  norm = np.asarray(back.layers.post_attention_layernorm.scale[...])
  assert norm.shape == (L, cfg.hidden_size)


@pytest.mark.slow  # four learner-step compiles at T = 512 (~30 s)
def test_scanned_step_memory_grows_by_the_saved_block_input_per_layer():
  """The cause of the multiturn learner's 59.8 GiB per device (16K-token rows, unrolled blocks), pinned small.

  The two-pass ghost step with remat="block" needs, per extra layer, only the block input the remat saves
  (2 rows x 512 tokens x 64 floats = 0.26 MB). Unrolled, XLA:CPU's default scheduler keeps the temporaries of
  several blocks alive at once (12.8 MB per layer at this shape), so the step's memory grows with depth x the
  per-block attention and MLP buffers; the scan runs one block's body at a time and its memory stays flat.
  """
  n, t = 2, 512
  sds = jax.ShapeDtypeStruct
  batch = {"tokens": sds((n, t), jnp.int32), "valid_mask": sds((n, t), bool), "loss_mask": sds((n, t), jnp.float32)}

  def temp_bytes(layers, scan):
    cfg = config.tiny_llama(vocab_size=256, num_layers=layers, hidden_size=64, intermediate_size=256, logprob_chunk=64,
                            remat="block", attention="chunked", attention_chunk=128, scan_layers=scan)  # fmt: skip
    graphdef, abstract = tf.split(jax.eval_shape(lambda: tf.init(cfg)))
    coef = lambda lp, sq: (sq, None)
    fn = lambda p, b: (
      gn.ghost_sq_norms_and_grad(
        gn.sequence_logp_fn(graphdef),
        p,
        b,
        b["loss_mask"],
        coef,
        method="direct",
        memory_budget_bytes=1 << 20,
        passes=2,
      ).grads
    )
    return jax.jit(fn).lower(abstract, batch).compile().memory_analysis().temp_size_in_bytes

  saved_input = n * t * 64 * 4
  scanned = (temp_bytes(6, True) - temp_bytes(2, True)) / 4
  unrolled = (temp_bytes(6, False) - temp_bytes(2, False)) / 4
  assert scanned <= 2 * saved_input, (scanned, saved_input)
  assert unrolled > 10 * scanned, (unrolled, scanned)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_unrolled_decode_layers_draw_the_same_tokens_as_the_scan(name):
  """SamplerConfig.decode_layers="unrolled" (one cache buffer pair per layer, a Python loop over the layers in
  the decode step) draws the same tokens with the same behaviour log-probs as the scanned decode, stop tokens
  included; the prompt bucket is prefilled in chunks (the scan over chunks) as before."""
  _, _, params = _models(name)
  cfg = CFGS[name]
  graphdef, _ = tf.split(tf.init(cfg, seed=3))
  base = dict(prompt_buckets=(8,), new_token_buckets=(8,), batch_buckets=(4,), max_new_tokens=8, prefill_chunk=2)
  prompts = [[3, 17, 42], [7, 8, 9, 10, 11], [5]]
  outs = []
  for layers in ("scan", "unrolled"):
    scfg = S.SamplerConfig(**base, eos_id=11, decode_layers=layers)
    outs.append(S.Sampler(graphdef, cfg, scfg).generate(params, prompts, jax.random.key(2), num_samples=2))
  a, b = outs
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.lengths, b.lengths)
  np.testing.assert_allclose(a.behavior_logp, b.behavior_logp, atol=1e-6)


def test_unrolled_decode_step_reads_each_layer_cache_in_place():
  """The compiled unrolled decode step holds no cache-sized copy or slice (the scanned one copies each layer's
  slice of the stacked cache before its matmul: the reason for the unrolled path, XLA:CPU)."""
  cfg = CFGS["qwen2"]
  graphdef, params = tf.split(tf.init(cfg, seed=3))
  b, tp, tn = 4, 8, 8

  def cache_copies(layers):
    scfg = S.SamplerConfig(
      prompt_buckets=(tp,), new_token_buckets=(tn,), batch_buckets=(b,), max_new_tokens=tn, decode_layers=layers
    )
    text = S.Sampler(graphdef, cfg, scfg).lower(params, b, tp, tn, part="decode").compile().as_text()
    k_shape = f"f32[{b},{cfg.num_kv_heads},{cfg.head_dim},{tp + tn}]"  # one layer's keys [B, K, H, S]
    # a copy, or a fusion that slices (an in-place dynamic-update-slice fusion writes the new keys: not a copy)
    out = lambda line: line.split("=")[0]
    copied = lambda line: "copy(" in line or ("fusion(" in line and "slice" in out(line).replace("update-slice", ""))
    return [line for line in text.splitlines() if f"= {k_shape}" in line and copied(line)]

  assert cache_copies("scan")  # the scan's per-layer dynamic-slice of the stacked cache, materialised
  assert not cache_copies("unrolled")


@pytest.mark.parametrize("layers", ["scan", "unrolled"])
def test_decode_step_computes_the_rotation_once(layers):
  """The decode step reads its RoPE from the call's table (`transformer.rotation_table`): no sin or cos in the
  compiled step, where each layer's q and k fusions computed their own (XLA:CPU, 2 per layer)."""
  cfg = CFGS["qwen2"]
  graphdef, params = tf.split(tf.init(cfg, seed=3))
  scfg = S.SamplerConfig(
    prompt_buckets=(8,), new_token_buckets=(8,), batch_buckets=(4,), max_new_tokens=8, decode_layers=layers
  )
  text = S.Sampler(graphdef, cfg, scfg).lower(params, 4, 8, 8, part="decode").compile().as_text()
  assert " cosine(" not in text and " sine(" not in text
  generate = S.Sampler(graphdef, cfg, scfg).lower(params, 4, 8, 8).compile().as_text()
  assert 1 <= generate.count(" cosine(") <= 2  # the table (and the prefill's rotation): not one per layer


def test_unrolled_decode_layers_config_errors():
  with pytest.raises(ValueError, match="decode_layers"):
    S.SamplerConfig(decode_layers="loop")
  with pytest.raises(ValueError, match="decode_layers"):
    S.SamplerConfig(decode_layers="unrolled", decode="refill")
  with pytest.raises(schema.ConfigError, match=r"config.sampler.decode_layers='loop'"):
    S.SamplingConfig(decode_layers="loop")
  assert S.SamplerConfig(**S.SamplingConfig(decode_layers="unrolled").sampler_kwargs()).decode_layers == "unrolled"


def test_auto_decode_layers_follow_the_models_layout():
  """decode_layers="auto" (the default) decodes over per-layer caches exactly for a dense model with unrolled layers
  under static decode; "scan" / "unrolled" are taken as given."""
  dense = config.tiny_qwen2()
  moe = config.tiny_qwen3_moe()
  auto = S.SamplerConfig()
  assert auto.decode_layers == "auto"
  assert S.unrolled_decode(auto, dense.replace(scan_layers=False))
  assert not S.unrolled_decode(auto, dense.replace(scan_layers=True))
  assert not S.unrolled_decode(auto, moe.replace(scan_layers=False))
  for mode in ("chunked", "refill"):
    assert not S.unrolled_decode(S.SamplerConfig(decode=mode), dense.replace(scan_layers=False))
  assert S.unrolled_decode(S.SamplerConfig(decode_layers="unrolled"), dense.replace(scan_layers=True))
  assert not S.unrolled_decode(S.SamplerConfig(decode_layers="scan"), dense.replace(scan_layers=False))
