"""The async sampler process: newest parameters (ParamSlot) -> RolloutMaker.make -> ShmQueue.

`AsyncSource` (async_.py) starts `main` in a "spawn" process (a fork of a process running JAX can deadlock),
so everything crosses as picklable pieces (`WorkerArgs`: frozen rollout / model / sampler configs, an optional
`MultiTurnConfig`, the tokenizer, the training problems, the raw RNG key data). The graphdef is rebuilt here
with `nnx.eval_shape` and must flatten to the names the learner publishes.

Loop, for b = first_step, ..., end_step - 1:
  1. staleness bound (PipelineRL-style): wait until the published version v >= b - k (pause rather than
     make a batch more than k steps stale; nothing is generated and then dropped),
  2. take the newest parameters (v in [b - k, b]),
  3. batch = maker.make(params, b, fold_in(key, b), v): every row records policy_version = v, so the
     learner's lag b - v lies in [0, k]; the maker's scalar info["metrics"] travel in the JSON metadata,
  4. put it into the queue (blocks while full: back-pressure).

Options:
- In-flight updates (`WorkerArgs.inflight`): between decode chunks `_on_chunk` loads a newer version; each
  token records its version (batch["token_version"]) and policy_version is the row's oldest token's, so
  the bound of step 1 is the oldest token's lag bound. The metadata echoes every version's checksum.
- Several hosts: `WorkerArgs.prompt_block` = (lo, hi) samples prompts [lo, hi) of each step's P, seeded as
  rows [lo G, hi G) of the single-host batch (Sampler.generate's row_offset).
- Background evaluation (`WorkerArgs.eval`): before each batch and in its waits the worker evaluates a newer
  version found in the eval slot (the trainer's protocol, RNG fold_in(key, 10**9 + v)) and sends
  ("eval", record) back; the learner keeps at most one request outstanding.

Idle time (blocked in 1 and 4, less evaluation time there) travels with each batch. Control and errors use
one duplex `Pipe`: the learner sends "stop"; the worker sends ("attached", pid) first, ("eval", record) and
("error", traceback) before exiting non-zero. Heartbeat: the worker bumps the queue's counter (ShmQueue.beat)
at every wait slice, after each batch, between decode chunks and around evaluation calls; a counter that
stops moving is a hung sampler (async_.heartbeat_timeout_s). The worker ignores SIGINT and asks the kernel
to SIGKILL it if the learner dies (PR_SET_PDEATHSIG). Details: docs/design_notes.md "rollout/process/worker.py".
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pickle
import queue as queue_lib
import signal
import sys
import time
import traceback
from typing import Any

import numpy as np

_POLL_S = 0.2  # how often a blocked worker looks for "stop" and a dead learner


class _Stop(Exception):
  """The learner asked the worker to stop."""


@dataclasses.dataclass(frozen=True)
class EvalArgs:
  """Background evaluation in the sampler process (eval.background): what trainer.run's evaluation uses."""

  problems: tuple  # tasks.Problem, the held-out set (spec.make_eval_problems())
  protocol: Any  # evaluation.EvalProtocol, its size = len(problems)
  sampler_cfg: Any  # sampler.SamplerConfig: EvalSampling's base (the protocol's settings are written into it)
  chat_template: bool = False  # RolloutConfig.chat_template


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
  """Everything the sampler process needs, all picklable (no jax objects)."""

  rollout: Any  # common.RolloutConfig
  model_cfg: Any  # model.config.ModelConfig
  sampler_cfg: Any  # sampler.SamplerConfig (for multi-turn: multiturn.sampler_config's, with its buckets)
  tokenizer: Any  # a picklable tokenizer (PreTrainedTokenizerFast pickles)
  problems: tuple  # tasks.Problem, the training pool (same order as the learner's)
  key_data: np.ndarray  # jax.random.key_data(key): uint32
  key_impl: str  # jax.random.key_impl(key), e.g. "threefry2x32"
  k: int  # staleness bound
  first_step: int  # first batch to make (= the version the learner published first)
  end_step: int  # make batches first_step .. end_step - 1, then finish the queue
  param_names: tuple[str, ...]  # ParamSlot names, in the learner's flatten order
  meta_bytes: int  # room for one batch's JSON metadata in the queue
  cpus: tuple[int, ...] = ()  # CPU affinity of this process (empty: inherit)
  multiturn: Any = None  # rollout.multiturn.MultiTurnConfig: tool-use episodes; None = single-turn
  inflight: bool = False  # in-flight updates: newer parameters between decode chunks (sampler_cfg is chunked)
  update_every_tokens: int = 16  # in-flight: decode steps between looks at the parameter slot
  recompute_kv: bool = False  # in-flight: recompute the KV cache under the new parameters
  # Multi-host (rollout/multihost.py): this host's prompts [lo, hi) of each step's P (rows seeded as rows
  # [lo G, hi G) of the whole batch). None: the whole batch (one host).
  prompt_block: tuple[int, int] | None = None
  host: int = 0
  eval: EvalArgs | None = None  # background evaluation (eval.background); None: the learner evaluates
  # async_.publish_path='device' (rollout/device_publish.py: this loop in a thread of the learner's process):
  # the sampler's jax.Device objects. None: every device of this process.
  devices: tuple | None = None
  # LoRA (model.lora_rank > 0): the frozen base's arrays {name: host array}, sent once; every published version
  # (the slot, its checksum) is then the adapters only, applied unmerged on this base. None: no LoRA, or (a
  # spawned sampler) the base comes through main()'s one-shot `base_slot` instead, with this checksum.
  base: dict | None = None
  base_checksum: int | None = None


