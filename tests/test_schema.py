"""The config tree <-> ConfigDict (vcpo_jax/schema.py), and every default written once.

The config is one tree of frozen dataclasses (run_spec.RunConfig); configs/common.py's ConfigDict is generated
from it. "Written once" is checked on the source (ast): every leaf of the generated ConfigDict has exactly one
literal default, found by following the field's default through references (`temperature: float =
EvalProtocol.temperature` points at EvalProtocol's literal; a field a section has from another class,
`schema.fields_from`, is its literal there), and no other config dataclass the run builds holds a
literal default of the same name and value (a second copy that could drift), apart from DUPLICATES_ALLOWED.
"""

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing

import ml_collections
import pytest

from configs import common
from vcpo_jax import estimator, evaluation, run_config, run_spec, schema
from vcpo_jax.evaluation import EvalProtocol
from vcpo_jax.learner import LearnerConfig
from vcpo_jax.model import config as model_config
from vcpo_jax.model.config import ModelConfig
from vcpo_jax.rl import choices, method
from vcpo_jax.rollout.common import RolloutConfig
from vcpo_jax.sampler import SamplerConfig
from vcpo_jax.sft import SFTConfig

# The configs the run builds from the tree besides its own sections: a default of theirs that repeats a knob's
# default is a second copy.
BUILT = (RolloutConfig, LearnerConfig, ModelConfig, EvalProtocol, SFTConfig, SamplerConfig, run_spec.RunSpec)
# (class, field) -> why its literal default may equal a knob's: library defaults for standalone use that
# parse_config always overrides from the config.
DUPLICATES_ALLOWED = {
  ("RolloutConfig", "seed"): "a RolloutMaker built by hand (tests, notebooks); parse_config passes config.seed",
  ("EvalProtocol", "seed"): "evaluation.evaluate called by hand; parse_config passes config.seed",
  ("ModelConfig", "router_aux_loss_coef"): "the checkpoint's own weight (its config.json), never applied; another knob "
  "than learner.router_aux_loss_coef, the weight the learner applies",
}


def _literal(node):
  """The value of a literal default (3, -1.0, "x", (1, 2), None), else a sentinel."""
  try:
    return ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError):
    return _literal


def _defaults(cls) -> dict[str, ast.expr]:
  """{field: its default's expression} as written in the class bodies of cls and its dataclass bases."""
  out = {}
  for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
    tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    for node in tree.body[0].body:
      if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        out[node.target.id] = (klass, node.value)
  return out


def _definition(cls, name):
  """(class, field, value) where the default of cls.name is written as a literal, following `Other.field`."""
  klass, node = _defaults(cls)[name]
  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
    other = vars(sys.modules[klass.__module__])[node.value.id]
    return _definition(other, node.attr)
  if isinstance(node, ast.Name):  # a module-level constant (`LORA_TARGETS = (...)`), written once there
    value = vars(sys.modules[klass.__module__])[node.id]
    assert isinstance(value, (bool, int, float, str, tuple)), f"{klass.__name__}.{name}: {node.id} is not a constant"
    return klass, name, value
  value = _literal(node)
  assert value is not _literal, f"{klass.__name__}.{name}: default is neither a literal nor Other.field"
  return klass, name, value


def _leaf_definitions(cls=run_spec.RunConfig, prefix=""):
  """{dotted leaf path: (class, field, value)} over the tree (sub-sections and dict fields have no default)."""
  hints, out = typing.get_type_hints(cls), {}
  for f in dataclasses.fields(cls):
    if not f.metadata.get("config", True) or "tree" in f.metadata:
      continue
    if dataclasses.is_dataclass(hints[f.name]):
      out.update(_leaf_definitions(hints[f.name], f"{prefix}{f.name}."))
    elif f.default is not dataclasses.MISSING:  # a field from another class (fields_from): its definition there
      out[prefix + f.name] = _definition(f.metadata.get("from", cls), f.name)
  return out


def test_every_leaf_default_is_one_literal_and_matches_the_config_dict():
  defs = _leaf_definitions()
  base = {p: v for p, v, _ in schema.leaves(common.get_base_config())}
  for path, (_, _, value) in defs.items():
    assert base[path] == value, path
  # method.*: the tree of the default preset's choices, their defaults read off the factories (rl/choices.py)
  generated = {p for p in base if not p.startswith("method.")}
  dict_fields = {"task.gen", "async_.sampler_env"}  # open sub-dicts, empty by default
  assert generated == set(defs) | dict_fields
  assert {p: v for p, v in base.items() if p.startswith("method.")} == {
    f"method.{p}": v for p, v, _ in schema.leaves(choices.tree(method.PRESETS["vcpo"]))
  }


