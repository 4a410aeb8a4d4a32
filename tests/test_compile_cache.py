"""vcpo_jax/compile_cache.py: --compile_cache -> this process's jax config and its sampler's environment."""

import os

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

from vcpo_jax import compile_cache, trainer
from vcpo_jax.run_config import ConfigError


@pytest.fixture
def jax_cache_config():
  """The three jax options as they were, restored (and jax's cache decision reset) after the test."""
  old = {n: getattr(jax.config, n) for n in compile_cache.OPTIONS}
  yield
  for n, v in old.items():
    jax.config.update(n, v)
  cc.reset_cache()


def test_auto_is_on_for_one_accelerator_process_only(tmp_path):
  env = {"XDG_CACHE_HOME": str(tmp_path)}
  want = {
    "jax_compilation_cache_dir": str(tmp_path / "vcpo_jax" / "jax_cache"),
    "jax_persistent_cache_min_compile_time_secs": 1.0,  # small programs are not written
    "jax_persistent_cache_min_entry_size_bytes": 0,
  }
  for platform in ("gpu", "tpu"):
    assert compile_cache.settings("auto", platform, environ=env) == want
  assert compile_cache.settings("auto", "cpu", environ=env) is None  # CPU runs and the tests: unchanged
  assert compile_cache.settings("auto", "gpu", process_count=2, environ=env) is None  # a shared dir, by path
  assert compile_cache.settings("auto", "gpu", configured="/elsewhere", environ=env) is None  # kept


def test_off_and_a_directory_hold_everywhere(tmp_path):
  assert compile_cache.settings("off", "gpu") == {"jax_compilation_cache_dir": None}
  got = compile_cache.settings(f" {tmp_path} ", "cpu", process_count=4, configured="/elsewhere")
  assert got["jax_compilation_cache_dir"] == str(tmp_path) and got["jax_persistent_cache_min_compile_time_secs"] == 1.0
  with pytest.raises(ValueError, match="--compile_cache"):
    compile_cache.settings(" ", "gpu")


def test_default_dir_follows_xdg_cache_home():
  assert compile_cache.default_dir({"XDG_CACHE_HOME": "/c"}) == "/c/vcpo_jax/jax_cache"
  home = os.path.expanduser("~")
  assert compile_cache.default_dir({}) == os.path.join(home, ".cache", "vcpo_jax", "jax_cache")


def test_apply_sets_the_jax_config(tmp_path, jax_cache_config):
  jax.config.update("jax_compilation_cache_dir", None)
  assert compile_cache.apply("auto") is None and jax.config.jax_compilation_cache_dir is None  # CPU: off
  assert compile_cache.apply(str(tmp_path)) == str(tmp_path)
  assert jax.config.jax_compilation_cache_dir == str(tmp_path)
  assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_S
  assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
  assert compile_cache.apply("auto") == str(tmp_path)  # configured already: kept
  assert compile_cache.apply("off") is None and jax.config.jax_compilation_cache_dir is None


def test_the_sampler_process_gets_the_learners_cache(tmp_path, jax_cache_config):
  jax.config.update("jax_compilation_cache_dir", None)
  assert compile_cache.child_env({}) == {}  # no cache: nothing to pass on
  compile_cache.apply(str(tmp_path))
  assert compile_cache.child_env({}) == {
    "JAX_COMPILATION_CACHE_DIR": str(tmp_path),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1.0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
  assert compile_cache.child_env({"JAX_COMPILATION_CACHE_DIR": "/mine"}) == {}  # the environment's own choice


def test_trainer_refuses_an_empty_choice_before_anything_starts(tmp_path):
  with pytest.raises(ConfigError, match="--compile_cache"):
    trainer.run(None, str(tmp_path / "wd"), compile_cache="")
  assert not (tmp_path / "wd").exists()
