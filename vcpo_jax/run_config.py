"""ConfigDict -> RunSpec: the single place where a config crosses into library code.

Each config section becomes a frozen component config that checks its own
fields in `__post_init__`: `optim` -> optim.OptimConfig, `vcpo` + `method` ->
estimator.PGConfig, `sampler` -> SamplingConfig, `checkpoint` ->
CheckpointConfig, `async_` -> AsyncConfig, `log` -> LogConfig, `distributed` ->
DistributedConfig, `task` -> RolloutConfig (+ MultiTurnConfig) and the run's one
configured tasks.Task (tasks.build, shared by rollouts and evaluation), `eval` ->
EvalProtocol, `model` -> ModelConfig; RunSpec itself checks the top-level
fields and the constraints between them. `parse_config` maps fields, adds the
checks that need several sections or the file system, and turns a component's
error into one ConfigError line that names the config field, its value and the
fix, e.g.

  config.optim.b1=1.5: Adam's moment decay must be in [0, 1) (usual: 0.9)

Every check runs before anything is built or compiled, including that every
training and evaluation prompt fits task.max_prompt_len (the task's problems
are made and tokenized here; the model is not needed for that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import re

from vcpo_jax import estimator, sharding, tasks
from vcpo_jax.evaluation import EvalProtocol
from vcpo_jax.learner import LearnerConfig
from vcpo_jax.model import config as model_config
from vcpo_jax.optim import OptimConfig
from vcpo_jax.rollout.common import RolloutConfig
from vcpo_jax.rollout.multiturn import MultiTurnConfig

MODES = ("sync", "lag", "async")
MAX_LAG = 1024
MAX_SEED = 2**32 - 1  # numpy's and JAX's seeds are unsigned 32-bit


class ConfigError(ValueError):
  """A bad config value; the message is one line: `config.FIELD=VALUE: what to do`."""


def _check(ok: bool, field: str, value, fix: str):
  if not ok:
    raise ConfigError(f"config.{field}={value!r}: {fix}")


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@contextlib.contextmanager
def _section(section: str, cls=None, names: dict[str, str] | None = None):
  """Re-raises a component's ValueError / TypeError as a ConfigError naming config.<section>.<field>.

  Component messages name their field as `Class.field ...`, `section.field ...` or `field ...`;
  `names` maps component field names that differ from the config's (EvalProtocol.size -> num_problems).
  """
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(_config_message(str(e), section, cls, names or {})) from None


def _config_message(msg: str, section: str, cls, names: dict[str, str]) -> str:
  msg = " ".join(msg.split())  # one line
  if msg.startswith("config."):
    return msg
  known = set(names) | ({f.name for f in dataclasses.fields(cls)} if cls is not None else set())
  m = re.match(r"(?:[A-Z]\w*\.)?([a-z_]\w*(?:\.[a-z_]\w*)*)(.*)$", msg)
  if m:
    field, rest = m.groups()
    if "." in field and field.split(".")[0] == section.split(".")[0]:  # already a config path: "optim.b1=..."
      return f"config.{field}{rest}"
    if field in known:
      return f"config.{section}.{names.get(field) or field}{rest}"
  return f"config.{section}: {msg}"


# ----------------------------------------------------------------------------- component configs


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Training-rollout sampling (config.sampler); the evaluation protocol has its own (config.eval)."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  draw: str = "inverse_cdf"
  param_dtype: str = "auto"
  mesh_shape: tuple = (-1, 1, 1)

  def __post_init__(self):
    _check(self.draw in ("inverse_cdf", "gumbel"), "sampler.draw", self.draw, "use inverse_cdf or gumbel.")
    _check(
      self.param_dtype in ("", "auto", "float32", "bfloat16"),
      "sampler.param_dtype",
      self.param_dtype,
      "use auto (bf16 on accelerators), float32 or bfloat16.",
    )
    try:
      object.__setattr__(self, "mesh_shape", sharding.MeshConfig(tuple(self.mesh_shape)).shape)
    except (ValueError, TypeError) as e:
      _check(False, "sampler.mesh_shape", self.mesh_shape, f"{e}")
    _check(
      _finite(self.temperature) and self.temperature > 0,
      "sampler.temperature",
      self.temperature,
      "training rollouts need a finite temperature > 0 (greedy behavior log-probs are degenerate); released: 1.0.",
    )
    _check(_finite(self.top_p) and 0 < self.top_p <= 1, "sampler.top_p", self.top_p, "must be in (0, 1] (1 = off).")
    _check(self.top_k >= 0, "sampler.top_k", self.top_k, "must be >= 0 (0 = off).")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 50  # save every this many steps
  keep_last: int = 2  # newest checkpoints kept
  keep_best: int = 1  # plus the best by eval accuracy

  def __post_init__(self):
    _check(self.every >= 1, "checkpoint.every", self.every, "must be >= 1 (steps between saves).")
    _check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1 (resuming needs the newest).")
    _check(self.keep_best >= 0, "checkpoint.keep_best", self.keep_best, "must be >= 0 (0 = keep no best).")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
  """The sampler process of mode='async' (config.async_)."""

  queue_slots: int = 4
  sampler_devices: str = ""
  timeout_s: float = 120.0
  startup_timeout_s: float = 600.0
  sampler_cpus: str = ""
  sampler_env: dict = dataclasses.field(default_factory=dict)
  decode: str = "static"
  chunk_tokens: int = 16
  inflight_updates: bool = False
  update_every_tokens: int = 16
  recompute_kv: bool = False
  peer_lost_s: float = 30.0  # multi-host: a learner process without a heartbeat this long is lost
  extra: dict = dataclasses.field(default_factory=dict)  # config.async_ keys not modelled here, passed on

  def __post_init__(self):
    _check(self.queue_slots >= 1, "async_.queue_slots", self.queue_slots, "must be >= 1 (batches the queue holds).")
    for f in ("timeout_s", "startup_timeout_s"):
      v = getattr(self, f)
      _check(_finite(v) and v > 0, f"async_.{f}", v, "must be a finite number of seconds > 0.")
    _check(
      _finite(self.peer_lost_s) and self.peer_lost_s > 2.0,
      "async_.peer_lost_s",
      self.peer_lost_s,
      "must be a finite number of seconds > 2 (4 heartbeats of 0.5 s; 30 tolerates a busy host).",
    )
    ids = str(self.sampler_devices).replace(" ", "").split(",") if str(self.sampler_devices) else []
    _check(
      all(x.isdigit() for x in ids) and len(set(ids)) == len(ids),
      "async_.sampler_devices",
      self.sampler_devices,
      "use distinct device ids like '1' or '6,7' ('' = share the learner's devices).",
    )
    from vcpo_jax.sampler import DECODE_MODES

    _check(self.decode in DECODE_MODES, "async_.decode", self.decode, f"choose one of {DECODE_MODES}.")
    for f in ("chunk_tokens", "update_every_tokens"):
      v = getattr(self, f)
      _check(isinstance(v, int) and v >= 1, f"async_.{f}", v, "must be an int >= 1 (decode steps).")
    for f in ("inflight_updates", "recompute_kv"):
      _check(isinstance(getattr(self, f), bool), f"async_.{f}", getattr(self, f), "must be True or False.")
    from vcpo_jax.rollout.async_ import parse_cpus  # the one parser of CPU lists ("1", "0,2", "2-3")

    with _section("async_"):
      parse_cpus(self.sampler_cpus)

  def as_dict(self) -> dict:
    """The dict rollout.async_.AsyncSource reads (spec.async_cfg): every config.async_ key."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
    return {**d, "sampler_env": dict(self.sampler_env), **self.extra}


