"""Asynchronous rollouts: a sampler process streams batches to the learner through shared memory.

    learner (this process)                         sampler (spawned, process/worker.py)
    publish(params, v) --ParamSlot (v, weights)--> newest params, once v >= b - k
    next(b) <----------ShmQueue (batch b)--------- RolloutMaker.make(params, b, fold_in(key, b), v)

Structure: `AsyncSource` owns the queue, the staleness bound, liveness, replacement and checkpoints, and composes
two parts. Where the learner processes are is a Topology (rollout/topology.py) picked by jax.process_count():
OneHost, or ManyHosts (rollout/multihost.py: one sampler per host, a per-step agreement, the global batch
gathered). How a version reaches the sampler is a Publisher (rollout/publish.py) picked by
`async_.publish_path`: "shm" (ShmPublisher, the ParamSlot above), "device" (device_publish.DevicePublisher: a
sampler thread of this process, device_put) or "transfer" (transfer_publish.TransferPublisher: the spawned
sampler pulls device arrays). Each publisher records the checksum of every version it publishes
(Publisher.record, which also drops those no batch can echo any more); next() checks each batch's echo.

Contract:
- Staleness (PipelineRL-style): the worker makes batch b only once version >= b - k is published and the
  learner consumes batch b at step b, so every row's lag b - policy_version is in [0, k]; nothing is
  generated and discarded. The worker takes the newest version it finds, so runs are not bit-for-bit
  reproducible. With `async_.inflight_updates` rows carry per-token versions (token_version [N, T]),
  policy_version is the oldest token's, and every token's version is checked against [step - k, step].
- Resume: `queued_state()` (every checkpoint save) drains batches received but not consumed into the
  checkpoint; `load_queued()` serves them first and the new worker starts at the first step not covered, so
  each batch is consumed exactly once across a resume.
- Publishing: one parameter copy in shared memory with a version counter and a 64-bit checksum
  (`async_.publish_buffers`, `publish_checksum`, `background_publish`, `publish_delta`; a LoRA run
  publishes the adapters only). Metrics: time/publish_s (learner-side blocking time of publish() per step),
  time/publish_copy_s (the host copy of the newest version written since the previous row).
- Devices: `async_.sampler_devices` / `sampler_env` / `sampler_cpus` / `memory_share` place the sampler.
- Failures: every learner wait runs in slices of `_POLL_S`, calling the trainer's `interrupt()` and checking
  the worker (exit code, error pipe, heartbeat). A dead, silent (`heartbeat_timeout_s`) or stuck
  (`timeout_s`) sampler is replaced (`restart_causes` says why); past `max_sampler_restarts` within
  `restart_window_s` a death raises `SamplerDiedError` with the worker's traceback, and no batch in
  `timeout_s` (`startup_timeout_s` for the first) raises TimeoutError. `close()` stops the worker and
  removes every segment and semaphore; names carry the run id and pid (`vcpo_jax.cleanup`).
- Background evaluation (eval.background, one host): `enable_background_eval`, `request_eval(v, params)`,
  `eval_results()`; at most one request outstanding.

The design notes (publishing paths and their costs, delta records, LoRA's base channel, device placement,
failure handling and /dev/shm hygiene in detail) are in docs/design_notes.md "rollout/async_.py".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import pickle
import queue as queue_lib
import signal
import tempfile
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax import batch as batch_lib
from vcpo_jax import cleanup, compile_cache
from vcpo_jax import mesh as mesh_lib
from vcpo_jax.model import lora
from vcpo_jax.rollout import device_publish, multihost, transfer_publish
from vcpo_jax.rollout import publish as publish_lib
from vcpo_jax.rollout import topology as topology_lib
from vcpo_jax.rollout.base import RolloutSource, SourceFailed
from vcpo_jax.rollout.common import lag_stats, token_lag_stats
from vcpo_jax.rollout.process import worker as worker_lib
from vcpo_jax.rollout.process.param_slot import ParamSlot
from vcpo_jax.rollout.process.shm_queue import SPAWN, BatchSchema, Field, PeerDiedError, QueueFinished, ShmQueue
from vcpo_jax.rollout.publish import background_for, snapshot_leaf  # noqa: F401 (re-exported)
from vcpo_jax.sampler import DECODE_MODES, SamplerConfig, routing_width
from vcpo_jax.schema import ConfigError, check_field, config_message, finite

_POLL_S = 0.25  # learner-side wait slice: between slices it checks interrupt(), the worker and the deadline
# close(): how long to wait for the stop message to be obeyed (a worker inside generation only reads it when
# the batch is done), then for SIGTERM; short enough that a signal still exits within a few seconds.
_STOP_GRACE_S = 1.0

log = logging.getLogger("vcpo_jax")


class SamplerDiedError(SourceFailed):
  """The async sampler process exited while the learner depended on it."""


def batch_schema(n: int, t: int, k: int = 0, r: int = 0, support: bool = False, e: int = 0) -> BatchSchema:
  """The queue schema of one rollout Batch (vcpo_jax/batch.py): N rows, T columns (and the sampler's per-token
  records over the R response columns: K top-k ids, SamplerConfig.record_topk; the kept support,
  SamplerConfig.record_support; E routing entries, sampler.routing_width), fixed shapes."""
  fields = batch_lib.schema(n, t, k, r, support, e)
  return BatchSchema({f: Field(dtype, shape) for f, (dtype, shape) in fields.items()}, {})


def maker_schema(maker, n: int) -> BatchSchema:
  """`batch_schema` of n rows of the maker's batches: its T columns and its training sampler's records."""
  cfg, scfg = maker.cfg, maker.sampler.cfg
  t, r = cfg.max_prompt_len + cfg.max_new_tokens, cfg.max_new_tokens
  e = routing_width(maker.sampler.cfg_model, scfg)  # the MoE routing record's entries per token (0: none)
  return batch_schema(n, t, int(scfg.record_topk), r, bool(scfg.record_support), e=e)


def parse_cpus(text: str) -> tuple[int, ...]:
  """ "1" / "0,2" / "2-3" -> a tuple of CPU ids."""
  out: list[int] = []
  for part in str(text).replace(" ", "").split(","):
    if not part:
      continue
    lo, _, hi = part.partition("-")
    try:
      out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
      raise ValueError(f"async_.sampler_cpus={text!r}: use CPU ids like '1', '0,2' or '2-3'.") from None
  return tuple(out)


@contextlib.contextmanager
def _environ(overrides: dict[str, str | None]):
  """Temporarily set environment variables: a spawned child inherits os.environ at start()."""
  old = {k: os.environ.get(k) for k in overrides}
  for k, v in overrides.items():  # None: unset (mesh.memory_plan's "XLA's default")
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@contextlib.contextmanager
def _sigint_ignored():
  """SIGINT ignored while a child is spawned: an ignored signal stays ignored across exec, so the sampler
  ignores a terminal's Ctrl-C (sent to the whole process group) from its first instruction, its imports
  included, and the learner stops it. The learner's own handler is back once start() returns (a Ctrl-C in
  that window of a few milliseconds is dropped). Off the main thread (signals cannot be set there): as is."""
  try:
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
  except ValueError:
    yield
    return
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, old)


def _describe_exit(code: int | None) -> str:
  if code is None:
    return "is still running"
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name} (exit code {code})"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
  """The sampler process of mode='async' (config.async_): rollout.async_.AsyncSource's own config."""

  queue_slots: int = 4  # shared-memory queue capacity (batches)
  sampler_devices: str = ""  # e.g. "0,1": device ids for the sampler process ("" = same platform default)
  timeout_s: float = 120.0  # a learner wait longer than this (dead sampler) is an error
  startup_timeout_s: float = 600.0  # the first batch (worker start-up + compilation) may take this long
  sampler_cpus: str = ""  # pin the sampler process to these cores, e.g. "1" or "2-3" ("" = no pinning)
  sampler_env: dict = dataclasses.field(default_factory=dict)  # extra environment variables of the sampler process
  background_publish: str | bool = "auto"  # "true"/True: copy in a thread | "false": learner's path | auto: CPU false
  publish_path: str = "shm"  # shm: process, shm slot | device: thread, device_put | transfer: process, pull
  publish_dtype: str = "auto"  # slot dtype of floating params: "auto" (bf16 on accelerators, f32 on CPU)
  publish_buffers: int = 1  # parameter copies in the shm slot: 1 | 2 | 0 = 1 with background publish, else 2
  publish_checksum: str = "true"  # shm slot checksum, echoed + checked: true | false | background (thread only)
  publish_delta: str = "off"  # off (full copies) | auto (delta vs the sampler's version: one-copy shm slot, transfer)
  decode: str = (
    SamplerConfig.decode
  )  # sampler process: static (one device loop) | chunked | refill (continuous batching)
  chunk_tokens: int = 16  # decode steps per jitted chunk ("chunked" / "refill" / in-flight updates)
  inflight_updates: bool = False  # switch to newer params between decode chunks; per-token versions
  update_every_tokens: int = 16  # in-flight: check the parameter slot every this many decode steps
  recompute_kv: bool = False  # in-flight: recompute the KV cache under the new params (False: keep it)
  peer_lost_s: float = 30.0  # multi-host: a learner process silent (no heartbeat) this long is lost; the others exit
  max_sampler_restarts: int = 3  # a dead sampler, or one with no batch in timeout_s, is replaced this often
  restart_window_s: float = 3600.0  # ... per this many seconds; one more failure checkpoints and exits 1
  heartbeat_timeout_s: float = 0.0  # a sampler whose heartbeat stops this long is hung, replaced; 0 = timeout_s
  # mesh.memory_plan: "auto" = a shared GPU 0.6 / 0.3, own GPUs XLA's defaults; "xla" = XLA_PYTHON_CLIENT_* as set
  memory_share: str = "auto"  # GPU memory of learner / sampler process: auto | grow (no preallocation) | xla | "L,S"

  def __post_init__(self):
    check_field(
      self.queue_slots >= 1, "async_.queue_slots", self.queue_slots, "must be >= 1 (batches the queue holds)."
    )
    for f in ("timeout_s", "startup_timeout_s"):
      v = getattr(self, f)
      check_field(finite(v) and v > 0, f"async_.{f}", v, "must be a finite number of seconds > 0.")
    check_field(
      isinstance(self.max_sampler_restarts, int) and self.max_sampler_restarts >= 0,
      "async_.max_sampler_restarts",
      self.max_sampler_restarts,
      "must be an int >= 0 (0 = a failed sampler ends the run).",
    )
    check_field(
      finite(self.heartbeat_timeout_s) and self.heartbeat_timeout_s >= 0,
      "async_.heartbeat_timeout_s",
      self.heartbeat_timeout_s,
      "must be a finite number of seconds >= 0 (0 = async_.timeout_s).",
    )
    check_field(
      finite(self.restart_window_s) and self.restart_window_s > 0,
      "async_.restart_window_s",
      self.restart_window_s,
      "must be a finite number of seconds > 0.",
    )
    check_field(
      finite(self.peer_lost_s) and self.peer_lost_s > 2.0,
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
      "in-flight updates do not run over publish_path='transfer' (a pull lands on one device inside the sampler's "
      "mesh); set it False or async_.publish_path='shm'.",
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
      self.publish_delta in ("off", "auto"),
      "async_.publish_delta",
      self.publish_delta,
      "use 'off' (every publish copies all weights into the slot) or 'auto' (a compressed XOR delta against the "
      "version the sampler holds, when the shm slot holds one copy and on the transfer path; full copies elsewhere).",
    )
    check_field(
      str(self.background_publish).lower() in ("auto", "true", "false"),
      "async_.background_publish",
      self.background_publish,
      "use 'auto' (synchronous on CPU, background on accelerators), 'true' or 'false'.",
    )
    for f in ("inflight_updates", "recompute_kv"):
      check_field(isinstance(getattr(self, f), bool), f"async_.{f}", getattr(self, f), "must be True or False.")
    try:
      parse_cpus(self.sampler_cpus)
      mesh_lib.parse_memory_share(self.memory_share)
    except ValueError as e:
      raise ConfigError(config_message(str(e), "async_")) from None


