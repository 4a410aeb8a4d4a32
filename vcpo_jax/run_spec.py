"""The run's checked configuration: frozen component configs and the RunSpec that holds them.

Each config section has a frozen dataclass that checks its own fields in `__post_init__` and names
the config field in its message (`config.sampler.top_p=1.5: must be in (0, 1] (1 = off).`):
SamplingConfig (config.sampler), CheckpointConfig (config.checkpoint), AsyncConfig (config.async_),
LogConfig (config.log), DistributedConfig (config.distributed); the other sections' configs live with
their components (optim.OptimConfig, estimator.PGConfig, learner.LearnerConfig, rollout.common.
RolloutConfig, rollout.multiturn.MultiTurnConfig, evaluation.EvalProtocol, model.config.ModelConfig,
mesh_lib.MeshConfig). Components get only their own config: rollout.async_.AsyncSource its AsyncConfig,
sft.warm_start an sft.SFTConfig (RunSpec.sft_config(): config.sft plus the data setting it depends on).
RunSpec checks the top-level fields and the constraints between sections;
`check_prompt_lengths` checks the data against the prompt bucket. run_config.parse_config is the one
mapper from a ConfigDict to a RunSpec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

from vcpo_jax import mesh as mesh_lib
from vcpo_jax import sft, tasks
from vcpo_jax.evaluation import EvalProtocol
from vcpo_jax.learner import LearnerConfig
from vcpo_jax.model import config as model_config
from vcpo_jax.model.tokenizer import encode_prompts
from vcpo_jax.optim import OptimConfig
from vcpo_jax.rollout.common import RolloutConfig
from vcpo_jax.rollout.multiturn import MultiTurnConfig

MODES = ("sync", "lag", "async")
MAX_LAG = 1024
MAX_SEED = 2**32 - 1  # numpy's and JAX's seeds are unsigned 32-bit


class ConfigError(ValueError):
  """A bad config value; the message is one line: `config.FIELD=VALUE: what to do`."""


def check_field(ok: bool, field: str, value, fix: str):
  if not ok:
    raise ConfigError(f"config.{field}={value!r}: {fix}")


def _finite(x) -> bool:
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
  prefill_chunk: int = 0
  max_batch: int = 0

  def __post_init__(self):
    check_field(
      isinstance(self.max_batch, int) and self.max_batch >= 0,
      "sampler.max_batch",
      self.max_batch,
      "must be an int >= 0 (rows per sampler call; 0 = all rows of a step in one call).",
    )
    check_field(
      isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 0,
      "sampler.prefill_chunk",
      self.prefill_chunk,
      "must be an int >= 0 (0 = the whole prompt bucket in one pass; e.g. 512 bounds prefill memory).",
    )
    check_field(self.draw in ("inverse_cdf", "gumbel"), "sampler.draw", self.draw, "use inverse_cdf or gumbel.")
    check_field(
      self.param_dtype in ("", "auto", "float32", "bfloat16"),
      "sampler.param_dtype",
      self.param_dtype,
      "use auto (bf16 on accelerators), float32 or bfloat16.",
    )
    try:
      object.__setattr__(self, "mesh_shape", mesh_lib.MeshConfig(tuple(self.mesh_shape)).shape)
    except (ValueError, TypeError) as e:
      check_field(False, "sampler.mesh_shape", self.mesh_shape, f"{e}")
    check_field(
      _finite(self.temperature) and self.temperature > 0,
      "sampler.temperature",
      self.temperature,
      "training rollouts need a finite temperature > 0 (greedy behavior log-probs are degenerate); released: 1.0.",
    )
    check_field(
      _finite(self.top_p) and 0 < self.top_p <= 1, "sampler.top_p", self.top_p, "must be in (0, 1] (1 = off)."
    )
    check_field(self.top_k >= 0, "sampler.top_k", self.top_k, "must be >= 0 (0 = off).")

  def sampler_kwargs(self, **override) -> dict:
    """The sampler.SamplerConfig fields these settings give (an evaluation overrides temperature / top_p / top_k)."""
    names = ("temperature", "top_p", "top_k", "draw", "param_dtype", "mesh_shape", "prefill_chunk", "max_batch")
    return {**{n: getattr(self, n) for n in names}, **override}


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 50  # save every this many steps
  keep_last: int = 2  # newest checkpoints kept
  keep_best: int = 1  # plus the best by eval accuracy

  def __post_init__(self):
    check_field(self.every >= 1, "checkpoint.every", self.every, "must be >= 1 (steps between saves).")
    check_field(
      self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1 (resuming needs the newest)."
    )
    check_field(self.keep_best >= 0, "checkpoint.keep_best", self.keep_best, "must be >= 0 (0 = keep no best).")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
  """The sampler process of mode='async' (config.async_): rollout.async_.AsyncSource's own config."""

  queue_slots: int = 4
  sampler_devices: str = ""
  timeout_s: float = 120.0
  startup_timeout_s: float = 600.0
  sampler_cpus: str = ""
  sampler_env: dict = dataclasses.field(default_factory=dict)
  background_publish: str = "auto"  # "true": copy in a thread; "false": on the learner's path; auto: false on CPU
  publish_path: str = "shm"  # shm: process + shared memory | device: thread, device_put | transfer: process, pull
  publish_dtype: str = "auto"  # slot dtype of floating parameters: auto (bf16 on accelerators, f32 on CPU)
  publish_buffers: int = 1  # parameter copies in the shm slot: 1 | 2 | 0 = 1 with background publish, else 2
  publish_checksum: str = "true"  # shm slot checksum, echoed and checked: true | false | background (thread only)
  decode: str = "static"
  chunk_tokens: int = 16
  inflight_updates: bool = False
  update_every_tokens: int = 16
  recompute_kv: bool = False
  peer_lost_s: float = 30.0  # multi-host: a learner process without a heartbeat this long is lost
  max_sampler_restarts: int = 3  # a dead / hung sampler is replaced at most this often per restart_window_s
  restart_window_s: float = 3600.0  # the window of max_sampler_restarts; one more failure ends the run
  heartbeat_timeout_s: float = 0.0  # a sampler whose heartbeat stops this long is hung (replaced); 0 = timeout_s

  def __post_init__(self):
    check_field(
      self.queue_slots >= 1, "async_.queue_slots", self.queue_slots, "must be >= 1 (batches the queue holds)."
    )
    for f in ("timeout_s", "startup_timeout_s"):
      v = getattr(self, f)
      check_field(_finite(v) and v > 0, f"async_.{f}", v, "must be a finite number of seconds > 0.")
    check_field(
      isinstance(self.max_sampler_restarts, int) and self.max_sampler_restarts >= 0,
      "async_.max_sampler_restarts",
      self.max_sampler_restarts,
      "must be an int >= 0 (0 = a failed sampler ends the run).",
    )
    check_field(
      _finite(self.heartbeat_timeout_s) and self.heartbeat_timeout_s >= 0,
      "async_.heartbeat_timeout_s",
      self.heartbeat_timeout_s,
      "must be a finite number of seconds >= 0 (0 = async_.timeout_s).",
    )
    check_field(
      _finite(self.restart_window_s) and self.restart_window_s > 0,
      "async_.restart_window_s",
      self.restart_window_s,
      "must be a finite number of seconds > 0.",
    )
    check_field(
      _finite(self.peer_lost_s) and self.peer_lost_s > 2.0,
      "async_.peer_lost_s",
      self.peer_lost_s,
      "must be a finite number of seconds > 2 (4 heartbeats of 0.5 s; 30 tolerates a busy host).",
    )
    ids = str(self.sampler_devices).replace(" ", "").split(",") if str(self.sampler_devices) else []
    check_field(
      all(x.isdigit() for x in ids) and len(set(ids)) == len(ids),
      "async_.sampler_devices",
      self.sampler_devices,
      "use distinct device ids like '1' or '6,7' ('' = share the learner's devices).",
    )
    from vcpo_jax.sampler import DECODE_MODES

    check_field(self.decode in DECODE_MODES, "async_.decode", self.decode, f"choose one of {DECODE_MODES}.")
    for f in ("chunk_tokens", "update_every_tokens"):
      v = getattr(self, f)
      check_field(isinstance(v, int) and v >= 1, f"async_.{f}", v, "must be an int >= 1 (decode steps).")
    check_field(
      self.publish_dtype in ("auto", "float32", "bfloat16"),
      "async_.publish_dtype",
      self.publish_dtype,
      "use 'auto' (bfloat16 on accelerators, float32 on CPU), 'float32' or 'bfloat16'.",
    )
    check_field(
      self.publish_path in ("shm", "device", "transfer"),
      "async_.publish_path",
      self.publish_path,
      "use 'shm' (a sampler process, shared memory), 'device' (a sampler thread on async_.sampler_devices) or "
      "'transfer' (a sampler process pulling with jax.experimental.transfer).",
    )
    check_field(
      not (self.publish_path == "transfer" and self.inflight_updates),
      "async_.inflight_updates",
      self.inflight_updates,
      "in-flight updates are not tested with publish_path='transfer'; set it False or async_.publish_path='shm'.",
    )
    check_field(
      self.publish_path != "device" or bool(self.sampler_devices),
      "async_.publish_path",
      self.publish_path,
      "'device' needs async_.sampler_devices (e.g. '2,3': the sampler's devices of this process).",
    )
    check_field(
      self.publish_buffers in (0, 1, 2),
      "async_.publish_buffers",
      self.publish_buffers,
      "use 1 (one parameter copy in /dev/shm: a publish waits for a sampler read in progress), 2 (double "
      "buffer: never waits) or 0 (1 with background publishing, 2 with the synchronous one).",
    )
    check_field(
      self.publish_checksum in ("true", "false", "background"),
      "async_.publish_checksum",
      self.publish_checksum,
      "use 'true' (every shm publish records the slot checksum and next() checks the sampler's echo), 'false' "
      "(none) or 'background' (only the background publisher's copies).",
    )
    check_field(
      str(self.background_publish).lower() in ("auto", "true", "false"),
      "async_.background_publish",
      self.background_publish,
      "use 'auto' (synchronous on CPU, background on accelerators), 'true' or 'false'.",
    )
    for f in ("inflight_updates", "recompute_kv"):
      check_field(isinstance(getattr(self, f), bool), f"async_.{f}", getattr(self, f), "must be True or False.")
    from vcpo_jax.rollout.async_ import parse_cpus  # the one parser of CPU lists ("1", "0,2", "2-3")

    try:
      parse_cpus(self.sampler_cpus)
    except ValueError as e:
      raise ConfigError(config_message(str(e), "async_")) from None

  def as_dict(self) -> dict:
    """spec.async_cfg: every config.async_ key (this dataclass models them all; AsyncSource reads the fields)."""
    return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "sampler_env": dict(self.sampler_env)}


