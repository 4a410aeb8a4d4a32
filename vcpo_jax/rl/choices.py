"""A Method as the config's `method` tree: each part is a named choice that holds only its own fields.

  method.advantage  {name: grpo, std: population, std_eps: 1e-06}     rl.advantages: grpo | rloo | drgrpo | reinforce
  method.weights    {name: tis, c: 8.0}                               rl.weights.WEIGHT_VARIANTS
  method.baseline   {name: opob, weights: unclipped, ...} | {name: none}
  method.loss       {name: surrogate, loss_agg: ..., ...} | {name: ppo_clip, eps_low: 0.2, ...}   (rl.losses)
  method.lr         {name: ess_lr, rule: sqrt, rho_on: 1.0} | {name: constant}
  method.log_ratio_clamp: 20.0

A choice's fields and their defaults are read off the value its factory makes with no arguments (the factory's
signature or its dataclass: `tis()` -> c = 8.0), so no default is written here. `tree(method)` writes a Method
as that ConfigDict (`preset("ppo_clip")` is tree(PRESETS["ppo_clip"])); `build(tree)` makes the Method back,
refusing an unknown choice or a field the chosen choice does not have with one line that names the nearest
names. On the command line (main.py: schema.split_args, then `set_paths`): `--config.method=PRESET` replaces the tree,
`--config.method.PART=NAME` replaces a part by that choice at its defaults (the same name keeps its fields),
`--config.method.PART.FIELD=VALUE` sets one field; presets first, then parts, then fields, whatever their order.
A config file writes `c.method = choices.preset("ppo_clip")`, `c.method.weights = choices.choice("weights", "tis",
c=4.0)` or `c.method.lr.rho_on = 0.9`. The choices are the registries themselves (WEIGHT_VARIANTS, POLICY_LOSSES,
the advantage factories), so a new weight variant or peer loss is a choice here with no edit to this file.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from vcpo_jax.rl import advantages as adv_lib
from vcpo_jax.rl import losses
from vcpo_jax.rl.ess import ess_lr
from vcpo_jax.rl.method import PRESETS, Method
from vcpo_jax.rl.surrogate import Surrogate, surrogate
from vcpo_jax.rl.weights import WEIGHT_VARIANTS, Weights
from vcpo_jax.schema import ConfigError, nearest

ROOT = "method"
NAME = "name"  # the key of a part's choice in its sub-dict


@dataclasses.dataclass(frozen=True)
class Part:
  """One part of a Method: its choices (name -> factory) and how a value of it is named."""

  choices: Mapping[str, Callable[..., Any]]
  name_of: Callable[[Any], str]
  doc: str


def _loss_name(loss) -> str:
  if isinstance(loss, Surrogate):
    return "surrogate"
  return "decoupled_ppo_loglinear" if loss.name == "decoupled_ppo" and loss.needs else loss.name


PARTS: dict[str, Part] = {
  "advantage": Part(
    {n: getattr(adv_lib, n) for n in adv_lib.ADVANTAGE_ESTIMATORS}, lambda v: v.estimator, "advantage estimator"
  ),
  "weights": Part(WEIGHT_VARIANTS, lambda v: v.variant, "importance weights"),
  "baseline": Part({"none": lambda: None, "opob": adv_lib.opob}, lambda v: "none" if v is None else "opob", "baseline"),
  "loss": Part(
    {"surrogate": surrogate, **losses.POLICY_LOSSES, "decoupled_ppo_loglinear": losses.decoupled_ppo_loglinear},
    _loss_name,
    "surrogate or a peer loss (its own ratio, clip and aggregation)",
  ),
  "lr": Part({"constant": lambda: None, "ess_lr": ess_lr}, lambda v: "constant" if v is None else "ess_lr", "lr rule"),
}
SCALARS = {"log_ratio_clamp": Method.log_ratio_clamp}  # the Method's own fields besides its parts


def fields_of(value) -> dict[str, Any]:
  """A part value's own fields: a variant's parameters, a peer loss's hyper-parameters, a dataclass's fields
  (an advantage's std options only where the estimator divides by the group std)."""
  if value is None:
    return {}
  if isinstance(value, Weights):
    return dict(value.params)
  if isinstance(value, losses.PeerLoss):
    return value.kwargs
  if isinstance(value, adv_lib.Advantage):
    own = adv_lib.ADVANTAGE_ESTIMATORS[value.estimator].std_normalized
    return {"std": value.std, "std_eps": value.std_eps} if own else {}
  return dataclasses.asdict(value)


def defaults(part: str, name: str) -> dict[str, Any]:
  """The fields of choice `name` of `part` at their defaults (its factory's value with no arguments)."""
  return fields_of(PARTS[part].choices[name]())


def choice(part: str, name: str, **fields) -> ml_collections.ConfigDict:
  """The sub-tree of choice `name` of `part`: its defaults, then `fields` (checked by `build`)."""
  _check_choice(part, name)
  return ml_collections.ConfigDict({NAME: name, **defaults(part, name), **fields})


def tree(method: Method) -> ml_collections.ConfigDict:
  """The config tree of a Method (every part's choice and its fields)."""
  out = ml_collections.ConfigDict()
  for part, spec in PARTS.items():
    value = getattr(method, part)
    out[part] = ml_collections.ConfigDict({NAME: spec.name_of(value), **fields_of(value)})
  for name in SCALARS:
    out[name] = getattr(method, name)
  return out


def preset(name: str) -> ml_collections.ConfigDict:
  """The tree of rl.method.PRESETS[name]."""
  if name not in PRESETS:
    _unknown(ROOT, name, list(PRESETS), "preset")
  return tree(PRESETS[name])


def build(t) -> Method:
  """The Method of config tree `t` (a ConfigDict or dict); ValueError `config.method.PART.FIELD=VALUE: ...` (one
  line) for an unknown part, choice or field (with the nearest names) or a value its factory refuses."""
  t = t.to_dict() if hasattr(t, "to_dict") else dict(t)
  known = [*PARTS, *SCALARS]
  for key in t:
    if key not in known:
      _unknown(f"{ROOT}.{key}", t[key], [f"{ROOT}.{k}" for k in known])
  kw = {}
  for part in PARTS:
    node = dict(t.get(part) or {NAME: PARTS[part].name_of(getattr(Method(), part))})
    name = node.pop(NAME, None)
    _check_choice(part, name)
    own = defaults(part, name)
    for field in node:
      if field not in own:
        where = f"{ROOT}.{part}.{field}"
        _unknown(where, node[field], [f"{ROOT}.{part}.{f}" for f in own], f"field of {part} {name!r}")
    kw[part] = _make(f"{ROOT}.{part}", name, lambda p=part, n=name, f=node: PARTS[p].choices[n](**f))
  kw.update({k: t[k] for k in SCALARS if k in t})
  return _make(ROOT, None, lambda: Method(**kw))


def _make(path: str, name: str | None, make):
  """make(); a factory's ValueError (`c=-1.0: must be > 0`) as one line naming the config field."""
  try:
    return make()
  except (TypeError, ValueError) as e:
    msg = " ".join(str(e).split())
    m = re.match(r"(?:\w+: )?([a-z_]\w*)=(.*)", msg)
    if m and (name is not None or m.group(1) in SCALARS):
      return _raise(f"config.{path}.{m.group(1)}={m.group(2)}")
    what = f" {name!r}" if name else ""
    return _raise(f"config.{path}{what}: {msg}")


def _raise(msg: str):
  raise ConfigError(msg)


def _check_choice(part: str, name) -> None:
  if part not in PARTS:
    _unknown(f"{ROOT}.{part}", name, [f"{ROOT}.{p}" for p in PARTS])
  if name not in PARTS[part].choices:
    _unknown(f"{ROOT}.{part}", name, list(PARTS[part].choices), PARTS[part].doc)


def _unknown(path: str, value, names: list[str], what: str = "field"):
  """The one-line ConfigError for config.PATH=VALUE that is not a valid name, naming the nearest valid names:
  a field (`names`: dotted paths of the valid fields) or a choice (`names`: the choices; `what` says of what)."""
  if what == "field" or what.startswith("field of"):
    close = nearest(path, names) if names else []
    hint = f"did you mean {' or '.join(f'config.{c}' for c in close)}? " if close else ""
    own = f"{what[len('field of ') :]} has {[n.rpartition('.')[2] for n in names]}" if what != "field" else ""
    raise ConfigError(f"config.{path}={value!r}: unknown field; {hint}{own or '--config_help lists the fields'}.")
  close = nearest(f"x.{value}", [f"x.{n}" for n in names]) if isinstance(value, str) else []
  hint = f"did you mean {' or '.join(repr(c[2:]) for c in close)}? " if close else ""
  raise ConfigError(f"config.{path}={value!r}: unknown {what}; {hint}choose one of {sorted(names)}.")


# ----------------------------------------------------------------------------- the command line


def _parse(text: str, like):
  """The command-line text as the type of `like` (the field's current value); None: a Python literal, else text."""
  if isinstance(like, bool):
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ValueError(f"{text!r} is not a bool (true / false)")
  if isinstance(like, int):
    return int(text)
  if isinstance(like, float):
    return float(text)
  if like is None:
    try:
      return ast.literal_eval(text)
    except (ValueError, SyntaxError):
      return text
  return text


def _rank(path: str) -> int:
  """0 a preset, 1 a part's choice, 2 a field: the order `set_paths` applies them in."""
  keys = path.split(".")[1:]
  if not keys:
    return 0
  return 1 if (len(keys) == 1 and keys[0] in PARTS) or (len(keys) == 2 and keys[1] == NAME) else 2


def set_paths(config: ml_collections.ConfigDict, items) -> None:
  """Sets each (path, value) on config.method (path "method[.PART[.FIELD]]"; a str value is parsed to the field's
  type, as schema.split_args gives them): presets first, then parts' choices, then fields, each in its given order.

  A part switched to another choice gets that choice's defaults (the old one's fields are gone; the same choice
  again keeps them); a field that the chosen choice does not have is a ConfigError naming the nearest fields."""
  with config.unlocked():
    for path, value in sorted(items, key=lambda a: _rank(a[0])):
      keys = path.split(".")[1:]
      if not keys:
        config[ROOT] = preset(value)
      elif _rank(path) == 1:
        if config[ROOT].get(keys[0], {}).get(NAME) != value:  # the same choice again keeps its fields
          config[ROOT][keys[0]] = choice(keys[0], value)
      elif len(keys) == 1 and keys[0] in SCALARS:
        config[ROOT][keys[0]] = _typed(path, value, config[ROOT].get(keys[0], SCALARS[keys[0]]))
      elif len(keys) == 2 and keys[0] in PARTS:
        node = config[ROOT][keys[0]]
        own = defaults(keys[0], node[NAME])
        if keys[1] not in own:
          siblings = [f"{ROOT}.{keys[0]}.{f}" for f in own]
          _unknown(path, value, siblings, f"field of {keys[0]} {node[NAME]!r}")
        node[keys[1]] = _typed(path, value, node.get(keys[1], own[keys[1]]))
      else:
        _unknown(path, value, [f"{ROOT}.{k}" for k in [*PARTS, *SCALARS]])


def _typed(path: str, value, like):
  if not isinstance(value, str):
    return value
  try:
    return _parse(value, like)
  except ValueError:
    raise ConfigError(f"config.{path}={value!r}: not a {type(like).__name__}") from None


def from_preset(name: str, overrides: Mapping[str, Any] | None = None) -> Method:
  """PRESETS[name] with {path under method: value} set as on the command line, e.g. {"lr.rho_on": 0.55},
  {"weights": "clip", "weights.upper": 3.0} (a part named switches its choice first)."""
  config = ml_collections.ConfigDict({ROOT: preset(name)})
  set_paths(config, [(f"{ROOT}.{p}", v) for p, v in (overrides or {}).items()])
  return build(config[ROOT])


# ----------------------------------------------------------------------------- --config_help


def help_lines(t) -> list[tuple[str, Any, str]]:
  """(dotted path, value, comment) of the chosen choices' fields of tree `t`: only the fields that mean
  something for this method (ppo_clip: eps_low / eps_high, no TIS c)."""
  t = t.to_dict() if hasattr(t, "to_dict") else dict(t)
  out = []
  for part, spec in PARTS.items():
    node = dict(t.get(part) or {})
    name = node.pop(NAME, None)
    factory = spec.choices.get(name)
    doc = getattr(factory, "doc", None) or (getattr(factory, "__doc__", None) or "").strip().split("\n")[0]
    doc = f"{doc.rstrip('.')}; " if doc and getattr(factory, "__name__", "") != "<lambda>" else ""
    out.append((f"{ROOT}.{part}", name, f"{doc}{spec.doc}: {' | '.join(spec.choices)}"))
    for field, value in sorted(node.items()):
      out.append((f"{ROOT}.{part}.{field}", value, f"{name}'s {field}"))
  out += [(f"{ROOT}.{k}", t.get(k, v), "applied weights use exp(clamp(l, -c, c))") for k, v in SCALARS.items()]
  return out


def _leaves(method: Method) -> dict[str, Any]:
  t = tree(method)
  return {
    **{f"{p}.{k}" if k != NAME else p: v for p in PARTS for k, v in t[p].items()},
    **{k: t[k] for k in SCALARS},
  }


def describe(method: Method) -> str:
  """The method in a few words: its preset's name, or the nearest preset with what differs ("vcpo (lr.rho_on=0.5)")."""
  mine = _leaves(method)

  def diff(name):
    theirs = _leaves(PRESETS[name])
    return [f"{p}={v}" for p, v in mine.items() if theirs.get(p, object()) != v]

  name = min(PRESETS, key=lambda n: len(diff(n)))  # the first of the nearest (dicts keep their order)
  return name if not diff(name) else f"{name} ({', '.join(diff(name))})"
