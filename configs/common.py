"""Defaults shared by every config, generated from the run's dataclass tree (vcpo_jax/run_spec.py RunConfig).

Each field's default and one-line comment are written once, on its line in the section's dataclass (its
component's own config where it has one); each experiment config overrides what it needs. `python
main.py --config=FILE --config_help` prints every field with that config's values (a placeholder with
the value in effect: `vcpo.tis_c: float = None -> 8.0 (preset 'vcpo')`) and its comment, then the
comments of the fields the experiment file adds itself (task.gen.*, model.shape.*).
"""

import ast
import io
import os
import tokenize

import ml_collections

from vcpo_jax import estimator, schema
from vcpo_jax.model import config as model_config
from vcpo_jax.rl import flat
from vcpo_jax.run_spec import RunConfig

__all__ = ["VCPO_COMMENTS", "field_comments", "get_base_config", "help_text", "leaves", "vcpo_comments"]

leaves = schema.leaves
VCPO_COMMENTS = schema.field_comment_lines(flat.Overrides)  # the comment on each flat vcpo.* name's line

# Fields chosen by name from an estimator registry: --config_help lists the registry's current names.
VCPO_CHOICES = {
  "advantage": "ADVANTAGE_ESTIMATORS",
  "is_variant": "WEIGHT_VARIANTS",
  "loss_agg": "LOSS_AGGREGATIONS",
  "mask_normalizer": "MASK_NORMALIZERS",
  "opob_weights": "OPOB_WEIGHTS",
  "opob_scope": "OPOB_SCOPES",
  "std": "STD_KINDS",
  "ess_rule": "ESS_LR_RULES",
}


def get_base_config() -> ml_collections.ConfigDict:
  """The ConfigDict of RunConfig() (every section at its defaults)."""
  return schema.to_config_dict(RunConfig)


def vcpo_comments() -> dict[str, str]:
  """{vcpo.* name: one-line comment}: the comment on its line in rl.flat.Overrides, then the registry's names
  for a field chosen by name (VCPO_CHOICES)."""
  out = {}
  for name, text in schema.comments(RunConfig).items():
    if name.startswith("vcpo."):
      field = name[len("vcpo.") :]
      choices = list(getattr(estimator, VCPO_CHOICES.get(field, ""), None) or ())
      if choices and not all(c in text for c in choices):
        text = f"{text}: {' | '.join(choices)}" if text else " | ".join(choices)
      out[field] = text
  return out


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
  it adds)."""
  out = {**schema.comments(RunConfig), **{f"vcpo.{k}": v for k, v in vcpo_comments().items()}}
  if config_file:
    for k, v in _assignment_comments(config_file).items():
      out.setdefault(k, v)
  return out


def _effective(c: ml_collections.ConfigDict) -> dict[str, tuple]:
  """{placeholder path: (the value in effect, its source)}: the method preset's live vcpo.* names (rl.flat.live:
  those that mean something for it), and the model preset's sizes when no checkpoint is given."""
  out = {}
  if c.get("method") in estimator.PRESETS:
    method = estimator.method_from_preset(c.method, **{k: v for k, v in c.vcpo.items() if v is not None})
    out.update({f"vcpo.{k}": (v, c.method) for k, v in flat.live(method).items()})
  m = c.get("model")
  if m is not None and not m.get("checkpoint") and m.get("preset") in model_config.PRESETS:
    base = model_config.PRESETS[m.preset]()
    out.update({f"model.{k}": (getattr(base, k), m.preset) for k in ("hidden_size", "num_layers", "intermediate_size")})
  return out


def help_text(c: ml_collections.ConfigDict, config_file: str | None = None) -> str:
  """Every field of `c` with its value and one-line comment (what `python main.py --config_help` prints).

  A placeholder (None: the preset's value) shows the value in effect, e.g.
  `vcpo.tis_c: float = None -> 8.0 (preset 'vcpo')`; a vcpo.* name that means nothing for the chosen method
  (tis_c under ppo_clip) is left out."""
  comments, effective = field_comments(config_file), _effective(c)
  lines = [f"Fields of {config_file or os.path.relpath(__file__)} (set with --config.FIELD=VALUE; None = preset):"]
  for path, value, type_name in leaves(c):
    if path.startswith("vcpo.") and value is None and effective and path not in effective:
      continue  # inert for this method
    shown = repr(value)
    if value is None and path in effective:
      shown = f"None -> {effective[path][0]!r} (preset {effective[path][1]!r})"
    lines.append(f"  {path}: {type_name} = {shown}  # {comments.get(path, '(no comment)')}")
  return "\n".join(lines)
