"""Async mode: a crashed or hung sampler process is replaced and training goes on (fault injection).

What a user sees: SIGKILL of the sampler during a run -> the run finishes (every step trained and logged
once, no batch used twice, lags in [0, k], async/sampler_restarts counting the replacements, nothing left in
/dev/shm); past async_.max_sampler_restarts -> the run ends with SamplerDiedError and a checkpoint of the
last completed step. A stopped (SIGSTOP) sampler is replaced once async_.timeout_s passes without a batch.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import fixtures
from tests.test_async import _assert_removed, _source, _subprocesses_share_a_compilation_cache, _tiny  # noqa: F401
from vcpo_jax import cleanup, trainer
from vcpo_jax import metrics as metrics_lib
from vcpo_jax.checkpoint import Checkpointer
from vcpo_jax.rollout import async_


@contextlib.contextmanager
def _closed_clean(src):
  """Runs the block on an open source, then closes it; if the block passed, its shared-memory objects are gone."""
  try:
    yield
    paths = src.resource_paths()
  finally:
    src.close()
  _assert_removed(paths)


def _killing_sources(monkeypatch, kill_at, sig=signal.SIGKILL):
  """Wraps build_source: before learner step s in `kill_at` the current sampler gets `sig`.

  Returns (built, seen, paths, kills): the sources, (step, policy_version, info) per consumed batch, every
  /dev/shm path any of the run's samplers used, and per kill (step, pid, seconds until the first batch made by
  the next sampler was consumed)."""
  seen, paths, kills = [], set(), []

  def next_(src, step, nxt):
    if src.proc is not None:
      paths.update(src.resource_paths())
    if step in kill_at:
      kills.append([step, src.pid, time.monotonic(), None])
      os.kill(src.pid, sig)
      if sig == signal.SIGKILL:
        # Until it has exited the learner may not see the death (on a loaded machine a JAX process takes
        # seconds to go): the next kill would hit the same, dead, sampler instead of its replacement.
        src.proc.join(60.0)
    batch, info = nxt(step)
    paths.update(src.resource_paths())
    if kills and kills[-1][3] is None and info["producer"][0] != kills[-1][1]:
      kills[-1][3] = time.monotonic() - kills[-1][2]  # kill -> first batch of the replacement consumed
    seen.append((step, batch["policy_version"].copy(), info))
    return batch, info

  return fixtures.wrap_sources(monkeypatch, next_), seen, paths, kills


def _run_with_kills(tmp_path, steps, over, kill_at):
  """trainer.run of _tiny(steps, **over) with a SIGKILL to the current sampler before each step in `kill_at`, and
  the checks every such run passes: each step once, in order, from a batch no other step used; every token's
  version in [step - k, step]; one sampler more per kill; each step logged once; a clean exit, nothing left in
  /dev/shm. Returns (the source, the (step, versions, info) records, the kills, the metrics rows, the workdir)."""
  k = over["lag.k"]
  with pytest.MonkeyPatch.context() as mp:
    built, seen, paths, kills = _killing_sources(mp, kill_at=kill_at)
    workdir = str(tmp_path / "run")
    summary = trainer.run(_tiny(steps=steps, **over), workdir)
  assert summary["step"] == steps
  (src,) = built
  assert [s for s, _, _ in seen] == list(range(steps))
  producers = [info["producer"] for _, _, info in seen]
  assert len(set(producers)) == steps  # no batch (sampler pid, its n-th batch) used twice
  assert len({pid for pid, _ in producers}) == 1 + len(kill_at) and src.sampler_restarts == len(kill_at)
  for step, versions, _ in seen:
    assert ((step - k <= versions) & (versions <= step)).all(), (step, versions)
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/lag_max" in r]
  assert [r["step"] for r in recs] == list(range(1, steps + 1))
  assert recs[-1]["async/sampler_restarts"] == len(kill_at)
  assert src.proc.exitcode == 0
  _assert_removed(sorted(paths))  # the eval slots too
  return src, seen, kills, recs, workdir


@pytest.mark.exclusive  # shared-memory leak checks
@pytest.mark.slow
def test_two_sigkills_replace_the_sampler_and_the_run_finishes(tmp_path):
  src, seen, kills, recs, _ = _run_with_kills(tmp_path, 12, {"lag.k": 2}, kill_at={3, 8})  # 8: after new batches
  pids = [info["producer"][0] for _, _, info in seen]
  for s, pid, _, _ in kills:  # the killed sampler's queued batches first, then only the replacement's
    after = pids[s:]
    assert pid not in after[next(i for i, p in enumerate(after) if p != pid) :]
  restarts = [r["async/sampler_restarts"] for r in recs]
  assert restarts == sorted(restarts) and restarts[0] == 0
  for s, pid, _, dt in kills:
    print(f"kill before step {s} (pid {pid}): first batch of the replacement consumed after {dt:.1f} s")


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_sigkilled_sampler_with_inflight_updates_refill_decode_and_background_eval_is_replaced(tmp_path):
  """The shm path with in-flight updates, async_.decode='refill' (the static decode: the tests above) and
  eval.background: SIGKILL before step 3 -> every step once, no batch twice, every token's version in
  [step - k, step] (next() checks it), and every requested background evaluation (steps 0, 2, 4) comes back,
  the one the killed sampler had not returned made by the replacement."""
  over = {"lag.k": 2, "async_.inflight_updates": True, "async_.decode": "refill", "async_.chunk_tokens": 2}
  over.update({"async_.update_every_tokens": 2, "eval.every": 2, "eval.background": True})
  src, _, kills, _, workdir = _run_with_kills(tmp_path, 6, over, kill_at={3})
  assert src._worker_sampler_cfg().decode == "refill"
  bg = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "eval.jsonl")) if r.get("background")]
  assert sorted(r["step"] for r in bg) == [0, 2, 4] and bg[-1]["sampler_pid"] == src.pid, bg
  print(f"[inflight, refill, eval.background] kill before step 3: replacement's first batch after {kills[0][3]:.1f} s")


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_background_eval_the_killed_sampler_had_not_returned_comes_back_from_its_replacement():
  """request_eval(0), then SIGKILL of the sampler before it can evaluate (it is still starting up): its
  replacement evaluates version 0 and eval_results(wait=True) hands over that record, once."""
  from vcpo_jax import run_config
  from vcpo_jax.rollout.process import worker as worker_lib

  cfg = _tiny(steps=4, **{"eval.background": True})
  spec = run_config.parse_config(cfg, check_prompts=False)
  src, params = _source(cfg)
  with _closed_clean(src):
    sampling, problems, protocol = trainer._build_eval(spec, src.tokenizer, None, trainer._buckets(spec), src.maker)
    eval_args = worker_lib.EvalArgs(tuple(problems), protocol, sampling.base, spec.rollout.chat_template)
    src.enable_background_eval(eval_args)
    src.publish(params, 0)
    src.request_eval(0, params)
    first = src.pid
    os.kill(first, signal.SIGKILL)
    src.proc.join(60.0)
    src.next(0)  # the learner sees the death: replaced
    assert src.sampler_restarts == 1 and src.pid != first
    (rec,) = src.eval_results(wait=True)
    assert rec["policy_version"] == 0 and rec["background"] and rec["sampler_pid"] == src.pid
    assert src.eval_results(wait=True) == []


@pytest.mark.exclusive
@pytest.mark.slow
def test_the_transfer_path_replaces_a_sigkilled_sampler_and_the_run_finishes(tmp_path):
  # publish_path='transfer': the replacement pulls the newest offer from the learner's same transfer server
  # over a fresh request pipe; every step once, no batch twice, lags in [0, k], nothing left in /dev/shm.
  from vcpo_jax.rollout.transfer_publish import TransferPublisher

  over = {"lag.k": 1, "async_.publish_path": "transfer", "async_.queue_slots": 1}
  src, _, kills, _, _ = _run_with_kills(tmp_path, 8, over, kill_at={3})
  assert isinstance(src.publisher, TransferPublisher)
  for s, pid, _, dt in kills:
    print(f"[transfer] kill before step {s} (pid {pid}): first batch of the replacement consumed after {dt:.1f} s")


@pytest.mark.slow
def test_the_device_path_replaces_a_crashed_sampler_thread_and_the_run_finishes(tmp_path):
  """publish_path='device': the sampler thread raises while making batch 3 -> a fresh thread on the same devices,
  from the newest published version, makes batch 3 again; every step once, no batch twice, lags in [0, k]."""
  from vcpo_jax.rollout import device_publish
  from vcpo_jax.rollout.process import worker as worker_lib

  k, steps = 1, 6
  # the learner on devices 0-3 (N = 8 rows split over them), the sampler thread on 4-7
  over = {"lag.k": k, "async_.publish_path": "device", "async_.sampler_devices": "4,5,6,7", "async_.queue_slots": 1}
  put, crashed = worker_lib._Worker._put, []

  def crashing_put(self, batch, meta):  # the first thread, once: an exception in the sampler thread
    if meta["step"] == 3 and not crashed:
      crashed.append(meta["step"])
      raise RuntimeError("injected: the sampler thread crashed making batch 3")
    return put(self, batch, meta)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(worker_lib._Worker, "_put", crashing_put)
    built, seen, _, _ = _killing_sources(mp, kill_at=set())
    workdir = str(tmp_path / "run")
    summary = trainer.run(_tiny(steps=steps, **over), workdir)
  assert summary["step"] == steps and crashed == [3]
  (src,) = built
  assert isinstance(src.publisher, device_publish.DevicePublisher)
  assert [s for s, _, _ in seen] == list(range(steps))  # every step once, in order
  producers = [info["producer"] for _, _, info in seen]  # (pid, seq, thread): the pid is the learner's
  assert len(set(producers)) == steps and [t for _, _, t in producers] == [1, 1, 1, 2, 2, 2], producers
  assert src.sampler_restarts == 1 and "injected: the sampler thread crashed" in src.restart_causes[0][1]
  for step, versions, _ in seen:
    assert ((step - k <= versions) & (versions <= step)).all(), (step, versions)
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/lag_max" in r]
  assert [r["step"] for r in recs] == list(range(1, steps + 1))  # each step logged once
  assert [r["async/sampler_restarts"] for r in recs] == [0, 0, 0, 1, 1, 1]
  assert src.proc.exitcode == 0  # the replacement thread stopped cleanly at close()


@pytest.mark.slow
def test_the_device_path_does_not_replace_a_hung_sampler_thread():
  """A sampler thread that stops beating (here: blocked before putting batch 2) cannot be stopped: no replacement
  (a second sampler on the same devices), the learner's wait ends with TimeoutError as without the budget."""
  import threading

  import jax

  from vcpo_jax.rollout.process import worker as worker_lib

  over = {"lag.k": 1, "async_.publish_path": "device", "async_.sampler_devices": "2,3", "async_.queue_slots": 1}
  over.update({"async_.heartbeat_timeout_s": 2.0, "async_.timeout_s": 2.0})
  put, release = worker_lib._Worker._put, threading.Event()

  def hanging_put(self, batch, meta):
    if meta["step"] == 2:
      release.wait(120.0)
    return put(self, batch, meta)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(worker_lib._Worker, "_put", hanging_put)
    src, params = _source(_tiny(steps=4, **over), devices=jax.devices()[:2])
    try:
      for step in (0, 1):
        src.publish(params, step)
        src.next(step)
      src.publish(params, 2)
      with pytest.raises(TimeoutError, match="no heartbeat for 2 s|no batch 2 within"):
        src.next(2)
      assert src.sampler_restarts == 0 and src.proc.exitcode is None  # the same thread, still blocked
    finally:
      release.set()  # close() then stops it (it reads "stop" at its next loop point)
      src.close()


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_kill_past_the_restart_budget_ends_the_run_with_a_checkpoint(tmp_path):
  over = {"lag.k": 2, "async_.max_sampler_restarts": 1, "checkpoint.every": 100}
  with pytest.MonkeyPatch.context() as mp:
    built, seen, paths, _ = _killing_sources(mp, kill_at={2, 4})
    workdir = str(tmp_path / "run")
    with pytest.raises(async_.SamplerDiedError, match="SIGKILL"):
      trainer.run(_tiny(steps=10, **over), workdir)
  (src,) = built
  last = seen[-1][0]
  assert src.sampler_restarts == 1 and 4 <= last + 1 < 10
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    assert ckpt.latest_step() == last + 1  # the last completed step
  finally:
    ckpt.close()
  _assert_removed(sorted(paths))


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_run_that_spent_its_restart_budget_resumes_from_its_checkpoint_and_finishes(tmp_path):
  """Past the budget the run checkpoints and exits; rerun in the same workdir, it resumes at the saved step,
  consumes the batches the checkpoint kept (first, once), then makes the rest: every step trained and logged
  once over both attempts, each with the prompts of an uninterrupted run (fold_in(key, step)), lags in [0, k]."""
  k, steps = 2, 10
  config = _tiny(steps=steps, **{"lag.k": k, "async_.max_sampler_restarts": 1, "checkpoint.every": 100})
  workdir = str(tmp_path / "run")
  with pytest.MonkeyPatch.context() as mp:
    _, first, paths, _ = _killing_sources(mp, kill_at={2, 4})
    with pytest.raises(async_.SamplerDiedError, match="SIGKILL"):
      trainer.run(config, workdir)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    saved = ckpt.latest_step()
    queued = ckpt.restore_meta(saved)["queued"]
  finally:
    ckpt.close()
  assert saved == first[-1][0] + 1  # the last completed step
  assert [m["step"] for m in queued] == list(range(saved, saved + len(queued)))

  with pytest.MonkeyPatch.context() as mp:
    built, second, paths2, _ = _killing_sources(mp, kill_at=set())
    summary = trainer.run(config, workdir)  # resumes at `saved`
  assert summary["step"] == steps
  (src,) = built
  assert src.sampler_restarts == 0 and src.proc.exitcode == 0
  seen = first + second
  assert [s for s, _, _ in seen] == list(range(steps))  # every step once, in order, across the two attempts
  n = len(queued)
  assert [info["producer"] for _, _, info in second[:n]] == [(m["sampler_pid"], m["seq"]) for m in queued]
  assert all(info["restored"] for _, _, info in second[:n]) and not any(info["restored"] for _, _, info in second[n:])
  producers = [info["producer"] for _, _, info in seen]
  assert len(set(producers)) == steps  # no batch used twice: the kept ones are not made again
  for step, versions, info in seen:
    assert ((step - k <= versions) & (versions <= step)).all(), (step, versions)
    assert list(info["problem_ids"]) == [p.id for p in src.maker.problems_for_step(step)]  # the data order
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/lag_max" in r]
  assert [r["step"] for r in recs] == list(range(1, steps + 1))  # each step logged once
  _assert_removed(sorted(paths | paths2))


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_stopped_sampler_is_replaced_after_timeout_s():
  """SIGSTOP: no batch within async_.timeout_s (the bound allows one) -> killed and replaced."""
  k = 2
  src, params = _source(_tiny(steps=8, **{"lag.k": k, "async_.timeout_s": 3.0, "async_.queue_slots": 1}))
  with _closed_clean(src):
    src.publish(params, 0)
    src.next(0)
    first = src.pid
    os.kill(first, signal.SIGSTOP)
    for step in range(1, 5):
      src.publish(params, step)
      batch, info = src.next(step)
      assert (step - k <= batch["policy_version"]).all() and (batch["policy_version"] <= step).all()
    assert src.sampler_restarts == 1 and src.pid != first
    assert info["producer"][0] == src.pid


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_stopped_sampler_is_replaced_once_its_heartbeat_goes_stale():
  """SIGSTOP: its heartbeat stops, and after async_.heartbeat_timeout_s (far below timeout_s, the batch timeout,
  which would otherwise replace it) the learner replaces it, naming the heartbeat and the stop."""
  k = 2
  over = {"lag.k": k, "async_.heartbeat_timeout_s": 5.0, "async_.timeout_s": 120.0, "async_.queue_slots": 1}
  src, params = _source(_tiny(steps=8, **over))
  with _closed_clean(src):
    src.publish(params, 0)
    src.next(0)
    first = src.pid
    os.kill(first, signal.SIGSTOP)
    t0, replaced_s = time.monotonic(), None
    for step in range(1, 5):
      src.publish(params, step)
      batch, info = src.next(step)
      assert (step - k <= batch["policy_version"]).all() and (batch["policy_version"] <= step).all()
      if replaced_s is None and info["producer"][0] != first:
        replaced_s = time.monotonic() - t0
    assert src.pid != first and info["producer"][0] == src.pid
    assert [pid for pid, _ in src.restart_causes] == [first]
    cause = src.restart_causes[0][1]
    assert "no heartbeat for 5 s" in cause and "stopped" in cause, cause
    print(f"SIGSTOP -> first batch of the replacement consumed after {replaced_s:.1f} s (heartbeat_timeout_s=5)")


