"""The tree stays clean under its one formatter (ruff format, settings in pyproject.toml)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_format_clean():
  ruff = shutil.which("ruff")
  if ruff is None:
    pytest.skip("ruff is not installed (it is in requirements-dev.txt)")
  out = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, f"run `ruff format .` to fix:\n{out.stdout}{out.stderr}"
