"""vcpo_jax/mesh.py: each process's share of one accelerator (memory_plan), and the learner's devices."""

import multiprocessing
import os

import jax
import pytest
from jax._src import xla_bridge

from vcpo_jax import mesh as mesh_lib
from vcpo_jax.rollout import async_
from vcpo_jax.schema import ConfigError

FRACTION, PREALLOCATE = mesh_lib.MEMORY_VARS


@pytest.mark.parametrize("platform", ["cpu", "tpu", "CPU"])
def test_no_variable_off_gpus(platform):
  """CPU runs are unaffected; a TPU chip belongs to one process (the sampler needs its own chips)."""
  for share in ("auto", "grow", "0.5,0.4"):
    for ids in ((), (1,)):
      assert mesh_lib.memory_plan(share, platform, ids) == {"learner": {}, "sampler": {}}


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_one_shared_gpu_gets_two_shares(platform):
  plan = mesh_lib.memory_plan("auto", platform)
  assert plan == {"learner": {FRACTION: "0.6"}, "sampler": {FRACTION: "0.3"}}  # mesh.AUTO_SHARES
  assert mesh_lib.memory_plan("0.5, 0.45", platform) == {"learner": {FRACTION: "0.5"}, "sampler": {FRACTION: "0.45"}}
  off = {PREALLOCATE: "false", FRACTION: None}  # None: unset (not inherited from the learner)
  assert mesh_lib.memory_plan("grow", platform) == {"learner": off, "sampler": off}
  assert mesh_lib.memory_plan("xla", platform) == {"learner": {}, "sampler": {}}  # the environment decides


def test_own_gpus_keep_xla_defaults_and_the_learner_leaves_the_samplers_alone():
  # The learner sees every GPU (no CUDA_VISIBLE_DEVICES): its client would preallocate 75% of the sampler's
  # GPU too, so it grows instead; the sampler does not inherit that (None: unset in the child).
  plan = mesh_lib.memory_plan("auto", "gpu", (6, 7), visible=None)
  assert plan == {"learner": {PREALLOCATE: "false"}, "sampler": {PREALLOCATE: None}}
  # launch/multi_gpu.sh: the learner sees LEARNER_GPUS only; nothing to share, XLA's defaults in both.
  assert mesh_lib.memory_plan("auto", "gpu", (6, 7), visible=(0, 1, 2, 3, 4, 5)) == {"learner": {}, "sampler": {}}
  assert mesh_lib.memory_plan("auto", "gpu", (5,), visible=(4, 5))["learner"] == {PREALLOCATE: "false"}
  # Explicit fractions hold wherever the processes are.
  assert mesh_lib.memory_plan("0.7,0.2", "gpu", (1,)) == {"learner": {FRACTION: "0.7"}, "sampler": {FRACTION: "0.2"}}


@pytest.mark.parametrize("bad", ["half", "0.6", "0.6,0.6", "0,0.5", "1.2,0.1", "0.5,0.3,0.1"])
def test_a_bad_memory_share_names_the_field(bad):
  with pytest.raises(ValueError, match=r"async_\.memory_share"):
    mesh_lib.parse_memory_share(bad)
  with pytest.raises(ConfigError, match=r"async_\.memory_share"):
    async_.AsyncConfig(memory_share=bad)


def test_the_async_config_plans_per_publish_path(monkeypatch):
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  assert async_.memory_plan(async_.AsyncConfig(), "gpu")["sampler"] == {FRACTION: "0.3"}
  own = async_.AsyncConfig(sampler_devices="1")
  assert async_.memory_plan(own, "gpu")["learner"] == {PREALLOCATE: "false"}
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the launcher gave the learner GPU 0 only
  assert async_.memory_plan(own, "gpu") == {"learner": {}, "sampler": {}}
  thread = async_.AsyncConfig(sampler_devices="1", publish_path="device")  # one process: nothing to share
  assert async_.memory_plan(thread, "gpu") == {"learner": {}, "sampler": {}}
  assert async_.memory_plan(async_.AsyncConfig(memory_share="grow"), "cpu") == {"learner": {}, "sampler": {}}


