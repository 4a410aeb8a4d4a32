"""vcpo_jax.cleanup: owner-stamped shared-memory names; a SIGKILLed process group's leftovers are removed,
a live owner's are kept."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.test_shm_queue import SCHEMA
from vcpo_jax import cleanup
from vcpo_jax.rollout.process.param_slot import ParamSlot
from vcpo_jax.rollout.process.shm_queue import ShmQueue

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A learner stand-in: owns a queue, a parameter slot and an argument file, has a child attached (the
# "sampler") and a resource tracker, then waits to be killed with its whole process group.
_OWNER_SCRIPT = textwrap.dedent("""
    import os, sys, tempfile, time
    from tests.test_shm_queue import SCHEMA, _produce_forever, _start
    from vcpo_jax import cleanup
    from vcpo_jax.rollout.process.param_slot import ParamSlot
    from vcpo_jax.rollout.process.shm_queue import ShmQueue
    if __name__ == "__main__":
      run = sys.argv[1]
      q = ShmQueue(SCHEMA, nslots=2, run=run)
      slot = ParamSlot({"w": ((1000,), "float32")}, run=run)
      fd, args = tempfile.mkstemp(prefix=cleanup.owner_prefix(run) + "-a-", suffix=".pkl")
      os.write(fd, b"x" * 1000); os.close(fd)
      p = _start(_produce_forever, q)
      while q.qsize() < 2:
        time.sleep(0.01)
      print(" ".join(q.resource_paths() + slot.resource_paths() + [args]), flush=True)
      time.sleep(600)
""")


def orphans(run: str) -> list[str]:
  """Paths of the 2 segments, 3 semaphores and 1 argument file a process group left when SIGKILLed as a whole.

  The owner runs in its own session, so killpg reaches it, its child and its resource tracker, and
  nothing of this test process.
  """
  proc = subprocess.Popen(
    [sys.executable, "-c", _OWNER_SCRIPT, run], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
  )
  try:
    paths = proc.stdout.readline().split()
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
  assert len(paths) == 6, paths
  deadline = time.monotonic() + 10.0  # the group's other members die asynchronously
  while (
    time.monotonic() < deadline
    and subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, check=False).stdout
  ):
    time.sleep(0.05)
  left = [p for p in paths if os.path.exists(p)]
  assert left == paths, "a group SIGKILL leaves everything in place (nothing survives to unlink it)"
  return paths


def test_names_carry_run_pid_and_start_and_a_live_owner_is_kept():
  run = cleanup.run_id()
  with ShmQueue(SCHEMA, nslots=2, run=run) as q, ParamSlot({"w": ((8,), np.float32)}, run=run) as slot:
    paths = q.resource_paths() + slot.resource_paths()
    assert len(paths) == 5
    found = {x.path: x for x in cleanup.scan()}
    start = cleanup.process_start(os.getpid())
    assert start > 0
    for p in paths:
      x = found[p]
      assert (x.run, x.pid, x.start, x.alive) == (run, os.getpid(), start, True)
    assert sorted(found[p].kind for p in paths) == ["p", "pl", "q", "qf", "qi"]
    removed = cleanup.remove_stale()
    assert not {x.path for x in removed} & set(paths)
    assert all(os.path.exists(p) for p in paths)  # live: kept
  assert not [p for p in paths if os.path.exists(p)]  # close() removed them


def test_run_id_is_a_stable_hash_of_the_workdir():
  assert cleanup.run_id("/a/b") == cleanup.run_id("/a/b/") != cleanup.run_id("/a/c")
  assert cleanup.run_id("gs://bucket/run") == cleanup.run_id("gs://bucket/run/") != cleanup.run_id("gs://bucket/r")
  assert len(cleanup.run_id()) == 8
  with pytest.raises(ValueError, match="hex"):
    cleanup.owner_prefix("my-run")


def test_a_reused_pid_does_not_keep_a_dead_owner_alive():
  """A name whose pid runs but started at another time (pid reuse) belongs to a dead owner."""
  me, start = os.getpid(), cleanup.process_start(os.getpid())
  assert cleanup.owner_alive(me, start)
  assert not cleanup.owner_alive(me, start + 1)
  assert not cleanup.owner_alive(2**22 + 1, 0)  # above Linux's pid_max: no such process


@pytest.mark.exclusive  # a dead owner's leftovers: another xdist worker's async run would remove them
@pytest.mark.slow
def test_group_sigkill_leftovers_are_removed_and_a_live_owners_kept(tmp_path):
  """SIGKILL of the whole process group leaves 2 segments, 3 semaphores and the argument file; the CLI's
  --dry-run lists them and removes nothing; cleanup removes them, and not this live process's queue."""
  run = cleanup.run_id()
  paths = orphans(run)
  with ShmQueue(SCHEMA, nslots=2, run=run) as live:  # same run id, live owner
    kept = live.resource_paths()
    cli = [sys.executable, "-m", "vcpo_jax.cleanup"]
    out = subprocess.run([*cli, "--dry-run"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for p in paths:
      assert p in out and os.path.exists(p)
    assert all(f"{p}  run {run}  pid {os.getpid()}" in out for p in kept)
    assert "would remove" in out and "live owner, kept" in out
    out = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert not [p for p in paths if os.path.exists(p)], out
    assert all(os.path.exists(p) for p in kept)
  assert not [p for p in kept if os.path.exists(p)]