def test_no_config_dataclass_repeats_a_knobs_default():
  defs = _leaf_definitions()
  sites = {(k.__name__, n) for k, n, _ in defs.values()}
  by_name = {}
  for path, (_, name, value) in defs.items():
    by_name.setdefault(path.rpartition(".")[2], []).append((path, value))
  classes = {t for t in _section_classes()} | set(BUILT)
  copies = []
  for cls in classes:
    for name, (klass, node) in _defaults(cls).items():
      value = _literal(node)
      if klass is not cls or (cls.__name__, name) in sites or value is _literal:
        continue
      for path, v in by_name.get(name, ()):
        if v == value and type(v) is type(value):
          copies.append(((cls.__name__, name), path))
  unexpected = [c for c in copies if c[0] not in DUPLICATES_ALLOWED]
  assert not unexpected, f"a knob's default written twice (point the copy at the one definition): {unexpected}"
  assert {c[0] for c in copies} == set(DUPLICATES_ALLOWED)  # no stale allowance


def _section_classes(cls=run_spec.RunConfig):
  hints = typing.get_type_hints(cls)
  yield cls
  for f in dataclasses.fields(cls):
    if dataclasses.is_dataclass(hints[f.name]):
      yield from _section_classes(hints[f.name])


def test_configs_common_and_the_mapping_write_no_default():
  """configs/common.py only generates the ConfigDict; run_config.py reads no field with a fallback value."""
  src = ast.parse(inspect.getsource(common))
  assigned = [n for n in ast.walk(src) if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Attribute)]
  assert not assigned
  for mod in (run_config, run_spec):
    calls = [n for n in ast.walk(ast.parse(inspect.getsource(mod))) if isinstance(n, ast.Call)]
    get = [n for n in calls if isinstance(n.func, ast.Attribute) and n.func.attr == "get" and len(n.args) == 2]
    fallbacks = [ast.unparse(n) for n in get]
    assert not fallbacks, fallbacks


def test_round_trip_and_errors_name_the_field():
  c = common.get_base_config()
  run = schema.from_config_dict(run_spec.RunConfig, c)
  assert run == run_spec.RunConfig()
  assert schema.to_config_dict(run_spec.RunConfig).to_json() == c.to_json()
  c.optim.b1 = 1.5
  with pytest.raises(schema.ConfigError, match=r"^config\.optim\.b1=1\.5: Adam's moment decay"):
    schema.from_config_dict(run_spec.RunConfig, c)


@pytest.mark.parametrize(
  "path,value,guess",
  [
    ("model.lora_rnak", 8, "model.lora_rank"),  # a section's field
    ("optim.learning_rate", 1e-3, "optim.lr"),  # no close sibling: the nearest one
    ("task.multiturn.max_turn", 2, "task.multiturn.max_turns"),  # a nested section
    ("method.weights.cc", 4.0, "method.weights.c"),  # a field the method's chosen weights do not have
    ("method.los", {"name": "ppo_clip"}, "method.loss"),  # a part of the method misspelled
    ("model.shape.num_layer", 28, "model.shape.num_layers"),  # the checkpoint's architecture block
    ("optimm", {"lr": 1.0}, "optim"),  # a whole section misspelled
  ],
)
def test_an_unknown_key_anywhere_names_it_its_value_and_the_nearest_names(path, value, guess):
  """A key the tree does not model (what a config file can add) is an error, not silently dropped."""
  c = common.get_base_config()
  *parents, leaf = path.split(".")
  node = c
  for name in parents:
    if name not in node:
      node[name] = ml_collections.ConfigDict()
    node = node[name]
  node[leaf] = value
  shown = " ".join(repr(value).split())
  with pytest.raises(schema.ConfigError) as e:
    schema.from_config_dict(run_spec.RunConfig, c)
  msg = str(e.value)
  assert msg.startswith(f"config.{path}={shown}: unknown field; did you mean ") and "\n" not in msg, msg
  assert f"config.{guess}" in msg.split("did you mean ")[1].split("?")[0], msg


