"""End-to-end: the real run() for a few steps, crash / resume equivalence of state and logs, URLs, config errors."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import jax
import jax.monitoring
import jax.numpy as jnp
import pytest

from tests import fixtures
from tests.test_metrics import read_tensorboard
from vcpo_jax import fs, rollout, run_config, trainer
from vcpo_jax import metrics as metrics_lib
from vcpo_jax.rollout import common as rollout_common
from vcpo_jax.rollout.lag import LagSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

real_build_source = rollout.build_source


def _dense_score(task, text, reference, extraction=None):
  """A test reward with signal for a random policy: fraction of digits in the response."""
  del task, reference, extraction
  return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def _tiny(**overrides):
  return fixtures.tiny_countdown_config(**{"optim.lr": 1e-2, **overrides})


def _train_records(workdir):
  keys = (
    "train/reward_mean",
    "train/grad_norm",
    "train/ess_ratio",
    "train/lr_scale",
    "train/pg_loss",
    "train/lag_max",
    "train/baseline_mean",
  )
  recs = [r for r in metrics_lib.read_jsonl(fs.join(workdir, "metrics.jsonl")) if "train/pg_loss" in r]
  return [(r["step"],) + tuple(r.get(k) for k in keys) for r in recs]


@pytest.fixture()
def dense_reward(monkeypatch):
  monkeypatch.setattr(
    rollout_common.tasks,
    "score_problems",
    lambda problems, outputs, extraction=None: (
      [_dense_score(p.task, o, p.reference) for p, o in zip(problems, outputs)],
      0,
    ),
  )


class InjectedCrash(RuntimeError):
  pass


def _hook_source(monkeypatch, crash_at=None, on_step=None):
  """Wraps rollout.build_source: source.next(step) calls on_step(step), and raises InjectedCrash at crash_at
  (a crash after `crash_at` updates, their rows logged: what a fault or the OOM killer leaves behind)."""
  build = rollout.build_source

  def hooked_build_source(*a, **kw):
    src = build(*a, **kw)
    nxt = src.next

    def next_(step):
      if on_step is not None:
        on_step(step)
      if step == crash_at:
        raise InjectedCrash(f"injected crash before update {step + 1}")
      return nxt(step)

    src.next = next_
    return src

  monkeypatch.setattr(rollout, "build_source", hooked_build_source)


def _log_rows(workdir):
  """metrics.jsonl as (step, keys) and eval.jsonl as (step, tag, accuracy): what must match a clean run."""
  metrics_rows = [(r["step"], tuple(sorted(r))) for r in metrics_lib.read_jsonl(fs.join(workdir, "metrics.jsonl"))]
  evals = [(r["step"], r["tag"], r["mean_at_n"]) for r in metrics_lib.read_jsonl(fs.join(workdir, "eval.jsonl"))]
  return metrics_rows, evals


@pytest.mark.slow
def test_lag_run_resumes_bit_for_bit_and_logs_each_step_once(tmp_path, dense_reward, monkeypatch):
  """A clean 6-step lag run (file:// workdir) against the same run crashed and rerun in a memory:// workdir:

  attempt 1 crashes after update 1 (no checkpoint yet); attempt 2 starts afresh, checkpoints at 3,
  evaluates at 4 and crashes; attempt 3 resumes from step 3 and finishes; attempt 4 reruns the finished
  run. The training rows equal the clean run's bit for bit (parameters, optimizer and kept versions
  restored), every log (metrics.jsonl, eval.jsonl, tensorboard) holds each step once, as the clean run
  does, and eval.jsonl has no evaluation of a discarded timeline. The clean run (which evaluates at 0, 4
  and 6, checkpoints at 3 and 6, and times the plain gradient step every 2 steps) compiles nothing after
  its first update. Orbax cannot write to memory://, so attempt 2-4's checkpoints go to a file:// URL.
  """
  base = dict(mode="lag", **{"lag.k": 2, "checkpoint.every": 3, "eval.every": 4, "method": "vcpo"})
  assert _tiny().log.norm_overhead_every == 2  # the smoke preset exercises the opt-in timing
  compiles, armed = [], []

  def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration" and armed:
      compiles.append(duration)

  _hook_source(monkeypatch, on_step=lambda step: armed.append(step) if step >= 1 else None)
  full = f"file://{tmp_path}/full"
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    trainer.run(_tiny(steps=6, **base), full)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert armed and compiles == [], f"{len(compiles)} compiles after the first update"

  part = f"memory://test_trainer/{uuid.uuid4().hex}"
  real_checkpointer = trainer.Checkpointer
  monkeypatch.setattr(
    trainer, "Checkpointer", lambda d, **kw: real_checkpointer(d.replace(part, f"file://{tmp_path}/part"), **kw)
  )
  monkeypatch.chdir(tmp_path)
  # The four attempts compile the same programs: from the second on they load them from the persistent
  # cache (the clean run above, whose compilations are counted, ran without it).
  with fixtures.persistent_compilation_cache(tmp_path / "jax_cache"):
    for crash_at in (1, 4):
      _hook_source(monkeypatch, crash_at=crash_at)
      with pytest.raises(InjectedCrash):
        trainer.run(_tiny(steps=6, **base, **{"log.plots": True}), part)
    monkeypatch.setattr(rollout, "build_source", real_build_source)
    trainer.run(_tiny(steps=6, **base, **{"log.plots": True}), part)
    after_finish = _log_rows(part)
    trainer.run(_tiny(steps=6, **base, **{"log.plots": True}), part)  # a finished run: nothing logged again

  a, b = _train_records(full), _train_records(part)
  assert [r[0] for r in a] == [1, 2, 3, 4, 5, 6]
  assert a == b
  # The run learned something (a zero gradient would make resume equality vacuous) and was stale.
  assert max(r[2] for r in a) > 0
  assert max(r[6] for r in a) == 2
  rows_full, evals_full = _log_rows(full)
  assert [e[:2] for e in evals_full] == [(0, None), (4, None), (6, "final")]
  assert [r[0] for r in rows_full] == [0, 1, 2, 3, 4, 5, 6, 6]  # step 6: the last update, the final eval
  assert _log_rows(part) == (rows_full, evals_full) == after_finish
  tb = [(t, s) for t, s, _ in read_tensorboard(fs.join(part, "tb")) if t == "train/pg_loss"]
  assert tb == [("train/pg_loss", s) for s in range(1, 7)]
  summary = json.loads(fs.read_text(fs.join(part, "summary.json")))
  assert summary["step"] == 6 and summary["eval/accuracy"] == evals_full[-1][2]
  for name in ("config.json", "plots/reward.png", "plots/lag.png"):
    assert fs.exists(fs.join(part, name)), name
  recorded = json.loads(fs.read_text(fs.join(part, "config.json")))
  assert recorded["lag"]["k"] == 2 and recorded["optim"]["lr"] == 1e-2  # the config, as run
  prov = recorded["provenance"]  # and what ran it (vcpo_jax.provenance; its test checks the values)
  assert prov["versions"]["jax"] == jax.__version__ and prov["devices"]["count"] == len(jax.devices())
  assert set(prov) >= {"git", "cpu_model", "xla_flags", "versions", "devices"}
  assert set(os.listdir(tmp_path)) - {"jax_cache"} == {"full", "part"}  # no ./memory:/ directory
  assert sorted(os.listdir(tmp_path / "part" / "checkpoints")) == ["3", "6"]


def test_remote_workdir_without_its_backend_is_one_clear_line(tmp_path, monkeypatch):
  """gs:// without gcsfs: one line naming the package, before anything is built or written locally."""
  if importlib.util.find_spec("gcsfs") is not None:
    pytest.skip("gcsfs is installed")
  monkeypatch.chdir(tmp_path)
  with pytest.raises(fs.MissingDependency, match="pip install gcsfs") as e:
    trainer.run(_tiny(), "gs://bucket/run")
  assert "\n" not in str(e.value)
  assert os.listdir(tmp_path) == []  # the bug made ./gs:/bucket/run here


