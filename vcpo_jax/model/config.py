"""Architecture settings of the decoder-only policy (Qwen2/Qwen2.5, Qwen3 dense and MoE, and Llama families).

`ModelConfig` is the one place architecture crosses into the model code. It is
built from a Hugging Face `config.json` (read with transformers' config classes,
so every alias and default is the one transformers uses) or from a preset for
CPU-sized tests and demos.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from vcpo_jax import schema
from vcpo_jax.model.moe import GROUPED_MATMULS, MoESpec
from vcpo_jax.model.rope import RopeScaling

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT_ROPE = RopeScaling()  # plain RoPE (frozen, shared as the dataclass default)
ATTENTION_IMPLEMENTATIONS = ("dense", "xla", "chunked", "cudnn", "splash")  # see vcpo_jax.model.attention
# How the model is computed, not what it is: set from the run config for presets AND checkpoints
# (a checkpoint's config.json gives the architecture, never these).
EXECUTION_FIELDS = (
  "attention",
  "attention_chunk",
  "remat",
  "scan_layers",
  "logprob_chunk",
  "logprob_vocab_chunk",
  "routing_replay",
  "moe_matmul",
)
REMAT_CHOICES = ("none", "block")
# jax.checkpoint_policies that are policies themselves (the others are factories taking names).
REMAT_POLICIES = (
  "everything_saveable",
  "nothing_saveable",
  "dots_saveable",
  "checkpoint_dots",
  "dots_with_no_batch_dims_saveable",
  "checkpoint_dots_with_no_batch_dims",
)
# LoRA (vcpo_jax.model.lora): the projections adapters may target, and the fields that, like the execution
# fields, come from the run config for presets AND checkpoints (a checkpoint's config.json never has them).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")
# ModelConfig's fields a run config sets (config.model.*, ModelSection): the compute dtype, execution and LoRA fields.
RUN_FIELDS = ("dtype",) + EXECUTION_FIELDS + LORA_FIELDS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer hyper-parameters.

  Attributes:
    vocab_size: V, rows of the embedding table.
    hidden_size: D, residual stream width.
    intermediate_size: F, SwiGLU hidden width.
    num_layers: number of transformer blocks.
    num_heads, num_kv_heads: query heads; key/value heads (grouped-query attention when fewer).
    head_dim: per-head width H (hidden_size // num_heads unless the checkpoint says otherwise).
    rope_theta, rms_eps: RoPE base frequency; RMSNorm epsilon.
    qkv_bias: q/k/v projections carry a bias (Qwen2) or not (Llama, Qwen3).
    qk_norm: RMSNorm over each head's H of q and k before RoPE (Qwen3's q_norm / k_norm).
    rope_scaling: the RoPE scaling rule (`vcpo_jax.model.rope`; default RoPE when "default").
    tie_embeddings, max_position: the LM head reuses the embedding table; the longest sequence (cache bound).
    dtype: compute dtype, "float32" or "bfloat16" (parameters stay float32).
    model_type: "qwen2", "qwen3" or "llama" (for export back to Hugging Face format).
    attention: `vcpo_jax.model.attention`: "dense" (einsum reference, default), "xla" (jax.nn.dot_product_attention),
      "chunked" (query chunks, never [B, N, T, T]), "cudnn" (GPU flash attention), "splash" (TPU Pallas kernel).
    attention_chunk: query chunk of "chunked" and key block of the cached decode attention, in tokens.
    remat: rematerialization of each block in the backward pass: "none", "block" (save only the block
      inputs) or the name of a `jax.checkpoint_policies` policy (e.g. "dots_with_no_batch_dims_saveable").
    scan_layers: run the blocks as one `jax.lax.scan` (compile time flat in depth); False unrolls them.
    logprob_chunk: positions along T per chunk of the log-prob head (0 = all at once, as is T <= chunk + 1).
    logprob_vocab_chunk: vocabulary entries per chunk (0 = whole vocabulary; keep 0 with a "tensor" axis).
    lora_rank: r of the LoRA adapters (vcpo_jax.model.lora); 0 = none. With r > 0 every base parameter is
      frozen (stored in the compute dtype) and only the float32 adapters train.
    lora_alpha, lora_targets: the adapter path is scaled by lora_alpha / lora_rank (PEFT's convention); the
      projections that get adapters, names from LORA_TARGETS (default: all seven).
    num_experts: E, experts per MoE block (Qwen3-MoE); 0 = a dense model (every other MoE field unused).
    num_experts_per_tok, moe_intermediate_size: K, experts each token is routed to; each expert's SwiGLU width.
    norm_topk_prob: the K gates are renormalised to sum to 1 (Qwen3-30B-A3B: True).
    decoder_sparse_step, mlp_only_layers: which layers are MoE blocks (`MoESpec.is_sparse`, transformers'
      rule). The layers run as one scan, so they must be all sparse (step 1, no mlp_only_layers) or all dense.
    router_aux_loss_coef: the checkpoint's weight of the router's load-balancing loss; never applied by itself
      (the learner's loss gains it only with learner.router_aux_loss_coef > 0, RL's default 0).
    routing_replay: the learner routes each token through the experts the sampler recorded (the Batch's
      expert_ids; R3, `moe` module docstring), gates from its own router; off, a dense model or a batch
      without the record: the learner's own top-K.
    moe_matmul: the experts' grouped matmul (`moe.grouped_matmul`): "ragged" (jax.lax.ragged_dot, default)
      or "scan" (over the experts: exact, E x the flops; for CPU sizing).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  qkv_bias: bool = False
  qk_norm: bool = False
  rope_scaling: RopeScaling = DEFAULT_ROPE
  tie_embeddings: bool = False
  max_position: int = 2048
  dtype: str = "float32"  # compute dtype: float32 | bfloat16
  model_type: str = "llama"
  attention: str = "dense"  # kernel: dense (reference) | xla | chunked (no [B,H,T,T]) | cudnn | splash
  attention_chunk: int = 512  # query chunk of "chunked", key block of the cached decode
  remat: str = "none"  # per-block rematerialization: none | block | a jax.checkpoint_policies name
  scan_layers: bool = True  # the blocks as one scan (True) or unrolled (False: debugging)
  logprob_chunk: int = 512  # positions per chunk of the log-prob head (0 = [N, T, V] logits)
  logprob_vocab_chunk: int = 0  # vocabulary entries per head chunk (0 = all)
  lora_rank: int = 0  # LoRA adapters' rank r (0 = off: full fine-tuning); > 0 freezes the base
  lora_alpha: float = 16.0  # LoRA alpha: the adapter path is scaled by alpha / r
  lora_targets: tuple[str, ...] | str = LORA_TARGETS  # projections that get adapters (or "q_proj,v_proj")
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.0
  routing_replay: bool = False  # MoE: the learner replays the sampler's recorded experts
  moe_matmul: str = "ragged"  # MoE grouped matmul: ragged (ragged_dot) | scan (CPU sizing stand-in)

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):  # from dataclasses.asdict (a saved config)
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    if isinstance(self.lora_targets, (list, str)):  # a saved config (list) or "q_proj,v_proj" (run config)
      targets = self.lora_targets.split(",") if isinstance(self.lora_targets, str) else self.lora_targets
      object.__setattr__(self, "lora_targets", tuple(t.strip() for t in targets))
    self._check_lora()
    self._check_moe()
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "max_position",
      "attention_chunk",
    ):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
        f"({self.num_kv_heads}) for grouped-query attention."
      )
    for name in ("logprob_chunk", "logprob_vocab_chunk"):
      if int(getattr(self, name)) < 0:
        raise ValueError(f"ModelConfig.{name} must be >= 0 (0 = no chunking), got {getattr(self, name)}.")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}.")
    if self.dtype not in _DTYPES:
      raise ValueError(f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}.")
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"ModelConfig.model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}.")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(
        f"ModelConfig.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r} "
        "(use 'chunked' for long sequences on any backend)."
      )
    if self.remat not in REMAT_CHOICES + REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat must be one of {REMAT_CHOICES + REMAT_POLICIES}, got {self.remat!r}.")

  def _check_lora(self):
    r = self.lora_rank
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
      raise ValueError(f"ModelConfig.lora_rank={r!r}: must be an int >= 0 (0 = no LoRA adapters; e.g. 64).")
    if isinstance(self.lora_alpha, bool) or not (isinstance(self.lora_alpha, (int, float)) and self.lora_alpha > 0):
      raise ValueError(f"ModelConfig.lora_alpha={self.lora_alpha!r}: must be a number > 0 (scale = alpha / rank).")
    bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
    if bad or not self.lora_targets or len(set(self.lora_targets)) != len(self.lora_targets):
      raise ValueError(
        f"ModelConfig.lora_targets={self.lora_targets!r}: give distinct names from {LORA_TARGETS} (unknown: {bad})."
      )

  def _check_moe(self):
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
    if (self.model_type == "qwen3_moe") != (self.num_experts > 0):
      raise ValueError(
        f"ModelConfig.num_experts={self.num_experts} with model_type={self.model_type!r}: MoE blocks are "
        "Qwen3-MoE's (model_type='qwen3_moe' iff num_experts > 0)."
      )
    spec = self.moe  # MoESpec validates K, the widths and the aux coef
    if spec is not None:
      sparse = spec.sparse_layers(self.num_layers)
      if sparse and len(sparse) != self.num_layers:
        raise ValueError(
          f"ModelConfig: layers {sparse} of {self.num_layers} are MoE blocks (decoder_sparse_step="
          f"{self.decoder_sparse_step}, mlp_only_layers={self.mlp_only_layers}); the layers run as one scan of "
          "one block, so mixed dense/sparse stacks are not supported: make every layer sparse (Qwen3-MoE's default)."
        )
      if self.lora:
        raise ValueError("ModelConfig: LoRA adapters on MoE models are not supported (set lora_rank=0).")
    if self.moe_matmul not in GROUPED_MATMULS:
      raise ValueError(f"ModelConfig.moe_matmul must be one of {GROUPED_MATMULS}, got {self.moe_matmul!r}.")

  @property
  def moe(self) -> MoESpec | None:
    """The MoE fields as a `MoESpec` when num_experts > 0 (every layer an MoE block), else None (dense)."""
    if self.num_experts <= 0:
      return None
    return MoESpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MoESpec)})  # same-named fields

  @property
  def lora(self) -> bool:
    """LoRA adapters on (lora_rank > 0): the base is frozen, only the adapters train."""
    return self.lora_rank > 0

  @property
  def lora_scale(self) -> float:
    """alpha / r, the factor of the adapter path x A B."""
    return float(self.lora_alpha) / self.lora_rank if self.lora_rank else 0.0

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def remat_policy(self):
    """None (no remat), or the jax.checkpoint policy of each block ("block": save nothing inside it)."""
    if self.remat == "none":
      return None
    if self.remat == "block":
      return jax.checkpoint_policies.nothing_saveable
    return getattr(jax.checkpoint_policies, self.remat)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @property
  def num_params(self) -> int:
    d, f, h, v = self.hidden_size, self.intermediate_size, self.head_dim, self.vocab_size
    q, kv = self.num_heads * h, self.num_kv_heads * h
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
    mlp = (
      3 * d * f if self.moe is None else self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
    )
    block = attn + mlp + 2 * d + (2 * h if self.qk_norm else 0)
    return v * d * (1 if self.tie_embeddings else 2) + self.num_layers * block + d

  @classmethod
  def from_hf(cls, config_or_dir, dtype: str = "float32") -> "ModelConfig":
    """Builds a ModelConfig from a transformers config object or a checkpoint directory."""
    if isinstance(config_or_dir, (str, os.PathLike)):
      path = os.fspath(config_or_dir)
      if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
          f"No config.json in checkpoint directory {path!r}: pass a Hugging Face model directory "
          "(config.json + *.safetensors)."
        )
      import transformers  # local import: only needed for HF interop

      hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    else:
      hf = config_or_dir
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
        f"Unsupported architecture model_type={model_type!r} in config.json; supported: "
        f"{SUPPORTED_MODEL_TYPES} (Qwen2/Qwen2.5, Qwen3 dense and MoE, and Llama families)."
      )
    # transformers 5 keeps theta and the scaling in rope_parameters (legacy rope_scaling folded in)
    rope_params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    max_position = int(getattr(hf, "max_position_embeddings", 2048))
    rope_scaling = RopeScaling.from_hf(rope_params, max_position)
    if rope_scaling.rope_type == "dynamic":  # it exists to run past max_position_embeddings: factor x
      max_position = int(max_position * rope_scaling.factor)
    rope_theta = getattr(hf, "rope_theta", None)
    if rope_theta is None:
      rope_theta = rope_params.get("rope_theta", 10000.0)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if model_type in ("llama", "qwen3", "qwen3_moe") and getattr(hf, "attention_bias", False):
      raise ValueError(
        f"{model_type} checkpoints with attention_bias=True (biases on q/k/v/o) are not supported; "
        "set attention_bias=false."
      )
    qkv_bias = model_type == "qwen2"
    if model_type == "llama" and getattr(hf, "mlp_bias", False):
      raise ValueError("Llama checkpoints with mlp_bias=True are not supported.")
    return cls(
      vocab_size=hf.vocab_size,
      hidden_size=hf.hidden_size,
      intermediate_size=hf.intermediate_size,
      num_layers=hf.num_hidden_layers,
      num_heads=hf.num_attention_heads,
      num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
      head_dim=head_dim,
      rope_theta=float(rope_theta),
      rms_eps=float(hf.rms_norm_eps),
      qkv_bias=qkv_bias,
      qk_norm=model_type in ("qwen3", "qwen3_moe"),
      rope_scaling=rope_scaling,
      tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
      max_position=max_position,
      dtype=dtype,
      model_type=model_type,
      **_moe_fields(hf),
    )


def _moe_fields(hf) -> dict:
  """ModelConfig's MoE fields of a transformers config (none for a dense one)."""
  if getattr(hf, "model_type", None) != "qwen3_moe":
    return {}
  spec = MoESpec.from_hf(hf)
  return {f.name: getattr(spec, f.name) for f in dataclasses.fields(MoESpec)}


