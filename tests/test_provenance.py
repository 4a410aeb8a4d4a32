"""vcpo_jax.provenance: the record config.json and sft.json carry, checked against independent sources."""

import importlib.metadata
import json
import os
import shutil
import subprocess

import jax
import pytest

from vcpo_jax import provenance


def test_record_matches_independent_sources(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  rec = provenance.collect()
  json.dumps(rec)  # JSON-able as it is (config.json is written without default=str surprises)
  assert rec["xla_flags"] == "--xla_cpu_enable_fast_math=false"
  assert rec["versions"]["jax"] == jax.__version__
  assert rec["versions"]["optax"] == importlib.metadata.version("optax")
  assert rec["versions"]["flax"] == importlib.metadata.version("flax")
  devs = jax.devices()
  assert rec["devices"]["count"] == len(devs) and rec["devices"]["platform"] == devs[0].platform
  assert rec["devices"]["kinds"] == sorted({d.device_kind for d in devs})
  assert rec["cpu_count"] == os.cpu_count()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      names = {ln.split(":", 1)[1].strip() for ln in f if ln.lower().startswith("model name")}
    assert not names or rec["cpu_model"] in names
  repo = os.path.dirname(os.path.dirname(os.path.abspath(provenance.__file__)))
  if shutil.which("git") and os.path.exists(os.path.join(repo, ".git")):
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert rec["git"]["commit"] == head and len(head) == 40 and isinstance(rec["git"]["dirty"], bool)


def test_missing_git_and_package_are_none_not_errors(monkeypatch):
  monkeypatch.setattr(provenance, "_REPO", "/nonexistent-dir-for-provenance")
  assert provenance.git_info() == {"commit": None, "dirty": None}
  monkeypatch.setenv("PATH", "/nonexistent-bin")  # no git executable at all
  assert provenance.git_info() == {"commit": None, "dirty": None}
  assert provenance.versions(("surely-not-an-installed-distribution",)) == {
    "surely-not-an-installed-distribution": None
  }


@pytest.mark.parametrize("dirty", [False, True])
def test_dirty_flag_follows_tracked_changes(tmp_path, monkeypatch, dirty):
  if not shutil.which("git"):
    pytest.skip("no git")
  git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
  subprocess.run([*git, "init", "-q"], check=True)
  (tmp_path / "a.py").write_text("x = 1\n")
  subprocess.run([*git, "add", "a.py"], check=True)
  subprocess.run([*git, "commit", "-qm", "a"], check=True)
  (tmp_path / "untracked.txt").write_text("untracked files do not make a checkout dirty\n")
  if dirty:
    (tmp_path / "a.py").write_text("x = 2\n")
  monkeypatch.setattr(provenance, "_REPO", str(tmp_path))
  info = provenance.git_info()
  head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
  assert info == {"commit": head, "dirty": dirty}
