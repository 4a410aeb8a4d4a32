"""ConfigDict -> RunSpec: the single place where a config crosses into library code.

`parse_config` maps each config section onto its frozen component config (run_spec.py lists them)
and turns a component's error into one ConfigError line that names the config field, its value and
the fix, e.g.

  config.optim.b1=1.5: Adam's moment decay must be in [0, 1) (usual: 0.9)

The checks themselves live in the components' `__post_init__` and in RunSpec (constraints between
sections); here only what mapping needs first: that a name (method, task, data set, preset) is in
its registry and that a data file exists before it is read. Every check runs before anything is
built or compiled, including that every training and evaluation prompt fits task.max_prompt_len
(run_spec.check_prompt_lengths: the task's problems are made and tokenized, no model needed).
`check_override_paths` names the closest field for an unknown `--config.PATH`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re

from vcpo_jax import estimator, tasks
from vcpo_jax import mesh as mesh_lib
from vcpo_jax.evaluation import EvalProtocol
from vcpo_jax.learner import LearnerConfig
from vcpo_jax.model import config as model_config
from vcpo_jax.optim import OptimConfig
from vcpo_jax.rollout.common import RolloutConfig
from vcpo_jax.rollout.multiturn import MultiTurnConfig
from vcpo_jax.run_spec import (
  AsyncConfig,
  CheckpointConfig,
  ConfigError,
  DistributedConfig,
  LogConfig,
  RunSpec,
  SamplingConfig,
  check_field,
  check_prompt_lengths,
  config_errors,
  config_message,
)

__all__ = ["ConfigError", "RunSpec", "check_override_paths", "field_paths", "parse_config"]


# ----------------------------------------------------------------------------- parse_config


def _pg_config(c) -> estimator.PGConfig:
  close = difflib.get_close_matches(str(c.method), list(estimator.PRESETS), n=3, cutoff=0.5)
  hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
  check_field(
    c.method in estimator.PRESETS,
    "method",
    c.method,
    f"unknown preset; {hint}choose one of {sorted(estimator.PRESETS)}.",
  )
  overrides = {k: v for k, v in c.vcpo.items() if v is not None}
  try:
    return estimator.pg_config_from_preset(c.method, **overrides)
  except (TypeError, ValueError) as e:
    raise ConfigError(
      f"{config_message(str(e), 'vcpo', estimator.PGConfig, {})} (config.method={c.method!r})"
    ) from None


def _model_config(c, need_pos: int) -> model_config.ModelConfig:
  m = c.model
  check_field(
    m.preset in model_config.PRESETS, "model.preset", m.preset, f"choose one of {sorted(model_config.PRESETS)}."
  )
  with config_errors("model", model_config.ModelConfig):
    base = model_config.PRESETS[m.preset](dtype=m.dtype)
  overrides = {}
  for f in ("hidden_size", "num_layers", "intermediate_size"):
    if m[f] is not None:
      check_field(m[f] >= 1, f"model.{f}", m[f], "must be >= 1 (or None for the preset's value).")
      overrides[f] = m[f]
  h = overrides.get("hidden_size")
  if h is not None and not m.checkpoint:  # Qwen2 / Llama: width = heads x head_dim: it splits over the heads
    n = base.num_heads
    check_field(
      h % n == 0,
      "model.hidden_size",
      h,
      f"must be a multiple of the {m.preset} preset's num_heads={n}, e.g. {-(-h // n) * n}.",
    )
  for f in model_config.EXECUTION_FIELDS + model_config.LORA_FIELDS:  # apply to checkpoints too
    overrides[f] = m[f]
  with config_errors("model", model_config.ModelConfig):
    cfg = base.replace(**overrides)
  if cfg.max_position < need_pos and not m.checkpoint:
    cfg = cfg.replace(max_position=need_pos)
  return cfg


def _multiturn_config(c) -> MultiTurnConfig | None:
  mt = c.task.multiturn
  if not mt.enabled:
    return None
  with config_errors("task.multiturn", MultiTurnConfig):
    return MultiTurnConfig(**{k: v for k, v in mt.to_dict().items() if k != "enabled"})


def _eval_protocol(c) -> EvalProtocol:
  dataset = c.eval.dataset or c.task.name
  check_field(
    dataset in tasks.TASKS, "eval.dataset", dataset, f"unknown data set; choose one of {sorted(tasks.TASKS)}."
  )
  check_field(
    dataset == c.task.name or not tasks.TASKS[dataset].generated,
    "eval.dataset",
    dataset,
    "is a generated task; evaluate it by training on it (leave eval.dataset empty).",
  )
  with config_errors("eval", EvalProtocol, {"size": "num_problems"}):
    return EvalProtocol(
      dataset=dataset,
      split="test",
      size=c.eval.num_problems,
      temperature=c.eval.temperature,
      top_p=c.eval.top_p,
      n=1 if c.eval.greedy else c.eval.n,
      max_new_tokens=c.task.max_new_tokens,
      greedy=c.eval.greedy,
      pass_at_k=tuple(c.eval.pass_at_k),
      prompt_template=c.task.template or None,
      seed=c.seed,
    )


def _tasks(c) -> dict:
  """{"task": the run's configured task, "eval_task": the one evaluations draw from}, each built once."""
  t = c.task
  gen = dict(t.gen.to_dict())
  try:
    with config_errors("task.gen" if tasks.TASKS[t.name].generated else "task", names=dict.fromkeys(gen)):
      task = tasks.build(t.name, template=t.template, options=gen, data_path=t.data_path)
  except ConfigError as e:
    if m := re.search(r"unexpected keyword argument '(\w+)'", str(e)):  # e.g. --config.task.gen.foo=1
      raise ConfigError(
        f"config.task.gen.{m.group(1)}={gen[m.group(1)]!r}: not a knob of the {t.name} generator."
      ) from None
    raise
  dataset = c.eval.dataset or t.name
  if dataset == t.name and not c.eval.data_path:
    return {"task": task, "eval_task": task}
  with config_errors("eval", names={"data_path": "data_path"}):
    return {"task": task, "eval_task": tasks.build(dataset, template=t.template, data_path=c.eval.data_path)}


def _component(cls, section: str, d: dict):
  """cls(**the section's fields); keys cls does not model go to its `extra` dict if it has one, else stay unused."""
  names = {f.name for f in dataclasses.fields(cls)}
  kw = {k: v for k, v in d.items() if k in names and k != "extra"}
  if "extra" in names:
    kw["extra"] = {k: v for k, v in d.items() if k not in names}
  with config_errors(section, cls):
    return cls(**kw)


def _exists(field: str, path: str, what: str):
  check_field(not path or os.path.exists(path), field, path, f"does not exist; {what}")


def parse_config(config, *, check_prompts: bool = True) -> RunSpec:
  """Checks `config` (configs/common.py's fields) and maps it onto a RunSpec; raises ConfigError.

  check_prompts: also make and tokenize the training and evaluation problems (no model) to check that
  every prompt fits task.max_prompt_len; the result is cached per data setting within a process.
  """
  c = config
  t = c.task
  pg = _pg_config(c)
  check_field(t.name in tasks.TASKS, "task.name", t.name, f"unknown task; choose one of {sorted(tasks.TASKS)}.")
  _exists("task.data_path", t.data_path, "point it at a local parquet/jsonl file ('' = the shipped fixture).")
  _exists("eval.data_path", c.eval.data_path, "point it at a local parquet/jsonl file ('' = the shipped fixture).")
  with config_errors("task", RolloutConfig):
    rollout = RolloutConfig(
      task=t.name,
      prompts_per_step=t.prompts_per_step,
      group_size=t.group_size,
      max_prompt_len=t.max_prompt_len,
      max_new_tokens=t.max_new_tokens,
      chat_template=t.chat_template,
      num_train_problems=t.num_train_problems,
      seed=c.seed,
    )
  multiturn = _multiturn_config(c)
  # A multi-turn context reaches T - 1 tokens and one call adds up to max_turn_tokens more.
  model_cfg = _model_config(c, t.max_prompt_len + t.max_new_tokens + (multiturn.max_turn_tokens if multiturn else 0))
  with config_errors("learner", LearnerConfig):
    learner_cfg = LearnerConfig(
      pg=pg,
      grad_path=c.learner.grad_path,
      ghost_passes=c.learner.get("ghost_passes", 1),
      one_pass_budget_gib=c.learner.get("one_pass_budget_gib", 24.0),
      microbatch_size=c.learner.get("microbatch_size") or None,
      ppo_epochs=c.learner.get("ppo_epochs", 1),
      minibatches=c.learner.get("minibatches", 1),
      group_size=rollout.group_size,
      batch_size=rollout.batch_size,
    )
  optim_cfg = _component(OptimConfig, "optim", c.optim.to_dict())
  with config_errors("mesh", mesh_lib.MeshConfig):
    mesh_shape = mesh_lib.MeshConfig(tuple(c.mesh.shape)).shape
  spec = RunSpec(
    seed=c.seed,
    steps=c.steps,
    mode=c.mode,
    k=int(c.lag.k),
    method=c.method,
    rollout=rollout,
    task_template=t.template,
    task_gen=dict(t.gen.to_dict()),
    task_data_path=t.data_path,
    eval_data_path=c.eval.data_path,
    model_cfg=model_cfg,
    model_checkpoint=c.model.checkpoint,
    tokenizer_dir=c.model.tokenizer,
    sampling=_component(SamplingConfig, "sampler", c.sampler.to_dict()),
    learner=learner_cfg,
    optim=optim_cfg,
    on_nonfinite=c.learner.on_nonfinite,
    eval=_eval_protocol(c),
    eval_every=c.eval.every,
    eval_background=c.eval.get("background", False),
    checkpoint=_component(CheckpointConfig, "checkpoint", c.checkpoint.to_dict()),
    sft_steps=c.sft.steps,
    sft_lr=c.sft.lr,
    sft_batch_size=c.sft.batch_size,
    sft_cache_dir=c.sft.cache_dir,
    sft_noise=c.sft.noise,
    mesh_shape=mesh_shape,
    dist=_component(DistributedConfig, "distributed", c.distributed.to_dict()),
    async_=_component(AsyncConfig, "async_", c.async_.to_dict()),
    log=_component(LogConfig, "log", c.log.to_dict()),
    multiturn=multiturn,
    **_tasks(c),
  )
  if check_prompts:
    check_prompt_lengths(spec)
  return spec


# ----------------------------------------------------------------------------- command-line fields


def field_paths(config, prefix: str = "") -> list[str]:
  """Every dotted field of a ConfigDict, sub-dicts included (`task`, `task.name`, ...)."""
  out = []
  for k, v in config.items():
    out.append(prefix + k)
    if hasattr(v, "items"):
      out.extend(field_paths(v, f"{prefix}{k}."))
  return out


def check_override_paths(config, overrides: dict[str, str]):
  """ConfigError for the first `--config.PATH=VALUE` whose PATH is not a field, with the closest name."""
  known = field_paths(config)
  for path, value in overrides.items():
    if path in known:
      continue
    parent = path.rpartition(".")[0]  # compare with the siblings first: optim.b3 -> optim.b1, sed -> seed
    pool = [p for p in known if p.rpartition(".")[0] == parent] if parent in known or not parent else known
    guess = difflib.get_close_matches(path, pool, n=1, cutoff=0.0) or difflib.get_close_matches(path, known, n=1)
    hint = f"did you mean config.{guess[0]}? " if guess else ""
    raise ConfigError(f"config.{path}={value!r}: unknown field; {hint}--config_help lists every field.")
