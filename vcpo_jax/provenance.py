"""What produced a run: code version, library versions, machine, XLA flags, devices.

`collect()` returns one JSON-able dict that the trainer stores under "provenance"
in the run's config.json and that the SFT warm start stores in sft.json (and in
its cache file, so a cached warm start names the code that trained it). A number
in a results document can then be traced to the commit, the jax / XLA build and
the CPU or accelerator it was measured on: the same config on another XLA
version or thread count is a different experiment (docs/results/cpu_default_study13.md).

Every field is best effort: a missing git, a non-Linux host or an absent package
gives None, never an error.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys

# Distributions whose versions decide the numbers a run produces.
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml-collections", "transformers")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(
      ["git", "-C", _REPO, *args], capture_output=True, text=True, timeout=10, check=True, stdin=subprocess.DEVNULL
    )
  except (OSError, subprocess.SubprocessError):  # no git, not a checkout, a hung file system
    return None
  return out.stdout.strip()


def git_info() -> dict:
  """{"commit": 40-hex or None, "dirty": tracked files modified (bool or None)} of the code being run."""
  commit = _git("rev-parse", "HEAD")
  status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
  return {"commit": commit or None, "dirty": None if status is None else bool(status)}


def cpu_model() -> str | None:
  """The CPU's marketing name ("model name" in /proc/cpuinfo), else platform.processor()."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith(("model name", "hardware")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or None


def affinity() -> int | None:
  """How many CPUs this process may run on (its scheduler affinity), or None where the OS does not say."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def cpu_flags() -> str | None:
  """The CPU's instruction-set flags ("flags" in /proc/cpuinfo, sorted), or None where there is none."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith("flags"):
          return " ".join(sorted(line.split(":", 1)[1].split()))
  except OSError:
    pass
  return None


def numerics() -> dict:
  """What decides the floats of a jitted program besides the program itself: the XLA build, XLA_FLAGS, the
  device kind and, on a CPU, its model, the instruction sets XLA:CPU emits vector code for and the threads it
  splits work over. A result cached under a program's text and this record is one this machine would compute
  again (the SFT warm start's cache key: sft.numerics_fields)."""
  import jax

  dev = jax.devices()[0]
  out = {
    "jaxlib": versions(("jaxlib",))["jaxlib"],
    "xla_flags": os.environ.get("XLA_FLAGS"),
    "device": f"{dev.platform}:{dev.device_kind}",
  }
  if dev.platform == "cpu":
    flags = cpu_flags()
    out["cpu"] = {
      "model": cpu_model(),
      "flags_sha256": flags and hashlib.sha256(flags.encode()).hexdigest()[:16],
      "threads": affinity() or os.cpu_count(),
    }
  return out


def versions(packages=PACKAGES) -> dict:
  out = {}
  for name in packages:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def devices() -> dict:
  """The jax backend as this process sees it (initializes jax's backend if it is not yet)."""
  import jax

  devs = jax.devices()
  return {
    "platform": devs[0].platform,
    "kinds": sorted({d.device_kind for d in devs}),
    "count": len(devs),
    "local_count": jax.local_device_count(),
    "process_count": jax.process_count(),
  }


def collect() -> dict:
  """The provenance record; see the module docstring."""
  return {
    "git": git_info(),
    "python": platform.python_version(),
    "versions": versions(),
    "cpu_model": cpu_model(),
    "cpu_count": os.cpu_count(),
    "affinity": affinity(),
    "platform": platform.platform(),
    "xla_flags": os.environ.get("XLA_FLAGS"),
    "devices": devices(),
    "argv": list(sys.argv),
  }
