"""run(config, workdir): the one training loop, for every method and execution mode.

Sections, top to bottom: Config -> Distributed -> Tokenizer & Model -> Warm
start -> Optimizer & Update step -> Checkpoint / resume -> Rollouts -> Evals ->
Loop. The mode only decides which rollout source is built:

    batch = source.next(step)                   # sync / lag: sampled here; async: from the queue
    state, metrics = train_step(state, batch)   # estimator -> grads -> ESS-scaled AdamW
    source.publish(state.params, step + 1)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time

import jax
import numpy as np

from vcpo_jax import distributed, evaluation, fs, learner, optim, provenance, sharding
from vcpo_jax import metrics as metrics_lib
from vcpo_jax.checkpoint import Checkpointer
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer
from vcpo_jax.rollout.common import RolloutMaker
from vcpo_jax.run_config import ConfigError, RunSpec, parse_config
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


def build_policy(spec: RunSpec):
  """(model_cfg, tokenizer, graphdef, params) from a checkpoint or a random preset."""
  from vcpo_jax.model import tokenizer as tok_lib

  if spec.model_checkpoint:
    from vcpo_jax.model import hf_io

    execution = {f: getattr(spec.model_cfg, f) for f in model_config.EXECUTION_FIELDS}
    model_cfg, model = hf_io.load_hf(spec.model_checkpoint, dtype=spec.model_cfg.dtype, **execution)
    tokenizer = tok_lib.load_tokenizer(spec.tokenizer_dir or spec.model_checkpoint)
  else:
    tokenizer = tok_lib.load_tokenizer(spec.tokenizer_dir) if spec.tokenizer_dir else tok_lib.build_char_tokenizer()
    model_cfg = spec.model_cfg.replace(vocab_size=max(spec.model_cfg.vocab_size, len(tokenizer)))
    model = transformer.init(model_cfg, seed=spec.seed)
  graphdef, params = transformer.split(model)
  return model_cfg, tokenizer, graphdef, params


def make_sampler_cfg(spec: RunSpec, tokenizer, *, temperature, top_p, top_k, max_new_tokens) -> SamplerConfig:
  eos = tokenizer.eos_token_id
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
  return SamplerConfig(
    temperature=temperature,
    top_p=top_p,
    top_k=top_k,
    eos_id=eos,
    pad_id=pad,
    max_new_tokens=max_new_tokens,
    prompt_buckets=(spec.rollout.max_prompt_len,),
    new_token_buckets=(max_new_tokens,),
    batch_buckets=tuple(sorted({1, spec.rollout.batch_size, spec.eval_batch_size})),
    draw=spec.sampling.draw,
    param_dtype=spec.sampling.param_dtype,
    mesh_shape=spec.sampling.mesh_shape,
  )


def run(config, workdir: str) -> dict:
  """Trains according to `config` (a ConfigDict, see configs/common.py) in `workdir`; resumes if possible.

  `workdir` is a local path or a URL (file://, gs://, s3://; every output goes through vcpo_jax.fs, and
  orbax checkpoints need a scheme etils knows: not memory://). On every start the logs are cut back to
  the restored step, so a crashed attempt's rows after its last checkpoint never appear twice.
  """
  # ---------------------------------------------------------------- Config
  spec = parse_config(config)  # every check happens here, before anything compiles
  fs.check(workdir)  # a URL whose file system is missing (e.g. gcsfs for gs://) fails here, in one line

  # ---------------------------------------------------------------- Distributed
  if spec.distributed.get("enabled"):
    sharding.maybe_initialize_distributed(
      spec.distributed["coordinator_address"], spec.distributed["num_processes"], spec.distributed["process_id"]
    )
  primary = jax.process_index() == 0  # writes the logs and summaries (orbax coordinates checkpoints itself)
  if primary:  # the config, plus what produced the run: commit, versions, CPU, XLA_FLAGS, devices
    fs.makedirs(workdir)
    record = {**config.to_dict(), "provenance": provenance.collect()}
    fs.write_text(fs.join(workdir, "config.json"), json.dumps(record, indent=1, default=str))

  # ---------------------------------------------------------------- Tokenizer & Model
  model_cfg, tokenizer, graphdef, params = build_policy(spec)
  log.info("policy: %s, %.2fM parameters", model_cfg.model_type, model_cfg.num_params / 1e6)

  # ---------------------------------------------------------------- Warm start
  train_problems = spec.make_train_problems()  # made by spec.task, the run's one configured task (its grader)
  if spec.sft_steps > 0:
    from vcpo_jax import sft

    params = sft.warm_start(graphdef, params, model_cfg, tokenizer, train_problems, spec, workdir if primary else None)

  # ---------------------------------------------------------------- Optimizer & Update step
  tx = optim.make_optimizer(
    spec.lr,
    weight_decay=spec.weight_decay,
    clip_norm=spec.clip_norm,
    b1=spec.b1,
    b2=spec.b2,
    schedule=spec.schedule,
    total_steps=spec.steps,
  )
  mesh = build_mesh(spec)
  state_sh = sharding.param_shardings(
    jax.eval_shape(lambda p: learner.init_state(p, tx), params), sharding.TRANSFORMER_RULES, mesh
  )
  # Parameters and optimizer state are placed by the (regex, PartitionSpec) rules; the batch is split
  # over ("data", "fsdp"); the state is donated so each step updates it in place.
  state = jax.jit(lambda p: learner.init_state(p, tx), out_shardings=state_sh)(params)
  batch_sh = sharding.batch_sharding(mesh)
  # Traced under the mesh (MeshJit), so the model's activation constraints keep the batch split.
  train_step = sharding.MeshJit(
    mesh,
    learner.make_train_step(graphdef, tx, spec.learner),
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, sharding.replicated(mesh)),
    donate_argnums=0,
  )

  # Opt-in yardstick for "per-example norms cost little" (review #9): a plain gradient step, compiled at
  # the first step (not when first timed), so that the timing adds no compile in the middle of the run.
  plain_jit = plain_step = None
  if spec.norm_overhead_every:
    plain_jit = sharding.MeshJit(mesh, learner.make_plain_grad_fn(graphdef), in_shardings=(state_sh.params, batch_sh))

  # ---------------------------------------------------------------- Rollouts
  key = jax.random.key(spec.seed)
  train_sampler = Sampler(
    graphdef,
    model_cfg,
    make_sampler_cfg(
      spec,
      tokenizer,
      temperature=spec.temperature,
      top_p=spec.top_p,
      top_k=spec.top_k,
      max_new_tokens=spec.rollout.max_new_tokens,
    ),
    mesh=mesh,  # sync/lag sample on the learner's devices: its mesh, so the published params need no move
  )
  if spec.multiturn is None:
    maker = RolloutMaker(spec.rollout, tokenizer, train_sampler, train_problems)
  else:  # tool-use episodes: contexts grow each turn, so the sampler gets multi-turn buckets
    from vcpo_jax.rollout import multiturn

    maker = multiturn.MultiTurnRolloutMaker(
      spec.rollout,
      spec.multiturn,
      tokenizer,
      Sampler(
        graphdef, model_cfg, multiturn.sampler_config(train_sampler.cfg, spec.rollout, spec.multiturn), mesh=mesh
      ),
      train_problems,
    )
  # ---------------------------------------------------------------- Evals
  eval_problems = spec.make_eval_problems()
  eval_proto = dataclasses.replace(spec.eval, size=len(eval_problems))  # a fixture may hold fewer
  # One generation path (evaluation.EvalSampling): every eval decodes with a sampler built from the
  # protocol's own temperature / top_p / greedy / max_new_tokens, the settings eval.jsonl records.
  eval_base = make_sampler_cfg(
    spec,
    tokenizer,
    temperature=spec.eval.temperature,
    top_p=spec.eval.top_p,
    top_k=0,
    max_new_tokens=spec.eval.max_new_tokens,
  )
  eval_episodes = None
  if spec.multiturn is not None:  # tool-use evaluation: the same episodes as training, eval sampling
    eval_base = multiturn.sampler_config(eval_base, spec.rollout, spec.multiturn)
    eval_episodes = maker.eval_episodes
  eval_sampling = evaluation.EvalSampling(
    lambda cfg: Sampler(graphdef, model_cfg, cfg, mesh=mesh),
    eval_base,
    tokenizer,
    chat_template=spec.rollout.chat_template,
    episodes=eval_episodes,
  )

  def run_eval(step, params, tag=None):
    if spec.eval_background and tag is None:  # eval.background: the async sampler evaluates, logged on arrival
      source.request_eval(step, params)
      return {}
    gen = eval_sampling.generate_fn(params, jax.random.fold_in(key, 10**9 + step))
    rec = evaluation.evaluate(gen, eval_problems, eval_proto, step, tag=tag)
    writer.write_eval(rec)  # eval.jsonl, through the file-system layer and truncated with the other logs
    return _eval_metrics(rec)

  def background_evals(step, wait=False):
    """eval.background: logs the records that arrived (eval.jsonl, and metrics.jsonl at the step each
    evaluated); wait: first the outstanding one (every periodic checkpoint does, so that it follows the
    records of every step <= its own, and ranks by its own step's evaluation). Returns the newest's metrics."""
    out = {}
    for rec in source.eval_results(wait=wait) if spec.eval_background else []:
      writer.write_eval(dict(rec, arrived_at_step=step))
      out = _eval_metrics(rec)
      writer.write(rec["step"], dict(out, **{"eval/policy_version": rec["policy_version"]}))
    return out

  # ---------------------------------------------------------------- Checkpoint / resume
  # The signal handlers go in before the source exists: SIGINT / SIGTERM during start-up (the async sampler's
  # spawn, a restore) only set the flag, and the guard below closes whatever was built (the sampler, its
  # shared memory) and exits 130; nothing was trained, so there is nothing to checkpoint. From the loop on,
  # a signal checkpoints the last completed step. It is noticed in every source wait and at the top of each
  # step: a signal during an evaluation or a compile is acted on once that returns.
  flag: dict = {}  # set by the signal handlers; every source wait and every step polls check_signal

  def check_signal():
    if flag.get("signal"):
      raise Interrupted(f"signal {flag['signal']}")

  old_handlers = _install_signal_handlers(flag)
  source = ckpt = writer = None
  try:
    source = build_source(spec, maker, key, model_cfg, graphdef, tokenizer, workdir, interrupt=check_signal)
    if spec.eval_background:  # before the first publish starts the sampler process
      from vcpo_jax.rollout.process.worker import EvalArgs

      source.enable_background_eval(EvalArgs(tuple(eval_problems), eval_proto, eval_base, spec.rollout.chat_template))
    ckpt = Checkpointer(
      fs.join(workdir, "checkpoints"),
      keep_last=spec.keep_last,
      keep_best=spec.keep_best,
      best_metric="eval/accuracy",
    )
    start, meta = 0, {}
    latest = ckpt.latest_step()
    if latest is not None:
      state, meta = _restore(ckpt, latest, state, source)
      start = latest
      log.info("resumed from step %d in %s", start, workdir)
    source.publish(state.params, start)  # lag: re-registers the newest kept version; async: starts the sampler

    # Every log is cut back to the restored step (or emptied on a fresh start): rows of a crashed attempt
    # after its last checkpoint belong to a discarded timeline and are logged again by this one.
    writer = metrics_lib.MetricsWriter(
      workdir,
      spec.steps,
      resume_step=latest,
      wall_offset=float(meta.get("wall_time", 0.0)),
      progress=spec.progress,
      primary=primary,
    )
    summary_path = fs.join(workdir, "summary.json")
    if primary:
      fs.remove(summary_path)  # written again when this run finishes; a stale one would claim an earlier end
    check_signal()
  except BaseException as e:
    _close_all(old_handlers, source, ckpt, writer)
    if isinstance(e, Interrupted):
      log.warning("interrupted during start-up (%s): nothing trained since the last checkpoint; exiting", e)
      raise SystemExit(130) from None
    raise

  # ---------------------------------------------------------------- Loop
  last_eval: dict = {}
  agreed_stops = hasattr(source, "agreement")
  nonfinite_steps: list[int] = []
  step = start
  try:
    if latest is None:  # a checkpoint at step 0 (a signal before the first update) follows this eval
      last_eval = run_eval(0, state.params)
      if last_eval:  # eval.background: logged when it arrives
        writer.write(0, last_eval)
    while step < spec.steps:
      if not agreed_stops:  # multi-host async: the source's next() agrees on a stop with every host
        check_signal()
      t0 = time.time()
      batch, info = source.next(step)
      t1 = time.time()
      dev_batch = _global_batch(batch.device(), mesh, spec.rollout.batch_size)
      if plain_jit is not None and plain_step is None:
        plain_step = plain_jit.lower(state.params, dev_batch).compile()
      state, m = train_step(state, dev_batch)
      m = jax.device_get(m)
      t2 = time.time()
      step += 1
      try:
        source.publish(state.params, step)
      except Interrupted:
        pass  # raised again at the top of the loop, once this step's row is logged (and checkpointed)
      if m["nonfinite"]:
        nonfinite_steps.append(step - 1)
        if spec.on_nonfinite == "abort":
          raise FloatingPointError(
            f"non-finite loss or gradient at step {step - 1} (non-finite steps so far: {nonfinite_steps}); "
            "set learner.on_nonfinite='skip' to skip such updates."
          )
      n_tokens = float(batch["valid_mask"].sum())
      row = {f"train/{k}": v for k, v in m.items()}
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
          # generation busy time of this batch (sync: the rollout phase itself; async: the sampler's)
          "time/gen_s": info.get("sampler_gen_s", t1 - t0),
          "time/tokens_per_s": n_tokens / max(t2 - t0, 1e-9),
          "time/sampler_idle_frac": info.get("sampler_idle_frac", 0.0),
          "time/learner_idle_frac": info.get("learner_wait_s", t1 - t0) / max(t2 - t0, 1e-9),
        }
      )
      row.update(info.get("metrics", {}))  # source-specific statistics (e.g. multi-turn tool use)
      if plain_step is not None and step % spec.norm_overhead_every == 0:
        row.update(_norm_overhead(plain_step, state.params, dev_batch, t2 - t1))
      if spec.eval_every and step % spec.eval_every == 0 and step < spec.steps:
        last_eval = run_eval(step, state.params)
        row.update(last_eval)
      background_evals(step)
      writer.write(step, row, advance=True)
      if step % spec.checkpoint_every == 0 and step < spec.steps:
        last_eval = background_evals(step, wait=True) or last_eval
        _save(ckpt, step, state, source, writer, last_eval if spec.eval_every and step % spec.eval_every == 0 else None)
    # A rerun of a finished run restores the final checkpoint, whose evaluation is logged already.
    final_eval = meta.get("final_eval") if step == start else None
    background_evals(step, wait=True)
    if final_eval is None:
      final_eval = run_eval(step, state.params, tag="final")
      writer.write(step, final_eval)
    _save(ckpt, step, state, source, writer, final_eval, final=True)
  except (Interrupted, distributed.JobStopped) as e:
    log.warning("interrupted (%s): saving a checkpoint at step %d", e, step)
    background_evals(step)  # what arrived is logged; an evaluation still running is lost (no wait here)
    _save(ckpt, step, state, source, writer, None, force=True)
    raise SystemExit(getattr(e, "exit_code", 130))
  finally:
    _close_all(old_handlers, source, ckpt, writer)
  summary = {"step": step, **final_eval, "nonfinite_steps": nonfinite_steps}
  if primary:
    if spec.plots:
      metrics_lib.plot_run(workdir)
    fs.write_text(summary_path, json.dumps(summary, indent=1))
  return summary


def _close_all(old_handlers: dict, *closeables):
  """Restores the signal handlers, then closes each of `closeables` that was built (None: not yet)."""
  for s, h in old_handlers.items():
    signal.signal(s, h)
  for c in closeables:
    if c is not None:
      c.close()


def build_mesh(spec: RunSpec):
  """The learner's device mesh; the sampler's devices (async_.sampler_devices) are left out of it."""
  devices = jax.devices()
  if spec.mode == "async" and spec.async_cfg.get("sampler_devices") and jax.process_count() > 1:
    devices = distributed.learner_devices(spec.async_cfg["sampler_devices"], devices)  # host-local ids
  elif spec.mode == "async" and spec.async_cfg.get("sampler_devices") and len(devices) > 1:
    devices = sharding.split_devices(spec.async_cfg["sampler_devices"], devices)[1]
  try:
    mesh = sharding.make_mesh(sharding.MeshConfig(spec.mesh_shape), devices=devices)
  except ValueError as e:
    raise ConfigError(f"config.mesh.shape: {e}") from None
  data_par = mesh.shape["data"] * mesh.shape["fsdp"]
  if spec.rollout.batch_size % data_par:
    raise ConfigError(
      f"config.task.prompts_per_step: the batch N = P*G = {spec.rollout.batch_size} must be "
      f"divisible by data*fsdp = {data_par} of the mesh {dict(mesh.shape)}."
    )
  return mesh


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
  rows = sharding.process_rows(global_n, sharding.batch_sharding(mesh))
  return sharding.make_global_batch({k: v[rows] for k, v in batch.items()}, mesh, global_n)


def build_source(spec: RunSpec, maker, key, model_cfg, graphdef, tokenizer, workdir, interrupt=None):
  from vcpo_jax.rollout.lag import LagSource

  if spec.mode in ("sync", "lag"):
    return LagSource(maker, spec.k if spec.mode == "lag" else 0, key)
  from vcpo_jax.rollout.async_ import AsyncSource

  if jax.process_count() > 1:  # one sampler per host, a per-step agreement (rollout/multihost.py)
    from vcpo_jax.rollout.multihost import MultiHostAsyncSource

    AsyncSource = MultiHostAsyncSource
  return AsyncSource(spec, key, model_cfg, graphdef, tokenizer, maker, workdir=workdir, interrupt=interrupt)


def _state_tree(state, source):
  """(tree, versions, queued metadata): the arrays a checkpoint saves and the JSON it records about them.

  tree["queued"]: async mode's received-but-unconsumed batches (AsyncSource.queued_state); an empty list adds
  no leaves, so checkpoints without queued batches (every other mode) keep their layout."""
  versions, plist = source.state()
  queued, queued_meta = source.queued_state() if hasattr(source, "queued_state") else ([], [])
  return {"train": state, "versions": plist, "queued": queued}, versions, queued_meta


def _eval_metrics(rec: dict) -> dict:
  """The metrics.jsonl / checkpoint-ranking scalars of one evaluation.evaluate record."""
  return {
    "eval/accuracy": rec["mean_at_n"],
    "eval/mean_reward": rec["mean_reward"],
    **{f"eval/pass_at_{k}": v for k, v in rec["pass_at_k"].items()},
  }


def _save(ckpt, step, state, source, writer, eval_metrics, force=False, final=False):
  """Saves the checkpoint at `step` (after the rows it covers are stored); `final`: the run's last, whose
  meta keeps the final evaluation so that a rerun of the finished run neither repeats nor re-logs it."""
  if step in ckpt.all_steps():  # e.g. a signal right after a periodic save: that checkpoint is current
    return
  writer.flush()  # every row this checkpoint covers is stored before it (object stores buffer rows)
  tree, versions, queued_meta = _state_tree(state, source)
  meta = {"step": step, "versions": versions, "queued": queued_meta, "wall_time": writer.wall_time}
  if final:
    meta["final_eval"] = {k: float(v) for k, v in eval_metrics.items()}
  ckpt.save(step, tree, meta, metrics=eval_metrics, force=force)
  ckpt.wait()


def _restore(ckpt, step, state, source):
  saved = ckpt.restore_meta(step)
  queued_meta = saved.get("queued", [])  # checkpoints from before queued batches were kept have none
  if queued_meta and not hasattr(source, "load_queued"):
    raise ValueError(
      f"the checkpoint at step {step} holds {len(queued_meta)} queued async batches; resume it with "
      "mode='async', or start this run in a fresh workdir."
    )
  queued = source.queued_template(len(queued_meta)) if queued_meta else []
  template = {"train": state, "versions": [state.params for _ in saved["versions"]], "queued": queued}
  tree, meta = ckpt.restore(step, template)
  source.load_state(meta["versions"], tree["versions"])
  if queued_meta:
    source.load_queued([{k: np.asarray(v) for k, v in b.items()} for b in tree["queued"]], queued_meta)
  return tree["train"], meta