@dataclasses.dataclass(frozen=True)
class LogConfig:
  progress: bool = True
  plots: bool = True
  norm_overhead_every: int = 0

  def __post_init__(self):
    _check(
      self.norm_overhead_every >= 0, "log.norm_overhead_every", self.norm_overhead_every, "must be >= 0 (0 = off)."
    )


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  enabled: bool = False
  coordinator_address: str = ""
  num_processes: int = 1
  process_id: int = 0
  extra: dict = dataclasses.field(default_factory=dict)  # config.distributed keys not modelled here

  def as_dict(self) -> dict:
    """spec.distributed: every config.distributed key."""
    return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}, **self.extra}

  def __post_init__(self):
    _check(self.num_processes >= 1, "distributed.num_processes", self.num_processes, "must be >= 1.")
    _check(
      0 <= self.process_id < self.num_processes,
      "distributed.process_id",
      self.process_id,
      f"must be in [0, distributed.num_processes={self.num_processes}).",
    )
    if self.enabled:
      addr = self.coordinator_address
      _check(
        bool(re.fullmatch(r"\S+:\d+", addr or "")),
        "distributed.coordinator_address",
        addr,
        "required when distributed.enabled=True: host:port of process 0.",
      )


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """Everything a run needs, checked; the trainer builds from it. Flat names below are read-only views."""

  seed: int
  steps: int
  mode: str
  k: int
  method: str
  rollout: RolloutConfig
  task_template: str
  task_gen: dict
  task_data_path: str
  eval_data_path: str  # held-out data for text tasks ("" = the task's own file / fixture)
  model_cfg: model_config.ModelConfig
  model_checkpoint: str
  tokenizer_dir: str
  sampling: SamplingConfig
  learner: LearnerConfig
  optim: OptimConfig
  on_nonfinite: str
  eval: EvalProtocol
  eval_every: int
  checkpoint: CheckpointConfig
  sft_steps: int
  sft_lr: float
  sft_batch_size: int
  sft_cache_dir: str
  mesh_shape: tuple
  dist: DistributedConfig
  async_: AsyncConfig
  log: LogConfig
  multiturn: MultiTurnConfig | None = None  # tool-use episodes; None = single-turn rollouts
  eval_background: bool = False  # eval.background: the async sampler process evaluates (trainer.run)
  # The run's one configured task (tasks.build of config.task) and the one evaluations draw from (the same
  # object unless eval.dataset / eval.data_path name another): every reward is graded by these objects.
  task: tasks.Task | None = None
  eval_task: tasks.Task | None = None

  def __post_init__(self):
    _check(isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED, "seed", self.seed, f"must be in [0, {MAX_SEED}].")
    _check(self.steps >= 1, "steps", self.steps, "must be >= 1 (learner steps).")
    _check(self.mode in MODES, "mode", self.mode, f"choose one of {MODES}.")
    _check(self.k >= 0, "lag.k", self.k, "staleness must be >= 0.")
    _check(self.k <= MAX_LAG, "lag.k", self.k, f"must be <= {MAX_LAG}; lag mode keeps k + 1 parameter copies.")
    _check(
      self.mode != "sync" or self.k == 0,
      "lag.k",
      self.k,
      "mode='sync' samples with the current policy (k = 0); set lag.k=0 or mode='lag'.",
    )
    _check(
      self.mode != "async" or self.k >= 1,
      "lag.k",
      self.k,
      "mode='async' needs a staleness budget k >= 1 (the sampler runs ahead by up to k steps).",
    )
    _check(
      not (self.async_.inflight_updates and self.multiturn is not None),
      "async_.inflight_updates",
      True,
      "in-flight updates cover single-turn rollouts only; set it False for task.multiturn.enabled runs.",
    )
    _check(
      self.on_nonfinite in ("skip", "abort"), "learner.on_nonfinite", self.on_nonfinite, "choose 'skip' or 'abort'."
    )
    _check(self.eval_every >= 0, "eval.every", self.eval_every, "must be >= 0 (0 = at the start and end only).")
    _check(
      not self.eval_background or (self.mode == "async" and not self.dist.enabled),
      "eval.background",
      self.eval_background,
      "the async sampler process evaluates: only with mode='async' on one host (distributed.enabled=False); "
      "set eval.background=False.",
    )
    _check(self.sft_steps >= 0, "sft.steps", self.sft_steps, "must be >= 0 (0 = no warm start).")
    _check(_finite(self.sft_lr) and self.sft_lr > 0, "sft.lr", self.sft_lr, "must be a finite rate > 0.")
    _check(self.sft_batch_size >= 1, "sft.batch_size", self.sft_batch_size, "must be >= 1.")
    _check(
      not (self.sft_steps and self.model_checkpoint),
      "sft.steps",
      self.sft_steps,
      "the warm start is for randomly initialised CPU-sized models; set sft.steps=0 with model.checkpoint.",
    )

  # Flat views of the component configs (what the trainer, sft and the async source read).
  temperature = property(lambda self: self.sampling.temperature)
  top_p = property(lambda self: self.sampling.top_p)
  top_k = property(lambda self: self.sampling.top_k)
  lr = property(lambda self: self.optim.lr)
  weight_decay = property(lambda self: self.optim.weight_decay)
  clip_norm = property(lambda self: self.optim.clip_norm)
  b1 = property(lambda self: self.optim.b1)
  b2 = property(lambda self: self.optim.b2)
  schedule = property(lambda self: self.optim.schedule)
  checkpoint_every = property(lambda self: self.checkpoint.every)
  keep_last = property(lambda self: self.checkpoint.keep_last)
  keep_best = property(lambda self: self.checkpoint.keep_best)
  progress = property(lambda self: self.log.progress)
  plots = property(lambda self: self.log.plots)
  norm_overhead_every = property(lambda self: self.log.norm_overhead_every)
  distributed = property(lambda self: self.dist.as_dict())
  async_cfg = property(lambda self: self.async_.as_dict())

  @property
  def eval_batch_size(self) -> int:
    return (self.eval.size or 1) * self.eval.n

  def make_train_problems(self):
    """The training pool (as the trainer makes it): num_train_problems generated, or the whole data set."""
    return self.task.make_problems("train", self.rollout.num_train_problems if self.task.generated else None, self.seed)

  def make_eval_problems(self):
    """The held-out problems (as the trainer makes them), at most eval.num_problems."""
    return self.eval_task.make_problems("test", self.eval.size if self.eval_task.generated else None, self.seed)[
      : self.eval.size
    ]

  def load_tokenizer(self):
    """The policy's tokenizer (as the trainer loads it): model.tokenizer, the checkpoint's, or the char one."""
    from vcpo_jax.model import tokenizer as tok_lib

    if self.tokenizer_dir or self.model_checkpoint:
      return tok_lib.load_tokenizer(self.tokenizer_dir or self.model_checkpoint)
    return tok_lib.build_char_tokenizer()


