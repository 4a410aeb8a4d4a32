"""The launcher of the multi-host tests: one job as n local processes ("hosts") on fake CPU devices.

A test file runs itself as a script in each process: `python <file> <process_id> <port> <extra...>`,
where port is a free local port for `jax.distributed.initialize` (127.0.0.1:<port>, gloo collectives).
Every process gets `devices` fake CPU devices and the fast compile (tests/xla_flags.py) and the repository on its PYTHONPATH.
"""

import os
import socket
import subprocess
import sys

from tests import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(script: str, *extra: str, n: int = 2, devices: int = 2, logs=None) -> list[subprocess.Popen]:
  """Starts `script` n times as processes 0..n-1 of one job; returns their Popen objects.

  logs: one open file per process for its stdout + stderr; None: a text pipe each (read it with
  communicate()).
  """
  port = free_port()
  env = dict(
    os.environ,
    XLA_FLAGS=xla_flags.with_devices(devices),
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
  )
  return [
    subprocess.Popen(
      [sys.executable, os.path.abspath(script), str(i), str(port), *extra],
      env=env,
      cwd=REPO,
      stdout=subprocess.PIPE if logs is None else logs[i],
      stderr=subprocess.STDOUT,
      text=logs is None,
    )
    for i in range(n)
  ]


def kill(procs) -> None:
  """SIGKILL and reap every process of procs that is still running (a test's finally: nothing outlives it)."""
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
