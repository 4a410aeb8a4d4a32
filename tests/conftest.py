"""Test configuration: 8 fake CPU devices, fast XLA:CPU compiles, float32 matmuls, shared fixtures.

XLA_FLAGS must be set before jax initializes its backends, so this file sets it
at import time (pytest imports conftest.py before any test module).

Under pytest-xdist (`pytest -n 2 --dist loadfile`, docs/results/readme_history.md) the test files run in two worker processes at once. A test marked
`exclusive` runs while the other worker runs nothing: two file locks shared by the workers of one run
(a turnstile, so that an exclusive test waiting for the room is not starved by the other worker's
stream of tests, and the room: shared for a test, exclusive for an `exclusive` one).
"""

import fcntl
import gc
import os

from tests import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags.with_devices(8))  # and XLA:CPU's fast compile (tests/xla_flags.py)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def _run_locks(request, tmp_path_factory):
  """(turnstile, room) open lock files of this xdist run, or None outside xdist.

  They live in the folder that holds every worker's base temp dir (pytest keeps the last few runs' folders).
  """
  if not hasattr(request.config, "workerinput"):
    yield None
    return
  shared = tmp_path_factory.getbasetemp().parent
  files = [open(shared / f"{name}.lock", "a+") for name in ("turnstile", "room")]  # noqa: SIM115
  try:
    yield files
  finally:
    for f in files:
      f.close()


@pytest.fixture(autouse=True)
def _exclusive_under_xdist(request, _run_locks):
  if _run_locks is None:
    yield
    return
  turnstile, room = (f.fileno() for f in _run_locks)
  exclusive = request.node.get_closest_marker("exclusive") is not None
  fcntl.flock(turnstile, fcntl.LOCK_EX)
  try:
    fcntl.flock(room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
  finally:
    if not exclusive:
      fcntl.flock(turnstile, fcntl.LOCK_UN)
  try:
    yield
  finally:
    fcntl.flock(room, fcntl.LOCK_UN)
    if exclusive:
      fcntl.flock(turnstile, fcntl.LOCK_UN)


_CACHE_OPTIONS = (
  "jax_compilation_cache_dir",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture(autouse=True)
def _no_persistent_cache_leaks():
  """A test that turns jax's persistent compilation cache on (a study's run_study, compile_cache.apply, main.py's
  --compile_cache) leaves it on in this process, pointing at its tmp_path, and jax decides once whether to use it:
  every later test would compile through a cache in a deleted folder (a segfault in XLA's compile was seen there).
  Restore the options and reset jax's decision after any test that changed them."""
  from jax.experimental.compilation_cache import compilation_cache as cc

  old = {n: getattr(jax.config, n) for n in _CACHE_OPTIONS}
  yield
  if any(getattr(jax.config, n) != v for n, v in old.items()):
    for n, v in old.items():
      jax.config.update(n, v)
    cc.reset_cache()


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
  """Each XLA:CPU executable holds ~6 memory mappings of JIT code until its jit cache entry goes, and the
  kernel allows 65,530 per process (vm.max_map_count): a serial run of the whole suite reached that around
  its 1,050th test, where the next compile's mmap failed inside LLVM and the process died with SIGSEGV (CI,
  exit 139). Dropping jax's caches after each test file keeps the count to one file's programs."""
  yield
  jax.clear_caches()
  gc.collect()