# ----------------------------------------------------------------------------- parse_config


def _pg_config(c) -> estimator.PGConfig:
  _check(
    c.method in estimator.PRESETS, "method", c.method, f"unknown preset; choose one of {sorted(estimator.PRESETS)}."
  )
  overrides = {k: v for k, v in c.vcpo.items() if v is not None}
  try:
    return estimator.pg_config_from_preset(c.method, **overrides)
  except (TypeError, ValueError) as e:
    raise ConfigError(
      f"{_config_message(str(e), 'vcpo', estimator.PGConfig, {})} (config.method={c.method!r})"
    ) from None


def _model_config(c, need_pos: int) -> model_config.ModelConfig:
  m = c.model
  _check(m.preset in model_config.PRESETS, "model.preset", m.preset, f"choose one of {sorted(model_config.PRESETS)}.")
  with _section("model", model_config.ModelConfig):
    base = model_config.PRESETS[m.preset](dtype=m.dtype)
  overrides = {}
  for f in ("hidden_size", "num_layers", "intermediate_size"):
    if m[f] is not None:
      _check(m[f] >= 1, f"model.{f}", m[f], "must be >= 1 (or None for the preset's value).")
      overrides[f] = m[f]
  h = overrides.get("hidden_size")
  if h is not None and not m.checkpoint:  # Qwen2 / Llama: width = heads x head_dim: it splits over the heads
    n = base.num_heads
    _check(
      h % n == 0,
      "model.hidden_size",
      h,
      f"must be a multiple of the {m.preset} preset's num_heads={n}, e.g. {-(-h // n) * n}.",
    )
  for f in model_config.EXECUTION_FIELDS:  # how the model is computed: applies to checkpoints too
    overrides[f] = m[f]
  with _section("model", model_config.ModelConfig):
    cfg = base.replace(**overrides)
  if cfg.max_position < need_pos and not m.checkpoint:
    cfg = cfg.replace(max_position=need_pos)
  return cfg


