"""Test configuration: 8 fake CPU devices, float32 matmuls, shared fixtures.

XLA_FLAGS must be set before jax initializes its backends, so this file sets it
at import time (pytest imports conftest.py before any test module).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