def resolve_publish_dtype(name: str, platform: str):
  """async_.publish_dtype on `platform`: "auto" is bfloat16 on accelerators and float32 on CPU."""
  if name == "auto":
    name = "float32" if platform == "cpu" else "bfloat16"
  return jnp.dtype(name)


def memory_plan(cfg: AsyncConfig, platform: str | None) -> dict:
  """mesh.memory_plan for this config: {"learner": {var: value}, "sampler": {var: value}}; empty dicts without a
  sampler process (publish_path='device' samples in a thread of the learner's process)."""
  if cfg.publish_path == "device":
    return {"learner": {}, "sampler": {}}
  ids = tuple(int(x) for x in str(cfg.sampler_devices).replace(" ", "").split(",") if x)
  vis = os.environ.get("CUDA_VISIBLE_DEVICES")
  visible = None if vis is None else tuple(int(x) for x in vis.split(",") if x.strip().isdigit())
  return mesh_lib.memory_plan(cfg.memory_share, platform, ids, visible)


class AsyncSource(RolloutSource):
  """Rollout source backed by a sampler (a spawned process; a thread with the device publisher); same interface as
  `LagSource`. How versions reach the sampler is its `publisher` (rollout/publish.py, by async_.publish_path).

  Args:
    cfg: its own config, AsyncConfig (config.async_: queue_slots, timeout_s, startup_timeout_s,
      sampler_devices / sampler_cpus / sampler_env, background_publish, publish_path / dtype, decode, in-flight
      updates; checked there).
    key: the run's RNG key; batch b is sampled with fold_in(key, b), as in the other modes.
    model_cfg, graphdef: the policy; the worker rebuilds graphdef from model_cfg (checked here).
    tokenizer: pickled to the worker.
    maker: the learner's RolloutMaker (or MultiTurnRolloutMaker): its rollout config, sampler config,
      problems and, for tool use, its MultiTurnConfig `maker.mt` are sent; the worker rebuilds the same kind.
    k: the staleness budget (config.lag.k >= 1); steps: the run's length (the worker makes batches < steps).
    workdir: the run's directory; its hash is the run id in every shared-memory name (None: a random id).
    interrupt: called between the slices of every wait; it raises to abandon the wait (the trainer's
      check of its SIGINT / SIGTERM flag). None: waits end only with a batch, a dead worker or a timeout.

  The worker starts at the first `publish(params, v)` and makes batches v, v + 1, ..., steps - 1.
  """

  def __init__(self, cfg, key, model_cfg, graphdef, tokenizer, maker, *, k, steps, workdir=None, interrupt=None):
    if k < 1:
      raise ValueError(f"lag.k={k}: async mode needs a staleness budget k >= 1.")
    self.cfg = cfg
    self.k, self.end_step = int(k), int(steps)
    self.timeout_s = float(cfg.timeout_s)
    # A sampler whose heartbeat (ShmQueue.beat, from every loop point of the worker) stops this long is hung.
    self.heartbeat_timeout_s = float(cfg.heartbeat_timeout_s) or self.timeout_s
    self._beat = (-1, 0.0)  # (the last heartbeat count seen, monotonic time it was first seen)
    # The first batch includes the worker's start-up (imports, compilation): it gets a separate allowance.
    self.startup_timeout_s = float(cfg.startup_timeout_s)
    self.nslots = int(cfg.queue_slots)
    self.cpus = parse_cpus(cfg.sampler_cpus)
    # Of floating parameters in the slot; integer leaves keep theirs.
    self.publish_dtype = resolve_publish_dtype(cfg.publish_dtype, jax.default_backend())
    # Decoding of the sampler process; in-flight updates (between decode chunks, per-token versions).
    self.decode = cfg.decode
    self.chunk_tokens = int(cfg.chunk_tokens)
    self.inflight = bool(cfg.inflight_updates)
    self.update_every_tokens = int(cfg.update_every_tokens)
    self.recompute_kv = bool(cfg.recompute_kv)
    if self.inflight and getattr(maker, "mt", None) is not None:
      raise ValueError("async_.inflight_updates=True covers single-turn rollouts only; set it False for tool use.")
    env = {str(name): str(v) for name, v in dict(cfg.sampler_env or {}).items()}
    if cfg.sampler_devices:
      env.setdefault("CUDA_VISIBLE_DEVICES", str(cfg.sampler_devices))
    # Its share of a GPU it shares with this process (async_.memory_share), set before the child imports jax.
    for name, value in memory_plan(cfg, jax.default_backend())["sampler"].items():
      env.setdefault(name, value)  # async_.sampler_env wins
    for name, value in compile_cache.child_env().items():  # the learner's persistent compilation cache
      env.setdefault(name, value)
    rebuilt, _ = worker_lib.abstract_params(model_cfg)
    if rebuilt != graphdef:
      raise ValueError(
        "async mode: the policy's graphdef differs from transformer.init(model_cfg)'s, which the "
        "sampler process rebuilds; use a model built by vcpo_jax.model.transformer."
      )
    self.model_cfg, self.tokenizer, self.maker = model_cfg, tokenizer, maker
    self.run_id = cleanup.run_id(workdir)
    self.topology = self._build_topology(cfg, maker)
    self.env = self.topology.sampler_env(env)
    self._interrupt = self.topology.interrupt(interrupt)
    self.key_data = np.asarray(jax.random.key_data(key))
    self.key_impl = str(jax.random.key_impl(key))
    # The step's batch (N rows, what checkpoints store) and this process's (many hosts: its prompt block's rows).
    self.global_schema = maker_schema(maker, maker.cfg.batch_size)
    n = self.topology.rows(maker.cfg.batch_size)
    self.schema = maker_schema(maker, n) if n != maker.cfg.batch_size else self.global_schema
    # JSON metadata: per-row texts (escaped) and problem ids; the worker drops texts that do not fit.
    self.meta_bytes = 16384 + n * (8 * maker.cfg.max_new_tokens + 64)
    self.queue = self.proc = self.conn = None
    self._error: str | None = None
    self._prev_idle = (0.0, 0.0)  # the worker's (idle_s_total, elapsed_s_total) at the previous batch
    self._published = -1
    self._received = 0  # batches taken from the queue
    self._next_step = 0  # the learner's next batch
    self._fresh = True  # no batch from the current sampler yet: waits get async_.startup_timeout_s
    self.sampler_restarts = 0  # samplers replaced so far (async/sampler_restarts of every row)
    self._restart_times: collections.deque = collections.deque()  # monotonic times of the replacements
    self.restart_causes: list[tuple[int, str]] = []  # (replaced pid, first line of its failure) per replacement
    # Batches received (drained at a checkpoint, or restored from one) but not consumed yet, oldest first:
    # (arrays, meta, restored) with restored=True for those of an earlier run (their idle totals are its own).
    self._pending: collections.deque = collections.deque()
    self._last = None  # the last batch next() received (arrays, meta, restored), for _requeue
    self._finalizer = None
    self._child_conn = None  # an in-process sampler's end of the control pipe (device path), closed with it
    self._base: dict | None = None  # LoRA: the frozen base's host arrays, kept for every sampler spawned
    self.base_slot = None  # LoRA: the one-shot ParamSlot of the base, from a spawn until that sampler attaches
    self.publish_blocking_s: list[float] = []  # learner-side time inside publish(), per call (perf_counter)
    # Background evaluation (eval.background): the worker's EvalArgs, the eval slot, records that arrived.
    self.eval_args = None
    self.eval_slot = None
    self._eval_spec: dict | None = None  # {name: (shape, dtype)} of the learner's parameters
    self._evals: collections.deque = collections.deque()  # records received, not handed over yet
    self._eval_outstanding: int | None = None  # the version requested and not yet returned
    self.eval_request_s: list[float] = []  # learner-side time inside request_eval(), per call
    try:
      self.publisher = self._build_publisher(cfg)
    except BaseException:
      self.topology.close()  # many hosts: the agreement's heartbeat thread
      raise

  def _build_topology(self, cfg, maker) -> topology_lib.Topology:
    """The part that says where the learner processes are, by jax.process_count() (rollout/topology.py)."""
    if jax.process_count() > 1:
      return multihost.ManyHosts(cfg, maker.cfg, self.k, self.publish_dtype, self.run_id)
    return topology_lib.OneHost(self.publish_dtype)

  def _build_publisher(self, cfg) -> publish_lib.Publisher:
    """The part that moves the parameters to the sampler, by async_.publish_path (rollout/publish.py); it sees
    the topology through its `snapshot` and `host_arrays` (many hosts: a gather to host-complete arrays)."""
    args = (cfg, self.k, self.publish_dtype, self.run_id)
    kw = {"snap": self.topology.snapshot, "host_arrays": self.topology.host_arrays}
    if cfg.publish_path == "device":
      return device_publish.DevicePublisher(*args, mesh_shape=self._worker_sampler_cfg().mesh_shape, **kw)
    if cfg.publish_path == "transfer":
      return transfer_publish.TransferPublisher(*args, **kw)
    background = publish_lib.background_for(cfg.background_publish, jax.default_backend())
    return publish_lib.ShmPublisher(*args, background=background, eager=self.topology.gathers, **kw)

  @property
  def agreed_stops(self) -> bool:
    """True on many hosts: next() agrees on every stop with the other hosts (the trainer then saves jointly)."""
    return self.topology.agreed_stops

  @property
  def slot(self):
    """The current sampler's parameter channel (ParamSlot, DeviceSlot or TransferSlot)."""
    return self.publisher.slot

  @property
  def background(self) -> bool:
    return self.publisher.background

  # ------------------------------------------------------------------ learner side

  def _worker_args(self, arrays: dict, first_step: int, **fields) -> worker_lib.WorkerArgs:
    """The sampler's WorkerArgs: what every publish path shares, plus its own `fields`."""
    return worker_lib.WorkerArgs(
      rollout=self.maker.cfg,
      model_cfg=self.model_cfg,
      sampler_cfg=self._worker_sampler_cfg(),
      tokenizer=self.tokenizer,
      problems=tuple(self.maker.problems),
      key_data=self.key_data,
      key_impl=self.key_impl,
      k=self.k,
      first_step=first_step,
      end_step=self.end_step,
      param_names=tuple(arrays),
      meta_bytes=self.meta_bytes,
      inflight=self.inflight,
      update_every_tokens=self.update_every_tokens,
      recompute_kv=self.recompute_kv,
      base=self._base,
      **fields,
    )

  def _travelling(self, params):
    """What a publish moves: the trainable part of `params`. With LoRA that is the adapters only (the slot, its
    checksum, every version); the frozen base (it never changes) goes to each sampler once (`_base_channel`)."""
    params, frozen = lora.split(params)
    if frozen is not None and self._base is None:  # many hosts: gathered first, a collective of every host
      names = worker_lib.param_names(frozen)
      self._base = dict(zip(names, self.topology.host_copy(jax.tree.leaves(frozen))))
    return params

  def _start(self, arrays: dict, version: int):
    stale = cleanup.remove_stale()  # what runs killed with their whole process group left behind
    if stale:
      log.warning(
        "async: removed %d shared-memory objects / files (%.1f MB) of dead runs: %s",
        len(stale),
        sum(x.nbytes for x in stale) / 1e6,
        ", ".join(sorted({f"run {x.run} (pid {x.pid})" for x in stale})),
      )
    first = int(version) + len(self._pending)  # restored batches cover steps version .. first - 1
    self._next_step = int(version)
    if self._pending and self._pending[0][1]["step"] != int(version):
      raise RuntimeError(
        f"async source: restored queued batches start at step {self._pending[0][1]['step']} but the first "
        f"published version is {version}; publish the restored parameters with version = the restored step."
      )
    self._spawn(arrays, version, first)

  def _spawn(self, arrays: dict, version: int, first: int):
    """A fresh channel holding version `version`, and a sampler that makes batches first, ..., steps - 1."""
    self._open_slot(arrays, version)
    self._beat = (-1, 0.0)
    if self.publisher.in_process:
      self._start_thread(arrays, first)
    else:
      self._start_process(arrays, first)
    self.publisher.started()

  def _start_process(self, arrays: dict, first: int):
    """A spawned sampler process with fresh shared memory (batch queue, evaluation slot, LoRA base)."""
    self.queue = ShmQueue(self.schema, nslots=self.nslots, meta_bytes=self.meta_bytes, run=self.run_id)
    if self.eval_args is not None:  # one copy: the worker reads a request once, the learner writes rarely
      self.eval_slot = ParamSlot(self._eval_spec, run=self.run_id, nbuf=1)
    log.debug("async: shared memory of run %s: %s", self.run_id, " ".join(self.resource_paths()))
    self.conn, child_conn = SPAWN.Pipe(duplex=True)
    args = self._worker_args(
      arrays,
      first,
      cpus=self.cpus,
      multiturn=getattr(self.maker, "mt", None),
      eval=self.eval_args,
      **self.topology.worker_fields(),
    )
    args = self._base_channel(args)
    # The spawn payload stays small: the arguments (problems, tokenizer: can be MBs) go through a file.
    # CPython writes the payload into a pipe whose read end the parent holds until the write ends, so a
    # child dying during bootstrap (e.g. a script without `if __name__ == "__main__":`) would block a large
    # write, and start(), forever.
    # Named with the owner (cleanup removes it if this process dies before the worker has read it).
    fd, self._args_path = tempfile.mkstemp(prefix=cleanup.owner_prefix(self.run_id) + "-a-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
      pickle.dump(args, f, protocol=pickle.HIGHEST_PROTOCOL)
    self.proc = SPAWN.Process(
      target=worker_lib.main,
      args=(self._args_path, self.queue, self.slot, child_conn, self.eval_slot, self.base_slot),
      name="vcpo-async-sampler",
      daemon=False,
    )  # a daemon could not start graders
    with _environ(self.env), _sigint_ignored():
      self.proc.start()
    child_conn.close()
    self.queue.watch(self.proc)
    # Interpreter exit without close() (an uncaught error far away) still stops the worker.
    self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn, self._args_path)

  def _start_thread(self, arrays: dict, first: int):
    """An in-process sampler (the device path): a thread on the publisher's devices with its own queue and
    control pipe (rollout/device_publish.py); close() or garbage collection sends "stop" and waits for it."""
    if self._child_conn is not None:
      self._child_conn.close()  # a replaced thread's end of its pipe
    self.conn, self._child_conn = SPAWN.Pipe(duplex=True)
    args = self._worker_args(arrays, first, **self.publisher.worker_fields())
    self.queue, self.proc = self.publisher.start_sampler(args, self.schema, self.nslots, self._child_conn)
    self._args_path = ""
    self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn, self._args_path)

  def _base_channel(self, args: worker_lib.WorkerArgs) -> worker_lib.WorkerArgs:
    """LoRA: `args` without the frozen base, which goes through a one-shot ParamSlot instead of the pickled
    arguments (14 GiB at 7B in bf16): written here once per spawned sampler (a replacement gets a fresh one from
    `self._base`), read once by the worker's set-up (checked against the checksum in its arguments), closed on
    this side as soon as the worker has attached (`_unlink_channels`), so nothing stays in /dev/shm."""
    if self.base_slot is not None:  # a previous sampler's, never attached
      self.base_slot.close()
      self.base_slot = None
    if args.base is None:
      return args
    self.base_slot = ParamSlot(args.base, run=self.run_id, nbuf=1)
    self.base_slot.publish(args.base, 0)
    return dataclasses.replace(args, base=None, base_checksum=self.base_slot.last_checksum)

  def _open_slot(self, arrays: dict, version: int):
    """The parameter channel the worker reads (`self.slot`), holding version `version` before the worker starts."""
    self.publisher.open(arrays, version)

  def _worker_sampler_cfg(self):
    """The learner's sampler config, with the sampler process's decode mode (unchanged for the defaults)."""
    cfg = self.maker.sampler.cfg
    decode = "chunked" if self.inflight and self.decode == "static" else self.decode
    if decode == "static":
      return cfg
    return dataclasses.replace(cfg, decode=decode, chunk_tokens=self.chunk_tokens)

  def publish(self, params, version: int):
    """Makes `params` (after `version` updates) the newest policy for the sampler; starts it the first time.

    The publisher (rollout/publish.py) does the medium's work: the shm path's synchronous copy into the slot, or
    (async_.background_publish) an on-device snapshot handed to a thread, the device path's device_put, the
    transfer path's offer. A failed sampler is replaced first (within the restart budget), and one that dies
    during the write's lock wait is replaced and the version written into its replacement's channel.
    """
    t0 = time.perf_counter()
    version = int(version)
    params = self._travelling(params)
    names = worker_lib.param_names(params)
    payload = self.publisher.prepare(jax.tree.leaves(params), version)  # device-side: dispatched, every publish
    if self.proc is None:
      if self.eval_args is not None:
        self._eval_spec = {n: (tuple(x.shape), np.dtype(x.dtype)) for n, x in zip(names, jax.tree.leaves(params))}
      self._start(self.publisher.first(payload, names), version)
    else:  # many hosts: a failure is kept for the next agreement
      self.topology.publish(lambda: self._publish_next(payload, names, version))
    self.publisher.published(payload, version)
    self._published = version
    self.publish_blocking_s.append(time.perf_counter() - t0)

  def _publish_next(self, payload, names, version: int):
    """A version after the first into the running sampler's channel (a failed sampler replaced first)."""
    self._replace_if_dead()
    self._raise_thread_error()
    try:
      self.publisher.write(payload, names, version, self._poll_publish)
    except SamplerDiedError as e:  # it died during the write's lock wait: the new sampler's slot gets it
      if not self._replace(e):
        raise
      self.publisher.write(payload, names, version, self._poll_publish)

  def take_copy_s(self) -> float | None:
    """time/publish_copy_s: seconds of the newest host copy written since the last call (None: none)."""
    return self.publisher.take_copy_s()

  def _raise_thread_error(self):
    dead = self.proc is not None and self.proc.exitcode is not None
    self.publisher.raise_error(dead, self._died_error)

  def flush(self, timeout: float = 60.0):
    """Waits until the background publisher has written the newest version (tests, benchmarks)."""
    self.publisher.flush(timeout, self._raise_thread_error)

  def _poll_publish(self):
    """Before and between lock-wait slices of publish(): a signal (first) or a dead worker ends the wait."""
    if self._interrupt is not None:
      self._interrupt()
    self._raise_if_dead()

  def next(self, step: int) -> tuple[batch_lib.Batch, dict]:
    """Batch `step`: this process's from the queue, made the step's by the topology (many hosts: agreed on with
    every host, gathered); raises SamplerDiedError / TimeoutError instead of hanging."""
    return self.topology.next(step, self._next_local, self._requeue)

  def _requeue(self):
    """Puts the last host batch received back at the front (many hosts: the hosts agreed to stop at its step)."""
    self._pending.appendleft(self._last)

  def _next_local(self, step: int) -> tuple[batch_lib.Batch, dict]:
    if self.proc is None:
      raise RuntimeError(
        f"AsyncSource.next({step}) before any publish(): the sampler starts at the first published version. "
        "After a resume, publish the restored parameters (version = the restored step) first."
      )
    t0 = time.monotonic()
    self._replace_if_silent()  # a hung sampler is replaced while the batches it completed are consumed
    if self._pending:
      return self._pop_pending(step, t0)
    timeout = self.startup_timeout_s if self._fresh else self.timeout_s
    deadline = t0 + timeout
    item = None
    while item is None:
      if self._interrupt is not None:
        self._interrupt()  # raises (e.g. the trainer's Interrupted) once a signal has arrived
      # Exceptions are raised outside the `except` blocks: a chained __context__ would keep the queue's
      # frames (and its semaphores) alive in the traceback after close().
      failure = replaceable = None
      try:
        self._raise_if_error()
        self._raise_thread_error()
        item = self.queue.get(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
      except SamplerDiedError as e:
        failure = replaceable = e
      except queue_lib.Empty:
        if self._silent():  # hung or stopped, whatever the staleness bound allows
          failure = replaceable = TimeoutError(self._silent_message())
        elif time.monotonic() >= deadline:
          failure = TimeoutError(self._timeout_message(step, timeout))
          if self._published >= step - self.k:  # not paused on the staleness bound: hung (or stopped)
            replaceable = failure
      except QueueFinished:
        failure = RuntimeError(
          f"async source: batch {step} requested but the sampler made only batches up "
          f"to steps - 1 = {self.end_step - 1}."
        )
      except PeerDiedError as e:
        failure = replaceable = self._died_error(f"while the learner waited for batch {step}: {e}")
      if failure is not None:
        if self._interrupt is not None:
          self._interrupt()  # a signal to the whole group may also have ended the sampler: signal first
        if replaceable is None or not self._replace(replaceable):
          raise failure
        failure = replaceable = None
        if self._pending:  # batches the replaced sampler had completed
          return self._pop_pending(step, t0)
        timeout = self.startup_timeout_s
        deadline = time.monotonic() + timeout
    wait_s = time.monotonic() - t0
    self._received += 1
    self._fresh = False
    return self._info(step, item.arrays, item.meta, wait_s)

  def _pop_pending(self, step: int, t0: float) -> tuple[batch_lib.Batch, dict]:
    batch, meta, restored = self._pending.popleft()
    if meta["step"] != step:
      raise RuntimeError(
        f"async source: the oldest unconsumed batch is batch {meta['step']}, requested at learner step {step}; "
        "the learner must consume batches in order, one per step."
      )
    return self._info(step, batch, meta, time.monotonic() - t0, restored=restored)

  def _info(
    self, step: int, batch: dict, meta: dict, wait_s: float, restored: bool = False
  ) -> tuple[batch_lib.Batch, dict]:
    """Checks batch `step` (order, lag bound) and builds next()'s info dict."""
    self._last = (batch, meta, restored)  # as received (queue or restored), for _requeue
    if meta["step"] != step:
      raise RuntimeError(
        f"async source: received batch {meta['step']} at learner step {step}; the learner must "
        "consume batches in order, one per step, starting at the first published version."
      )
    self._next_step = step + 1
    lag = step - batch["policy_version"]
    if lag.min() < 0 or lag.max() > self.k:
      raise RuntimeError(f"async source: batch {step} has lags [{lag.min()}, {lag.max()}] outside [0, {self.k}].")
    tv = batch["token_version"]
    resp = tv >= 0
    if resp.any() and (tv[resp].min() < step - self.k or tv[resp].max() > step):
      raise RuntimeError(
        f"async source: batch {step} has token versions [{tv[resp].min()}, {tv[resp].max()}] outside "
        f"[{step - self.k}, {step}]."
      )
    # Every version the batch was sampled with (several with in-flight updates) echoes its checksum.
    echoed = {int(v): c for v, c in (meta.get("params_checksums") or {}).items()}
    echoed.setdefault(int(meta["version"]), meta.get("params_checksum"))
    for v, got in sorted(echoed.items()):
      want = self.publisher.checksums.get(v) if not restored else None
      if want is not None and got != int(want):  # int: the device path records a device scalar
        raise RuntimeError(
          f"async source: batch {step} was made from parameters with checksum {got}, "
          f"but version {v} was published with checksum {want}: the parameter copy was corrupted."
        )
    idle, elapsed = meta["idle_s_total"], meta["elapsed_s_total"]
    d_idle, d_elapsed = idle - self._prev_idle[0], elapsed - self._prev_idle[1]
    if restored:  # totals of the previous run's sampler: no idle fraction for this batch
      d_idle = d_elapsed = 0.0
    else:
      self._prev_idle = (idle, elapsed)
    info = dict(
      texts=meta.get("texts"),
      problem_ids=meta["problem_ids"],
      response_len_mean=meta["response_len_mean"],
      finished_frac=meta["finished_frac"],
      **lag_stats(step, batch["policy_version"]),
      learner_wait_s=wait_s,
      sampler_gen_s=meta["gen_s"],
      sampler_idle_frac=d_idle / d_elapsed if d_elapsed > 0 else 0.0,  # since the previous batch
      sampler_idle_s_total=idle,
      sampler_elapsed_s_total=elapsed,
      metrics={
        **dict(meta.get("metrics") or {}),
        **token_lag_stats(step, tv),
        "async/sampler_restarts": self.sampler_restarts,
      },
      params_checksum=meta.get("params_checksum"),  # the sampler's echo, checked against the published one
      producer=(meta.get("sampler_pid"), meta.get("seq")),  # which sampler made it, its n-th batch
      restored=restored,  # True: queued when the checkpoint this run resumed from was saved
      grading_failures=int(meta.get("grading_failures", 0)),  # the sampler process's count for this batch
    )  # the maker's scalars (multi-turn: rollout/turns_mean, ...)
    if "sampler_thread" in meta:  # an in-process sampler (device path): the pid is this process's, + the thread
      info["producer"] = (*info["producer"], meta["sampler_thread"])
    return batch_lib.Batch.from_arrays(batch), info

  # -- replacing a failed sampler

  replaceable = True  # False: a failed sampler ends the run whatever async_.max_sampler_restarts says

  def _replace_if_dead(self):
    """publish() of a dead sampler: replace it (within the restart budget) or raise SamplerDiedError; a hung
    one (no heartbeat) is replaced within the budget (past it, next() reports it)."""
    self._poll_error()
    if self._error is not None or self.proc.exitcode is not None:
      err = self._died_error("at publish()")
      if not self._replace(err):
        raise err
    else:
      self._replace_if_silent()

  def _replace_if_silent(self):
    if self.replaceable and self._silent():
      self._replace(TimeoutError(self._silent_message()))

  def _silent(self) -> bool:
    """True once the sampler's heartbeat count has not moved for async_.heartbeat_timeout_s (before its first
    batch: async_.startup_timeout_s, which covers imports and compilation, during which it does not beat)."""
    now, beats = time.monotonic(), self.queue.beats()
    if beats != self._beat[0]:
      self._beat = (beats, now)
      return False
    return now - self._beat[1] > (self.startup_timeout_s if self._fresh else self.heartbeat_timeout_s)

  def _silent_message(self) -> str:
    name, limit = (
      ("startup_timeout_s", self.startup_timeout_s)
      if self._fresh
      else ("heartbeat_timeout_s", self.heartbeat_timeout_s)
    )
    why = "it is hung (a grader? a device call?)"
    if _stopped(self.proc.pid):
      why = "it is stopped (SIGSTOP / SIGTSTP?)"
    return (
      f"async source: the sampler process (pid {self.proc.pid}) sent no heartbeat for {limit:g} s "
      f"(async_.{name}): {why}. A static decode does not beat during its device call: raise "
      f"async_.{name} if one legitimately takes that long."
    )

  def _replace(self, failure: BaseException) -> bool:
    """Replaces the failed (dead, hung or stopped) sampler; False once the restart budget is spent.

    Budget: async_.max_sampler_restarts replacements within any async_.restart_window_s seconds. The batches
    the old sampler completed are kept (drained into the host list) and served first; the one it was making
    is dropped, and the new sampler starts at the first step not covered, so every step's prompts
    (fold_in(key, step)) are made exactly once. It gets fresh shared memory holding the newest version
    written into the old slot, and the staleness bound is the worker's as before: batch b once v >= b - k.
    A background evaluation the old sampler had not returned is requested from the new one.
    """
    if self.publisher.in_process and self.proc.exitcode is None:
      return False  # a hung sampler thread cannot be stopped (rollout/device_publish.py, "Failures")
    now = time.monotonic()
    while self._restart_times and now - self._restart_times[0] > float(self.cfg.restart_window_s):
      self._restart_times.popleft()
    if not self.replaceable or len(self._restart_times) >= int(self.cfg.max_sampler_restarts):
      return False
    old_pid = self.proc.pid
    self._drain()  # what the old sampler completed
    self._quiesce_publisher()
    version, arrays = self._newest_written()
    redo = self._unanswered_eval()
    self._finalizer()  # stops the old sampler (SIGKILL at once if stopped), reaps it
    for x in (self.queue, self.eval_slot, self.conn):
      if x is not None:
        x.close()
    self.publisher.close_slot()
    self.queue = self.eval_slot = self.conn = None
    self._error, self._prev_idle, self._fresh = None, (0.0, 0.0), True
    self._eval_outstanding = None
    first = self._pending[-1][1]["step"] + 1 if self._pending else self._next_step
    self._spawn(arrays, version, first)
    if redo is not None:  # the new sampler evaluates what the old one had not returned
      self.eval_slot.publish(redo[1], redo[0])
      self._eval_outstanding = redo[0]
    self._restart_times.append(now)
    self.sampler_restarts += 1
    lines = str(failure).splitlines()
    cause = lines[0] + (f" ... {lines[-1].strip()}" if len(lines) > 1 else "")  # a traceback's last line: the error
    self.restart_causes.append((old_pid, cause))
    log.warning(
      "async: replaced the sampler (pid %d -> %d, restart %d of async_.max_sampler_restarts=%d per %g s) "
      "after: %s; %d queued batches kept, the new one starts at batch %d from version %d",
      old_pid,
      self.proc.pid,
      len(self._restart_times),
      int(self.cfg.max_sampler_restarts),
      float(self.cfg.restart_window_s),
      cause,
      len(self._pending),
      first,
      version,
    )
    return True

  def _unanswered_eval(self) -> tuple[int, dict] | None:
    """(version, host arrays) of the background evaluation requested from the failed sampler and not returned."""
    self._poll_error()  # records it sent before it failed are still in the pipe
    if self._eval_outstanding is None:
      return None
    return self.eval_slot.latest(min_version=self._eval_outstanding, timeout=60.0)

  def _newest_written(self) -> tuple[int, dict]:
    """(version, {name: array}) of the newest version the sampler could read, in the publish dtype: what a
    replacement sampler starts from."""
    return self.publisher.newest()

  def _quiesce_publisher(self):
    """Lets the background publisher finish its copy into the old slot; a thread that failed is restarted later."""
    try:
      self.publisher.quiesce(self._raise_thread_error)
    except (SamplerDiedError, RuntimeError, TimeoutError) as e:
      log.warning("async: the background publisher stopped with the sampler: %s", e)

  # -- failure reporting

  def _poll_error(self):
    """Reads the worker's messages: ("error", traceback), ("eval", record) of a background evaluation."""
    try:
      while self.conn is not None and self.conn.poll():
        kind, payload = self.conn.recv()
        if kind == "error":
          self._error = payload
        elif kind == "attached":  # the sampler holds every channel open: their names can go
          self._unlink_channels()
        elif kind == "eval":
          self._evals.append(payload)
          if payload["step"] == self._eval_outstanding:
            self._eval_outstanding = None
    except (EOFError, OSError):
      pass

  def _unlink_channels(self):
    """Removes the shared-memory names of this sampler's channels from /dev/shm: both sides keep what they
    hold open, and a SIGKILL of the whole process group leaves nothing behind (module docstring)."""
    for x in (self.queue, self.slot, self.eval_slot):
      if x is not None:
        x.unlink()
    if self.base_slot is not None:  # one-shot: the worker holds it open and reads it once; the creator's close
      self.base_slot.close()  # unlinks it, and its memory goes when the worker closes its side
      self.base_slot = None

  def _raise_if_error(self):
    self._poll_error()
    if self._error is not None:
      if self.proc.exitcode is None:
        # it exits right after sending its traceback, but the interpreter teardown (JAX, atexit) of a loaded
        # machine takes seconds
        self.proc.join(10.0)
      raise self._died_error("")

  def _raise_if_dead(self):
    self._poll_error()
    if self._error is not None or self.proc.exitcode is not None:
      raise self._died_error("at publish()")

  def _died_error(self, context: str) -> SamplerDiedError:
    self.proc.join(1.0)  # reap: the exit code is known once the process is gone
    self._poll_error()
    msg = f"the async sampler process (pid {self.proc.pid}) {_describe_exit(self.proc.exitcode)}"
    if context:
      msg += f" ({context})"
    if self._error:
      msg += f". Its traceback:\n{self._error}"
    else:
      msg += (
        ". It sent no traceback: it was killed from outside (out of memory? a signal?) or crashed in native "
        "code; see its stderr above."
      )
    return SamplerDiedError(msg)

  def _timeout_message(self, step: int, timeout: float) -> str:
    need = step - self.k
    why = (
      f"it may only make batch {step} once version >= {need} is published (latest: {self._published}), "
      "so it is paused on the staleness bound"
      if self._published < need
      else "the sampler is alive but slower than the timeout (compilation? an overloaded machine?)"
    )
    if _stopped(self.proc.pid):
      why = f"the sampler process (pid {self.proc.pid}) is stopped (SIGSTOP / SIGTSTP?); `kill -CONT` resumes it"
    name = "startup_timeout_s" if self._fresh else "timeout_s"
    return (
      f"async source: no batch {step} within async_.{name}={timeout:g} s; {why}. Raise "
      f"async_.{name} if generation is legitimately that slow."
    )

  # ------------------------------------------------------------------ background evaluation

  def enable_background_eval(self, eval_args):
    """eval.background: the sampler process evaluates the versions request_eval() hands it.

    eval_args: worker.EvalArgs (held-out problems, protocol, eval sampler config); before the first publish()."""
    if not self.publisher.eval_ok:
      raise ValueError(
        "eval.background=True needs a sampler process: async_.publish_path='shm' or 'transfer' "
        f"(have {self.cfg.publish_path!r}); set one of them."
      )
    if self.proc is not None:
      raise RuntimeError("async source: enable_background_eval() must come before the first publish().")
    if jax.process_count() > 1:
      raise ValueError("eval.background=True: the sampler process evaluates on one host only; set it False.")
    self.eval_args = eval_args

  def request_eval(self, version: int, params):
    """Asks the sampler process to evaluate `params` (version `version`) and returns without waiting for it.

    One blocking host copy of the parameters (device_get, then into the eval slot), no generation. With a
    request still outstanding it first waits for that record (`eval_results(wait=True)` keeps it for the
    caller): evaluations slower than eval.every learner steps cannot overlap each other.
    """
    if self.eval_args is None or self.proc is None:
      raise RuntimeError("async source: request_eval() needs enable_background_eval() and a first publish().")
    t0 = time.perf_counter()
    if self._eval_outstanding is not None:
      self._wait_eval()
    params = self._travelling(params)
    names = worker_lib.param_names(params)
    arrays = {n: np.asarray(a) for n, a in zip(names, jax.device_get(jax.tree.leaves(params)))}
    self._poll_publish()
    self.eval_slot.publish(arrays, int(version), poll=self._poll_publish)
    self._eval_outstanding = int(version)
    self.eval_request_s.append(time.perf_counter() - t0)

  def eval_results(self, wait: bool = False) -> list[dict]:
    """The background evaluation records that arrived since the last call, oldest first (each handed over once).

    Each is evaluation.evaluate's record of the requested version (its "step"), with policy_version = that
    version, background = True and the sampler's pid. wait: first wait for the outstanding request's record
    (within async_.startup_timeout_s; a dead sampler or an interrupt ends the wait as in next()).
    """
    if wait and self._eval_outstanding is not None:
      self._wait_eval()
    self._poll_error()
    out = list(self._evals)
    self._evals.clear()
    return out

  def _wait_eval(self):
    deadline = time.monotonic() + self.startup_timeout_s  # an evaluation compiles its sampler the first time
    while self._eval_outstanding is not None:
      if self._interrupt is not None:
        self._interrupt()
      self._raise_if_error()
      if self.proc.exitcode is not None:
        raise self._died_error(f"while the learner waited for the evaluation of version {self._eval_outstanding}")
      if time.monotonic() >= deadline:
        raise TimeoutError(
          f"async source: the background evaluation of version {self._eval_outstanding} did not return within "
          f"async_.startup_timeout_s={self.startup_timeout_s:g} s; raise it, or set eval.background=False."
        )
      self.conn.poll(_POLL_S)

  # ------------------------------------------------------------------ checkpointing, lifetime

  def state(self) -> tuple[list[int], list]:
    """Async mode keeps no parameter versions (the worker holds its own copy)."""
    return [], []

  def load_state(self, versions: list[int], params_list: list):
    if versions:
      raise ValueError(
        f"async source: a checkpoint with kept versions {versions} came from lag mode; resume it "
        "with mode='lag', or start the async run in a fresh workdir."
      )

  def _drain(self):
    """Moves every complete batch in the shared-memory queue to the host list (non-blocking)."""
    while self.queue is not None:
      try:
        item = self.queue.get(timeout=0.0)
      except (queue_lib.Empty, QueueFinished, PeerDiedError):
        return  # a dead worker is reported by the next next(); what it completed is kept
      self._received += 1
      self._pending.append((item.arrays, item.meta, False))

  def queued_state(self) -> tuple[list[dict], list[dict]]:
    """(arrays, metas) of every batch received or queued and not consumed, oldest first, for a checkpoint.

    Drains the queue into host memory first (the batches stay in this source and are served by next()).
    arrays[i] = {field: array of batch_schema's shape}; metas[i] = the worker's JSON metadata (step, ...).
    """
    self._drain()
    return self.topology.pack([(a, m) for a, m, _ in self._pending], self.schema)

  def queued_template(self, count: int) -> list[dict]:
    """Restore template of `count` queued batches (zeros of the step's batch schema: N rows on any topology)."""
    return [{n: np.zeros(f.shape, f.dtype) for n, f in self.global_schema.fields.items()} for _ in range(count)]

  def load_queued(self, arrays: list[dict], metas: list[dict]):
    """Restores queued_state()'s batches (before the first publish); next() serves them first."""
    if self.proc is not None:
      raise RuntimeError("async source: load_queued() must come before the first publish() starts the sampler.")
    if len(arrays) != len(metas):
      raise ValueError(f"async source: {len(arrays)} queued batches but {len(metas)} metadata records.")
    # This process's share (rollout/topology.py): one host takes the batches complete on every host of a
    # multi-host checkpoint, several hosts each its own rows; the sampler makes the rest again.
    local = self.topology.unpack(arrays, metas)
    steps = [int(m["step"]) for _, m in local]
    if steps and steps != list(range(steps[0], steps[0] + len(steps))):
      raise ValueError(f"async source: restored queued batches have steps {steps}; expected consecutive steps.")
    self._pending.extend((dict(a), dict(m), True) for a, m in local)

  def resource_paths(self) -> list[str]:
    """/dev/shm paths this source owns (segments and semaphores), for leak checks."""
    chans = (self.queue, self.publisher, self.eval_slot, self.base_slot)
    return [p for x in chans if x is not None for p in x.resource_paths()]

  @property
  def pid(self) -> int | None:
    return self.proc.pid if self.proc is not None else None

  def close(self):
    """Stops the publisher's thread and the worker; removes every shared-memory segment. Idempotent."""
    self.publisher.stop()  # a copy in progress finishes (it cannot be cut short); a lock wait ends at once
    if self._finalizer is not None:
      self._finalizer()  # runs _shutdown once
    if self.queue is not None:
      self.queue.close()
    self.publisher.close()
    if self.eval_slot is not None:
      self.eval_slot.close()
    if self.base_slot is not None:
      self.base_slot.close()
    for conn in (self.conn, self._child_conn):
      if conn is not None:
        conn.close()
    self.queue = self.eval_slot = self.base_slot = self.conn = self._child_conn = None
    self.topology.close()


def _stopped(pid: int | None) -> bool:
  """True if `pid` is stopped (state T: SIGSTOP, SIGTSTP) or traced (t): it cannot act on messages or SIGTERM."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
  except (OSError, IndexError, TypeError):
    return False


def _join(proc, timeout: float) -> None:
  """Wait up to `timeout` for `proc` to exit; give up early if it is stopped (it would not exit)."""
  deadline = time.monotonic() + timeout
  while proc.exitcode is None and time.monotonic() < deadline and not _stopped(proc.pid):
    proc.join(0.05)


def _shutdown(proc, conn, args_path):
  """Stop the worker: a stop message, then SIGTERM, then SIGKILL (at once if it is stopped); always reaps it."""
  with contextlib.suppress(FileNotFoundError):
    os.unlink(args_path)  # normally the worker deleted it already
  if proc.exitcode is None:
    try:
      conn.send("stop")
    except (OSError, ValueError):
      pass
    _join(proc, _STOP_GRACE_S)
  if proc.exitcode is None and not _stopped(proc.pid):
    proc.terminate()
    _join(proc, _STOP_GRACE_S)
  if proc.exitcode is None:
    proc.kill()  # SIGKILL also ends a stopped process
    proc.join()
