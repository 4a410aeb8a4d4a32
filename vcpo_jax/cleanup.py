"""Owner-stamped names for the async mode's shared memory, and removal of what dead runs left behind.

Every shared-memory segment, named semaphore and spawn-argument file the async
mode creates is named

    vcpo-{run}-{pid}-{start}-{kind}-{random}

run: the run's id (hex; `AsyncSource` derives it from the workdir, see `run_id`);
pid, start: the creating (owning) process and its start time in clock ticks
since boot (/proc/PID/stat field 22), so a pid reused by an unrelated process
does not make a dead owner look alive; kind: what it is (`KINDS`). The owner
unlinks everything it created on close, at exit, and (if only the owner is
killed) through multiprocessing's resource tracker. When the whole process
group dies at once (the OOM killer, a container stop: the tracker dies with
it), the names stay in /dev/shm; the next async run (`AsyncSource` calls
`remove_stale()` before creating its own) and

    python -m vcpo_jax.cleanup [--dry-run]

remove the objects whose owner is gone and never those of a live owner.
Unlinking only removes a name: a process that still maps a segment or holds a
semaphore keeps using it, so even a wrong guess could not corrupt a live run.

Scope: Linux (/dev/shm and procfs); owners are judged in the caller's pid
namespace, so processes that share /dev/shm must share the pid namespace too
(the default for one container or host). Nothing but `vcpo-` names is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import secrets
import sys
import tempfile

SHM_DIR = "/dev/shm"
KINDS = {
  "q": "queue segment",
  "qf": "queue semaphore (free slots)",
  "qi": "queue semaphore (items)",
  "p": "parameter-slot segment",
  "pl": "parameter-slot lock",
  "a": "sampler arguments file",
}
# The owner fields of a name; `sem.` is how Linux stores named semaphores in /dev/shm.
_NAME_RE = re.compile(r"^(?:sem\.)?vcpo-([0-9a-f]+)-(\d+)-(\d+)-([a-z]+)-")


def pid_alive(pid: int) -> bool:
  """True if `pid` runs and is not a zombie (a killed, not yet reaped child)."""
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      state = f.read().rsplit(b")", 1)[1].split()[0]
    return state not in (b"Z", b"X")
  except (OSError, IndexError):  # no procfs (macOS): trust os.kill
    return True


def process_start(pid: int) -> int:
  """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22); 0 where unknown."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return int(f.read().rsplit(b")", 1)[1].split()[19])  # fields after "(comm)" start at field 3
  except (OSError, IndexError, ValueError):
    return 0


def run_id(workdir: str | None = None) -> str:
  """8 hex digits naming a run: a hash of the workdir (its absolute path, or the URL as given), random without."""
  if workdir is None:
    return secrets.token_hex(4)
  path = os.fspath(workdir)
  key = path.rstrip("/") if "://" in path else os.path.abspath(path)  # gs://bucket/run: not a local path
  return hashlib.sha1(key.encode()).hexdigest()[:8]


def owner_prefix(run: str) -> str:
  """'vcpo-{run}-{pid}-{start}' for this process: the part of a name that says who owns it."""
  if not re.fullmatch(r"[0-9a-f]+", run):
    raise ValueError(f"run id {run!r} must be lower-case hex digits (cleanup.run_id() makes one).")
  pid = os.getpid()
  return f"vcpo-{run}-{pid}-{process_start(pid)}"


def new_name(run: str, kind: str) -> str:
  """A fresh owner-stamped name, e.g. 'vcpo-1a2b3c4d-4242-987654-q-5e6f7a' (no leading '/')."""
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}: one of {sorted(KINDS)}.")
  return f"{owner_prefix(run)}-{kind}-{secrets.token_hex(3)}"


@dataclasses.dataclass(frozen=True)
class Leftover:
  """One owner-stamped object: where it is, who made it, whether that process still runs."""

  path: str
  run: str
  pid: int
  start: int
  kind: str  # a key of KINDS
  nbytes: int
  alive: bool

  @property
  def what(self) -> str:
    return KINDS.get(self.kind, self.kind)


def owner_alive(pid: int, start: int) -> bool:
  """The owner runs: its pid is alive and (where known on both sides) started at `start`."""
  if not pid_alive(pid):
    return False
  now = process_start(pid)
  return not (start and now and now != start)


def scan(shm_dir: str = SHM_DIR, tmp_dir: str | None = None) -> list[Leftover]:
  """Every owner-stamped object in `shm_dir` (segments, semaphores) and `tmp_dir` (argument files)."""
  out = []
  for d in (shm_dir, tmp_dir or tempfile.gettempdir()):
    try:
      names = sorted(os.listdir(d))
    except OSError:  # no /dev/shm (macOS)
      continue
    for name in names:
      m = _NAME_RE.match(name)
      if m is None or m.group(4) not in KINDS:
        continue
      path = os.path.join(d, name)
      try:
        nbytes = os.stat(path).st_size
      except FileNotFoundError:  # removed meanwhile
        continue
      run, pid, start, kind = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
      out.append(Leftover(path, run, pid, start, kind, nbytes, owner_alive(pid, start)))
  return out


def remove_stale(dry_run: bool = False, shm_dir: str = SHM_DIR, tmp_dir: str | None = None) -> list[Leftover]:
  """Removes (unless `dry_run`) every owner-stamped object whose owner is gone; returns those objects."""
  stale = [x for x in scan(shm_dir, tmp_dir) if not x.alive]
  if not dry_run:
    _remove(stale)
  return stale


def remove_own(shm_dir: str = SHM_DIR, tmp_dir: str | None = None) -> list[Leftover]:
  """Removes every owner-stamped object of this very process (an exit that skips the owners' close)."""
  own = [x for x in scan(shm_dir, tmp_dir) if x.pid == os.getpid()]
  _remove(own)
  return own


def _remove(items: list[Leftover]) -> None:
  for x in items:
    try:
      os.unlink(x.path)  # on Linux the same as shm_unlink / sem_unlink of the name
    except FileNotFoundError:
      pass  # another cleaner was first


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m vcpo_jax.cleanup",
    description="List the async mode's shared memory and argument files; remove those of dead runs.",
  )
  p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
  p.add_argument("--shm-dir", default=SHM_DIR, help=argparse.SUPPRESS)  # tests
  p.add_argument("--tmp-dir", default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  found = scan(a.shm_dir, a.tmp_dir)
  for x in found:
    state = "live owner, kept" if x.alive else ("dead owner, would remove" if a.dry_run else "dead owner, removed")
    print(f"{x.path}  run {x.run}  pid {x.pid}  {x.what}  {x.nbytes} bytes  [{state}]")
  stale = [x for x in found if not x.alive]
  if not a.dry_run:
    _remove(stale)
  verb = "would remove" if a.dry_run else "removed"
  print(
    f"{len(found)} vcpo objects; {verb} {len(stale)} of dead runs "
    f"({sum(x.nbytes for x in stale)} bytes), kept {len(found) - len(stale)} of live runs."
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
