"""Frozen config dataclasses <-> the ml_collections ConfigDict of `--config`, and the one-line ConfigError.

A config section is a frozen dataclass whose fields are its knobs, each written once:

  @dataclasses.dataclass(frozen=True)
  class CheckpointConfig:
    every: int = 50  # save every this many steps (and at the end / on SIGTERM)

The field's type and default make the ConfigDict entry (`to_config_dict`), the comment on its line is its
`--config_help` text (`comments`), `__post_init__` checks it. A field that is another dataclass is a
sub-section (`section(Cls)`); a `dict` field an open sub-dict (task.gen); `int | None = None` a typed
placeholder (None = "the preset's value"); a union of two types (`int | str`) takes either; `tree(default,
to_tree, build)` a value kept in the ConfigDict as a tree of its own (config.method: rl/choices.py), checked by build;
`@fields_from(Cls, names)` gives a section fields of another class, each with the type, default and comment it has
there (config.model's compute options are ModelConfig's, config.eval's sampling EvalProtocol's);
metadata {"config": False} keeps a field out of the ConfigDict; {"when_set": True} keeps a `dict` field out of the
default ConfigDict (a config file adds the block: model.shape) and {"keys": Cls} limits its keys to Cls's fields.
`from_config_dict` builds the tree back, refuses a key the tree does not model (`unknown_field`: a misspelled
`c.model.lora_rnak = 8` in a config file fails like `--config.model.lora_rnak=8`) and names the config field in
every error (`config_errors`). This module imports no vcpo_jax module.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import inspect
import io
import math
import re
import textwrap
import tokenize
import types
import typing

import ml_collections
from ml_collections import config_dict


class ConfigError(ValueError):
  """A bad config value; the message is one line: `config.FIELD=VALUE: what to do`."""


def check_field(ok: bool, field: str, value, fix: str):
  if not ok:
    raise ConfigError(f"config.{field}={value!r}: {fix}")


def finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@contextlib.contextmanager
def config_errors(section: str, cls=None, names: dict[str, str] | None = None):
  """Re-raises a component's ValueError / TypeError as a ConfigError naming config.<section>.<field>.

  Component messages name their field as `Class.field ...`, `section.field ...` or `field ...`;
  `names` maps component field names that differ from the config's (EvalProtocol.size -> num_problems).
  """
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(config_message(str(e), section, cls, names or {})) from None


def config_message(msg: str, section: str, cls=None, names: dict[str, str] | None = None) -> str:
  """A component's error message as one line that names the config field (`config.optim.b1=1.5: ...`)."""
  msg = " ".join(msg.split())  # one line
  if msg.startswith("config."):
    return msg
  names = names or {}
  known = set(names) | ({f.name for f in dataclasses.fields(cls)} if cls is not None else set())
  m = re.match(r"(?:[A-Z]\w*\.)?([a-z_]\w*(?:\.[a-z_]\w*)*)(.*)$", msg)
  if m:
    field, rest = m.groups()
    if "." in field and field.split(".")[0] == section.split(".")[0]:  # already a config path: "optim.b1=..."
      return f"config.{field}{rest}"
    if field in known:
      return f"config.{section}.{names.get(field) or field}{rest}"
  return f"config.{section}: {msg}"


# ----------------------------------------------------------------------------- dataclass -> ConfigDict


def section(cls):
  """A sub-section field: an instance of dataclass `cls` at its defaults."""
  return dataclasses.field(default_factory=cls)


def fields_from(source, names, after: str | None = None):
  """Class decorator, under @dataclasses.dataclass: the section gets `source`'s fields `names` (config.model's
  compute options are ModelConfig's), each with source's type, default and metadata, written once there; its
  `--config_help` text is the comment on its line in source (`comments`). They come in source's order after
  field `after` (default: the section's last field); metadata {"from": source} marks them (`borrowed`)."""

  def add(cls):
    own = inspect.get_annotations(cls)
    clash = sorted(set(names) & set(own))
    if clash:
      raise TypeError(f"{cls.__name__}: {clash} come from {source.__name__} (fields_from); do not declare them")
    hints, fields = typing.get_type_hints(source), {f.name: f for f in dataclasses.fields(source)}
    unknown = sorted(set(names) - set(fields))
    if unknown:
      raise TypeError(f"{cls.__name__}: {source.__name__} has no fields {unknown}")
    ordered = [name for name in fields if name in names]
    at = list(own).index(after) + 1 if after else len(own)
    keys = list(own)[:at] + ordered + list(own)[at:]
    cls.__annotations__ = {k: own[k] if k in own else hints[k] for k in keys}
    for name in ordered:
      f = fields[name]
      kw = {"default": f.default} if f.default is not dataclasses.MISSING else {"default_factory": f.default_factory}
      setattr(cls, name, dataclasses.field(**kw, metadata={**f.metadata, "from": source}))
    return cls

  return add