def test_lag_source_copies_only_when_lagged():
  """k = 0 samples before the update that donates the parameters: it keeps a reference, k > 0 a copy.
  The newest version (the learner's own parameters) is never checkpointed twice."""
  params = {"w": jnp.arange(3.0)}
  sync = LagSource(maker=None, k=0, key=jax.random.key(0))
  sync.publish(params, 0)
  assert sync.versions[0]["w"] is params["w"]
  sync.publish({"w": params["w"] + 1}, 1)
  assert sorted(sync.versions) == [1] and sync.state() == ([], [])
  lag = LagSource(maker=None, k=2, key=jax.random.key(0))
  for v in range(4):
    lag.publish({"w": params["w"] + v}, v)
  assert sorted(lag.versions) == [1, 2, 3]
  assert lag.versions[3]["w"] is not params["w"]
  versions, kept = lag.state()
  assert versions == [1, 2] and [float(p["w"][0]) for p in kept] == [1.0, 2.0]


BAD_CONFIGS = [
  ({"lag.k": -1, "mode": "lag"}, "lag.k"),
  ({"method": "ppo_magic"}, "config.method"),
  ({"method.advantage": "foo"}, "config.method.advantage='foo': unknown advantage estimator"),
  ({"task.group_size": 1}, "task.group_size"),
  ({"mesh.shape": (3, 1, 1)}, "divisible"),
  ({"model.checkpoint": "/nonexistent/ckpt"}, "model.checkpoint"),
  ({"method": "clip", "method.weights.lower": 3.0, "method.weights.upper": 2.0}, "config.method.weights.lower=3.0"),
  ({"mode": "turbo"}, "config.mode"),
  ({"mode": "sync", "lag.k": 4}, "mode='lag'"),
  ({"mode": "async", "lag.k": 0}, "k >= 1"),
  ({"sampler.temperature": 0.0}, "sampler.temperature"),
  ({"optim.lr": -1.0}, "optim.lr"),
  ({"task.name": "chess"}, "task.name"),
  ({"eval.pass_at_k": (1, 8), "eval.n": 3}, "pass_at_k"),
  ({"learner.on_nonfinite": "ignore"}, "on_nonfinite"),
  ({"learner.grad_path": "magic"}, "grad_path"),
  ({"task.data_path": "/no/such/file.parquet"}, "task.data_path"),
  ({"eval.dataset": "chess"}, "eval.dataset"),
  ({"eval.data_path": "/no/such/test.jsonl"}, "eval.data_path"),
]