@dataclasses.dataclass(frozen=True)
@schema.fields_from(ModelConfig, RUN_FIELDS, after="intermediate_size")
class ModelSection:
  """config.model: a random-init preset (with size overrides) or a checkpoint, and how it is computed: the
  compute options (RUN_FIELDS) are ModelConfig's fields, with their defaults and comments (schema.fields_from)."""

  checkpoint: str = ""  # local Hugging Face directory ("" = random init of model.preset)
  preset: str = "tiny_qwen2"  # vcpo_jax.model.config.PRESETS name when no checkpoint
  hidden_size: int | None = None  # preset overrides (None = preset value)
  num_layers: int | None = None  # transformer blocks (None = preset value)
  intermediate_size: int | None = None  # SwiGLU width (None = preset value)
  tokenizer: str = ""  # tokenizer directory ("" = checkpoint dir, or the built-in char tokenizer)
  # A checkpoint's architecture for sizing without weights (benchmarks/memory.py; a run reads the checkpoint's
  # config.json): only in the ConfigDict when a config file sets it, its keys ModelConfig's fields.
  shape: dict = dataclasses.field(
    default_factory=dict, metadata={"when_set": True, "keys": ModelConfig}
  )  # checkpoint's config.json architecture (ModelConfig fields) for benchmarks/memory.py