def borrowed(obj) -> dict:
  """{name: value} of the fields dataclass instance `obj` has from another class (`fields_from`)."""
  return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if "from" in f.metadata}


def tree(default, to_tree, build):
  """A field whose value (`default()`) the ConfigDict holds as the tree `to_tree(value)`, made back by
  `build(tree)`, which checks the tree's keys itself (config.method: rl.choices.tree / rl.choices.build)."""
  return dataclasses.field(default_factory=default, metadata={"tree": (to_tree, build)})


def _config_fields(cls):
  return [f for f in dataclasses.fields(cls) if f.metadata.get("config", True)]


def _types(t) -> tuple:
  """The non-None types of an annotation (`int | None` -> (int,), `int | str` -> (int, str))."""
  if typing.get_origin(t) in (typing.Union, types.UnionType):
    return tuple(a for a in typing.get_args(t) if a is not type(None))
  return (typing.get_origin(t) or t,)


def to_config_dict(cls) -> ml_collections.ConfigDict:
  """The ConfigDict of dataclass `cls` at its defaults (see the module docstring for each kind of field)."""
  hints, c = typing.get_type_hints(cls), ml_collections.ConfigDict()
  for f in _config_fields(cls):
    t = hints[f.name]
    if f.metadata.get("when_set"):
      continue
    if "tree" in f.metadata:
      c[f.name] = f.metadata["tree"][0](f.default_factory())
    elif dataclasses.is_dataclass(t):
      c[f.name] = to_config_dict(t)
    else:
      value = f.default_factory() if f.default is dataclasses.MISSING else f.default
      kinds = _types(t)
      if isinstance(value, dict):
        c[f.name] = ml_collections.ConfigDict(value)
      elif value is None:
        c[f.name] = config_dict.placeholder(kinds[0])
      elif len(kinds) > 1:  # ml_collections otherwise locks a field to its first value's type
        c[f.name] = ml_collections.FieldReference(value, field_type=object)
      else:
        c[f.name] = value
  return c


def from_config_dict(cls, d, section: str = ""):
  """cls built from ConfigDict (or dict) `d`, sub-sections first; a missing key keeps the default, a key cls
  does not model goes to its `extra` dict if it has one (config.distributed), else is a ConfigError naming it
  (checked over the whole tree before anything is built: `check_keys`); an error names the config field
  (`config.optim.b1=1.5: ...`)."""
  if not section:
    check_keys(cls, d)
  hints, kw = typing.get_type_hints(cls), {}
  for f in _config_fields(cls):
    if f.name not in d:
      continue
    v, t = d[f.name], hints[f.name]
    if "tree" in f.metadata:
      v = f.metadata["tree"][1](v)
    elif dataclasses.is_dataclass(t):
      v = from_config_dict(t, v, f"{section}{f.name}.")
    elif hasattr(v, "to_dict"):
      v = v.to_dict()
    kw[f.name] = v
  names = {f.name for f in dataclasses.fields(cls)}
  if "extra" in names:  # a section that keeps the keys it does not model (config.distributed)
    kw["extra"] = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in d.items() if k not in names}
  with config_errors(section.rstrip("."), cls):
    return cls(**kw)


def check_keys(cls, d, prefix: str = ""):
  """ConfigError (`unknown_field`) for the first key of ConfigDict (or dict) `d` that the dataclass tree `cls`
  does not model, at any depth: sections and dict fields with {"keys": Cls}; a section with
  an `extra` field and the other dict fields (task.gen) are open."""
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in _config_fields(cls)}
  if "extra" not in {f.name for f in dataclasses.fields(cls)}:
    for k in d:
      if k not in fields:
        unknown_field(f"{prefix}{k}", d[k], [f"{prefix}{n}" for n in fields])
  for name, f in fields.items():
    if name not in d or not hasattr(d[name], "items"):
      continue
    if "tree" in f.metadata:  # a tree's build checks its keys (and values)
      f.metadata["tree"][1](d[name])
      continue
    allowed = f.metadata.get("keys")
    if dataclasses.is_dataclass(hints[name]):
      check_keys(hints[name], d[name], f"{prefix}{name}.")
    elif allowed is not None:
      names = [f"{prefix}{name}.{g.name}" for g in dataclasses.fields(allowed)]
      for k in d[name]:
        if f"{prefix}{name}.{k}" not in names:
          unknown_field(f"{prefix}{name}.{k}", d[name][k], names)


