"""Async mode: a spawned sampler process, bounded staleness, failure handling, no shared-memory leaks.

The model is tiny and every wait has a timeout, so a bug fails a test instead of hanging it. The
sampler is a fresh spawned interpreter: monkeypatches of this process do not reach it, so these
tests use the real countdown reward.
"""

import os
import signal
import time

import jax
import pytest

from tests import fixtures
from vcpo_jax import metrics as metrics_lib
from vcpo_jax import run_config, trainer
from vcpo_jax.rollout import async_
from vcpo_jax.rollout.common import RolloutMaker
from vcpo_jax.sampler import Sampler


def _tiny(**overrides):
  # timeout_s: only a hung sampler reaches it (compilation on a loaded machine is slow)
  return fixtures.tiny_countdown_config(**{"mode": "async", "lag.k": 2, "async_.timeout_s": 120.0, **overrides})


def _source(config) -> async_.AsyncSource:
  """An AsyncSource built the way trainer.run builds it, without the learner."""
  # check_prompts=False: a test below makes the worker fail on a prompt longer than the bucket.
  spec = run_config.parse_config(config, check_prompts=False)
  model_cfg, tokenizer, graphdef, params = trainer.build_policy(spec)
  problems = spec.task_object().make_problems("train", spec.rollout.num_train_problems, spec.seed)
  sampler = Sampler(
    graphdef,
    model_cfg,
    trainer.make_sampler_cfg(
      spec,
      tokenizer,
      temperature=spec.temperature,
      top_p=spec.top_p,
      top_k=spec.top_k,
      max_new_tokens=spec.rollout.max_new_tokens,
    ),
  )
  maker = RolloutMaker(spec.rollout, tokenizer, sampler, problems)
  return async_.AsyncSource(spec, jax.random.key(spec.seed), model_cfg, graphdef, tokenizer, maker), params


def _shm_mapped_by(pid: int) -> set[str]:
  """/dev/shm objects (segments, semaphores) that process `pid` has mapped."""
  with open(f"/proc/{pid}/maps") as f:
    return {line.split()[-1] for line in f if "/dev/shm/" in line}


def _assert_removed(paths):
  assert paths, "the source should own shared-memory objects while running"
  left = [p for p in paths if os.path.exists(p)]
  assert not left, f"shared-memory objects left behind: {left}"


def test_async_run_bounded_lag_and_clean_exit(tmp_path, monkeypatch):
  """trainer.run in async mode: every row's version in [step - k, step], metrics logged, nothing leaked."""
  k, steps = 2, 5
  built, seen, paths = fixtures.record_sources(monkeypatch)
  workdir = str(tmp_path / "run")
  summary = trainer.run(_tiny(steps=steps, **{"lag.k": k}), workdir)
  assert summary["step"] == steps
  (src,) = built
  assert isinstance(src, async_.AsyncSource)
  assert [s for s, _, _ in seen] == list(range(steps))
  for step, versions, info in seen:
    assert ((step - k <= versions) & (versions <= step)).all(), (step, versions)
    assert info["lag_max"] <= k and info["lag_min"] >= 0
    assert 0.0 <= info["sampler_idle_frac"] <= 1.0 and info["learner_wait_s"] >= 0.0
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/lag_max" in r]
  assert [r["step"] for r in recs] == list(range(1, steps + 1))
  assert all(0 <= r["train/lag_min"] <= r["train/lag_mean"] <= r["train/lag_max"] <= k for r in recs)
  assert all("time/sampler_idle_frac" in r and "time/learner_idle_frac" in r for r in recs)
  # close() stopped the worker cleanly (stop message, exit code 0) and removed every segment / semaphore.
  assert src.proc.exitcode == 0
  _assert_removed(paths)


