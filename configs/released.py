"""What the released configs (gsm8k, math, multiturn) share: the VCPO paper's recipe (`released_recipe`) and their
Qwen2-family checkpoints' architectures (`qwen2_shape`). configs/common.py generates the defaults; these
helpers set a config's values on top of them.
"""

import ml_collections

from vcpo_jax.rl import choices

__all__ = ["QWEN2_SHAPES", "qwen2_shape", "released_recipe"]


def released_recipe(c: ml_collections.ConfigDict) -> None:
  """The values the VCPO paper's released scripts (arXiv 2602.17616) share across GSM8K, MATH and multi-turn tool
  use, and those configs' shared accelerator settings; each config then sets its task's own (P, G, lengths, k,
  rho_on, data, cadences)."""
  c.mode = "async"  # released runs are asynchronous (sampler process + shared-memory queue)
  c.method = choices.preset("vcpo")  # ESS-scaled lr + OPOB on top of GRPO-style seq-TIS
  c.method.weights.c = 8.0  # sequence TIS truncation c (released)
  c.task.chat_template = True  # wrap prompts with the checkpoint's chat template
  c.model.dtype = "bfloat16"  # compute dtype on accelerators
  c.model.attention = "chunked"  # no [B, H, T, T] (on TPU: "splash", on GPU: "cudnn")
  c.model.remat = "block"  # keep only block inputs for the backward pass
  c.model.logprob_chunk = 256  # log-prob head in 256-position chunks (never [N, T, V] logits)
  c.learner.one_pass_budget_gib = 24.0  # per device (a quarter of a 95 GiB chip); see grad_norms.one_pass_bytes
  c.sampler.temperature = 1.0  # released training temperature
  c.sampler.prefill_chunk = 512  # prompt tokens per prefill pass: prefill memory flat in depth
  c.optim.lr = 1e-6  # released AdamW learning rate
  c.optim.weight_decay = 0.1  # released
  c.optim.clip_norm = 1.0  # released global-norm clip
  c.optim.schedule = "constant"  # released: no warmup, no decay
  c.eval.temperature = 0.8  # released validation protocol
  c.eval.top_p = 0.7  # released validation nucleus
  c.mesh.shape = (1, -1, 1)  # FSDP over the learner's devices


# The Qwen2-family checkpoints the released configs train: the values of their config.json (vocab_size,
# hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, tie_word_embeddings).
QWEN2_SHAPES = {
  "Qwen2-1.5B": (151936, 1536, 8960, 28, 12, 2, True),
  "Qwen2.5-7B": (152064, 3584, 18944, 28, 28, 4, False),  # and Qwen2.5-7B-Instruct
}


def qwen2_shape(c: ml_collections.ConfigDict, checkpoint: str) -> None:
  """c.model.shape of a QWEN2_SHAPES checkpoint (128-wide heads, theta 1e6): what benchmarks/memory.py compiles
  without weights (a run loads the checkpoint's own config.json)."""
  vocab, d, f, layers, heads, kv_heads, tied = QWEN2_SHAPES[checkpoint]
  c.model.shape = ml_collections.ConfigDict()  # the checkpoint's architecture, for sizing without weights
  c.model.shape.vocab_size = vocab  # config.json vocab_size
  c.model.shape.hidden_size = d  # hidden_size (D)
  c.model.shape.intermediate_size = f  # intermediate_size (F)
  c.model.shape.num_layers = layers  # num_hidden_layers
  c.model.shape.num_heads = heads  # num_attention_heads
  c.model.shape.num_kv_heads = kv_heads  # num_key_value_heads (grouped-query attention)
  c.model.shape.head_dim = 128  # hidden_size // num_attention_heads
  c.model.shape.rope_theta = 1000000.0  # rope_theta
  c.model.shape.rms_eps = 1e-6  # rms_norm_eps
  c.model.shape.tie_embeddings = tied  # tie_word_embeddings
  c.model.shape.qkv_bias = True  # Qwen2 family: q/k/v projections carry a bias
  c.model.shape.model_type = "qwen2"  # model_type