def param_names(params) -> tuple[str, ...]:
  """Stable names of a parameter pytree's leaves, in flatten order (the ParamSlot keys).

  sharding.path_str: the one naming of parameter leaves (partition rules, sft cache, ghost norms)."""
  import jax

  from vcpo_jax.sharding import path_str

  return tuple(path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def abstract_params(model_cfg):
  """(graphdef, abstract params) of `transformer.init(model_cfg)` without computing the init."""
  from flax import nnx

  from vcpo_jax.model import transformer

  return transformer.split(nnx.eval_shape(lambda: transformer.init(model_cfg, 0)))


def host_rollout_config(rollout, prompt_block):
  """The rollout config of one host's sampler: P = the host's prompt count (its batch has P * G rows)."""
  import dataclasses as dc

  lo, hi = prompt_block
  return dc.replace(rollout, prompts_per_step=hi - lo)


def _prompt_stream(rollout, problems):
  """A RolloutMaker used only for `problems_for_step`: the one-host run's P prompts of each step."""
  from vcpo_jax.rollout.common import RolloutMaker

  return RolloutMaker(rollout, None, None, problems)


def _set_parent_death_signal():
  """Linux: the kernel SIGKILLs this process when the learner dies, whatever it is doing."""
  if not sys.platform.startswith("linux"):
    return
  try:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
  except (OSError, AttributeError):
    pass


def pin_cpus(cpus) -> None:
  """Restrict every thread of this process to `cpus` (sched_setaffinity on pid 0 moves only the caller)."""
  cpus = {int(c) for c in cpus}
  try:
    tids = [int(t) for t in os.listdir("/proc/self/task")]
  except OSError:
    tids = [0]
  for tid in tids:
    try:
      os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:
      pass  # the thread ended meanwhile


def main(args_path: str, batch_queue, slot, conn, eval_slot=None, base_slot=None):
  """Process entry point (spawn target). Exits 0 on "stop", 1 with a traceback sent on error.

  `args_path`: a pickled WorkerArgs (a file keeps the spawn payload small). Deleted once read, so a
  learner killed later leaves no file behind (the learner also deletes it on close, if still there).
  eval_slot: the ParamSlot of background evaluation requests (None: off).
  base_slot: LoRA, a one-shot ParamSlot holding the frozen base (version 0), read once and closed at set-up.
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _set_parent_death_signal()
  parent = os.getppid()
  stopped = False
  try:
    # Unpickling the arguments attached every shared-memory channel: the learner may remove their names now.
    try:
      conn.send(("attached", os.getpid()))
      with open(args_path, "rb") as f:
        args = pickle.load(f)
    except (FileNotFoundError, BrokenPipeError):  # the learner closed (interrupted at start-up) before this read
      raise _Stop from None
    try:
      os.unlink(args_path)
    except FileNotFoundError:
      pass  # the learner closed meanwhile
    if args.cpus:
      pin_cpus(args.cpus)  # before JAX builds its CPU client: its thread pools inherit the mask
    _Worker(args, batch_queue, slot, conn, parent, eval_slot, base_slot).run()
  except _Stop:
    stopped = True
  except BaseException:
    try:
      conn.send(("error", traceback.format_exc()))
    except (OSError, ValueError):
      pass  # the learner is gone: nobody to tell
    raise  # also printed to this process's stderr; exit code 1
  finally:
    batch_queue.close()
    slot.close()
    if eval_slot is not None:
      eval_slot.close()
    if base_slot is not None:
      base_slot.close()
  if stopped:
    # Asked to stop: exit at once. The atexit handlers run (e.g. a grader subprocess is closed), but not the
    # interpreter's teardown of JAX and friends, which takes seconds on a loaded machine and would outlast the
    # learner's grace period (it then sends SIGTERM). Nothing here needs it: this process owns no shared memory.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Worker:
  def __init__(self, args: WorkerArgs, batch_queue, slot, conn, parent_pid: int, eval_slot=None, base_slot=None):
    self.args, self.queue, self.slot, self.conn, self.parent = args, batch_queue, slot, conn, parent_pid
    self.base_slot = base_slot  # LoRA: the one-shot base channel (None: the base is in args.base, or no LoRA)
    self.eval_slot = eval_slot if args.eval is not None else None
    self._evaluated = -1  # newest version evaluated in the background
    self._eval_sampling = None  # evaluation.EvalSampling, built at the first request
    self.eval_s = 0.0  # seconds spent on background evaluations (not idle, not generation)
    self.idle_s = 0.0
    self.t_start = time.monotonic()
    self._version, self._params, self._checksum = -1, None, None
    self._used: dict[int, int] = {}  # version -> checksum of every version the current batch sampled with
    self._since = 0  # decode steps since the last look at the slot (in-flight updates)
    self.updates = 0  # in-flight switches so far
    self._make_kw: dict = {}  # extra RolloutMaker.make arguments (multi-host: the row offset)

  # -- control

  def _check_stop(self):
    from vcpo_jax.rollout.process.shm_queue import PeerDiedError, pid_alive

    self.queue.beat()  # called at every loop point of this process: the learner's liveness signal
    if self.conn.poll():
      msg = self.conn.recv()
      if msg == "stop":
        raise _Stop()
    if not pid_alive(self.parent):
      raise PeerDiedError(f"the learner process {self.parent} exited")

  # -- setup

  def _build(self):
    import jax

    from vcpo_jax.rollout.common import RolloutMaker
    from vcpo_jax.sampler import Sampler, sampler_mesh

    from vcpo_jax.model import lora  # with the sampler's imports: only the spawned process needs them here

    a = self.args
    graphdef, abstract = abstract_params(a.model_cfg)
    abstract, frozen = lora.split(abstract)  # LoRA: versions carry the adapters, the base came in WorkerArgs
    names = param_names(abstract)
    if names != tuple(a.param_names):
      raise ValueError(
        "async sampler: the model rebuilt from model_cfg does not match the learner's parameters "
        f"(rebuilt {len(names)} arrays, learner publishes {len(a.param_names)}; first difference: "
        f"{next((x for x in zip(names, a.param_names) if x[0] != x[1]), None)}). The async worker "
        "rebuilds the model with transformer.init(model_cfg); use a model of that structure."
      )
    self.treedef = jax.tree.structure(abstract)
    self.dtypes = [x.dtype for x in jax.tree.leaves(abstract)]
    self.key = jax.random.wrap_key_data(np.asarray(a.key_data), impl=a.key_impl)
    # Its own mesh over this process's devices (async_.sampler_devices); params in sampler.param_dtype.
    mesh = sampler_mesh(a.sampler_cfg, devices=list(a.devices) if a.devices else None)
    self.sampler = sampler = Sampler(graphdef, a.model_cfg, a.sampler_cfg, mesh=mesh)
    self._base = None if frozen is None else self._prepare_base(frozen)
    rollout = a.rollout if a.prompt_block is None else host_rollout_config(a.rollout, a.prompt_block)
    if a.multiturn is None:
      self.maker = RolloutMaker(rollout, a.tokenizer, sampler, a.problems)
    else:  # the sandbox spawns `python -I -S` children (never forks this JAX process)
      from vcpo_jax.rollout.multiturn import MultiTurnRolloutMaker

      self.maker = MultiTurnRolloutMaker(rollout, a.multiturn, a.tokenizer, sampler, a.problems)
    if a.prompt_block is not None:
      self._split_prompts(a)

  def _prepare_base(self, frozen):
    """The frozen base on the sampler's mesh in its parameter dtype, once (LoRA); raises if it did not come."""
    import jax
    import jax.numpy as jnp

    base = self.args.base if self.base_slot is None else self._read_base()
    names = param_names(frozen)
    if base is None or set(base) != set(names):
      raise ValueError(
        "async sampler: the model has LoRA adapters (model.lora_rank > 0) but the learner sent no matching frozen "
        f"base ({0 if base is None else len(base)} arrays for {len(names)} base parameters)."
      )
    leaves = [jnp.asarray(base[n], dtype=x.dtype) for n, x in zip(names, jax.tree.leaves(frozen))]
    return self.sampler.prepare_params(jax.tree.unflatten(jax.tree.structure(frozen), leaves))

  def _read_base(self) -> dict:
    """The base's host arrays from the one-shot slot (checked against the learner's checksum); then closed, so
    its shared memory goes as soon as the learner has closed its side too."""
    _, arrays = self.base_slot.latest(min_version=0, timeout=60.0)
    got = self.base_slot.checksum_of(arrays, self.base_slot.spec)
    want = self.args.base_checksum
    self.base_slot.close()
    if want is not None and got is not None and int(got) != int(want):
      raise RuntimeError(f"async sampler: the frozen base read from shared memory has checksum {got}, sent {want}.")
    return arrays

  def _with_base(self, params):
    from vcpo_jax.model import lora  # the sampler process's own import (see _build)

    return lora.combine(params, self._base)

  def _split_prompts(self, a: WorkerArgs):
    """Multi-host: this host's block of the single-host prompt stream, sampled as those rows of the whole batch
    (the single-host run's draws); a multi-turn maker, which takes no row offset, gets its own key instead."""
    import jax

    lo, hi = a.prompt_block
    stream = _prompt_stream(a.rollout, a.problems)
    self.maker.problems_for_step = lambda step: stream.problems_for_step(step)[lo:hi]
    if a.multiturn is None:
      self._make_kw = {"row_offset": lo * a.rollout.group_size}
    else:
      self.key = jax.random.fold_in(self.key, a.host)

  # -- steps

  def _params_for(self, step: int):
    """(version, params) with version >= step - k, newest available; blocks (idle) until then."""

    need = max(0, step - self.args.k)
    t0, e0 = time.monotonic(), self.eval_s
    while True:
      self._check_stop()
      self._maybe_eval()  # paused on the bound: the time an evaluation needs is free here
      if self._version >= need and self.slot.version() == self._version:
        break  # nothing newer than the copy already on the device
      try:
        version, arrays = self.slot.latest(min_version=need, timeout=_POLL_S, poll=self._check_stop)
      except TimeoutError:
        continue
      self._load(version, arrays)
      break
    self.idle_s += time.monotonic() - t0 - (self.eval_s - e0)
    return self._version, self._params

  def _load(self, version: int, arrays: dict):
    import jax
    import jax.numpy as jnp

    # Of exactly what was read, echoed per batch: ParamSlot's is computed during its copy (param_slot.checksum);
    # the device and transfer paths' slots checksum their device arrays.
    self._checksum = self.slot.checksum_of(arrays, self.args.param_names)
    # Published in the learner's publish dtype (bf16 on accelerators); the model gets its parameter dtype.
    # Floating leaves go straight to the sampler's parameter dtype when it has one (no float32 copy).
    to = lambda d: (
      self.sampler.param_dtype if self.sampler.param_dtype is not None and jnp.issubdtype(d, jnp.floating) else d
    )
    leaves = [jnp.asarray(arrays[n], dtype=to(d)) for n, d in zip(self.args.param_names, self.dtypes)]
    # Once per version: cast to the sampler's parameter dtype (bf16 on accelerators) and placed on its mesh.
    # LoRA: the adapters of this version on the base prepared once (applied unmerged by the model's forward).
    prepared = self.sampler.prepare_params(jax.tree.unflatten(self.treedef, leaves))
    self._version, self._params = version, self._with_base(prepared)
    self._used[int(version)] = self._checksum

  def _on_chunk(self, steps: int):
    """In-flight updates, called by the sampler between decode chunks: (params, version) if a newer version
    is published and update_every_tokens decode steps passed since the last look, else None (never waits
    for a version; a write in progress is waited for, at most one copy)."""
    self.queue.beat()
    self._since += steps
    if self._since < self.args.update_every_tokens:
      return None
    self._since = 0
    self._check_stop()
    if self.slot.version() <= self._version:
      return None
    try:
      version, arrays = self.slot.latest(min_version=self._version + 1, timeout=_POLL_S, poll=self._check_stop)
    except TimeoutError:
      return None
    self._load(version, arrays)
    self.updates += 1
    return self._params, self._version

  def _beat_chunk(self, steps: int):
    """on_chunk of a chunked decode without in-flight updates: only the heartbeat (returns no new parameters)."""
    self.queue.beat()

  def _beating(self, fn):
    """`fn` with a heartbeat before and after each call (the background evaluation's generation calls)."""

    def call(*a, **kw):
      self.queue.beat()
      try:
        return fn(*a, **kw)
      finally:
        self.queue.beat()

    return call

  def _put(self, batch: dict, meta: dict):
    t0, e0 = time.monotonic(), self.eval_s
    while True:
      self._check_stop()
      try:
        self.queue.put(batch, meta, timeout=_POLL_S)
        break
      except queue_lib.Full:
        self._maybe_eval()  # the queue is full: the learner is behind, evaluate meanwhile
        continue
    self.idle_s += time.monotonic() - t0 - (self.eval_s - e0)

  # -- background evaluation

  def _maybe_eval(self):
    """Evaluates the eval slot's version if it is newer than the last one evaluated; sends the record."""
    if self.eval_slot is None or self.eval_slot.version() <= self._evaluated:
      return
    import jax
    import jax.numpy as jnp

    from vcpo_jax import evaluation

    try:
      version, arrays = self.eval_slot.latest(min_version=self._evaluated + 1, timeout=_POLL_S, poll=self._check_stop)
    except TimeoutError:
      return
    t0 = time.monotonic()
    e = self.args.eval
    # The learner's own (float32) parameters: the eval decodes exactly what a synchronous eval of v would.
    leaves = [jnp.asarray(arrays[n], dtype=d) for n, d in zip(self.args.param_names, self.dtypes)]
    params = self._with_base(jax.tree.unflatten(self.treedef, leaves))
    if self._eval_sampling is None:
      from vcpo_jax.sampler import Sampler, sampler_mesh

      graphdef, model_cfg = self.sampler.graphdef, self.args.model_cfg
      self._eval_sampling = evaluation.EvalSampling(
        lambda cfg: Sampler(graphdef, model_cfg, cfg, mesh=sampler_mesh(cfg)),
        e.sampler_cfg,
        self.args.tokenizer,
        chat_template=e.chat_template,
        episodes=getattr(self.maker, "eval_episodes", None) if self.args.multiturn is not None else None,
      )
    gen = self._beating(self._eval_sampling.generate_fn(params, jax.random.fold_in(self.key, 10**9 + version)))
    # policy_version: what was evaluated; params_checksum: of exactly the arrays read (end-to-end check)
    extra = {
      "policy_version": int(version),
      "params_checksum": self.eval_slot.checksum_of(arrays, self.args.param_names),
      "background": True,
      "sampler_pid": os.getpid(),
    }
    rec = evaluation.evaluate(gen, e.problems, e.protocol, int(version), extra=extra)
    self.conn.send(("eval", rec))
    self._evaluated = int(version)
    self.eval_s += time.monotonic() - t0

  def run(self):
    import jax

    self._build()
    fields = tuple(self.queue.schema.fields)
    for seq, step in enumerate(range(self.args.first_step, self.args.end_step)):
      self._maybe_eval()  # a requested evaluation goes before the next batch (the learner has k in hand)
      version, params = self._params_for(step)
      self._used = {int(version): self._checksum}
      t0 = time.monotonic()
      kw = dict(on_chunk=self._on_chunk, recompute_kv=self.args.recompute_kv) if self.args.inflight else {}
      if not kw and self.args.sampler_cfg.decode != "static" and self.args.multiturn is None:
        kw = {"on_chunk": self._beat_chunk}  # a heartbeat between decode chunks (no parameter change)
      kw.update(self._make_kw)
      self._since = 0
      batch, info = self.maker.make(params, step, jax.random.fold_in(self.key, step), version, **kw)
      self.queue.beat()
      gen_s = time.monotonic() - t0
      if "token_version" not in batch:  # makers without per-token versions (multi-turn): the row's version
        batch["token_version"] = np.where(batch["loss_mask"], batch["policy_version"][:, None], -1).astype(np.int32)
      meta = {
        "step": step,
        "version": int(version),
        "sampler_pid": os.getpid(),  # with seq: names this batch across runs (resume tests, debugging)
        "seq": seq,
        "params_checksum": self._used[int(version)],  # param_slot.checksum of the version-`version` arrays it read
        "params_checksums": {str(v): c for v, c in self._used.items()},  # every version this batch sampled with
        "inflight_updates_total": self.updates,
        "gen_s": gen_s,
        "idle_s_total": self.idle_s,
        "eval_s_total": self.eval_s,  # background evaluations so far
        "elapsed_s_total": time.monotonic() - self.t_start,
        "response_len_mean": info["response_len_mean"],
        "finished_frac": info["finished_frac"],
        "grading_failures": int(info.get("grading_failures", 0)),  # graders that raised (counted, graded 0)
        "problem_ids": list(info["problem_ids"]),
        "texts": list(info["texts"]),
        "metrics": {str(n): float(x) for n, x in info.get("metrics", {}).items()},
      }  # logged scalars
      if len(json.dumps(meta, separators=(",", ":"))) > self.args.meta_bytes:
        meta.pop("texts")  # long responses: the learner decodes tokens if it needs them
      self._put({f: batch[f] for f in fields}, meta)
    self.queue.finish()
    while True:  # every batch is made; stay attached until the learner says stop (and evaluate on request)
      self._check_stop()
      self._maybe_eval()
      time.sleep(_POLL_S)
