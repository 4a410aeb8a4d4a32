"""LoRA adapters on the policy: which parameters train, and the adapter tree that travels.

With `ModelConfig.lora_rank` = r > 0 every targeted projection (`ModelConfig.lora_targets`) computes

    y = x W (+ b) + (alpha / r) * (x A) B,        A [Din, r], B [r, Dout] (B = 0 at init: step 0 = the base)

(`transformer.Linear`, `transformer.LoRAFactor`). The base W, b, norms, embedding and head are frozen and
stored in the compute dtype; A and B are `nnx.LoRAParam` in float32. The parameter tree the rest of the code
passes around (TrainState.params, the sampler's params) is the whole model, base + adapters: every forward
pass is unchanged. What trains, what the optimizer holds state for and what is published is the adapter
subtree, `split(params)[0]`; `combine` puts the two back together.

Exact per-example norms: each factor is tapped as an ordinary "linear" layer (`vcpo_jax.model.taps`), A with
input x and output u = x A, B with input u and output u B, and the frozen layers are not tapped, so
`grad_norms` gives S_n = sum over the adapters of ||g_A,n||^2 + ||g_B,n||^2 (gram / direct / materialize,
one or two passes) with no LoRA-specific code: g_A,n = x_n^T (dL/du_n), g_B,n = u_n^T (dL/dz_n).

`merge_into_base` folds the adapters into the base weights (W + (alpha / r) A B, float32) for export and
for a sampler that prefers merged weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from vcpo_jax import sharding
from vcpo_jax.model import transformer
from vcpo_jax.model.config import ModelConfig


def has_adapters(params) -> bool:
  """Whether `params` (an nnx.State) holds LoRA adapters."""
  return isinstance(params, nnx.State) and bool(jax.tree.leaves(nnx.filter_state(params, nnx.LoRAParam)))


def split(params):
  """(trainable, frozen): (adapters, base) with LoRA; (params, None) without (everything trains)."""
  if not has_adapters(params):
    return params, None
  return nnx.split_state(params, nnx.LoRAParam, ...)


def combine(trainable, frozen):
  """The inverse of `split`: the whole parameter tree."""
  return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def adapters(params):
  """The adapter subtree (nnx.State of LoRAParam); empty without LoRA."""
  return nnx.filter_state(params, nnx.LoRAParam)


def freeze_base(params, cfg: ModelConfig):
  """The base (non-adapter) floating parameters cast to the compute dtype (LoRA's frozen base layout)."""
  trainable, frozen = split(params)
  if frozen is None:
    return params
  dt = cfg.compute_dtype
  frozen = jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, frozen)
  return combine(trainable, frozen)


def lora_kernels(params) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Dotted path of each adapted projection ("layers.self_attn.q_proj") -> (A [L, Din, r], B [L, r, Dout]), stacked."""
  flat = {sharding.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(adapters(params))[0]}
  out = {}
  for path, a in flat.items():
    if path.endswith(".lora_a.kernel"):
      base = path[: -len(".lora_a.kernel")]
      out[base] = (a, flat[base + ".lora_b.kernel"])
  return out


def merge_into_base(params, cfg: ModelConfig):
  """(cfg without LoRA, float32 params of the plain model): W <- W + (alpha / r) A B on every adapted projection.

  The result has exactly the parameter tree of `transformer.init(cfg.replace(lora_rank=0))` (export to Hugging
  Face format, or a sampler that applies merged weights once per version)."""
  pairs = lora_kernels(params)
  scale = cfg.lora_scale
  _, frozen = split(params)
  if frozen is None:
    return cfg, params

  def merge(path, x):
    name = sharding.path_str(path)
    x = x.astype(jnp.float32)
    owner = name[: -len(".kernel")] if name.endswith(".kernel") else None
    if owner in pairs:
      a, b = pairs[owner]
      x = x + scale * (a.astype(jnp.float32) @ b.astype(jnp.float32))
    return x

  base_cfg = cfg.replace(lora_rank=0)
  plain = jax.tree_util.tree_map_with_path(merge, frozen)
  # the same nnx.State layout (Param leaves, float32) as the plain model's split
  _, abstract = transformer.split(nnx.eval_shape(lambda: transformer.init(base_cfg)))
  flat = dict(nnx.to_flat_state(plain))
  out = [(p, v.replace(flat[p][...])) for p, v in nnx.to_flat_state(abstract)]
  return base_cfg, nnx.from_flat_state(out)


def init_adapters(cfg: ModelConfig, seed: int, mesh=None, rules: sharding.Rules = sharding.TRANSFORMER_RULES):
  """The adapters `transformer.init(cfg, seed)` would make (A from its "lora" stream, B = 0), born sharded.

  Only the adapters are computed: the base's initializer is dead code under jit."""

  def make():
    return adapters(transformer.split(transformer.init(cfg, seed))[1])

  if mesh is None:
    return jax.jit(make)()
  abstract = jax.eval_shape(make)
  return jax.jit(make, out_shardings=sharding.param_shardings(abstract, rules, mesh))()


def attach(cfg: ModelConfig, base_params, seed: int, mesh=None, rules: sharding.Rules = sharding.TRANSFORMER_RULES):
  """(graphdef, params) of the LoRA model `cfg` on top of a plain model's parameters (e.g. a checkpoint).

  base_params: the parameter tree of `cfg.replace(lora_rank=0)`'s model; cast to the compute dtype (frozen)."""
  if not cfg.lora:
    raise ValueError("lora.attach: cfg.lora_rank is 0; nothing to attach (set model.lora_rank > 0).")
  graphdef, _ = transformer.split(nnx.eval_shape(lambda: transformer.init(cfg)))
  params = combine(init_adapters(cfg, seed, mesh, rules), base_params)
  return graphdef, freeze_base(params, cfg)


def num_bytes(tree) -> int:
  """Bytes of the arrays in `tree` (what a publish of it moves)."""
  return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
