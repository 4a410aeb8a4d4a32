"""Defaults shared by every config, generated from the run's dataclass tree (vcpo_jax/run_spec.py RunConfig).

Each field's default and one-line comment are written once, on its line in the section's dataclass (its
component's own config where it has one); each experiment config overrides what it needs. `python
main.py --config=FILE --config_help` prints every field with that config's values (a placeholder with
the value in effect: `model.hidden_size: int = None -> 64 (preset 'tiny')`) and its comment, the method's
tree with only its chosen choices' fields (rl/choices.py), then the comments of the fields the experiment file
adds itself (task.gen.*, model.shape.*, including those configs/released.py's helpers add).
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

__all__ = ["field_comments", "get_base_config", "help_text", "leaves"]

leaves = schema.leaves


def get_base_config() -> ml_collections.ConfigDict:
  """The ConfigDict of RunConfig() (every section at its defaults)."""
  return schema.to_config_dict(RunConfig)


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
  it adds), then configs/released.py's (the fields its helpers add for a config: qwen2_shape's model.shape.*)."""
  out = schema.comments(RunConfig)
  if config_file:
    for path in (config_file, os.path.join(os.path.dirname(__file__), "released.py")):
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