def tiny_qwen2(vocab_size: int = 256, **kw) -> ModelConfig:
  """A few-layer Qwen2-style config (GQA, q/k/v bias, tied embeddings) for tests."""
  base = dict(
    vocab_size=vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=1e6,
    rms_eps=1e-6,
    qkv_bias=True,
    tie_embeddings=True,
    max_position=512,
    model_type="qwen2",
  )
  base.update(kw)
  return ModelConfig(**base)


def tiny_llama(vocab_size: int = 256, **kw) -> ModelConfig:
  """A few-layer Llama-style config (GQA 4/1, no bias, untied head, MLP 160) for tests: tiny_qwen2's other widths."""
  llama = {"intermediate_size": 160, "num_kv_heads": 1, "rope_theta": 10000.0, "rms_eps": 1e-5}
  llama.update(qkv_bias=False, tie_embeddings=False, model_type="llama")
  return tiny_qwen2(vocab_size, **{**llama, **kw})


def tiny_qwen3(vocab_size: int = 256, **kw) -> ModelConfig:
  """A few-layer Qwen3-style config (q/k norms, no bias, head_dim != D / N, tied) for tests: tiny_qwen2's widths."""
  qwen3 = dict(head_dim=32, qkv_bias=False, qk_norm=True, model_type="qwen3")
  return tiny_qwen2(vocab_size, **{**qwen3, **kw})


def tiny_qwen3_moe(vocab_size: int = 256, **kw) -> ModelConfig:
  """A few-layer Qwen3-MoE config (tiny_qwen3's attention, untied; every layer 8 experts, 2 per token,
  normalised top-k as Qwen3-30B-A3B) for tests."""
  moe = dict(
    model_type="qwen3_moe",
    tie_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
  )
  return tiny_qwen3(vocab_size, **{**moe, **kw})


PRESETS = {
  "tiny_qwen2": tiny_qwen2,
  "tiny_qwen3": tiny_qwen3,
  "tiny_llama": tiny_llama,
  "tiny_qwen3_moe": tiny_qwen3_moe,
}