def _multiturn_config(c) -> MultiTurnConfig | None:
  mt = c.task.multiturn
  if not mt.enabled:
    return None
  _check(
    not tasks.TASKS[c.task.name].generated,
    "task.multiturn.enabled",
    True,
    f"task.name={c.task.name!r} has no tool-use protocol; use a text data set (gsm8k, math, math500, aime).",
  )
  with _section("task.multiturn", MultiTurnConfig):
    cfg = MultiTurnConfig(**{k: v for k, v in mt.to_dict().items() if k != "enabled"})
  _check(
    cfg.max_turn_tokens <= c.task.max_new_tokens,
    "task.multiturn.max_turn_tokens",
    cfg.max_turn_tokens,
    f"exceeds the response budget task.max_new_tokens={c.task.max_new_tokens}; lower it or raise task.max_new_tokens.",
  )
  return cfg


def _eval_protocol(c) -> EvalProtocol:
  dataset = c.eval.dataset or c.task.name
  _check(dataset in tasks.TASKS, "eval.dataset", dataset, f"unknown data set; choose one of {sorted(tasks.TASKS)}.")
  _check(
    dataset == c.task.name or not tasks.TASKS[dataset].generated,
    "eval.dataset",
    dataset,
    "is a generated task; evaluate it by training on it (leave eval.dataset empty).",
  )
  with _section("eval", EvalProtocol, {"size": "num_problems"}):
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
    with _section("task.gen" if tasks.TASKS[t.name].generated else "task", names=dict.fromkeys(gen)):
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
  with _section("eval", names={"data_path": "data_path"}):
    return {"task": task, "eval_task": tasks.build(dataset, template=t.template, data_path=c.eval.data_path)}


