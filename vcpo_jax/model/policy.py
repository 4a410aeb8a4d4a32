"""The run's policy: tokenizer, model config and parameters, placed on the learner's mesh.

A random preset is born sharded (init_sharded: eval_shape -> shardings from the rules ->
jit(init, out_shardings)), so no host or device ever holds the whole model; its values equal the host
initializer's bit for bit (transformer._INIT). A Hugging Face checkpoint is read straight into the same
shardings, each device's block as its own slice of the file (hf_io.load_hf with a mesh).
"""

from __future__ import annotations

import jax
from flax import nnx

from vcpo_jax import sharding
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf_io, lora, transformer
from vcpo_jax.model import tokenizer as tok_lib


def load_tokenizer(checkpoint: str = "", tokenizer_dir: str = ""):
  """model.tokenizer's tokenizer, else the checkpoint's, else the built-in character tokenizer."""
  if tokenizer_dir or checkpoint:
    return tok_lib.load_tokenizer(tokenizer_dir or checkpoint)
  return tok_lib.build_char_tokenizer()


def build_policy(
  model_cfg: model_config.ModelConfig, mesh, *, seed: int, checkpoint: str = "", tokenizer_dir: str = ""
):
  """(model_cfg, tokenizer, graphdef, params), params laid out by sharding.TRANSFORMER_RULES on `mesh`.

  Args:
    model_cfg: the preset's config (random init; its vocabulary grows to the tokenizer's), or for a
      checkpoint only its dtype, execution fields (model_config.EXECUTION_FIELDS) and LoRA fields
      (model_config.LORA_FIELDS: adapters attached to the loaded base, `lora.attach`) are used.
    mesh: the learner's mesh. seed: the initializer's seed.
    checkpoint: a local Hugging Face model directory ("" = random init). tokenizer_dir: see load_tokenizer.
  """
  tokenizer = load_tokenizer(checkpoint, tokenizer_dir)
  if not checkpoint:
    model_cfg = model_cfg.replace(vocab_size=max(model_cfg.vocab_size, len(tokenizer)))
    graphdef, params = init_sharded(model_cfg, seed, mesh)
    return model_cfg, tokenizer, graphdef, params
  model_cfg_in = model_cfg
  execution = {f: getattr(model_cfg, f) for f in model_config.EXECUTION_FIELDS}
  model_cfg, model = hf_io.load_hf(
    checkpoint, dtype=model_cfg.dtype, mesh=mesh, rules=sharding.TRANSFORMER_RULES, **execution
  )
  graphdef, params = transformer.split(model)
  if lora_fields := {f: getattr(model_cfg_in, f) for f in model_config.LORA_FIELDS if model_cfg_in.lora}:
    model_cfg = model_cfg.replace(**lora_fields)
    graphdef, params = lora.attach(model_cfg, params, seed, mesh)
  return model_cfg, tokenizer, graphdef, params


def init_sharded(cfg: model_config.ModelConfig, seed: int, mesh, rules: sharding.Rules = sharding.TRANSFORMER_RULES):
  """Creates the model's parameters directly in their sharded layout.

  eval_shape traces the initializer without allocating, the rules turn the
  abstract parameters into shardings, and jit(init, out_shardings) materializes
  each shard on its own device, so no device ever holds the full model. The
  values equal `transformer.split(transformer.init(cfg, seed))[1]`.

  Returns:
    (graphdef, params): params an nnx.State of nnx.Param holding sharded jax.Arrays.
  """

  def init_params():
    return transformer.split(transformer.init(cfg, seed))[1]

  abstract_model = nnx.eval_shape(lambda: transformer.init(cfg, seed))
  graphdef, abstract_params = transformer.split(abstract_model)
  shardings = sharding.param_shardings(abstract_params, rules, mesh)
  params = jax.jit(init_params, out_shardings=shardings)()
  return graphdef, params