def unknown_field(path: str, value, siblings: list[str], known: list[str] | tuple = ()):
  """Raises the one-line ConfigError for config.PATH=VALUE, a field the config does not have, naming the
  nearest valid names: its siblings' first (optim.b3 -> optim.b1 / optim.b2), else any of `known`."""
  close = nearest(path, siblings) or difflib.get_close_matches(path, list(known), n=1)
  hint = f"did you mean {' or '.join(f'config.{c}' for c in close)}? " if close else ""
  shown = " ".join(repr(value.to_dict() if hasattr(value, "to_dict") else value).split())
  shown = shown if len(shown) <= 80 else shown[:77] + "..."
  raise ConfigError(f"config.{path}={shown}: unknown field; {hint}--config_help lists every field.")


def nearest(path: str, siblings: list[str]) -> list[str]:
  """Up to 3 of `siblings` (dotted paths) whose last name is nearest `path`'s: an abbreviation of it
  (learning_rate -> lr) or a prefix either way first, then difflib's close matches, else the closest one."""
  parent, _, leaf = path.rpartition(".")
  if any(p.rpartition(".")[0] != parent for p in siblings):  # not one section's fields: compare whole paths
    return difflib.get_close_matches(path, siblings, n=1, cutoff=0.0)
  by_leaf = {p.rpartition(".")[2]: p for p in siblings}
  initials = "".join(w[0] for w in leaf.split("_") if w)
  short = [n for n in by_leaf if len(leaf.split("_")) > 1 and n == initials]
  short += [
    n for n in by_leaf if n not in short and min(len(n), len(leaf)) >= 3 and (n.startswith(leaf) or leaf.startswith(n))
  ]
  close = short + [n for n in difflib.get_close_matches(leaf, list(by_leaf), n=3, cutoff=0.6) if n not in short]
  close = close or difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.0)
  return [by_leaf[n] for n in close[:3]]


def split_args(argv: list[str], root: str) -> tuple[list[str], list[tuple[str, str]]]:
  """(argv without its --config.ROOT[.A[.B]]=VALUE flags, [(path, text)] of those flags in order).

  For a `tree` field whose keys change with a choice's name (config.method: --config.method.weights=clip
  replaces the weights' fields), which ml_collections' override flags cannot express: main.py takes them out
  before ml_collections reads argv and sets them on the loaded config itself (rl.choices.set_paths)."""
  pattern = re.compile(rf"--?config\.({re.escape(root)}(?:\.\w+)*)(?:=(.*))?$")
  rest, found, i = [], [], 0
  while i < len(argv):
    m = pattern.match(argv[i])
    if m is None:
      rest.append(argv[i])
    elif m.group(2) is not None:
      found.append((m.group(1), m.group(2)))
    else:  # --config.method.lr.rho_on 0.9
      found.append((m.group(1), argv[i + 1] if i + 1 < len(argv) else ""))
      i += 1
    i += 1
  return rest, found


# ----------------------------------------------------------------------------- --config_help


def _line_comments(source: str) -> dict[int, str]:
  toks = tokenize.generate_tokens(io.StringIO(source).readline)
  return {t.start[0]: t.string.lstrip("#").strip() for t in toks if t.type == tokenize.COMMENT}


def field_comment_lines(cls) -> dict[str, str]:
  """{field: the comment on its line in the class body}, base classes' fields included."""
  out: dict[str, str] = {}
  for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
    source = textwrap.dedent(inspect.getsource(klass))
    lines = _line_comments(source)
    for node in ast.parse(source).body[0].body:
      if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        text = lines.get(node.end_lineno) or lines.get(node.lineno)
        if text:
          out[node.target.id] = text
  return out


def comments(cls, prefix: str = "") -> dict[str, str]:
  """{dotted path: one-line comment} of every field of the dataclass tree `cls`."""
  hints, own, out = typing.get_type_hints(cls), field_comment_lines(cls), {}
  for f in _config_fields(cls):
    t = hints[f.name]
    if dataclasses.is_dataclass(t):
      out.update(comments(t, f"{prefix}{f.name}."))
    text = field_comment_lines(f.metadata["from"]).get(f.name) if "from" in f.metadata else own.get(f.name)
    if text:
      out[prefix + f.name] = text
  return out


def leaves(c: ml_collections.ConfigDict, prefix: str = ""):
  """(dotted path, value, type name) of every field, sorted by name (ConfigDict order); an empty sub-dict is one."""
  for k, v in c.items(preserve_field_references=False):
    if isinstance(v, ml_collections.ConfigDict) and len(v):
      yield from leaves(v, f"{prefix}{k}.")
    else:
      t = "dict" if isinstance(v, ml_collections.ConfigDict) else getattr(c.get_type(k), "__name__", "?")
      yield f"{prefix}{k}", (v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v), t