def test_open_sub_dicts_and_the_shape_block_parse():
  """task.gen and distributed's extra keys stay open; model.shape is declared (absent from the default dict, so
  the study's run configs are unchanged) and reaches ModelSection.shape when a config file sets it."""
  c = common.get_base_config()
  assert "shape" not in c.model
  c.task.gen = {"num_numbers": (2, 2)}
  c.distributed.local_device_ids = "0"
  c.model.shape = ml_collections.ConfigDict({"num_layers": 28, "qkv_bias": True})
  run = schema.from_config_dict(run_spec.RunConfig, c)
  assert run.model.shape == {"num_layers": 28, "qkv_bias": True}
  assert run.distributed.extra == {"local_device_ids": "0"}


def test_config_dict_types_come_from_the_annotations():
  c = common.get_base_config()
  assert c.model.get_type("hidden_size") is int and c.model.hidden_size is None  # `int | None = None`
  c.learner.ghost_passes = "auto"  # `int | str`: either
  c.async_.background_publish = True  # `str | bool`
  assert c.method.weights.get_type("c") is float and c.method.weights.c == 8.0  # the tree of choices
  with pytest.raises(TypeError):
    c.optim.lr = "fast"


def test_presets_are_written_once_as_methods():
  """estimator.PRESETS is rl.method.PRESETS: a preset added there is a config method at once."""
  assert list(estimator.PRESETS) == list(method.PRESETS)
  method.PRESETS["_test_tis4"] = dataclasses.replace(method.PRESETS["seq_tis"], weights=method.tis(4.0))
  try:
    assert estimator.method_from_preset("_test_tis4").weights == method.tis(4.0)
  finally:
    del method.PRESETS["_test_tis4"]
  assert "_test_tis4" not in estimator.PRESETS


def test_fields_from_gives_a_section_the_source_fields_type_default_and_comment():
  """schema.fields_from on a toy section: source's order after `after`, defaults (a factory called per
  instance), comments from source's lines, `borrowed`'s values, and the refusals."""

  @dataclasses.dataclass(frozen=True)
  class Source:
    a: int = 3  # the a knob
    b: tuple[str, ...] | str = ("x",)  # the b knob
    c: list = dataclasses.field(default_factory=list)  # the c knob

  @dataclasses.dataclass(frozen=True)
  @schema.fields_from(Source, ("c", "a"), after="first")
  class Section:
    first: str = ""  # first
    last: bool = False  # last

  assert [f.name for f in dataclasses.fields(Section)] == ["first", "a", "c", "last"]  # source's order
  assert Section().a == 3 and Section().c == [] and Section().c is not Section().c
  assert schema.borrowed(Section(a=5)) == {"a": 5, "c": []}
  assert schema.comments(Section) == {"first": "first", "a": "the a knob", "c": "the c knob", "last": "last"}
  with pytest.raises(TypeError, match="come from Source"):
    schema.fields_from(Source, ("a",))(type("Clash", (), {"__annotations__": {"a": int}, "a": 1}))
  with pytest.raises(TypeError, match="no fields"):
    schema.fields_from(Source, ("zz",))(type("Unknown", (), {"__annotations__": {}}))


@pytest.mark.parametrize(
  "path, cls, names",
  [
    ("model", ModelConfig, model_config.RUN_FIELDS),
    ("eval", EvalProtocol, evaluation.RUN_FIELDS),
    ("task", RolloutConfig, run_spec.TASK_ROLLOUT_FIELDS),
  ],
)
def test_a_sections_borrowed_fields_are_written_once_in_their_component(path, cls, names):
  """config.model's compute options are ModelConfig's fields, config.eval's decoding EvalProtocol's, two of
  config.task's RolloutConfig's: the same default and type, the comment on the component's line, none of them
  written in the section's body."""
  section_cls = typing.get_type_hints(run_spec.RunConfig)[path]
  section, hints = {f.name: f for f in dataclasses.fields(section_cls)}, typing.get_type_hints(cls)
  assert {n for n, f in section.items() if f.metadata.get("from") is cls} == set(names)
  own, help_text = schema.field_comment_lines(cls), common.field_comments()
  for name in names:
    assert section[name].default == getattr(cls, name) and section[name].type == hints[name], name
    assert help_text[f"{path}.{name}"] == own[name], name
  assert not set(names) & set(_defaults(section_cls))  # not written in the section
