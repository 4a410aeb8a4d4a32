"""Defaults shared by every config, generated from the run's dataclass tree (vcpo_jax/run_spec.py RunConfig).

Each field's default and one-line comment are written once, on its line in the section's dataclass (its
component's own config where it has one); each experiment config overrides what it needs. `python
main.py --config=FILE --config_help` prints every field with that config's values (a placeholder with
the value in effect: `model.hidden_size: int = None -> 64 (preset 'tiny')`) and its comment, the method's
tree with only its chosen choices' fields (rl/choices.py), then the comments of the fields the experiment file
adds itself (task.gen.*, model.shape.*). It also holds what the released configs (gsm8k, math, multiturn)
share: the paper's recipe (`released_recipe`) and their checkpoints' architectures (`qwen2_shape`).
"""

import ast
import io
import os
import tokenize

import ml_collections

from vcpo_jax import schema
from vcpo_jax.model import config as model_config
from vcpo_jax.rl import choices
from vcpo_jax.run_spec import RunConfig

__all__ = ["QWEN2_SHAPES", "field_comments", "get_base_config", "help_text", "leaves", "qwen2_shape", "released_recipe"]

leaves = schema.leaves


def get_base_config() -> ml_collections.ConfigDict:
  """The ConfigDict of RunConfig() (every section at its defaults)."""
  return schema.to_config_dict(RunConfig)


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


def _assignment_comments(path: str) -> dict[str, str]:
  """{"task.name": comment} for every `c.task.name = ...  # comment` statement of a config file."""
  with open(path) as f:
    source = f.read()
  toks = tokenize.generate_tokens(io.StringIO(source).readline)
  comments = {t.start[0]: t.string.lstrip("#").strip() for t in toks if t.type == tokenize.COMMENT}
  out: dict[str, str] = {}
  for node in sorted((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
    text = comments.get(node.end_lineno) or comments.get(node.lineno)
    for target in node.targets:
      parts = []
      while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
      if parts and isinstance(target, ast.Name) and target.id == "c" and text:
        out.setdefault(".".join(reversed(parts)), text)  # the first comment of a field (its main path) wins
  return out


def field_comments(config_file: str | None = None) -> dict[str, str]:
  """{dotted field: one-line comment}: the dataclass tree's (what a field is), then config_file's (the fields
  it adds), then this file's (the fields its helpers add for a config: qwen2_shape's model.shape.*)."""
  out = schema.comments(RunConfig)
  if config_file:
    for path in (config_file, __file__):
      for k, v in _assignment_comments(path).items():
        out.setdefault(k, v)
  return out


def _effective(c: ml_collections.ConfigDict) -> dict[str, tuple]:
  """{placeholder path: (the value in effect, its source)}: the model preset's sizes when no checkpoint is given."""
  out = {}
  m = c.get("model")
  if m is not None and not m.get("checkpoint") and m.get("preset") in model_config.PRESETS:
    base = model_config.PRESETS[m.preset]()
    out.update({f"model.{k}": (getattr(base, k), m.preset) for k in ("hidden_size", "num_layers", "intermediate_size")})
  return out


def help_text(c: ml_collections.ConfigDict, config_file: str | None = None) -> str:
  """Every field of `c` with its value and one-line comment (what `python main.py --config_help` prints).

  A placeholder (None: the preset's value) shows the value in effect, e.g.
  `model.hidden_size: int = None -> 64 (preset 'tiny')`; the method shows its parts' chosen choices and only
  their fields (rl.choices.help_lines: ppo_clip's eps_low / eps_high, no TIS c)."""
  comments, effective = field_comments(config_file), _effective(c)
  lines = [f"Fields of {config_file or os.path.relpath(__file__)} (set with --config.FIELD=VALUE; None = preset):"]
  method_shown = False
  for path, value, type_name in leaves(c):
    if path.startswith(choices.ROOT + "."):
      if not method_shown:
        method_shown = True
        text = "the preset it equals or is nearest; set --config.method=PRESET, .PART=CHOICE, .PART.FIELD=VALUE"
        lines.append(f"  {choices.ROOT}: {choices.describe(choices.build(c[choices.ROOT]))}  # {text}")
        for p, v, text in choices.help_lines(c[choices.ROOT]):
          lines.append(f"  {p}: {'None' if v is None else type(v).__name__} = {v!r}  # {text}")
      continue
    shown = repr(value)
    if value is None and path in effective:
      shown = f"None -> {effective[path][0]!r} (preset {effective[path][1]!r})"
    lines.append(f"  {path}: {type_name} = {shown}  # {comments.get(path, '(no comment)')}")
  return "\n".join(lines)