def _component(cls, section: str, d: dict):
  """cls(**the section's fields); keys cls does not model go to its `extra` dict if it has one, else stay unused."""
  names = {f.name for f in dataclasses.fields(cls)}
  kw = {k: v for k, v in d.items() if k in names and k != "extra"}
  if "extra" in names:
    kw["extra"] = {k: v for k, v in d.items() if k not in names}
  with _section(section, cls):
    return cls(**kw)


def _exists(field: str, path: str, what: str):
  _check(not path or os.path.exists(path), field, path, f"does not exist; {what}")


def parse_config(config, *, check_prompts: bool = True) -> RunSpec:
  """Checks `config` (configs/common.py's fields) and maps it onto a RunSpec; raises ConfigError.

  check_prompts: also make and tokenize the training and evaluation problems (no model) to check that
  every prompt fits task.max_prompt_len; the result is cached per data setting within a process.
  """
  c = config
  t = c.task
  pg = _pg_config(c)
  _check(
    t.group_size >= 2 or pg.advantage not in ("grpo", "rloo", "drgrpo"),
    "task.group_size",
    t.group_size,
    f"advantage estimator {pg.advantage!r} compares responses within a group; use group_size >= 2 "
    "(or vcpo.advantage='reinforce').",
  )
  _check(t.name in tasks.TASKS, "task.name", t.name, f"unknown task; choose one of {sorted(tasks.TASKS)}.")
  _check(
    not t.template or tasks.TASKS[t.name].generated or "{problem}" in t.template,
    "task.template",
    t.template,
    f"a {t.name} prompt template must contain '{{problem}}'.",
  )
  _exists("task.data_path", t.data_path, "point it at a local parquet/jsonl file ('' = the shipped fixture).")
  _exists("eval.data_path", c.eval.data_path, "point it at a local parquet/jsonl file ('' = the shipped fixture).")
  _check(
    not c.model.checkpoint or os.path.isfile(os.path.join(c.model.checkpoint, "config.json")),
    "model.checkpoint",
    c.model.checkpoint,
    "has no config.json; pass a local Hugging Face model directory, or '' for a random preset.",
  )
  _check(
    not c.model.tokenizer or os.path.isdir(c.model.tokenizer),
    "model.tokenizer",
    c.model.tokenizer,
    "is not a directory.",
  )
  with _section("task", RolloutConfig):
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
  with _section("learner", LearnerConfig):
    learner_cfg = LearnerConfig(
      pg=pg,
      grad_path=c.learner.grad_path,
      microbatch_size=c.learner.get("microbatch_size") or None,
      ppo_epochs=c.learner.get("ppo_epochs", 1),
      minibatches=c.learner.get("minibatches", 1),
      group_size=rollout.group_size,
      batch_size=rollout.batch_size,
    )
  optim_cfg = _component(OptimConfig, "optim", c.optim.to_dict())
  mesh_shape = _mesh_shape(c.mesh.shape, rollout)
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
    mesh_shape=mesh_shape,
    dist=_component(DistributedConfig, "distributed", c.distributed.to_dict()),
    async_=_component(AsyncConfig, "async_", c.async_.to_dict()),
    log=_component(LogConfig, "log", c.log.to_dict()),
    multiturn=multiturn,
    **_tasks(c),
  )
  if check_prompts:
    _check_prompt_lengths(spec)
  return spec


