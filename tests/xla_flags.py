"""The XLA flags of every test process: this one (tests/conftest.py) and the ones the tests start.

FAST_COMPILE is XLA:CPU's LLVM optimization level 0 (`--xla_backend_optimization_level=0`) and its older
elemental IR emitters for fusions (`--xla_cpu_use_fusion_emitters=false`). The suite is mostly compiles of
tiny programs, and XLA:CPU's backend compile is most of its CPU time. At level 0 the same HLO (same fusion,
layout and buffer assignment, so the same memory_analysis figures) is emitted as less optimized machine
code, which the tests' tiny shapes run in about the same time. The MLIR fusion emitters (XLA's default) are
slower to compile than the elemental ones: compiling the vmap norms, a ghost step and the vmap policy
gradient of test_grad_norms' two models took 26.8 CPU s with them and 10.9 s without (at level 0, one
process each, under load). The elemental emitters' buffer assignment differs (those ghost steps' temp
bytes 879944 -> 875464 and 901256 -> 901000; test_remat's two-pass 3-layer step under the memory-minimizing
scheduler 18750416 -> 25259088, which loses the two-pass saving it checks), so the subprocesses that measure
memory (test_remat, test_memory's benchmarks/memory.py driver) compile with MEMORY_COMPILE: level 0 and XLA's
default emitters, the buffer assignment of XLA's defaults. Set VCPO_TEST_XLA_FLAGS to replace FAST_COMPILE
(`VCPO_TEST_XLA_FLAGS= python -m pytest` runs at XLA's defaults); a XLA_FLAGS already set for pytest is kept
as it is (conftest).
"""

import os

FAST_COMPILE = os.environ.get(
  "VCPO_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)

# Level 0 only: the same HLO and buffer assignment as XLA's defaults, for the subprocesses that measure memory.
MEMORY_COMPILE = os.environ.get("VCPO_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")


def with_devices(n: int) -> str:
  """XLA_FLAGS for a test process with n fake CPU devices, compiled with FAST_COMPILE."""
  return f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}".strip()
