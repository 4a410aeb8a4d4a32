"""The XLA flags of every test process: this one (tests/conftest.py) and the ones the tests start.

FAST_COMPILE is XLA:CPU's LLVM optimization level 0 (`--xla_backend_optimization_level=0`). The suite is
mostly compiles of tiny programs, and LLVM's optimization passes are most of a CPU compile: at level 0 the
same HLO (same fusion, layout and buffer assignment, so the same memory_analysis figures) is emitted as less
optimized machine code, which the tests' tiny shapes run in about the same time. Set VCPO_TEST_XLA_FLAGS to
replace it (`VCPO_TEST_XLA_FLAGS= python -m pytest` runs at XLA's default level 3); a XLA_FLAGS already set
for pytest is kept as it is (conftest).
"""

import os

FAST_COMPILE = os.environ.get("VCPO_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")


def with_devices(n: int) -> str:
  """XLA_FLAGS for a test process with n fake CPU devices, compiled with FAST_COMPILE."""
  return f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}".strip()