def _mesh_shape(shape, rollout: RolloutConfig) -> tuple:
  from vcpo_jax import sharding

  with _section("mesh", sharding.MeshConfig):
    mesh_shape = sharding.MeshConfig(tuple(shape)).shape
  data_par = max(mesh_shape[0], 1) * max(mesh_shape[1], 1)  # a -1 entry is resolved when the mesh is built
  _check(
    rollout.batch_size % data_par == 0,
    "task.prompts_per_step",
    rollout.prompts_per_step,
    f"the batch N = P*G = {rollout.batch_size} must be divisible by the data-parallel size data*fsdp = "
    f"{data_par} of mesh.shape={mesh_shape}.",
  )
  return mesh_shape


_PROMPT_LENGTHS: dict[str, dict] = {}  # data setting -> longest prompts; tests parse the same config often
_TOKENIZERS: dict[tuple, object] = {}  # (model.tokenizer, model.checkpoint) -> tokenizer, only for counting here


def _check_prompt_lengths(spec: RunSpec):
  """Every training and evaluation prompt fits the prompt bucket task.max_prompt_len (else: one line, the fix)."""
  from vcpo_jax.rollout.common import encode_prompts

  key = repr(
    (
      spec.rollout.task,
      spec.task_template,
      sorted(spec.task_gen.items()),
      spec.task_data_path,
      spec.rollout.num_train_problems,
      spec.eval.dataset,
      spec.eval.size,
      spec.eval_data_path,
      spec.seed,
      spec.rollout.chat_template,
      spec.model_checkpoint,
      spec.tokenizer_dir,
    )
  )
  if key not in _PROMPT_LENGTHS:
    with _section("task.gen" if spec.task.generated else "task", names=dict.fromkeys(spec.task_gen)):
      train = spec.make_train_problems()
    with _section("eval"):
      held_out = spec.make_eval_problems()
    with _section("model.tokenizer" if spec.tokenizer_dir else "model.checkpoint"):
      src = (spec.tokenizer_dir, spec.model_checkpoint)
      tokenizer = _TOKENIZERS[src] = _TOKENIZERS.get(src) or spec.load_tokenizer()
    longest = {}
    for name, problems in (("training", train), ("evaluation", held_out)):
      lengths = [len(ids) for ids in encode_prompts(tokenizer, problems, spec.rollout.chat_template)]
      i = max(range(len(lengths)), key=lengths.__getitem__) if lengths else None
      longest[name] = (lengths[i], problems[i].id) if lengths else (0, None)
    _PROMPT_LENGTHS[key] = longest
  for name, (n, problem_id) in _PROMPT_LENGTHS[key].items():
    _check(
      n <= spec.rollout.max_prompt_len,
      "task.max_prompt_len",
      spec.rollout.max_prompt_len,
      f"the longest {name} prompt (problem {problem_id}) has {n} tokens; set task.max_prompt_len >= {n}.",
    )


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
