"""Asynchronous rollouts: a sampler process streams batches to the learner through shared memory.

    learner (this process)                         sampler (spawned, worker.py)
    publish(params, v) --ParamSlot (v, weights)--> newest params, once v >= b - k
    next(b) <----------ShmQueue (batch b)--------- RolloutMaker.make(params, b, fold_in(key, b), v)

Staleness is bounded PipelineRL-style: the worker makes batch b only once the
learner has published version >= b - k, and the learner consumes batch b at
step b, so every row's lag b - policy_version is in [0, k]. The worker pauses
rather than produce a staler batch; nothing is generated and then discarded.
Unlike `lag` mode the lag is not exact (the worker takes the newest version it
finds), so runs are not bit-for-bit reproducible; `state()` keeps nothing.

Devices: `async_cfg["sampler_devices"]` (e.g. "2,3") is written to the child's
CUDA_VISIBLE_DEVICES before it imports JAX, so on a multi-GPU host the sampler
runs on its own GPUs (the learner should then be given the others). On TPU and
elsewhere pass platform variables through `async_cfg["sampler_env"]` (a dict,
e.g. {"TPU_VISIBLE_CHIPS": "3"}). On CPU the sampler is simply another process;
`async_cfg["sampler_cpus"]` (e.g. "1" or "2-3") pins it to those cores with
sched_setaffinity (XLA's CPU thread pools follow XLA_FLAGS, inherited).

Failures: every learner wait (the queue in `next`, the parameter slot's lock in
`publish`) runs in slices of at most `_POLL_S`; between slices it calls the
trainer's `interrupt()` (which raises once SIGINT / SIGTERM has arrived, so the
trainer checkpoints and exits 130 even while the sampler hangs or is stopped)
and checks the worker (exit code, error pipe). A dead worker raises
`SamplerDiedError` naming the exit code or signal and the worker's traceback
within a fraction of a second, and no batch within `async_cfg["timeout_s"]`
(the first batch, which includes the worker's start-up and compilation:
`async_cfg.get("startup_timeout_s", 600)`) raises TimeoutError saying what the
worker is waiting for (and whether it is stopped, e.g. by SIGSTOP). `close()`
(normal exit, exception, or the trainer's signal handling) stops the worker
within about `2 * _STOP_GRACE_S` (stop message, then SIGTERM, then SIGKILL; a
stopped worker gets SIGKILL at once) and removes every shared-memory segment
and semaphore. If the learner itself is killed the worker gets SIGKILL from the
kernel (PR_SET_PDEATHSIG) and the resource tracker unlinks the segments.

Leftovers: every segment, semaphore and the spawn-argument file are named with
the run id (a hash of the workdir) and the learner's pid (`vcpo_jax.cleanup`).
When the whole process group is SIGKILLed (OOM killer, container stop) the
resource tracker dies too; the next async run removes what dead runs left
(`cleanup.remove_stale()`, logged), as does `python -m vcpo_jax.cleanup`. The
worker deletes the argument file as soon as it has read it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue as queue_lib
import signal
import tempfile
import time
import weakref

import jax
import numpy as np

from vcpo_jax import cleanup
from vcpo_jax.rollout import worker as worker_lib
from vcpo_jax.rollout.common import lag_stats
from vcpo_jax.rollout.param_slot import ParamSlot
from vcpo_jax.rollout.shm_queue import SPAWN, BatchSchema, Field, PeerDiedError, QueueFinished, ShmQueue

_POLL_S = 0.25  # learner-side wait slice: between slices it checks interrupt(), the worker and the deadline
# close(): how long to wait for the stop message to be obeyed (a worker inside generation only reads it when
# the batch is done), then for SIGTERM; short enough that a signal still exits within a few seconds.
_STOP_GRACE_S = 1.0

log = logging.getLogger("vcpo_jax")


class SamplerDiedError(RuntimeError):
  """The async sampler process exited while the learner depended on it."""


def batch_schema(n: int, t: int) -> BatchSchema:
  """The queue schema of one rollout Batch (rollout/common.py): N rows, T columns, fixed shapes."""
  nt = (n, t)
  return BatchSchema(
    {
      "tokens": Field(np.int32, nt),
      "valid_mask": Field(np.bool_, nt),
      "loss_mask": Field(np.bool_, nt),
      "behavior_logp": Field(np.float32, nt),
      "rewards": Field(np.float32, (n,)),
      "correct": Field(np.float32, (n,)),
      "group_id": Field(np.int32, (n,)),
      "policy_version": Field(np.int32, (n,)),
    },
    {},
  )


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
def _environ(overrides: dict[str, str]):
  """Temporarily set environment variables: a spawned child inherits os.environ at start()."""
  old = {k: os.environ.get(k) for k in overrides}
  os.environ.update(overrides)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def _describe_exit(code: int | None) -> str:
  if code is None:
    return "is still running"
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name} (exit code {code})"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


class AsyncSource:
  """Rollout source backed by a spawned sampler process; same interface as `LagSource`.

  Args:
    spec: the RunSpec (k, steps, async_cfg: queue_slots, timeout_s, sampler_devices, [sampler_cpus,
      sampler_env]).
    key: the run's RNG key; batch b is sampled with fold_in(key, b), as in the other modes.
    model_cfg, graphdef: the policy; the worker rebuilds graphdef from model_cfg (checked here).
    tokenizer: pickled to the worker.
    maker: the learner's RolloutMaker (or MultiTurnRolloutMaker): its rollout config, sampler config,
      problems and, for tool use, its MultiTurnConfig `maker.mt` are sent; the worker rebuilds the same kind.
    workdir: the run's directory; its hash is the run id in every shared-memory name (None: a random id).
    interrupt: called between the slices of every wait; it raises to abandon the wait (the trainer's
      check of its SIGINT / SIGTERM flag). None: waits end only with a batch, a dead worker or a timeout.

  The worker starts at the first `publish(params, v)` and makes batches v, v + 1, ..., spec.steps - 1.
  """

  def __init__(self, spec, key, model_cfg, graphdef, tokenizer, maker, *, workdir=None, interrupt=None):
    if spec.k < 1:
      raise ValueError(f"lag.k={spec.k}: async mode needs a staleness budget k >= 1.")
    cfg = dict(spec.async_cfg)
    self.k, self.end_step = int(spec.k), int(spec.steps)
    self.timeout_s = float(cfg.get("timeout_s", 120.0))
    # The first batch includes the worker's start-up (imports, compilation): it gets a separate allowance.
    self.startup_timeout_s = float(cfg.get("startup_timeout_s", max(600.0, self.timeout_s)))
    for name, v in (("timeout_s", self.timeout_s), ("startup_timeout_s", self.startup_timeout_s)):
      if not v > 0:
        raise ValueError(f"async_.{name}={v} must be positive.")
    self.nslots = int(cfg.get("queue_slots", 4))
    if self.nslots < 1:
      raise ValueError(f"async_.queue_slots={self.nslots} must be >= 1.")
    self.cpus = parse_cpus(cfg.get("sampler_cpus", "") or "")
    env = {str(k): str(v) for k, v in dict(cfg.get("sampler_env") or {}).items()}
    if cfg.get("sampler_devices"):
      env.setdefault("CUDA_VISIBLE_DEVICES", str(cfg["sampler_devices"]))
    self.env = env
    rebuilt, _ = worker_lib.abstract_params(model_cfg)
    if rebuilt != graphdef:
      raise ValueError(
        "async mode: the policy's graphdef differs from transformer.init(model_cfg)'s, which the "
        "sampler process rebuilds; use a model built by vcpo_jax.model.transformer."
      )
    self.model_cfg, self.tokenizer, self.maker = model_cfg, tokenizer, maker
    self.run_id = cleanup.run_id(workdir)
    self._interrupt = interrupt
    self.key_data = np.asarray(jax.random.key_data(key))
    self.key_impl = str(jax.random.key_impl(key))
    n = maker.cfg.batch_size
    self.schema = batch_schema(n, maker.cfg.max_prompt_len + maker.cfg.max_new_tokens)
    # JSON metadata: per-row texts (escaped) and problem ids; the worker drops texts that do not fit.
    self.meta_bytes = 16384 + n * (8 * maker.cfg.max_new_tokens + 64)
    self.queue = self.slot = self.proc = self.conn = None
    self._error: str | None = None
    self._prev_idle = (0.0, 0.0)  # the worker's (idle_s_total, elapsed_s_total) at the previous batch
    self._published = -1
    self._received = 0  # batches taken from the queue
    self._finalizer = None

  # ------------------------------------------------------------------ learner side

  def _start(self, arrays: dict, version: int):
    stale = cleanup.remove_stale()  # what runs killed with their whole process group left behind
    if stale:
      log.warning(
        "async: removed %d shared-memory objects / files (%.1f MB) of dead runs: %s",
        len(stale),
        sum(x.nbytes for x in stale) / 1e6,
        ", ".join(sorted({f"run {x.run} (pid {x.pid})" for x in stale})),
      )
    self.slot = ParamSlot({n: a for n, a in arrays.items()}, run=self.run_id)
    self.slot.publish(arrays, version)  # before the start: the worker's first wait succeeds at once
    self.queue = ShmQueue(self.schema, nslots=self.nslots, meta_bytes=self.meta_bytes, run=self.run_id)
    log.info("async: shared memory of run %s: %s", self.run_id, " ".join(self.resource_paths()))
    self.conn, child_conn = SPAWN.Pipe(duplex=True)
    args = worker_lib.WorkerArgs(
      rollout=self.maker.cfg,
      model_cfg=self.model_cfg,
      sampler_cfg=self.maker.sampler.cfg,
      tokenizer=self.tokenizer,
      problems=tuple(self.maker.problems),
      key_data=self.key_data,
      key_impl=self.key_impl,
      k=self.k,
      first_step=int(version),
      end_step=self.end_step,
      param_names=tuple(arrays),
      meta_bytes=self.meta_bytes,
      cpus=self.cpus,
      multiturn=getattr(self.maker, "mt", None),
    )
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
      args=(self._args_path, self.queue, self.slot, child_conn),
      name="vcpo-async-sampler",
      daemon=False,
    )  # a daemon could not start graders
    with _environ(self.env):
      self.proc.start()
    child_conn.close()
    self.queue.watch(self.proc)
    # Interpreter exit without close() (an uncaught error far away) still stops the worker.
    self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn, self._args_path)

  def publish(self, params, version: int):
    """Makes `params` (after `version` updates) the newest policy for the sampler; starts it the first time."""
    version = int(version)
    leaves = jax.device_get(jax.tree.leaves(params))
    names = worker_lib.param_names(params)
    arrays = {n: np.asarray(a) for n, a in zip(names, leaves)}
    if self.proc is None:
      self._start(arrays, version)
    else:
      self._poll_publish()
      self.slot.publish(arrays, version, poll=self._poll_publish)
    self._published = version

  def _poll_publish(self):
    """Before and between lock-wait slices of publish(): a signal (first) or a dead worker ends the wait."""
    if self._interrupt is not None:
      self._interrupt()
    self._raise_if_dead()

  def next(self, step: int) -> tuple[dict, dict]:
    """Batch `step` from the queue; raises SamplerDiedError / TimeoutError instead of hanging."""
    if self.proc is None:
      raise RuntimeError(
        f"AsyncSource.next({step}) before any publish(): the sampler starts at the first published version. "
        "After a resume, publish the restored parameters (version = the restored step) first."
      )
    t0 = time.monotonic()
    timeout = self.timeout_s if self._received else self.startup_timeout_s
    deadline = t0 + timeout
    item = None
    while item is None:
      if self._interrupt is not None:
        self._interrupt()  # raises (e.g. the trainer's Interrupted) once a signal has arrived
      self._raise_if_error()
      # Exceptions are raised outside the `except` blocks: a chained __context__ would keep the queue's
      # frames (and its semaphores) alive in the traceback after close().
      failure = None
      try:
        item = self.queue.get(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
      except queue_lib.Empty:
        if time.monotonic() >= deadline:
          failure = TimeoutError(self._timeout_message(step, timeout))
      except QueueFinished:
        failure = RuntimeError(
          f"async source: batch {step} requested but the sampler made only batches up "
          f"to spec.steps - 1 = {self.end_step - 1}."
        )
      except PeerDiedError as e:
        failure = self._died_error(f"while the learner waited for batch {step}: {e}")
      if failure is not None:
        if self._interrupt is not None:
          self._interrupt()  # a signal to the whole group may also have ended the sampler: signal first
        raise failure
    wait_s = time.monotonic() - t0
    self._received += 1
    batch, meta = item.arrays, item.meta
    if meta["step"] != step:
      raise RuntimeError(
        f"async source: received batch {meta['step']} at learner step {step}; the learner must "
        "consume batches in order, one per step, starting at the first published version."
      )
    lag = step - batch["policy_version"]
    if lag.min() < 0 or lag.max() > self.k:
      raise RuntimeError(f"async source: batch {step} has lags [{lag.min()}, {lag.max()}] outside [0, {self.k}].")
    idle, elapsed = meta["idle_s_total"], meta["elapsed_s_total"]
    d_idle, d_elapsed = idle - self._prev_idle[0], elapsed - self._prev_idle[1]
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
      metrics=dict(meta.get("metrics") or {}),
    )  # the maker's scalars (multi-turn: rollout/turns_mean, ...)
    return batch, info

  # -- failure reporting

  def _poll_error(self):
    try:
      while self.conn is not None and self.conn.poll():
        kind, text = self.conn.recv()
        if kind == "error":
          self._error = text
    except (EOFError, OSError):
      pass

  def _raise_if_error(self):
    self._poll_error()
    if self._error is not None:
      if self.proc.exitcode is None:
        self.proc.join(1.0)  # it exits right after sending its traceback
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
    name = "timeout_s" if self._received else "startup_timeout_s"
    return (
      f"async source: no batch {step} within async_.{name}={timeout:g} s; {why}. Raise "
      f"async_.{name} if generation is legitimately that slow."
    )

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

  def resource_paths(self) -> list[str]:
    """/dev/shm paths this source owns (segments and semaphores), for leak checks."""
    return (self.queue.resource_paths() if self.queue else []) + (self.slot.resource_paths() if self.slot else [])

  @property
  def pid(self) -> int | None:
    return self.proc.pid if self.proc is not None else None

  def close(self):
    """Stops the worker and removes every shared-memory segment. Idempotent."""
    if self._finalizer is not None:
      self._finalizer()  # runs _shutdown once
    if self.queue is not None:
      self.queue.close()
    if self.slot is not None:
      self.slot.close()
    if self.conn is not None:
      self.conn.close()
    self.queue = self.slot = self.conn = None


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