@pytest.mark.parametrize("overrides,needle", BAD_CONFIGS, ids=[n for _, n in BAD_CONFIGS])
def test_bad_config_is_a_clear_error(overrides, needle):
  with pytest.raises(run_config.ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
    run_config.parse_config(_tiny(**overrides))


def test_bad_config_fails_before_anything_is_built(tmp_path):
  with pytest.raises(run_config.ConfigError):
    trainer.run(_tiny(**{"lag.k": -3, "mode": "lag"}), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")


def _read(path):
  with open(path) as f:
    return f.read()


@pytest.mark.slow
def test_resume_with_changed_trajectory_fields_is_refused_unless_allowed(tmp_path, monkeypatch):
  """The checkpoint stores the config's fingerprint; a rerun with another learning rate is refused before
  anything is built (config.json untouched), one changing only eval / log fields and `steps` is not, and
  allow_config_change continues and records each config with the steps it governed."""
  built = []
  monkeypatch.setattr(
    trainer.policy, "build_policy", lambda *a, _real=trainer.policy.build_policy, **k: built.append(1) or _real(*a, **k)
  )
  workdir = str(tmp_path / "run")
  base = {"checkpoint.every": 2, "log.plots": False}
  trainer.run(_tiny(steps=2, **base), workdir)
  ckpt = trainer.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    saved = ckpt.restore_meta(2)["config_fingerprint"]
  finally:
    ckpt.close()
  assert saved["optim.lr"] == 1e-2 and "steps" not in saved and "eval.every" not in saved
  record = _read(os.path.join(workdir, "config.json"))
  n_built = len(built)

  with pytest.raises(run_config.ConfigError) as e:
    trainer.run(_tiny(steps=3, **base, **{"optim.lr": 1e-3, "seed": 7}), workdir)
  msg = str(e.value)
  assert "\n" not in msg and "step 2" in msg and "--allow_config_change" in msg
  assert "config.optim.lr: 0.01 -> 0.001" in msg and "config.seed: 0 -> 7" in msg
  assert "steps" not in msg.replace("with its steps", "")
  assert len(built) == n_built  # refused before the policy was built
  assert _read(os.path.join(workdir, "config.json")) == record

  # Logging, evaluation cadence and a larger step count leave the trajectory alone: no refusal.
  trainer.run(_tiny(steps=3, **base, **{"eval.every": 1, "log.progress": False}), workdir)
  assert "config_history" not in json.loads(_read(os.path.join(workdir, "config.json")))

  summary = trainer.run(_tiny(steps=4, **base, **{"optim.lr": 1e-3}), workdir, allow_config_change=True)
  assert summary["step"] == 4
  rec = json.loads(_read(os.path.join(workdir, "config.json")))
  assert rec["optim"]["lr"] == 1e-3 and rec["from_step"] == 3
  [old] = rec["config_history"]
  assert old["steps"] == [0, 3] and old["config"]["optim"]["lr"] == 1e-2
  assert old["changed_after"] == {"optim.lr": {"from": 1e-2, "to": 1e-3}}
  # The new checkpoint holds the new fingerprint: the same rerun now goes through without the opt-in.
  trainer.run(_tiny(steps=4, **base, **{"optim.lr": 1e-3}), workdir)


def test_unwritable_workdir_is_a_config_error_before_anything_is_built(tmp_path):
  """A workdir that is a file, lies under a file, or cannot be created: one ConfigError line naming it."""
  (tmp_path / "f").write_text("x")
  for wd, reason in [
    (tmp_path / "f", "a file of that name exists"),
    (tmp_path / "f" / "run", "Not a directory"),
    ("/proc/self/vcpo_run", "cannot write there"),
  ]:
    with pytest.raises(run_config.ConfigError, match=f"--workdir='{wd}': cannot write there") as e:
      trainer.run(_tiny(), str(wd))
    assert reason in str(e.value) and "\n" not in str(e.value)


def _stderr_after_signal(proc, marker: str, delay: float, sig=signal.SIGINT, timeout=240.0):
  """Waits for `marker` on proc's stderr, sends `sig` `delay` s later; (seconds to exit, stderr lines after it)."""
  lines, seen = [], threading.Event()

  def read():
    for line in proc.stderr:
      lines.append((time.monotonic(), line.rstrip()))
      if marker in line:
        seen.set()

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  assert seen.wait(timeout), "\n".join(ln for _, ln in lines[-30:])
  time.sleep(delay)
  sent = time.monotonic()
  proc.send_signal(sig)
  try:
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  reader.join(10)
  return time.monotonic() - sent, [ln for t, ln in lines if t >= sent and ln.strip()]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_warm_start_exits_130_at_once_with_one_line(tmp_path, sig):
  """main.py's handlers are in place before its imports: a signal while the warm start trains (a smoke run,
  its cache empty) ends the process with exit 130 within 3 s (a loaded machine: 10) and one line on stderr,
  nothing written to the warm-start cache (a rerun trains it again) and no checkpoint."""
  cache, workdir = tmp_path / "sft_cache", tmp_path / "run"
  cmd = [sys.executable, "main.py", "--config=configs/countdown.py:smoke", f"--workdir={workdir}"]
  cmd += ["--config.sft.steps=400", f"--config.sft.cache_dir={cache}", "--config.log.progress=False"]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stderr=subprocess.PIPE, text=True)
  elapsed, after = _stderr_after_signal(proc, "policy:", 1.0, sig)  # logged just before the warm start
  print(f"{signal.Signals(sig).name} during the warm start -> exit {proc.returncode} in {elapsed:.2f} s: {after}")
  assert proc.returncode == 130 and len(after) == 1 and "nothing trained" in after[0], after
  assert elapsed < 10.0
  assert not list(cache.glob("*.safetensors")) and not (workdir / "checkpoints").exists()


_WATCHDOG_SCRIPT = """
import os, signal, sys, time
from vcpo_jax import trainer
signals = trainer._Signals(grace_s=0.5)
if sys.argv[1] == "trained":
  signals.trained()
os.kill(os.getpid(), signal.SIGINT)
t0 = time.monotonic()
while time.monotonic() - t0 < 3.0:  # a phase that does not call check() (a compile, an evaluation)
  pass
print("phase over", flush=True)
"""


def test_the_watchdog_ends_a_start_up_that_does_not_act_on_a_signal_and_never_a_trained_run():
  """_Signals(grace_s): a signal that the run has not acted on within grace_s ends the process (one line, 130)
  while nothing is trained; after trained() the run acts on it itself (here: it never does, and finishes)."""
  run = lambda phase: fixtures.run_python(["-c", _WATCHDOG_SCRIPT, phase], timeout=120)
  t0 = time.monotonic()
  r = run("start-up")
  assert r.returncode == 130 and r.stdout == "", (r.stdout, r.stderr)
  assert r.stderr.strip().splitlines() == [
    "interrupted during start-up (SIGINT): nothing trained yet; exiting with code 130"
  ]
  assert time.monotonic() - t0 < 60
  r = run("trained")
  assert r.returncode == 0 and r.stdout == "phase over\n" and r.stderr == "", (r.stdout, r.stderr)