# One async run in a process group of its own (the learner, its sampler, the resource tracker).
_RUN_SCRIPT = """
import json, sys
from tests import fixtures
from vcpo_jax import trainer
trainer.run(fixtures.tiny_countdown_config(**json.loads(sys.argv[2])), sys.argv[1])
"""


@pytest.mark.exclusive
@pytest.mark.slow
def test_sigkill_of_the_whole_process_group_leaves_nothing_in_dev_shm(tmp_path):
  """The sampler has attached and steps are training: SIGKILL to every process of the run at once (the OOM
  killer, `kill -9 -PGID`) leaves no object of the run in /dev/shm or the temp dir (every name was removed once
  both sides held it open), without waiting for a later run; the rerun in the same workdir finishes clean."""
  steps = 12
  over = {"mode": "async", "lag.k": 2, "async_.timeout_s": 120.0, "steps": steps}
  workdir = str(tmp_path / "run")
  run = cleanup.run_id(workdir)
  ours = lambda: [x.path for x in cleanup.scan() if x.run == run]  # noqa: E731
  env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
  with open(tmp_path / "run.log", "w") as out:
    proc = subprocess.Popen(
      [sys.executable, "-c", _RUN_SCRIPT, workdir, json.dumps(over)],
      env=env,
      stdout=out,
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
  try:
    rows = os.path.join(workdir, "metrics.jsonl")
    deadline = time.monotonic() + 600.0  # hang guard: start-up and compilation of both processes
    while not (os.path.exists(rows) and "train/lag_max" in open(rows).read()):
      assert proc.poll() is None, open(tmp_path / "run.log").read()[-3000:]
      assert time.monotonic() < deadline, "the run trained no step"
      time.sleep(0.1)
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
  assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
  assert not ours(), "left behind by the SIGKILLed process group"

  with pytest.MonkeyPatch.context() as mp:
    built, seen, paths, _ = _killing_sources(mp, kill_at=set())
    summary = trainer.run(_tiny(**{k: v for k, v in over.items() if k != "mode"}), workdir)
  assert summary["step"] == steps and built[0].proc.exitcode == 0
  _assert_removed(sorted(paths))
  assert not ours()


def test_restart_settings_are_checked_in_config_parsing():
  from vcpo_jax import run_config

  with pytest.raises(Exception, match=r"async_\.max_sampler_restarts.*-1.*int >= 0"):
    run_config.parse_config(_tiny(**{"async_.max_sampler_restarts": -1}))
  with pytest.raises(Exception, match=r"async_\.restart_window_s.*0.*seconds > 0"):
    run_config.parse_config(_tiny(**{"async_.restart_window_s": 0.0}))
  with pytest.raises(Exception, match=r"async_\.heartbeat_timeout_s.*-1.*seconds >= 0"):
    run_config.parse_config(_tiny(**{"async_.heartbeat_timeout_s": -1.0}))
  run_config.parse_config(_tiny(**{"async_.publish_path": "transfer"}))


def test_the_device_path_says_at_start_up_that_a_hung_sampler_thread_is_not_replaced(caplog):
  import jax

  from tests.test_async import _source

  device = {"async_.publish_path": "device", "async_.sampler_devices": "2,3"}
  with caplog.at_level("INFO", logger="vcpo_jax"):
    src, _ = _source(_tiny(**device), devices=jax.devices()[:2])
    src.close()
  assert any("a sampler thread that crashes is replaced" in r.message for r in caplog.records)
  assert any("one that hangs cannot be stopped, and ends the run" in r.message for r in caplog.records)