@dataclasses.dataclass(frozen=True)
class LogConfig:
  progress: bool = True
  plots: bool = True
  norm_overhead_every: int = 0
  ref_grad_every: int = 0  # sync / lag: cosine of the step's gradient to an on-policy one every N steps (0 = off)

  def __post_init__(self):
    check_field(
      self.norm_overhead_every >= 0, "log.norm_overhead_every", self.norm_overhead_every, "must be >= 0 (0 = off)."
    )
    check_field(self.ref_grad_every >= 0, "log.ref_grad_every", self.ref_grad_every, "must be >= 0 (0 = off).")


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
    check_field(self.num_processes >= 1, "distributed.num_processes", self.num_processes, "must be >= 1.")
    check_field(
      0 <= self.process_id < self.num_processes,
      "distributed.process_id",
      self.process_id,
      f"must be in [0, distributed.num_processes={self.num_processes}).",
    )
    if self.enabled:
      addr = self.coordinator_address
      check_field(
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
  sft_noise: float = 0.0  # config.sft.noise (sft.SFTConfig.noise)

  def _check_centering(self, pg):
    """vcpo.score_centering='exact' needs the behaviour parameters (sync / lag) and q = softmax(logits); 'topk'
    is not carried by the Batch yet (the sampler records it, the learner consumes it: not wired between)."""
    check_field(
      pg.score_centering != "topk",
      "vcpo.score_centering",
      "topk",
      "the sampler records the top-k (SamplerConfig.record_topk) and the learner centers from it, but the Batch "
      "does not carry it through the rollout sources yet; use vcpo.score_centering='exact' with mode='lag'.",
    )
    if pg.score_centering != "exact":
      return
    check_field(
      not self.model_cfg.lora_rank,
      "vcpo.score_centering",
      "exact",
      f"the behaviour forward takes a whole model, not LoRA adapters (model.lora_rank={self.model_cfg.lora_rank}); "
      "set vcpo.score_centering='off' or model.lora_rank=0.",
    )
    check_field(
      self.mode in ("sync", "lag"),
      "vcpo.score_centering",
      "exact",
      f"needs the behaviour parameters, kept only in mode='sync' / 'lag' (have {self.mode!r}); "
      "use vcpo.score_centering='topk' (with vcpo.sc_topk) or mode='lag'.",
    )
    s = self.sampling
    check_field(
      s.temperature == 1.0 and s.top_p >= 1.0 and not s.top_k,
      "vcpo.score_centering",
      "exact",
      f"recomputes q = softmax(logits) of the behaviour version; sampler.temperature={s.temperature}, "
      f"top_p={s.top_p}, top_k={s.top_k} change q: set them to 1.0, 1.0, 0 or use vcpo.score_centering='topk'.",
    )

  def __post_init__(self):
    check_field(
      isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED, "seed", self.seed, f"must be in [0, {MAX_SEED}]."
    )
    check_field(self.steps >= 1, "steps", self.steps, "must be >= 1 (learner steps).")
    check_field(self.mode in MODES, "mode", self.mode, f"choose one of {MODES}.")
    check_field(self.k >= 0, "lag.k", self.k, "staleness must be >= 0.")
    check_field(self.k <= MAX_LAG, "lag.k", self.k, f"must be <= {MAX_LAG}; lag mode keeps k + 1 parameter copies.")
    check_field(
      self.mode != "sync" or self.k == 0,
      "lag.k",
      self.k,
      "mode='sync' samples with the current policy (k = 0); set lag.k=0 or mode='lag'.",
    )
    check_field(
      self.mode != "async" or self.k >= 1,
      "lag.k",
      self.k,
      "mode='async' needs a staleness budget k >= 1 (the sampler runs ahead by up to k steps).",
    )
    check_field(
      not (self.async_.inflight_updates and self.multiturn is not None),
      "async_.inflight_updates",
      True,
      "in-flight updates cover single-turn rollouts only; set it False for task.multiturn.enabled runs.",
    )
    check_field(
      self.on_nonfinite in ("skip", "abort"), "learner.on_nonfinite", self.on_nonfinite, "choose 'skip' or 'abort'."
    )
    check_field(self.eval_every >= 0, "eval.every", self.eval_every, "must be >= 0 (0 = at the start and end only).")
    check_field(
      not self.eval_background or (self.mode == "async" and not self.dist.enabled),
      "eval.background",
      self.eval_background,
      "the async sampler process evaluates: only with mode='async' on one host (distributed.enabled=False); "
      "set eval.background=False.",
    )
    check_field(
      not (self.log.ref_grad_every and self.mode == "async"),
      "log.ref_grad_every",
      self.log.ref_grad_every,
      "the on-policy reference batch is sampled in the learner's process: mode='sync' or 'lag' only; set 0.",
    )
    check_field(
      not (self.mode == "async" and self.async_.publish_path == "transfer" and self.dist.enabled),
      "async_.publish_path",
      "transfer",
      "the transfer path serves one learner process; set async_.publish_path='shm' for distributed.enabled runs.",
    )
    check_field(
      not (self.eval_background and self.async_.publish_path != "shm"),
      "eval.background",
      self.eval_background,
      f"needs async_.publish_path='shm' (have {self.async_.publish_path!r}); set one of them.",
    )
    with config_errors("sft", sft.SFTConfig):  # the warm start's own config checks config.sft.*
      self.sft_config()
    if self.task is not None:
      check_field(
        not self.task_template or self.task.generated or "{problem}" in self.task_template,
        "task.template",
        self.task_template,
        f"a {self.rollout.task} prompt template must contain '{{problem}}'.",
      )
    if self.multiturn is not None:
      check_field(
        self.task is None or not self.task.generated,
        "task.multiturn.enabled",
        True,
        f"task.name={self.rollout.task!r} has no tool-use protocol; use a text data set (gsm8k, math, math500, aime).",
      )
      n = self.rollout.max_new_tokens
      check_field(
        self.multiturn.max_turn_tokens <= n,
        "task.multiturn.max_turn_tokens",
        self.multiturn.max_turn_tokens,
        f"exceeds the response budget task.max_new_tokens={n}; lower it or raise task.max_new_tokens.",
      )
    pg = self.learner.pg
    self._check_centering(pg)
    check_field(
      self.rollout.group_size >= 2 or pg.advantage not in ("grpo", "rloo", "drgrpo"),
      "task.group_size",
      self.rollout.group_size,
      f"advantage estimator {pg.advantage!r} compares responses within a group; use group_size >= 2 "
      "(or vcpo.advantage='reinforce').",
    )
    g, mb = self.rollout.group_size, self.sampling.max_batch
    check_field(
      mb % g == 0,
      "sampler.max_batch",
      mb,
      f"must be a multiple of task.group_size={g}, so that each sampler call holds whole groups (0 = no cap).",
    )
    data_par = max(self.mesh_shape[0], 1) * max(self.mesh_shape[1], 1)  # a -1 entry: resolved by build_mesh
    check_field(
      self.rollout.batch_size % data_par == 0,
      "task.prompts_per_step",
      self.rollout.prompts_per_step,
      f"the batch N = P*G = {self.rollout.batch_size} must be divisible by the data-parallel size "
      f"data*fsdp = {data_par} of mesh.shape={self.mesh_shape}.",
    )
    check_field(
      not self.model_checkpoint or os.path.isfile(os.path.join(self.model_checkpoint, "config.json")),
      "model.checkpoint",
      self.model_checkpoint,
      "has no config.json; pass a local Hugging Face model directory, or '' for a random preset.",
    )
    check_field(
      not self.tokenizer_dir or os.path.isdir(self.tokenizer_dir),
      "model.tokenizer",
      self.tokenizer_dir,
      "is not a directory.",
    )
    check_field(
      not (self.sft_steps and self.model_checkpoint),
      "sft.steps",
      self.sft_steps,
      "the warm start is for randomly initialised CPU-sized models; set sft.steps=0 with model.checkpoint.",
    )

  # Flat views of the component configs (read by tests and scripts; components get their own configs).
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

  def sft_config(self) -> sft.SFTConfig:
    """The warm start's own config (sft.warm_start): config.sft plus the data setting, seed and sampling."""
    return sft.SFTConfig(
      steps=self.sft_steps,
      lr=self.sft_lr,
      batch_size=self.sft_batch_size,
      max_prompt_len=self.rollout.max_prompt_len,
      max_new_tokens=self.rollout.max_new_tokens,
      task=self.rollout.task,
      template=self.task_template,
      task_gen=self.task_gen,
      chat_template=self.rollout.chat_template,
      seed=self.seed,
      cache_dir=self.sft_cache_dir,
      noise=self.sft_noise,
      temperature=self.sampling.temperature,
      progress=self.log.progress,
    )

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
    from vcpo_jax.model import policy

    return policy.load_tokenizer(self.model_checkpoint, self.tokenizer_dir)


# ----------------------------------------------------------------------------- prompt lengths


_PROMPT_LENGTHS: dict[str, dict] = {}  # data setting -> longest prompts; tests parse the same config often
_TOKENIZERS: dict[tuple, object] = {}  # (model.tokenizer, model.checkpoint) -> tokenizer, only for counting here


def check_prompt_lengths(spec: RunSpec):
  """Every training and evaluation prompt fits the prompt bucket task.max_prompt_len (else: one line, the fix)."""
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
    with config_errors("task.gen" if spec.task.generated else "task", names=dict.fromkeys(spec.task_gen)):
      train = spec.make_train_problems()
    with config_errors("eval"):
      held_out = spec.make_eval_problems()
    with config_errors("model.tokenizer" if spec.tokenizer_dir else "model.checkpoint"):
      src = (spec.tokenizer_dir, spec.model_checkpoint)
      tokenizer = _TOKENIZERS[src] = _TOKENIZERS.get(src) or spec.load_tokenizer()
    longest = {}
    for name, problems in (("training", train), ("evaluation", held_out)):
      lengths = [len(ids) for ids in encode_prompts(tokenizer, problems, spec.rollout.chat_template)]
      i = max(range(len(lengths)), key=lengths.__getitem__) if lengths else None
      longest[name] = (lengths[i], problems[i].id) if lengths else (0, None)
    _PROMPT_LENGTHS[key] = longest
  for name, (n, problem_id) in _PROMPT_LENGTHS[key].items():
    check_field(
      n <= spec.rollout.max_prompt_len,
      "task.max_prompt_len",
      spec.rollout.max_prompt_len,
      f"the longest {name} prompt (problem {problem_id}) has {n} tokens; set task.max_prompt_len >= {n}.",
    )
