"""The driver side of the benchmarks that time this tree against older commits (learner_step, sampler_ab).

A base commit is unpacked with `git archive` into a directory (`unpack`); each tree then runs a worker process
of the calling benchmark's own file (`start`: `--worker`, one CPU device, the tree first on PYTHONPATH and as
the working directory), which answers each request with one JSON line (`reply`). Only the drivers import this
file: a worker runs against an older tree, whose benchmarks/ need not have it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args: str) -> str:
  """The stripped stdout of `git ARGS` in this repository."""
  return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def unpack(commit: str, into: str) -> str:
  """`git archive COMMIT` unpacked into the new directory `into`; returns `into`."""
  os.makedirs(into)
  archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
  subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
  return into


def start(script: str, tree: str, flags: Sequence[str]) -> subprocess.Popen:
  """`python SCRIPT --worker FLAGS` with `tree`'s code, on one CPU device (as the CPU default runs), its stdin
  and stdout pipes open for requests and replies."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=tree)
  env.pop("XLA_FLAGS", None)  # one CPU device
  cmd = [sys.executable, os.path.abspath(script), "--worker", *flags]
  return subprocess.Popen(cmd, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def reply(proc: subprocess.Popen) -> dict:
  """The worker's next JSON line (its other output is skipped); RuntimeError when it exits first."""
  for line in proc.stdout:
    if line.startswith("{"):
      return json.loads(line)
  raise RuntimeError(f"worker exited with {proc.wait()} (see its stderr above)")
