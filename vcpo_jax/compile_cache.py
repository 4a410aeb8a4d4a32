"""jax's persistent compilation cache for a run's processes: the learner's and its async sampler's.

A rerun of main.py (a resume, or a new workdir with the same shapes) then loads the learner step, the
initializer and the sampler's prefill / decode programs instead of compiling them again (minutes at the
1.5B-7B shapes on an accelerator). The choice is main.py's `--compile_cache` (trainer.run's
`compile_cache`), not a config field: it changes no result, only how long a start takes.

  auto     (default) on an accelerator of a one-process job: `default_dir()`, i.e.
           $XDG_CACHE_HOME/vcpo_jax/jax_cache (~/.cache/vcpo_jax/jax_cache). A user cache rather than the
           workdir's: a fresh workdir with the same shapes hits too (a workdir's cache would serve its resumes
           only), and an entry's key holds the program, the jax / XLA versions and the device kind, so one
           directory serves several machines and versions. Off on CPU: its compiles are short (seconds at the
           sizes a CPU trains), the test suite runs hundreds of tiny runs, some counting their compiles, and a
           cache shared between them would make a test depend on the ones before it. Off on several
           processes (one cache per host serves only the processes that wrote it, and a process that loads
           waits in the first collective for one that compiles); give them one shared directory by path.
           A cache configured already (JAX_COMPILATION_CACHE_DIR, jax.config.update) is kept.
  off      none (also none configured before).
  PATH     that directory (local or a URL jax's cache reads, e.g. gs://), on every platform and process count.

Only programs that took at least MIN_COMPILE_S to compile are written: below that a load costs about what the
compile does, and the many small programs of a run (casts, slices, metrics) would crowd the directory.
The sampler process gets the learner's settings through its environment (`child_env`), which jax reads at import.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

MIN_COMPILE_S = 1.0  # jax's own default: programs that compile faster are not written
OPTIONS = {  # jax config name -> the environment variable that sets it in a process jax has not started in
  "jax_compilation_cache_dir": "JAX_COMPILATION_CACHE_DIR",
  "jax_persistent_cache_min_compile_time_secs": "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
  "jax_persistent_cache_min_entry_size_bytes": "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
}


def default_dir(environ=None) -> str:
  """$XDG_CACHE_HOME/vcpo_jax/jax_cache, or ~/.cache/vcpo_jax/jax_cache without XDG_CACHE_HOME."""
  environ = os.environ if environ is None else environ
  root = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "vcpo_jax", "jax_cache")


def check(choice) -> str:
  """`choice` stripped; ValueError naming --compile_cache if it is empty."""
  choice = str(choice).strip()
  if not choice:
    raise ValueError("--compile_cache='': use 'auto', 'off' or a directory.")
  return choice


def settings(choice: str, platform: str, process_count: int = 1, configured: str | None = None, environ=None):
  """The jax config values for `choice` ("auto" | "off" | a directory; see the module docstring), or None to
  leave jax's configuration as it is.

  Args:
    platform: jax.default_backend() ("cpu", "gpu", "tpu", ...).
    process_count: jax.process_count().
    configured: the cache directory jax has already (jax.config.jax_compilation_cache_dir), or None.
  """
  choice = check(choice)
  if choice == "off":
    return {"jax_compilation_cache_dir": None}
  if choice == "auto":
    if configured or platform == "cpu" or process_count > 1:
      return None
    choice = default_dir(environ)
  return {
    "jax_compilation_cache_dir": choice,
    "jax_persistent_cache_min_compile_time_secs": MIN_COMPILE_S,
    "jax_persistent_cache_min_entry_size_bytes": 0,
  }


def apply(choice: str) -> str | None:
  """Configures this process's cache for `choice` (after jax has started: it needs the platform); returns the
  directory in use (None: no cache)."""
  from jax.experimental.compilation_cache import compilation_cache as cc

  values = settings(choice, jax.default_backend(), jax.process_count(), jax.config.jax_compilation_cache_dir)
  if values is not None:
    changed = any(getattr(jax.config, k) != v for k, v in values.items())
    for k, v in values.items():
      jax.config.update(k, v)
    if changed:
      cc.reset_cache()  # jax decides once, at its first compile, whether a cache is used: decide again
  used = jax.config.jax_compilation_cache_dir
  if used:
    log.info("persistent compilation cache: %s (--compile_cache=off: none)", used)
  return used


def child_env(environ=None) -> dict[str, str]:
  """This process's cache settings as the environment variables of a process it starts (the async sampler):
  {} without a cache, and {} if `environ` names a cache directory itself (the child inherits that choice)."""
  environ = os.environ if environ is None else environ
  if not jax.config.jax_compilation_cache_dir or environ.get(OPTIONS["jax_compilation_cache_dir"]):
    return {}
  return {var: str(getattr(jax.config, name)) for name, var in OPTIONS.items()}