def test_staleness_bound_pauses_the_sampler_then_kill_is_reported_and_nothing_leaks():
  """With only version 0 published the worker makes batches 0..k and then waits (a learner wait times out
  with a clear message); after SIGKILL of the worker the learner fails fast, naming the signal."""
  k = 2
  src, params = _source(_tiny(steps=20, **{"lag.k": k, "async_.timeout_s": 3.0, "async_.queue_slots": k + 3}))
  try:
    src.publish(params, 0)
    paths = src.resource_paths()
    assert len(paths) == 5  # queue: segment + 2 semaphores; param slot: segment + lock
    for step in range(k + 1):
      batch, info = src.next(step)
      assert (batch["policy_version"] == 0).all() and info["lag_max"] == step
    with pytest.raises(TimeoutError, match="staleness bound"):
      src.next(k + 1)  # the queue has room: only the bound stops the worker
    src.publish(params, 1)
    batch, info = src.next(k + 1)
    assert (batch["policy_version"] == 1).all() and info["lag_max"] == k
    # Everything the worker maps in /dev/shm is owned (and will be removed) by the learner.
    assert _shm_mapped_by(src.pid) <= set(paths)

    os.kill(src.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(async_.SamplerDiedError, match="SIGKILL") as e:
      for step in range(k + 2, 2 * k + 3):  # batches made before the kill are still delivered
        src.next(step)
    assert time.monotonic() - t0 < 30.0
    assert f"pid {src.pid}" in str(e.value)
    with pytest.raises(async_.SamplerDiedError):
      src.publish(params, 2)  # publishing to a dead sampler is an error too
  finally:
    src.close()
  _assert_removed(paths)
  src.close()  # idempotent


def test_worker_exception_reaches_the_learner_with_its_traceback():
  """A failure inside the sampler (here: prompts longer than the bucket) surfaces in next() with the cause."""
  src, params = _source(_tiny(**{"task.max_prompt_len": 4}))
  try:
    src.publish(params, 0)
    paths = src.resource_paths()
    t0 = time.monotonic()
    with pytest.raises(async_.SamplerDiedError, match=r"(?s)exited with code 1.*Traceback.*max_prompt_len"):
      src.next(0)
    assert time.monotonic() - t0 < 60.0  # the worker's imports, not a timeout
  finally:
    src.close()
  _assert_removed(paths)


def test_bad_async_settings_raise_value_errors():
  with pytest.raises(ValueError, match="sampler_cpus"):
    async_.parse_cpus("1,x")
  assert async_.parse_cpus("0, 2-3") == (0, 2, 3)
  src, _ = _source(_tiny(**{"async_.timeout_s": 5.0}))
  with pytest.raises(RuntimeError, match="before any publish"):
    src.next(0)
  with pytest.raises(ValueError, match="lag mode"):
    src.load_state([3], [None])
  assert src.state() == ([], [])
  src.close()


_SIGTERM_SCRIPT = r"""
import json, sys
from tests.test_async import _tiny
from vcpo_jax import trainer
out, workdir = sys.argv[1], sys.argv[2]
build = trainer.build_source
def recording_build_source(*a, **kw):
  src = build(*a, **kw)
  nxt = src.next
  def next_(step):
    batch, info = nxt(step)
    if step == 0:
      json.dump({"pid": src.pid, "paths": src.resource_paths()}, open(out, "w"))
    return batch, info
  src.next = next_
  return src
trainer.build_source = recording_build_source
# checkpoint.every: a periodic save at the interrupted step would collide with the forced one (reported).
trainer.run(_tiny(steps=10_000, **{"checkpoint.every": 10_000}), workdir)
"""


def test_sigterm_to_the_trainer_stops_the_worker_and_removes_segments(tmp_path):
  """SIGTERM mid-run: the trainer checkpoints and exits 130; the worker is gone; /dev/shm is clean."""
  import json
  import subprocess
  import sys

  info_path, workdir = tmp_path / "worker.json", tmp_path / "run"
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen(
    [sys.executable, "-c", _SIGTERM_SCRIPT, str(info_path), str(workdir)],
    cwd=repo,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
  )
  try:
    deadline = time.monotonic() + 240.0  # start-up and compilation on a loaded machine
    metrics = workdir / "metrics.jsonl"
    while not (metrics.exists() and sum("train/lag_max" in l for l in open(metrics)) >= 2):
      assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
      assert time.monotonic() < deadline, "the async run made no progress"
      time.sleep(0.2)
    worker = json.load(open(info_path))
    mapped = _shm_mapped_by(worker["pid"])
    assert mapped and mapped <= set(worker["paths"])
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 130, out[-3000:]
  assert not os.path.exists(f"/proc/{worker['pid']}"), "the sampler process outlived the trainer"
  _assert_removed(worker["paths"])
  recs = [r for r in metrics_lib.read_jsonl(str(workdir / "metrics.jsonl")) if "train/lag_max" in r]
  assert recs and all(0 <= r["train/lag_min"] and r["train/lag_max"] <= 2 for r in recs)
  assert os.path.isdir(workdir / "checkpoints")


_NO_MAIN_GUARD_SCRIPT = r"""
import sys
sys.path.insert(0, {repo!r})
from tests.test_async import _source, _tiny
src, params = _source(_tiny())
src.publish(params, 0)  # in the spawned child this line runs again and fails: no __main__ guard
try:
  src.next(0)
except Exception as e:
  print("LEARNER", type(e).__name__, e)
finally:
  src.close()
"""


def test_script_without_main_guard_fails_clearly_instead_of_hanging(tmp_path):
  """Spawn re-imports the main script in the child; without a __main__ guard the child dies in bootstrap.
  The learner must report it (and Process.start must not block on a large spawn payload)."""
  import subprocess
  import sys

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "no_guard.py"
  script.write_text(_NO_MAIN_GUARD_SCRIPT.format(repo=repo))
  out = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), capture_output=True, text=True, timeout=180)
  assert "LEARNER SamplerDiedError" in out.stdout, (out.stdout + out.stderr)[-3000:]
  assert "exited with code 1" in out.stdout
