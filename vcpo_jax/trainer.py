"""run(config, workdir): the one training loop, for every method and execution mode.

`run` reads top to bottom in banner sections (big_vision's train.py): config and workdir -> mesh and
policy (parameters born sharded, warm start) -> learner -> rollout source -> eval -> checkpoint and
resume -> loop. Each builder lives with its component (mesh.build_mesh, model.policy.build_policy,
SamplerConfig.from_tokenizer, rollout.build_maker / build_source); the helpers below the loop only
assemble them. The mode only decides which rollout source is built:

    batch = source.next(step)                   # sync / lag: sampled here; async: from the queue
    state, metrics = train_step(state, batch)   # estimator -> grads -> ESS-scaled AdamW
    source.publish(state.params, step + 1)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import threading
import time

import jax
import numpy as np
import optax
from flax import nnx

from vcpo_jax import compile_cache as compile_cache_lib
from vcpo_jax import (
  cleanup,
  distributed,
  evaluation,
  fingerprint,
  fs,
  learner,
  provenance,
  rollout,
  sft,
  sharding,
  telemetry,
)
from vcpo_jax import mesh as mesh_lib
from vcpo_jax import metrics as metrics_lib
from vcpo_jax.checkpoint import BEST_METRIC, Checkpointer, restore_target
from vcpo_jax.model import lora, policy, transformer
from vcpo_jax.rollout import async_
from vcpo_jax.run_config import ConfigError, parse_config
from vcpo_jax.sampler import Sampler, SamplerConfig

log = logging.getLogger("vcpo_jax")


class Interrupted(Exception):
  pass


def _install_signal_handlers(flag: dict):
  def handler(signum, _frame):
    flag["signal"] = signum

  old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    for s in old:
      signal.signal(s, handler)
  except ValueError:  # not the main thread (e.g. called from a worker thread): leave signals alone
    return {}
  return old


def run(
  config,
  workdir: str,
  *,
  allow_config_change: bool = False,
  compile_cache: str = "auto",
  interrupt_grace_s: float | None = None,
) -> dict:
  """Trains according to `config` (a ConfigDict, see configs/common.py) in `workdir`; resumes if possible.

  A resume whose trajectory fields (vcpo_jax.fingerprint) differ from the newest checkpoint's raises a
  ConfigError before anything is built, unless `allow_config_change`: then it continues with the new values
  and config.json's `config_history` keeps each earlier config with the steps it governed.

  `workdir` is a local path or a URL (file://, gs://, s3://; every output goes through vcpo_jax.fs, and
  orbax checkpoints need a scheme etils knows: not memory://). On every start the logs are cut back to
  the restored step, so a crashed attempt's rows after its last checkpoint never appear twice.
  `compile_cache`: "auto" (on an accelerator, a user cache dir), "off" or a directory (vcpo_jax/compile_cache.py);
  `interrupt_grace_s`: before the first update, a signal not acted on within it ends the process (`_Signals`).
  """
  # ---- config and workdir ----
  spec, primary = _open_workdir(config, workdir, allow_config_change, compile_cache)  # every check, before compiles
  config_fp = fingerprint.of(config)  # stored in every checkpoint

  # ---- mesh and policy ----
  mesh = _build_mesh(spec)  # the learner's devices: all but the async sampler's
  # Born sharded (init_sharded): each device creates only its shards, with the host initializer's values.
  model_cfg, tokenizer, graphdef, params = policy.build_policy(
    spec.model_cfg, mesh, seed=spec.seed, checkpoint=spec.model_checkpoint, tokenizer_dir=spec.tokenizer_dir
  )
  log.info("policy: %s, %.2fM parameters", model_cfg.model_type, model_cfg.num_params / 1e6)
  train_problems = spec.make_train_problems()  # made by spec.task, the run's one configured task (its grader)
  if spec.sft_steps > 0:  # supervised warm start on the solver's solutions (cached per config)
    params = _warm_start(spec, graphdef, params, model_cfg, tokenizer, train_problems, workdir if primary else None)

  # ---- learner ----
  state, train_step, plain_jit = _build_learner(spec, graphdef, params, mesh)
  plain_step = None  # compiled at the first step (see _build_learner)

  # ---- rollout source ----
  key = jax.random.key(spec.seed)
  # sync/lag sample on the learner's devices: its mesh, so the published params need no move
  make_sampler = lambda cfg: Sampler(graphdef, model_cfg, cfg, mesh=mesh)
  maker = _build_maker(spec, tokenizer, make_sampler, train_problems)
  ref_cosine = _reference_cosine(spec, graphdef, maker, key, mesh) if spec.log.ref_grad_every else None
  # (the source itself is built under the signal guard below: the async one starts a process)

  # ---- eval ----
  run_eval = _Evals(spec, *_build_eval(spec, tokenizer, make_sampler, _buckets(spec), maker), key)

  # ---- checkpoint and resume ----
  # The signal handlers go in before the source exists (_Signals): a signal during start-up ends the run
  # (exit 130) with whatever was built closed; from the loop on, it checkpoints the last completed step.
  signals = _Signals(interrupt_grace_s)
  build_source = functools.partial(
    _build_source, spec, maker, key, model_cfg, graphdef, tokenizer, workdir, signals.check, run_eval
  )
  source, ckpt, writer, state, latest, meta = _open(spec, workdir, primary, build_source, state, signals)
  start = latest or 0
  run_eval.source, run_eval.writer = source, writer

  # ---- loop ----
  last_eval: dict = {}
  agreed_stops = source.agreed_stops
  nonfinite_steps: list[int] = []
  step = start
  try:
    if latest is None:  # a checkpoint at step 0 (a signal before the first update) follows this eval
      last_eval = run_eval(0, state.params)
      if last_eval:  # eval.background: logged when it arrives
        writer.write(0, last_eval)
    while step < spec.steps:
      if not agreed_stops:  # multi-host async: the source's next() agrees on a stop with every host
        signals.check()
      t0 = time.time()
      batch, info = source.next(step)
      t1 = time.time()
      dev_batch = _global_batch(batch.device(), mesh, spec.rollout.batch_size)
      if plain_jit is not None and plain_step is None:
        plain_step = plain_jit.lower(state.params, dev_batch).compile()
      ref_row = {}  # log.ref_grad_every: before the step, which donates the parameters it is measured at
      if ref_cosine is not None and (step + 1) % spec.log.ref_grad_every == 0:
        ref_row = ref_cosine(state.params, dev_batch, step)
      state, m = train_step(state, dev_batch, *_behaviour_args(spec, source, step))
      m = jax.device_get(m)
      signals.trained()  # from here a signal checkpoints this step (no watchdog exit)
      t2 = time.time()
      step += 1
      _publish(source, state.params, step)
      t3 = time.time()
      _check_finite(m, step - 1, nonfinite_steps, spec.on_nonfinite)
      row = {**_train_row(m, batch, info, t0, t1, t2, t3), **ref_row, **_publish_row(source)}
      if plain_step is not None and step % spec.log.norm_overhead_every == 0:
        row.update(_norm_overhead(plain_step, state.params, dev_batch, t2 - t1))
      evaluate_now = spec.eval_every and step % spec.eval_every == 0
      if evaluate_now and step < spec.steps:
        last_eval = run_eval(step, state.params)
        row.update(last_eval)
      run_eval.arrived(step)
      writer.write(step, row, advance=True)
      if step % spec.checkpoint.every == 0 and step < spec.steps:
        run_eval.arrived(step, wait=True)  # eval.background: this step's record ranks its checkpoint
        _save(ckpt, step, state, source, writer, run_eval.at(step), config_fp)
    final_eval = _final_eval(run_eval, writer, state, step, meta.get("final_eval") if step == start else None)
    _save(ckpt, step, state, source, writer, final_eval, config_fp, final=True)
  except (Interrupted, distributed.JobStopped) as e:
    log.warning("interrupted (%s): saving a checkpoint at step %d, then exiting with code 130", e, step)
    run_eval.arrived(step)  # what arrived is logged; an evaluation still running is lost (no wait here)
    _save(ckpt, step, state, source, writer, None, config_fp, force=True)
    raise SystemExit(getattr(e, "exit_code", 130))
  except rollout.SourceFailed as e:  # e.g. the async sampler failed past async_.max_sampler_restarts
    if not source.agreed_stops:  # several hosts save jointly, after their agreement (JobStopped above)
      log.error("the rollout source failed (%s): saving a checkpoint at step %d", str(e).splitlines()[0], step)
      _save(ckpt, step, state, source, writer, None, config_fp, force=True)
    raise
  finally:
    _close_all(signals, source, ckpt, writer)
  return _finish(spec, workdir, primary, {"step": step, **final_eval, "nonfinite_steps": nonfinite_steps})


def _final_eval(run_eval, writer, state, step: int, logged: dict | None) -> dict:
  """The final evaluation, after every background one has arrived. A rerun of a finished run restores the final
  checkpoint, whose evaluation (`logged`) is in the logs already."""
  run_eval.arrived(step, wait=True)
  if logged is not None:
    return logged
  final_eval = run_eval(step, state.params, tag="final")
  writer.write(step, final_eval)
  return final_eval


def _publish_row(source) -> dict:
  """The async shm path's host copy seconds of the last publish ({} on the other paths; see _train_row)."""
  copy_s = source.take_copy_s()
  return {} if copy_s is None else {"time/publish_copy_s": copy_s}


# ----------------------------------------------------------------------------- the run's builders


def _open_workdir(config, workdir: str, allow_config_change: bool = False, compile_cache: str = "auto"):
  """(spec, primary): the checked config; distributed JAX started if asked; a resume's config compared with
  its newest checkpoint's (fingerprint); config.json written by process 0; the compilation cache set."""
  try:
    compile_cache_lib.check(compile_cache)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  spec = parse_config(config)
  fs.check(workdir)  # a URL whose file system is missing (e.g. gcsfs for gs://) fails here, in one line
  if not spec.dist.enabled or spec.dist.process_id == 0:  # before jax starts: its logs would follow the error
    _check_writable(workdir)
  saved_step, diff = _config_changes(config, workdir)  # read from the files: jax is not started yet
  if diff and not allow_config_change:
    raise ConfigError(fingerprint.message(diff, saved_step, workdir))
  if spec.mode == "async":  # each process's share of a GPU it shares, set before jax starts (async_.memory_share)
    mesh_lib.apply_env(async_.memory_plan(spec.async_, mesh_lib.platform_hint())["learner"])
  if spec.dist.enabled:
    mesh_lib.maybe_initialize_distributed(spec.dist.coordinator_address, spec.dist.num_processes, spec.dist.process_id)
  primary = jax.process_index() == 0  # writes the logs and summaries (orbax coordinates checkpoints itself)
  if primary:  # the config, plus what produced the run: commit, versions, CPU, XLA_FLAGS, devices
    record = {**config.to_dict(), "provenance": provenance.collect()}
    record.update(_config_history(workdir, saved_step, diff))
    fs.write_text(fs.join(workdir, "config.json"), json.dumps(record, indent=1, default=str))
  compile_cache_lib.apply(compile_cache)  # before the first compile; the async sampler inherits it
  return spec, primary


def _config_changes(config, workdir: str) -> tuple[int | None, dict]:
  """(newest checkpoint's step or None, fingerprint.differences from its config to `config`).

  Read straight from the files, without orbax or jax: orbax finalizes step s as the directory
  checkpoints/<s> (in-progress saves have a suffixed name), its JSON meta in <s>/meta/metadata."""
  root = fs.join(workdir, "checkpoints")
  steps = [int(n) for n in fs.listdir(root) if n.isdigit()] if fs.exists(root) else []
  if not steps:
    return None, {}
  step = max(steps)
  meta_path = fs.join(root, str(step), "meta", "metadata")
  saved = json.loads(fs.read_text(meta_path)).get("config_fingerprint") if fs.exists(meta_path) else None
  if saved is None:  # checkpoints written before fingerprints were stored
    return step, {}
  return step, fingerprint.differences(saved, fingerprint.of(config))


def _config_history(workdir: str, step: int | None, diff: dict) -> dict:
  """config.json's `config_history` (each earlier config, its `steps` [from, to) and what changed after it)
  and `from_step` (where the current config took over): carried over from the workdir's config.json, with
  that config appended when this resume changes trajectory fields (`diff`)."""
  path = fs.join(workdir, "config.json")
  if step is None or not fs.exists(path):
    return {}
  old = json.loads(fs.read_text(path))
  history, start = old.pop("config_history", []), old.pop("from_step", 0)
  if diff:
    changed = {p: {"from": a, "to": b} for p, (a, b) in diff.items()}
    history = [*history, {"steps": [start, step], "changed_after": changed, "config": old}]
    start = step
  return {"config_history": history, "from_step": start} if history else {}


def _check_writable(workdir: str):
  """Creates `workdir` and writes a probe file there; a ConfigError (one line, exit 2) when either fails:
  a path that is a file or lies under one, a read-only file system, a directory without write permission."""
  try:
    fs.makedirs(workdir)
    probe = fs.join(workdir, ".write_probe")
    fs.write_text(probe, "")
    fs.remove(probe)
  except OSError as e:
    reason = "a file of that name exists" if isinstance(e, FileExistsError) else (e.strerror or type(e).__name__)
    raise ConfigError(
      f"--workdir={workdir!r}: cannot write there ({reason}); pass a directory this user can create and write"
    ) from e


def _build_mesh(spec):
  """The learner's mesh (mesh.build_mesh): every device but the async sampler's (async_.sampler_devices)."""
  try:
    return mesh_lib.build_mesh(
      spec.mesh_shape, spec.rollout.batch_size, spec.async_.sampler_devices if spec.mode == "async" else ""
    )
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _warm_start(spec, graphdef, params, model_cfg, tokenizer, train_problems, workdir):
  """sft.warm_start with its own config (spec.sft_config()); `workdir` (None off process 0) gets sft.json."""
  # CPU-sized random models only (RunSpec): trained on one local device as always, so a cached warm
  # start and a fresh one agree whatever the mesh; the learner's state is then laid out on the mesh.
  params = jax.device_put(params, jax.local_devices()[0])
  if not model_cfg.lora:
    return sft.warm_start(graphdef, params, model_cfg, tokenizer, train_problems, spec.sft_config(), workdir)
  # LoRA: the warm start is the base's (the plain model's, cached and shared with a full fine-tuning run of the
  # same seed); the run's fresh adapters (B = 0) go on top, so RL step 0 is the warm-started model.
  plain_cfg, plain = lora.merge_into_base(params, model_cfg)  # B = 0: the base's weights, float32
  plain_graphdef, _ = transformer.split(nnx.eval_shape(lambda: transformer.init(plain_cfg)))
  plain = sft.warm_start(plain_graphdef, plain, plain_cfg, tokenizer, train_problems, spec.sft_config(), workdir)
  return lora.freeze_base(lora.combine(lora.adapters(params), plain), model_cfg)


def _buckets(spec) -> dict:
  """The samplers' shape buckets: the prompt bucket and the batch sizes (1, a training batch, an eval batch)."""
  return {
    "max_prompt_len": spec.rollout.max_prompt_len,
    "batch_sizes": (1, spec.rollout.batch_size, spec.eval_batch_size),
  }


def _build_maker(spec, tokenizer, make_sampler, train_problems):
  """The training rollout maker (rollout.build_maker) with the training sampler's settings (config.sampler)."""
  train_cfg = SamplerConfig.from_tokenizer(
    tokenizer,
    max_new_tokens=spec.rollout.max_new_tokens,
    **_buckets(spec),
    **spec.sampling.sampler_kwargs(),
    record_topk=spec.learner.method.record_topk,  # method.loss.score_centering='topk': the learner centers from this record
    record_routing=spec.model_cfg.routing_replay,  # MoE routing replay: the learner replays this record
    # sampler.support_replay: the learner renormalises over each token's recorded support (single-turn rollouts)
    record_support=spec.sampling.replays_support and spec.multiturn is None,
  )
  return rollout.build_maker(spec.rollout, spec.multiturn, tokenizer, make_sampler, train_cfg, train_problems)


def _build_source(spec, maker, key, model_cfg, graphdef, tokenizer, workdir, check_signal, run_eval):
  """The mode's rollout source (rollout.build_source; async: its own config spec.async_), polling
  `check_signal` in its waits; eval.background: set up before the first publish starts the sampler."""
  src = rollout.build_source(
    spec.mode,
    maker,
    key,
    k=spec.k,
    async_cfg=spec.async_,
    steps=spec.steps,
    model_cfg=model_cfg,
    graphdef=graphdef,
    tokenizer=tokenizer,
    workdir=workdir,
    interrupt=check_signal,
  )
  if spec.eval_background:  # before the first publish starts the sampler process
    src.enable_background_eval(run_eval.background_args())
  return src


class _Signals:
  """SIGINT / SIGTERM handlers that only set a flag, installed at construction (`old`: the handlers replaced).

  `check()` raises Interrupted once a signal has arrived. Every source wait and the top of each step call
  it: during start-up (the async sampler's spawn, a restore) _open's guard then closes whatever was built
  (the sampler, its shared memory) and exits 130, nothing trained; from the loop on, the run checkpoints
  the last completed step. A signal during an evaluation or a compile is acted on once that returns.

  grace_s (trainer.run's interrupt_grace_s; main.py: 2 s): until the run's first update has returned
  (`trained()`), nothing is trained, so a signal that the run does not act on within grace_s (a compile, the
  step-0 evaluation: Python's handler runs only when they return) ends the process from a watchdog thread:
  one line, exit 130. The watchdog learns of the signal from signal.set_wakeup_fd, written by the C-level
  handler at once. A sampler process dies with it (its parent-death signal); shared-memory names it had not
  attached yet are left to the next run's cleanup (vcpo_jax.cleanup). None: no watchdog (library use).
  """

  def __init__(self, grace_s: float | None = None):
    self.flag: dict = {}
    self.old = _install_signal_handlers(self.flag)
    self.grace_s = grace_s
    self._lock = threading.Lock()
    self._hard_exit = grace_s is not None and bool(self.old)  # nothing trained yet: an exit loses nothing
    self._wake = None
    if self._hard_exit:
      import socket

      r, w = socket.socketpair()
      w.setblocking(False)
      self._old_wakeup = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
      self._wake = (r, w)
      threading.Thread(target=self._watch, name="vcpo-signal-watchdog", daemon=True).start()

  def check(self):
    if self.flag.get("signal"):
      self.acting()
      raise Interrupted(f"signal {self.flag['signal']}")

  def acting(self):
    """The run acts on the signal itself (it closes what it built, or saves a checkpoint): no watchdog exit."""
    with self._lock:
      self._hard_exit = False

  def trained(self):
    """The first update returned: from now on a signal is acted on by the run (it checkpoints), never cut short."""
    self.acting()

  def _watch(self):
    r, _ = self._wake
    while True:
      try:
        data = r.recv(64)
      except OSError:
        return
      if not data:
        return
      if not {signal.SIGINT, signal.SIGTERM} & set(data):
        continue
      deadline = time.monotonic() + self.grace_s
      while time.monotonic() < deadline and self._hard_exit:
        time.sleep(0.02)
      with self._lock:
        if self._hard_exit:
          _exit_now(signal.Signals(self.flag.get("signal") or data[0]).name)

  def close(self):
    """Restores the handlers (and the wakeup fd) replaced at construction; stops the watchdog."""
    self.acting()
    for s, h in self.old.items():
      signal.signal(s, h)
    if self._wake is not None:
      signal.set_wakeup_fd(self._old_wakeup)
      for sock in self._wake:
        sock.close()
      self._wake = None


def _exit_now(signal_name: str):
  """The watchdog's exit (nothing trained yet): one line, the sampler process killed, this process's shared
  memory and argument files removed, multiprocessing's resource tracker stopped before it would warn about
  them (lines of its own), then os._exit(130)."""
  import multiprocessing
  from multiprocessing import resource_tracker

  os.write(2, f"interrupted during start-up ({signal_name}): nothing trained yet; exiting with code 130\n".encode())
  for child in multiprocessing.active_children():
    child.kill()
  cleanup.remove_own()
  tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
  if tracker:
    with contextlib.suppress(OSError):
      os.kill(tracker, signal.SIGKILL)
  os._exit(130)


def _publish(source, params, step: int):
  """source.publish; a signal noticed in its wait is raised again at the top of the loop, once this step's
  row is logged (and checkpointed). So is a failed source (SourceFailed: the async sampler died past its
  restart budget): its next() serves the batches it still holds, then raises the failure again; raised
  here, the step it ends would be trained and checkpointed but never logged."""
  try:
    source.publish(params, step)
  except (Interrupted, rollout.SourceFailed):
    pass


def _check_finite(m: dict, step: int, nonfinite_steps: list, on_nonfinite: str):
  """Records update `step` in `nonfinite_steps` if its loss or gradient was non-finite (learner.on_nonfinite:
  'skip' continues, the learner having skipped the update; 'abort' raises FloatingPointError)."""
  if not m["nonfinite"]:
    return
  nonfinite_steps.append(step)
  if on_nonfinite == "abort":
    raise FloatingPointError(
      f"non-finite loss or gradient at step {step} (non-finite steps so far: {nonfinite_steps}); "
      "set learner.on_nonfinite='skip' to skip such updates."
    )


def _finish(spec, workdir: str, primary: bool, summary: dict) -> dict:
  """Process 0 writes summary.json (and the plots); returns `summary`."""
  if primary:
    if spec.log.plots:
      metrics_lib.plot_run(workdir)
    fs.write_text(fs.join(workdir, "summary.json"), json.dumps(summary, indent=1))
  return summary


def _open(spec, workdir: str, primary: bool, build_source, state, signals: _Signals):
  """(source, ckpt, writer, state, latest, meta): the run opened, resumed from its newest checkpoint if any.

  Builds the source (`build_source()`), restores the newest checkpoint (latest: its step, None on a fresh
  start; meta: what it recorded), publishes the parameters (lag: re-registers the newest kept version;
  async: starts the sampler) and opens the logs, cut back to the restored step (or emptied on a fresh
  start): rows of a crashed attempt after its last checkpoint belong to a discarded timeline and are
  logged again by this one. Anything raised on the way (a signal's Interrupted: exit 130, nothing was
  trained) first closes whatever was built and restores the signal handlers.
  """
  source = ckpt = writer = None
  try:
    source = build_source()
    c = spec.checkpoint
    ckpt = Checkpointer(
      fs.join(workdir, "checkpoints"), keep_last=c.keep_last, keep_best=c.keep_best, best_metric=BEST_METRIC
    )
    meta = {}
    latest = ckpt.latest_step()
    if latest is not None:
      state, meta = _restore(ckpt, latest, state, source)
      log.info("resumed from step %d in %s", latest, workdir)
    source.publish(state.params, latest or 0)
    wall_offset = float(meta.get("wall_time", 0.0))
    writer = metrics_lib.MetricsWriter(
      workdir, spec.steps, resume_step=latest, wall_offset=wall_offset, progress=spec.log.progress, primary=primary
    )
    if primary:  # written again when this run finishes; a stale one would claim an earlier end
      fs.remove(fs.join(workdir, "summary.json"))
    signals.check()  # a signal during start-up ends the run here: nothing trained, nothing to save
    return source, ckpt, writer, state, latest, meta
  except BaseException as e:
    _close_all(signals, source, ckpt, writer)
    if isinstance(e, Interrupted):
      log.warning(
        "interrupted during start-up (%s): nothing trained since the last checkpoint; exiting with code 130", e
      )
      raise SystemExit(130) from None
    raise


class _Evals:
  """The run's evaluations: `self(step, params, tag)` evaluates and logs (eval.jsonl) and returns the metrics.

  Synchronous by default (one generation path, evaluation.EvalSampling, on the learner's devices). With
  eval.background (async, one host) a periodic evaluation is only requested from the sampler process and
  returns {}; `arrived(step)` logs the records that came back (eval.jsonl, and metrics.jsonl at the step
  each evaluated, tagged with eval/policy_version); wait=True first waits for the outstanding one (every
  periodic checkpoint does, so that it follows the records of every step <= its own and ranks by its own
  step's evaluation). The final evaluation always runs here.
  """

  def __init__(self, spec, sampling, problems, protocol, key):
    self.spec, self.sampling, self.problems, self.protocol, self.key = spec, sampling, problems, protocol, key
    self.source = self.writer = None  # set once the run is opened
    self._by_step: dict[int, dict] = {}  # step -> metrics of the evaluation of that step's parameters

  def at(self, step) -> dict | None:
    """The metrics of the evaluation of `step`'s parameters logged so far (a checkpoint's ranking), or None."""
    return self._by_step.get(step)

  def __call__(self, step, params, tag=None) -> dict:
    if self.spec.eval_background and tag is None:
      self.source.request_eval(step, params)
      return {}
    gen = self.sampling.generate_fn(params, jax.random.fold_in(self.key, 10**9 + step))
    rec = evaluation.evaluate(gen, self.problems, self.protocol, step, tag=tag)
    self.writer.write_eval(rec)  # eval.jsonl, through the file-system layer and truncated with the other logs
    self._by_step[step] = _eval_metrics(rec)
    return self._by_step[step]

  def arrived(self, step, wait=False) -> dict:
    """eval.background: logs the records that arrived by `step`; returns the newest's metrics ({} if none)."""
    out = {}
    for rec in self.source.eval_results(wait=wait) if self.spec.eval_background else []:
      self.writer.write_eval(dict(rec, arrived_at_step=step))
      out = self._by_step[rec["step"]] = _eval_metrics(rec)
      self.writer.write(rec["step"], dict(out, **{"eval/policy_version": rec["policy_version"]}))
    return out

  def background_args(self):
    """What the sampler process needs to evaluate as this run does (problems, protocol, sampler config)."""
    from vcpo_jax.rollout.process.worker import EvalArgs

    return EvalArgs(tuple(self.problems), self.protocol, self.sampling.base, self.spec.rollout.chat_template)


def _build_learner(spec, graphdef, params, mesh):
  """(state, train_step, plain_jit): the TrainState on `mesh`, the jitted update, the opt-in plain gradient.

  Parameters and optimizer state are placed by the (regex, PartitionSpec) rules; the batch is split over
  ("data", "fsdp"); the state is donated so each step updates it in place. Both steps are traced under
  the mesh (MeshJit), so the model's activation constraints keep the batch split.
  """
  tx = spec.optim.build(total_steps=spec.steps)
  init_state = lambda p: learner.init_state(p, tx)
  state_sh = sharding.param_shardings(jax.eval_shape(init_state, params), sharding.TRANSFORMER_RULES, mesh)
  state = jax.jit(init_state, out_shardings=state_sh)(params)
  batch_sh = sharding.batch_sharding(mesh)
  # exact score centering in lag mode: the step also reads the behaviour version (laid out as the params)
  behaviour_sh = (state_sh.params,) if _ring_centering(spec) else ()
  train_step = sharding.MeshJit(
    mesh,
    learner.make_train_step(graphdef, tx, spec.learner),
    in_shardings=(state_sh, batch_sh, *behaviour_sh),
    out_shardings=(state_sh, sharding.replicated(mesh)),
    donate_argnums=0,
  )
  # Opt-in yardstick for "per-example norms cost little": a plain gradient step, compiled at
  # the first step (not when first timed), so that the timing adds no compile in the middle of the run.
  plain_jit = None
  if spec.log.norm_overhead_every:
    plain_jit = sharding.MeshJit(mesh, learner.make_plain_grad_fn(graphdef), in_shardings=(state_sh.params, batch_sh))
  return state, train_step, plain_jit


def _ring_centering(spec) -> bool:
  """Whether the step reads the behaviour version: exact score centering (method.loss.score_centering='exact') in lag
  mode with k > 0 (RunSpec refuses it where no ring exists; with k = 0, q = p and the step uses its params)."""
  return spec.learner.method.centering is not None and spec.learner.method.centering[0] == "exact" and spec.k > 0


def _behaviour_args(spec, source, step: int) -> tuple:
  """train_step's extra arguments at `step`: (the lag ring's version that sampled the batch,) or ()."""
  return (source.behavior_params(step),) if _ring_centering(spec) else ()


def _eval_param_dtype(spec) -> str:
  """The evaluation's sampler weights: those of the rollouts, except int8 (a rollout precision whose mismatch the
  run measures), where the eval decodes the learner's policy in float ("auto")."""
  return "auto" if spec.sampling.param_dtype == "int8" else spec.sampling.param_dtype


def _build_eval(spec, tokenizer, make_sampler, buckets: dict, maker):
  """(EvalSampling, problems, protocol) of the run's evaluations.

  One generation path (evaluation.EvalSampling): every eval decodes with a sampler built from the
  protocol's own temperature / top_p / greedy / max_new_tokens, the settings eval.jsonl records; tool-use
  runs evaluate with the training episodes (maker.eval_episodes) under the evaluation's sampling.
  """
  problems = spec.make_eval_problems()
  protocol = dataclasses.replace(spec.eval, size=len(problems))  # a fixture may hold fewer
  cfg = SamplerConfig.from_tokenizer(
    tokenizer,
    max_new_tokens=spec.eval.max_new_tokens,
    **buckets,
    **spec.sampling.sampler_kwargs(
      temperature=spec.eval.temperature, top_p=spec.eval.top_p, top_k=0, param_dtype=_eval_param_dtype(spec)
    ),
  )
  episodes = None
  if spec.multiturn is not None:
    from vcpo_jax.rollout import multiturn

    cfg, episodes = multiturn.sampler_config(cfg, spec.rollout, spec.multiturn), maker.eval_episodes
  sampling = evaluation.EvalSampling(
    make_sampler, cfg, tokenizer, chat_template=spec.rollout.chat_template, episodes=episodes
  )
  return sampling, problems, protocol


def _train_row(m: dict, batch, info: dict, t0: float, t1: float, t2: float, t3: float) -> dict:
  """metrics.jsonl's row of one step: the learner's metrics `m`, the batch's, the source's `info`, timings.

  t0 -> t1: waiting for / making the batch (time/rollout_s); t1 -> t2: the update (time/learn_s); t2 -> t3:
  publishing the new parameters (time/publish_s: the learner-side blocking seconds of source.publish, the one
  publish timing the learner pays). The loop adds time/publish_copy_s in async mode's shared-memory path: the
  seconds of the newest host copy (device_get + slot write + checksum) completed since the previous row, done
  by a thread that overlaps the learner with async_.background_publish, inside time/publish_s without it."""
  n_tokens = float(batch["valid_mask"].sum())
  row = {k if k.startswith("grad/") else f"train/{k}": v for k, v in m.items()}  # grad/: vcpo_jax.telemetry
  row.update(
    {
      "train/reward_mean": float(batch["rewards"].mean()),
      "train/accuracy": float(batch["correct"].mean()),
      "train/response_len": info["response_len_mean"],
      # outputs whose grader raised (graded 0.0 and logged): a bug in a task's scorer, not a bad answer
      "train/grading_failures": info["grading_failures"],
      "train/lag_min": info["lag_min"],
      "train/lag_mean": info["lag_mean"],
      "train/lag_max": info["lag_max"],
      "time/rollout_s": t1 - t0,
      "time/learn_s": t2 - t1,
      "time/publish_s": t3 - t2,
      # generation busy time of this batch (sync: the rollout phase itself; async: the sampler's)
      "time/gen_s": info.get("sampler_gen_s", t1 - t0),
      "time/tokens_per_s": n_tokens / max(t2 - t0, 1e-9),
      "time/sampler_idle_frac": info.get("sampler_idle_frac", 0.0),
      "time/learner_idle_frac": info.get("learner_wait_s", t1 - t0) / max(t2 - t0, 1e-9),
    }
  )
  row.update(info.get("metrics", {}))  # source-specific statistics (e.g. multi-turn tool use)
  return row


REF_SALT = 0x5EF  # the reference batches' rngs: fold_in(fold_in(key, REF_SALT), step), apart from the run's own


def _reference_cosine(spec, graphdef, maker, key, mesh):
  """log.ref_grad_every (sync / lag): f(params, dev_batch, step) -> {"grad/ref_cosine", "grad/ref_norm"}.

  The cosine between the step's gradient (the run's method on its batch, recomputed: one more forward and
  backward) and the same method's gradient on a fresh batch of the step's prompts sampled with the current
  parameters (telemetry.cosine). In lag mode it measures how far staleness turns the update; sync mode gives
  its floor, the cosine of two independent on-policy batches. Opt-in: it samples a batch and compiles a
  function of its own (at the first measured step).
  """

  def fn(params, batch, fresh):
    step_grad, _ = learner._gradient(graphdef, params, batch, spec.learner)
    ref_grad, _ = learner._gradient(graphdef, params, fresh, spec.learner)
    return telemetry.cosine(step_grad, ref_grad), optax.global_norm(ref_grad)

  jitted = sharding.MeshJit(mesh, fn)
  ref_key = jax.random.fold_in(key, REF_SALT)

  def measure(params, dev_batch, step: int) -> dict:
    fresh, _ = maker.make(params, step, jax.random.fold_in(ref_key, step), step)
    cos, norm = jax.device_get(jitted(params, dev_batch, _global_batch(fresh.device(), mesh, spec.rollout.batch_size)))
    return {"grad/ref_cosine": float(cos), "grad/ref_norm": float(norm)}

  return measure


def _close_all(signals: _Signals, *closeables):
  """Restores the signal handlers, then closes each of `closeables` that was built (None: not yet)."""
  signals.close()
  for c in closeables:
    if c is not None:
      c.close()


def _norm_overhead(plain_step, params, dev_batch, learn_s: float) -> dict:
  """Times the (compiled) plain gradient step on this step's batch against the real one (second of two runs)."""
  times = []
  for _ in range(2):
    t0 = time.time()
    jax.block_until_ready(plain_step(params, dev_batch))
    times.append(time.time() - t0)
  return {"time/plain_grad_s": times[-1], "time/norm_overhead": learn_s / max(times[-1], 1e-9)}


def _global_batch(batch: dict, mesh, global_n: int):
  """Host arrays -> global arrays. Every process builds the same batch; each supplies its own rows."""
  if jax.process_count() == 1:
    return batch
  rows = mesh_lib.process_rows(global_n, sharding.batch_sharding(mesh))
  return mesh_lib.make_global_batch({k: v[rows] for k, v in batch.items()}, mesh, global_n)


def _state_tree(state, source):
  """(tree, versions, queued metadata): the arrays a checkpoint saves and the JSON it records about them.

  tree["queued"]: async mode's received-but-unconsumed batches (AsyncSource.queued_state); an empty list adds
  no leaves, so checkpoints without queued batches (every other mode) keep their layout."""
  versions, plist = source.state()
  queued, queued_meta = source.queued_state()
  return {"train": state, "versions": plist, "queued": queued}, versions, queued_meta


def _eval_metrics(rec: dict) -> dict:
  """The metrics.jsonl / checkpoint-ranking scalars of one evaluation.evaluate record."""
  return {
    "eval/accuracy": rec["mean_at_n"],
    "eval/mean_reward": rec["mean_reward"],
    **{f"eval/pass_at_{k}": v for k, v in rec["pass_at_k"].items()},
  }


def _save(ckpt, step, state, source, writer, eval_metrics, config_fp, force=False, final=False):
  """Saves the checkpoint at `step` (after the rows it covers are stored) with the config's fingerprint
  (`config_fp`: fingerprint.of); `final`: the run's last, whose meta keeps the final evaluation so that
  a rerun of the finished run neither repeats nor re-logs it."""
  if step in ckpt.all_steps():  # e.g. a signal right after a periodic save: that checkpoint is current
    return
  writer.flush()  # every row this checkpoint covers is stored before it (object stores buffer rows)
  tree, versions, queued_meta = _state_tree(state, source)
  meta = {"step": step, "versions": versions, "queued": queued_meta, "wall_time": writer.wall_time}
  meta["config_fingerprint"] = config_fp
  if final:
    meta["final_eval"] = {k: float(v) for k, v in eval_metrics.items()}
  ckpt.save(step, tree, meta, metrics=eval_metrics, force=force)
  ckpt.wait()


def _restore(ckpt, step, state, source):
  saved = ckpt.restore_meta(step)
  queued_meta = saved.get("queued", [])  # checkpoints from before queued batches were kept have none
  queued = source.queued_template(len(queued_meta)) if queued_meta else []  # a sync / lag source refuses some
  # Abstract (shape, dtype, sharding): orbax reads every array shard by shard into the learner's layout.
  state_target = jax.tree.map(restore_target, state)
  kept = lora.split(state_target.params)[0]  # a lag ring keeps the trainable part (with LoRA: the adapters)
  template = {"train": state_target, "versions": [kept for _ in saved["versions"]], "queued": queued}
  tree, meta = ckpt.restore(step, template)
  source.load_state(meta["versions"], tree["versions"])
  if queued_meta:
    source.load_queued([{k: np.asarray(v) for k, v in b.items()} for b in tree["queued"]], queued_meta)
  return tree["train"], meta