def test_apply_env_sets_and_unsets_before_jax_starts(monkeypatch):
  monkeypatch.setenv(PREALLOCATE, "false")
  monkeypatch.delenv(FRACTION, raising=False)
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
  assert mesh_lib.apply_env({FRACTION: "0.6", PREALLOCATE: None}) == {FRACTION: "0.6", PREALLOCATE: None}
  assert os.environ[FRACTION] == "0.6" and PREALLOCATE not in os.environ


def test_apply_env_too_late_changes_nothing_and_says_so(monkeypatch, caplog):
  monkeypatch.delenv(FRACTION, raising=False)
  jax.devices()  # started
  assert mesh_lib.apply_env({FRACTION: "0.6"}) == {}
  assert FRACTION not in os.environ and "jax started before" in caplog.text
  assert mesh_lib.apply_env({}) == {}


def test_platform_hint_reads_jax_platforms_before_jax_starts(monkeypatch):
  assert mesh_lib.platform_hint() == "cpu"  # started: the backend's own
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
  old = jax.config.jax_platforms
  try:
    jax.config.update("jax_platforms", "cuda,cpu")
    assert mesh_lib.platform_hint() == "gpu"
    jax.config.update("jax_platforms", "cpu")
    assert mesh_lib.platform_hint() == "cpu"
  finally:
    jax.config.update("jax_platforms", old)


def _report_env(conn):
  conn.send({k: os.environ.get(k) for k in mesh_lib.MEMORY_VARS})
  conn.close()


def test_a_spawned_child_starts_with_its_plan(monkeypatch):
  """The sampler's variables are in the child's environment from its first instruction (spawn: a fresh
  interpreter), so they are there before it imports jax; a None unsets what the learner set for itself."""
  monkeypatch.setenv(PREALLOCATE, "false")  # the learner's own (memory_plan's own-GPUs case)
  monkeypatch.delenv(FRACTION, raising=False)
  parent, child = multiprocessing.get_context("spawn").Pipe()
  with async_._environ({PREALLOCATE: None, FRACTION: "0.3"}):
    proc = multiprocessing.get_context("spawn").Process(target=_report_env, args=(child,))
    proc.start()
  assert os.environ[PREALLOCATE] == "false" and FRACTION not in os.environ  # restored here
  assert parent.recv() == {FRACTION: "0.3", PREALLOCATE: None}
  proc.join(60)
  assert proc.exitcode == 0


def test_build_mesh_on_a_host_whose_learner_sees_only_its_gpus(monkeypatch):
  """launch/multi_gpu.sh: LEARNER_GPUS in the learner's CUDA_VISIBLE_DEVICES, async_.sampler_devices the
  physical ids it leaves out. Those are excluded already: the learner keeps every device it sees."""
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
  assert len(mesh_lib.build_mesh((-1, 1, 1), 12, sampler_devices="6,7").devices.flat) == 6
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,8,9")  # 8 fake devices stand for these GPUs
  assert len(mesh_lib.build_mesh((-1, 1, 1), 16, sampler_devices="10,11").devices.flat) == 8


def test_the_trainer_sets_the_learners_share_before_jax_starts(tmp_path, monkeypatch):
  """trainer.run's first step (_open_workdir) applies the learner's half of the plan; a sync run sets nothing."""
  from tests.test_async import _tiny
  from vcpo_jax import trainer

  monkeypatch.delenv(FRACTION, raising=False)
  monkeypatch.setattr(mesh_lib, "platform_hint", lambda: "gpu")
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)  # as in a fresh main.py process
  trainer._open_workdir(_tiny(steps=1, mode="sync", **{"lag.k": 0}), str(tmp_path / "sync"))
  assert FRACTION not in os.environ
  trainer._open_workdir(_tiny(steps=1), str(tmp_path / "async"))
  assert os.environ[FRACTION] == "0.6"


def test_the_async_source_spawns_its_sampler_with_its_share_and_the_learners_cache(tmp_path, monkeypatch):
  from tests import fixtures
  from tests.test_async import _source, _tiny

  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("VCPO_TEST_COMPILE_CACHE", "1")  # this test checks that the cache setting reaches the sampler
  monkeypatch.setattr(async_.jax, "default_backend", lambda: "gpu")  # the learner's platform, as AsyncSource sees it
  with fixtures.persistent_compilation_cache(tmp_path / "cache"):
    src, _ = _source(_tiny(steps=2, **{"async_.sampler_env": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}}))
    src.close()
  assert src.env[FRACTION] == "0.3" and src.env["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"
  assert src.env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "cache")
